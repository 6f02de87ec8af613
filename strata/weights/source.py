"""Where tensors come from: one small interface for every reader (safetensors dir, GGUF, packs), and load_source,
which opens a model by path or name."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Protocol

import numpy as np

from strata.builtin import BUILTIN_MODELS, builtin_dir
from strata.errors import ConfigError, ModelLoadError


class TensorSource(Protocol):
    """Tensors by Hugging Face name, in Hugging Face layout."""

    def names(self) -> Iterable[str]:
        """Every tensor name the source holds."""

    def get(self, name: str) -> np.ndarray:
        """The tensor as a numpy array (float32, or its stored float dtype); KeyError if absent."""

    def where(self, name: str) -> str:
        """The file that holds `name` (or would hold it), for error messages."""


def load_source(path_or_name: str | os.PathLike, parts: tuple[str, ...] = ()):
    """-> (HF config dict, TensorSource, directory holding the tokenizer or None); parts: more GGUF files whose
    tensors join a .gguf model's (setting gguf_parts)."""
    path = builtin_dir(path_or_name) or Path(path_or_name)
    check_parts(path_or_name, parts)
    if path.is_file() and path.suffix == ".gguf":
        from strata.weights.gguf_reader import read_gguf
        config, tensors = read_gguf(path, parts)
        return config, tensors, path.parent
    if path.is_dir():
        from strata.weights.dequant import dequantizing
        from strata.weights.hf_dir import read_hf_dir
        config, tensors = read_hf_dir(path)
        return config, dequantizing(tensors, config), path
    what = "is a file but not a .gguf file" if path.is_file() else "not found"
    raise ModelLoadError(f"model {str(path_or_name)!r} {what}: pass a Hugging Face checkpoint directory, "
                         f"a .gguf file, or a built-in model's name: "
                         f"{' or '.join(repr(name) for name in BUILTIN_MODELS)}")


def check_parts(path_or_name: str | os.PathLike, parts: tuple[str, ...]) -> None:
    """gguf_parts join a .gguf model's tensors: with any other model (a directory, a pack, a built-in) they are an
    error, not ignored."""
    path = Path(path_or_name)
    if parts and not (path.is_file() and path.suffix == ".gguf"):
        raise ConfigError(f"gguf_parts: more GGUF files join a .gguf model, and {str(path_or_name)!r} is not one")
