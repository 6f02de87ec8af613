"""A Hugging Face checkpoint directory: config.json + safetensors (one file, or shards with an index).

Safetensors files are read by their header (8-byte length, JSON) and memory-mapped, so a tensor is read only when
asked for and a truncated file is caught at open with a message saying how much is missing.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from strata.errors import ModelLoadError

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


class SafetensorsFile:
    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    raise ValueError(f"header of {n} bytes but the file has {size} bytes")
                header = json.loads(f.read(n))
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path} is not a readable safetensors file (truncated or corrupt): {e}") from None
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
        if self.data_start + end > size:
            raise ModelLoadError(f"{path} is truncated: its header describes {self.data_start + end} bytes, "
                                 f"the file has {size}")
        self.header = header
        self._map = None

    def get(self, name: str) -> np.ndarray:
        t = self.header[name]
        if t["dtype"] not in _DTYPES:
            raise ModelLoadError(f"tensor {name} in {self.path} has dtype {t['dtype']}; "
                                 f"supported: {', '.join(_DTYPES)}")
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        a, b = (int(x) for x in t["data_offsets"])
        raw = self._map[self.data_start + a:self.data_start + b]
        return raw.view(_DTYPES[t["dtype"]]).reshape(t["shape"])


class SafetensorsDir:
    """TensorSource over the safetensors files of one directory."""

    def __init__(self, root: Path):
        self.root = root
        index = root / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in root.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise ModelLoadError(f"no *.safetensors files in {root}")
        self.files = {}
        for name in files:
            if not (root / name).exists():
                raise ModelLoadError(f"{index} lists {name}, which is not in {root}")
            self.files[name] = SafetensorsFile(root / name)
        self.location = {}
        for fname, f in self.files.items():
            for tname in f.header:
                if weight_map is None or weight_map.get(tname) == fname:
                    self.location[tname] = fname
        self._weight_map = weight_map

    def names(self):
        return self.location.keys()

    def get(self, name: str) -> np.ndarray:
        return self.files[self.location[name]].get(name)

    def where(self, name: str) -> str:
        if name in self.location:
            return str(self.root / self.location[name])
        if self._weight_map and name in self._weight_map:
            return str(self.root / self._weight_map[name])
        return ", ".join(str(self.root / f) for f in self.files)


def read_hf_dir(path: Path) -> tuple[dict, SafetensorsDir]:
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"no config.json in {path}: a model directory needs config.json and *.safetensors "
                             f"(a Hugging Face checkpoint), or pass a .gguf file")
    try:
        config = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise ModelLoadError(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{cfg_path} must hold a JSON object")
    return config, SafetensorsDir(path)
