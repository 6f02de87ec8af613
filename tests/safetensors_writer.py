"""Safetensors files for test checkpoints: written by hand for the published quantized forms (safetensors.numpy
cannot write float8: numpy has no float8 dtype, ml_dtypes' is refused), and a checkpoint's tensors edited in place."""
from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

DTYPES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16",
          np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32",
          np.dtype(np.int64): "I64"}


def save(tensors: dict, path) -> None:
    """tensors (numpy arrays, float8 included) -> one safetensors file at path."""
    header, data = {"__metadata__": {"format": "pt"}}, bytearray()
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        header[name] = {"dtype": DTYPES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [len(data), len(data) + a.nbytes]}
        data += a.tobytes()
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data))


def edit_tensors(path, edit) -> None:
    """A checkpoint directory's model.safetensors loaded, edit(dict of its tensors) applied, written back."""
    f = path / "model.safetensors"
    tensors = dict(load_file(str(f)))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})
