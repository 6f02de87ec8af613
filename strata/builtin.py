"""The models Strata knows by name, in one table: `demo` and `demo-flash` (random weights at the Qwen3-Next and
Qwen3.8-Flash-Next architectures, written on first use), `tiny` (trained
weights shipped inside the package) and `random:<shape>` (random weights at a real model's shapes, drawn on the device
at load: for measuring speed). Everything that takes a model path or name asks `builtin_dir` what a name is,
and logs `builtin_note` when one is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from strata.demo import DEMO_FLASH_NOTE, DEMO_NOTE, RANDOM_SHAPES
from strata.errors import ModelLoadError

TINY_DIR = Path(__file__).parent / "models" / "tiny"
TINY_NOTE = ("the tiny model was trained for under an hour on a CPU, on Python's documentation: it writes doc-like "
             "English, not reliable answers")


@dataclass(frozen=True)
class Builtin:
    note: str                      # said when the model is loaded, so nobody mistakes what its text means
    directory: Callable[[], Path]  # its checkpoint directory (the demo's is written on first use)


def _demo_dir() -> Path:
    from strata.demo import demo_model_dir
    return demo_model_dir()


def _demo_flash_dir() -> Path:
    from strata.demo import demo_flash_model_dir
    return demo_flash_model_dir()


def _tiny_dir() -> Path:
    if not (TINY_DIR / "model.safetensors").is_file():
        raise ModelLoadError(f"the tiny model's files are missing from this installation (looked in {TINY_DIR}); "
                             f"reinstall strata, or train it with `strata train-tiny --out DIR` and pass DIR")
    return TINY_DIR


RANDOM_PREFIX = "random:"
RANDOM_NOTE = ("random weights at {shape}'s shapes (int4 experts, drawn on the device): for measuring speed; its text "
               "is filler tokens")


def _random(shape: str) -> Builtin:
    from strata.demo import random_model_dir
    return Builtin(RANDOM_NOTE.format(shape=shape), lambda: random_model_dir(shape))


BUILTIN_MODELS = {"demo": Builtin(DEMO_NOTE, _demo_dir), "demo-flash": Builtin(DEMO_FLASH_NOTE, _demo_flash_dir),
                  "tiny": Builtin(TINY_NOTE, _tiny_dir),
                  **{RANDOM_PREFIX + shape: _random(shape) for shape in RANDOM_SHAPES}}


def is_random(name) -> bool:
    """A `random:<shape>` model: its weights are drawn at load, not read."""
    return str(name).startswith(RANDOM_PREFIX) and is_builtin(name)


def is_builtin(name) -> bool:
    return str(name) in BUILTIN_MODELS


def builtin_dir(name) -> Path | None:
    """The checkpoint directory of a built-in model's name; None for anything else (a path)."""
    model = BUILTIN_MODELS.get(str(name))
    return model.directory() if model else None


def builtin_note(name) -> str | None:
    model = BUILTIN_MODELS.get(str(name))
    return model.note if model else None
