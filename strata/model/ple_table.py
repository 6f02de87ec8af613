"""qwen4_exp's PLE n-gram table in its storage format and where it lives, and the gather of a window's rows from it.

Formats: a float dtype (the weights', or bfloat16), "float8" (float8_e4m3fn bytes, stored as uint8, times one
float32 scale per group of rows), "int8" (one float32 scale per row). Row r's scale is scale[r // (rows // groups)].
Places: "device" (the arrays sit in the parameter tree), "host" (numpy arrays in RAM) and "disk" (the checkpoint's
own files, memory-mapped: rows come through the page cache). A host or disk table sits in the parameter tree as a
HostRows, a pytree node without leaves (static to compiled functions): the PLE layer gathers its rows on the host
through the backend's host_call (a decode token needs heads x dim values) and decodes them on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from strata.host_rows import HostRows
from strata.errors import ConfigError

FORMATS = ("bfloat16", "float8", "int8")
PLACES = ("device", "host", "disk")
# float8_e4m3fn byte -> value (0x7F and 0xFF are NaN, as ml_dtypes decodes them)
FP8_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
_E4M3_MAX = 448.0
_CHUNK_ROWS = 1 << 20          # rows converted at a time (a conversion never holds a second float copy of the table)


def format_of(values_dtype) -> str:
    """The format a stored table's values dtype means (uint8: float8 bytes)."""
    d = np.dtype(values_dtype)
    return "float8" if d == np.uint8 else "int8" if d == np.int8 else "float"


@dataclass(frozen=True)
class PleTablePlace:
    """Where a model's PLE tables are kept (one of PLACES) and in which format (one of FORMATS, or "auto": the
    checkpoint's, float8 kept, a float table in the weights' dtype)."""
    where: str
    fmt: str


def table_rows(ops, lp: dict, ids, dtype):
    """The rows of a PLE layer's table (lp["ple_table"], lp["ple_scale"] on the device; or a HostRows) for ids
    [...] -> [..., dim] in dtype."""
    xp = ops.xp
    table = lp["ple_table"]
    if isinstance(table, HostRows):
        values, scale = ops.host_call(table.gather, [(tuple(ids.shape) + (table.dim,), table.dtype),
                                                     (tuple(ids.shape), np.dtype(np.float32))], ids)
        fmt = format_of(table.dtype)
    else:
        values, fmt = table[ids], format_of(table.dtype)
        scale = None
        if fmt != "float":
            s = lp["ple_scale"]
            scale = s[ids // (table.shape[0] // s.shape[0])]
    if fmt == "float":
        return values.astype(dtype)
    decoded = xp.asarray(FP8_VALUES)[values.astype(xp.int32)] if fmt == "float8" else values.astype(xp.float32)
    return (decoded * scale[..., None]).astype(dtype)


def stored_table(blocks: list[np.ndarray], scales: list[np.ndarray] | None, fmt: str, float_dtype) -> tuple:
    """A checkpoint's table (its row blocks as read: float, or float8_e4m3fn with one scale per block in `scales`)
    in format fmt ("auto": as stored when float8 or bfloat16, else float_dtype) -> (values [rows, dim], scale
    [groups] float32 or None), in RAM. Converted a chunk of rows at a time."""
    src = source_format(blocks[0].dtype)
    fmt = src if fmt == "auto" else fmt
    if fmt == src and fmt != "float":          # as stored: read into RAM (an array already there is not copied)
        kept = [np.asarray(b) if not isinstance(b, np.memmap) else np.array(b) for b in blocks]
        values = kept[0] if len(kept) == 1 else np.concatenate(kept)
        return (values.view(np.uint8), _block_scales(blocks, scales)) if fmt == "float8" else (values, None)
    rows, dim = sum(int(b.shape[0]) for b in blocks), int(blocks[0].shape[1])
    out_dtype = {"float": float_dtype, "bfloat16": ml_dtypes.bfloat16, "float8": np.uint8, "int8": np.int8}[fmt]
    values = np.empty((rows, dim), out_dtype)
    row_scale = np.empty(rows, np.float32) if fmt == "int8" else None
    if fmt == "float8":       # one scale for the whole table: its largest magnitude maps to e4m3's largest value
        amax = max(float(np.max(np.abs(x))) for _, x in _float_chunks(blocks, scales))
        tensor_scale = np.float32(amax / _E4M3_MAX if amax > 0 else 1.0)
    for at, x in _float_chunks(blocks, scales):
        n = x.shape[0]
        if fmt == "int8":
            s = np.max(np.abs(x), axis=1) / 127.0
            s = np.where(s > 0, s, 1.0).astype(np.float32)
            values[at:at + n] = np.clip(np.rint(x / s[:, None]), -127, 127).astype(np.int8)
            row_scale[at:at + n] = s
        elif fmt == "float8":
            values[at:at + n] = (x / tensor_scale).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        else:
            values[at:at + n] = x.astype(out_dtype)
    scale = row_scale if fmt == "int8" else np.array([tensor_scale], np.float32) if fmt == "float8" else None
    return values, scale


def mapped_table(blocks: list[np.ndarray], scales: list[np.ndarray] | None, fmt: str) -> HostRows:
    """The checkpoint's own row blocks, memory-mapped as they are (disk): its format only."""
    src = source_format(blocks[0].dtype)
    if fmt not in ("auto", src):
        raise ConfigError(f"ple_table = disk reads the checkpoint's table as stored ({src}), not converted: set "
                          f"ple_format to auto or {src}, or ple_table to host or device to convert it to {fmt}")
    if src == "float8":
        return HostRows([b.view(np.uint8) for b in blocks], _block_scales(blocks, scales), "disk")
    return HostRows(list(blocks), None, "disk")


def source_format(dtype) -> str:
    """A checkpoint table's format by its stored dtype: float8, bfloat16, or another float dtype ("float")."""
    d = np.dtype(dtype)
    return "float8" if d == np.dtype(ml_dtypes.float8_e4m3fn) else "bfloat16" if d == np.dtype(ml_dtypes.bfloat16) \
        else "float"


def _block_scales(blocks, scales) -> np.ndarray:
    """One float32 scale per row block (the blocks' rows equal: a scale per group of that many rows)."""
    if scales is None:
        return np.ones(1, np.float32)
    rows = {int(b.shape[0]) for b in blocks[:-1]}
    if len(rows) > 1 or (rows and int(blocks[-1].shape[0]) != rows.pop()):
        s = np.concatenate([np.full(int(b.shape[0]), np.float32(np.asarray(sc).reshape(-1)[0])) for b, sc in
                            zip(blocks, scales)])
        return s.astype(np.float32)
    return np.array([np.float32(np.asarray(sc).reshape(-1)[0]) for sc in scales], np.float32)


def _float_chunks(blocks, scales):
    """(first row, float32 rows times their block's scale) over the table, _CHUNK_ROWS rows at a time."""
    at = 0
    for i, b in enumerate(blocks):
        scale = np.float32(np.asarray(scales[i]).reshape(-1)[0]) if scales is not None else np.float32(1)
        for lo in range(0, int(b.shape[0]), _CHUNK_ROWS):
            x = np.asarray(b[lo:lo + _CHUNK_ROWS]).astype(np.float32) * scale
            yield at, x
            at += x.shape[0]


def table_bytes(rows: int, dim: int, fmt: str, float_dtype) -> int:
    """Bytes of a table of rows x dim in format fmt ("float": float_dtype; scales included)."""
    if fmt in ("float", "bfloat16"):
        return rows * dim * np.dtype(float_dtype if fmt == "float" else ml_dtypes.bfloat16).itemsize
    return rows * dim + (4 * rows if fmt == "int8" else 4)
