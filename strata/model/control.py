"""Control vectors in llama.cpp's GGUF format (setting control_vector, FILE[:SCALE]): float32 tensors direction.N
of hidden_size values, N >= 1. As llama.cpp's cvec: direction.N times the scale is added to the residual after layer N
(0-based), after its attention and MLP halves, so nothing is added after layer 0 and N < layers; several files add up,
each times its own scale. A row's scale (its request's, 1 = as loaded, 0 = off) multiplies the sum in the forward
pass (forward.py steer), so one window serves rows of different scales. A hyper-connected model's residual is
hc_count streams: the vector is added to each, as llama.cpp adds it across gemma3n's altup streams.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.errors import ConfigError

CONTROL = "control"          # a layer's parameter: the control vector added after it, float32 [hidden_size]
_DIRECTION = re.compile(r"^direction\.(\d+)$")


@dataclass(frozen=True)
class ControlVector:
    directions: dict             # {layer (0-based, the one it is added after): float32 [hidden_size]}
    files: tuple                 # ((path, scale), ...) as loaded

    def describe(self) -> str:
        layers = sorted(self.directions)
        return (", ".join(f"{p} x {s:g}" for p, s in self.files) +
                f": added after layers {layers[0]}..{layers[-1]} ({len(layers)} of them)")


def entries(value) -> list[tuple[str, float]]:
    """The setting's FILE[:SCALE] entries (a comma-separated string or a list) -> [(path, scale)]; no scale is 1."""
    items = value.split(",") if isinstance(value, str) else list(value)
    out = []
    for item in (x.strip() for x in items):
        path, sep, tail = item.rpartition(":")
        scale = 1.0
        if sep:
            try:
                scale = float(tail)
            except ValueError:
                path = item              # a colon in the path, no scale
            else:
                if not math.isfinite(scale):
                    raise ConfigError(f"control_vector {item!r}: the scale after the last ':' must be a finite "
                                      f"number, got {tail!r}")
        else:
            path = item
        if not path:
            raise ConfigError(f"control_vector {item!r}: give a file, as FILE or FILE:SCALE")
        out.append((path, scale))
    return out


def load_control_vector(value, num_layers: int, hidden_size: int) -> ControlVector | None:
    """The setting's files read and checked against the model (num_layers, hidden_size) and summed, each direction
    times its file's scale (llama.cpp's common_control_vector_load); None when unset. A ConfigError names the file,
    what is wrong and what is allowed."""
    if value is None:
        return None
    files = entries(value)
    total: dict[int, np.ndarray] = {}
    for path, scale in files:
        for layer, d in read_directions(path, num_layers, hidden_size).items():
            total[layer] = total.get(layer, np.zeros(hidden_size, np.float32)) + np.float32(scale) * d
    return ControlVector(total, tuple(files))


def read_directions(path, num_layers: int, hidden_size: int) -> dict[int, np.ndarray]:
    """One control vector file -> {N: direction.N as float32 [hidden_size]}, checked (module docstring)."""
    import gguf
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"control_vector {path}: no such file (give a control vector in llama.cpp's GGUF format, "
                          f"as FILE or FILE:SCALE)")
    try:
        reader = gguf.GGUFReader(p)
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError, struct errors and others on a foreign file
        raise ConfigError(f"control_vector {path}: not a GGUF file ({e}); a control vector is llama.cpp's GGUF "
                          f"format (tensors direction.1, direction.2, ...)") from None
    allowed = f"direction.1 .. direction.{num_layers - 1}"
    out: dict[int, np.ndarray] = {}
    for t in reader.tensors:
        m = _DIRECTION.match(t.name)
        if m is None:
            raise ConfigError(f"control_vector {path}: tensor {t.name!r} is not a control vector's: a control vector "
                              f"file holds only tensors named direction.N (for this model {allowed})")
        n = int(m.group(1))
        if not 1 <= n < num_layers:
            raise ConfigError(f"control_vector {path}: {t.name} is outside this model: direction.N is added after "
                              f"layer N (0-based, as llama.cpp) and the model has layers 0..{num_layers - 1} with "
                              f"nothing added after layer 0, so N must be in 1..{num_layers - 1}")
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ConfigError(f"control_vector {path}: {t.name} is {t.tensor_type.name}; control vectors are float32 "
                              f"(F32) tensors")
        values = np.asarray(t.data, np.float32).reshape(-1)
        if len(t.shape) != 1 or values.size != hidden_size:
            raise ConfigError(f"control_vector {path}: {t.name} has {values.size} values (shape "
                              f"{tuple(int(s) for s in t.shape)}) but this model's hidden size is {hidden_size}: "
                              f"the file was made for another model")
        if not np.all(np.isfinite(values)):
            raise ConfigError(f"control_vector {path}: {t.name} holds non-finite values")
        if n in out:
            raise ConfigError(f"control_vector {path}: {t.name} appears twice")
        out[n] = values.copy()
    if not out:
        raise ConfigError(f"control_vector {path}: holds no tensor direction.N: not a control vector file")
    return out


def with_control(params: dict, control: ControlVector | None) -> dict:
    """The parameter tree with each layer's control vector (CONTROL) beside its weights, where it has one."""
    if control is None:
        return params
    layers = [({**lp, CONTROL: control.directions[i]} if i in control.directions else lp)
              for i, lp in enumerate(params["layers"])]
    return {**params, "layers": layers}
