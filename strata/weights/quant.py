"""Expert storage formats: how one expert's three matrices are laid out, quantised, in ONE contiguous byte blob.

An expert is gate [I, H], up [I, H] and down [H, I] (row-major, out x in, like nn.Linear weights); its output for a
token x [H] is down @ (silu(gate @ x) * (up @ x)). Each expert is stored as one blob, so that one read from disk or one
host-to-device copy moves one expert; a device "pool" is a uint8 array [N, nbytes] of N such blobs. Formats (FORMATS):
f32, bf16, int8, int4, nvfp4, each quantising a matrix along its input dimension. This module is the numpy reference of
every format: `layout` says where each field sits, `encode_expert` quantises, `decode_expert` dequantises,
`expert_reference` computes the expert op from a pool. The device kernels decode the same bytes and must agree with
`decode_expert` bit for bit in float32. Each format's fields, arithmetic and alignment: docs/formats.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from strata.errors import ConfigError, ModelLoadError

FORMATS = ("f32", "bf16", "int8", "int4", "nvfp4")
FIELD_ALIGN = 64
BLOB_ALIGN = 4096
INT4_GROUP = 128     # nominal int4 group; a matrix with fewer columns uses one group of all its columns
NVFP4_BLOCK = 16     # values per float8_e4m3fn block scale
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# e2m1 magnitude of code c (bits 0..2); bit 3 is the sign
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_LUT = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)   # [16]: code -> value

# Relative Frobenius error ||decode(encode(w)) - w|| / ||w|| on gaussian weights (matrices of the sizes the tests use:
# 32..2048 columns), measured worst over hundreds of seeds and stated with margin. Measured worst: bf16 0.0017,
# int8 0.0083 (grows slowly with cols: the row's amax sets the step), int4 0.1024, nvfp4 0.0996.
REL_ERROR = {"f32": 0.0, "bf16": 0.0025, "int8": 0.012, "int4": 0.115, "nvfp4": 0.11}

_DTYPES = {
    "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8), "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
}
MATRICES = ("gate", "up", "down")


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a field's dtype name (ml_dtypes for bfloat16 and float8_e4m3fn)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown field dtype {name!r}; allowed: {', '.join(_DTYPES)}") from None


@dataclass(frozen=True)
class Field:
    name: str
    offset: int               # bytes from the blob's start, a multiple of FIELD_ALIGN
    dtype: str                # a key of _DTYPES
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        """Bytes the field holds."""
        return int(np.prod(self.shape, dtype=np.int64)) * np_dtype(self.dtype).itemsize

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class BlobLayout:
    """Where each field of one expert's blob sits. Hashable: a static argument of jitted functions.

    `group`: the nominal quantisation group along cols: 128 for int4 (each matrix uses min(group, cols)), 16 for
    nvfp4, 0 for the formats without groups (f32, bf16, int8 per row)."""
    fmt: str
    hidden: int
    inter: int
    group: int
    fields: tuple[Field, ...]
    nbytes: int

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"format {self.fmt} has no field {name!r}; it has {', '.join(f.name for f in self.fields)}")

    def has(self, name: str) -> bool:
        return any(f.name == name for f in self.fields)

    def shape_of(self, matrix: str) -> tuple[int, int]:
        """(rows, cols) of "gate", "up" or "down"."""
        return (self.inter, self.hidden) if matrix in ("gate", "up") else (self.hidden, self.inter)

    def group_of(self, matrix: str) -> int:
        """Columns per scale group of a matrix: int4 min(group, cols), nvfp4 16, int8 all cols, f32/bf16 0."""
        cols = self.shape_of(matrix)[1]
        if self.fmt == "int4":
            return min(self.group, cols)
        if self.fmt == "nvfp4":
            return self.group
        return cols if self.fmt == "int8" else 0

    def describe(self) -> dict:
        """A JSON-able description (for a pack's manifest); `BlobLayout.from_dict` reads it back."""
        return {"fmt": self.fmt, "hidden": self.hidden, "inter": self.inter, "group": self.group,
                "nbytes": self.nbytes,
                "fields": [{"name": f.name, "offset": f.offset, "dtype": f.dtype, "shape": list(f.shape)}
                           for f in self.fields]}

    @classmethod
    def from_dict(cls, d: dict) -> "BlobLayout":
        """The layout a manifest describes. It must be the layout this version builds for that format and those
        dimensions (the kernels assume it): a mismatch is a ModelLoadError, never a silent misread."""
        try:
            got = cls(fmt=str(d["fmt"]), hidden=int(d["hidden"]), inter=int(d["inter"]), group=int(d["group"]),
                      fields=tuple(Field(str(f["name"]), int(f["offset"]), str(f["dtype"]),
                                         tuple(int(s) for s in f["shape"])) for f in d["fields"]),
                      nbytes=int(d["nbytes"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"bad expert blob layout in manifest ({type(e).__name__}: {e}): {d!r}") from None
        try:
            want = layout(got.fmt, got.hidden, got.inter)
        except ConfigError as e:
            raise ModelLoadError(f"bad expert blob layout in manifest: {e}") from None
        if got != want:
            raise ModelLoadError(f"expert blob layout in manifest {got.describe()} differs from the layout this "
                                 f"version uses for {got.fmt} with hidden {got.hidden}, inter {got.inter}: "
                                 f"{want.describe()}; re-pack the model")
        return got


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def layout(fmt: str, hidden: int, inter: int) -> BlobLayout:
    """The blob layout of one expert with hidden size `hidden` and intermediate size `inter` in format `fmt`."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown expert format {fmt!r}; allowed: {', '.join(FORMATS)}")
    for name, v in (("hidden", hidden), ("inter", inter)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"expert {name} size must be a positive integer, got {v!r}")
    hidden, inter = int(hidden), int(inter)
    specs: list[tuple[str, str, tuple[int, ...]]] = []
    group = {"int4": INT4_GROUP, "nvfp4": NVFP4_BLOCK}.get(fmt, 0)
    for m in MATRICES:
        rows, cols = (inter, hidden) if m in ("gate", "up") else (hidden, inter)
        dim = "hidden" if m in ("gate", "up") else "inter"
        if fmt in ("f32", "bf16"):
            specs.append((m, "float32" if fmt == "f32" else "bfloat16", (rows, cols)))
        elif fmt == "int8":
            specs += [(f"{m}.q", "int8", (rows, cols)), (f"{m}.s", "float32", (rows,))]
        elif fmt == "int4":
            g = min(group, cols)
            if cols % g or cols % 2:
                raise ConfigError(f"int4 needs the {dim} size ({cols}, the columns of {m}) to be a multiple of "
                                  f"{group} or, below {group}, even; got {cols}")
            specs += [(f"{m}.q", "uint8", (rows, cols // 2)), (f"{m}.s", "float16", (rows, cols // g)),
                      (f"{m}.z", "uint8", (rows, cols // g))]
        else:  # nvfp4
            if cols % NVFP4_BLOCK:
                raise ConfigError(f"nvfp4 needs the {dim} size ({cols}, the columns of {m}) to be a multiple of "
                                  f"{NVFP4_BLOCK} (one float8 scale per {NVFP4_BLOCK} values); got {cols}")
            specs += [(f"{m}.q", "uint8", (rows, cols // 2)),
                      (f"{m}.s", "float8_e4m3fn", (rows, cols // NVFP4_BLOCK))]
    if fmt == "nvfp4":
        specs.append(("tail", "float32", (4,)))
    fields, off = [], 0
    for name, dt, shape in specs:
        f = Field(name, off, dt, shape)
        fields.append(f)
        off = _align(f.end, FIELD_ALIGN)
    return BlobLayout(fmt, hidden, inter, group, tuple(fields), _align(fields[-1].end, BLOB_ALIGN))


# --- quantisers (numpy; w float32 [rows, cols])

def _int8_quant(w):
    amax = np.abs(w).max(axis=1)
    scale = (amax / np.float32(127)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.where(scale[:, None] > 0, np.clip(np.rint(w / safe[:, None]), -127, 127), 0).astype(np.int8)
    return q, scale


def _int4_quant(w, g):
    rows, cols = w.shape
    wg = w.reshape(rows, cols // g, g)
    lo = np.minimum(wg.min(axis=-1), 0).astype(np.float32)
    hi = np.maximum(wg.max(axis=-1), 0).astype(np.float32)
    s = ((hi - lo) / np.float32(15)).astype(np.float16)
    s32 = s.astype(np.float32)
    safe = np.where(s32 > 0, s32, np.float32(1))
    z = np.where(s32 > 0, np.clip(np.rint(-lo / safe), 0, 15), 0).astype(np.uint8)
    q = np.clip(np.rint(wg / safe[..., None]) + z[..., None], 0, 15)
    q = np.where(s32[..., None] > 0, q, 0).astype(np.uint8).reshape(rows, cols)
    return _pack_nibbles(q), s, z


def _pack_nibbles(q):
    """uint8 [rows, cols] of 0..15 -> [rows, cols/2], low nibble = even column."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def _unpack_nibbles(p):
    """uint8 [rows, cols/2] -> [rows, cols], low nibble = even column."""
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


# midpoints between consecutive e2m1 magnitudes; crossing midpoint i moves from code i to i + 1
_E2M1_MID = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2


def _e2m1_codes(v):
    """Nearest e2m1 code (4 bits, bit 3 = sign) of float32 v, ties to even code, magnitudes above 6 saturate.
    Zero magnitudes get sign 0."""
    a = np.abs(v)
    code = np.zeros(v.shape, np.uint8)
    for i, m in enumerate(_E2M1_MID):
        up = (a > m) | ((a == m) & (i % 2 == 1))        # a tie goes to the even code: i + 1 when i is odd
        code += up.astype(np.uint8)
    sign = ((v < 0) & (code > 0)).astype(np.uint8) << 3
    return code | sign


def _nvfp4_quant(w):
    rows, cols = w.shape
    amax = np.float32(np.abs(w).max()) if w.size else np.float32(0)
    gscale = np.float32(amax / np.float32(E2M1_MAX * E4M3_MAX))
    wb = w.reshape(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK)
    if gscale > 0:
        bamax = np.abs(wb).max(axis=-1)
        bs = (bamax / np.float32(E2M1_MAX) / gscale).astype(np.float32)
        bs = np.minimum(bs, np.float32(E4M3_MAX)).astype(ml_dtypes.float8_e4m3fn)
    else:
        bs = np.zeros((rows, cols // NVFP4_BLOCK), ml_dtypes.float8_e4m3fn)
    denom = bs.astype(np.float32) * gscale                                            # [rows, cols/16]
    safe = np.where(denom > 0, denom, np.float32(1))
    v = np.where(denom[..., None] > 0, wb / safe[..., None], 0).astype(np.float32)
    codes = _e2m1_codes(v).reshape(rows, cols)
    return _pack_nibbles(codes), bs, gscale


def _put(blob, f: Field, arr):
    arr = np.ascontiguousarray(arr, dtype=np_dtype(f.dtype))
    assert arr.shape == f.shape, (f.name, arr.shape, f.shape)
    blob[f.offset:f.end] = arr.reshape(-1).view(np.uint8)


def _get(blob, f: Field):
    return blob[f.offset:f.end].view(np_dtype(f.dtype)).reshape(f.shape)


def encode_expert(lay: BlobLayout, gate, up, down) -> np.ndarray:
    """Quantise one expert into its blob: uint8 [lay.nbytes], padding bytes zero."""
    blob = np.zeros(lay.nbytes, np.uint8)
    tail = np.zeros(4, np.float32)
    for i, (m, w) in enumerate(zip(MATRICES, (gate, up, down))):
        w = np.asarray(w)
        if w.shape != lay.shape_of(m):
            raise ValueError(f"{m} has shape {w.shape}; format layout wants {lay.shape_of(m)}")
        w = w.astype(np.float32)
        if not np.isfinite(w).all():
            raise ValueError(f"{m} holds non-finite values: cannot quantise")
        if lay.fmt in ("f32", "bf16"):
            _put(blob, lay.field(m), w)     # astype to bfloat16 rounds to nearest even
        elif lay.fmt == "int8":
            q, s = _int8_quant(w)
            _put(blob, lay.field(f"{m}.q"), q)
            _put(blob, lay.field(f"{m}.s"), s)
        elif lay.fmt == "int4":
            q, s, z = _int4_quant(w, lay.group_of(m))
            _put(blob, lay.field(f"{m}.q"), q)
            _put(blob, lay.field(f"{m}.s"), s)
            _put(blob, lay.field(f"{m}.z"), z)
        else:
            q, bs, gs = _nvfp4_quant(w)
            _put(blob, lay.field(f"{m}.q"), q)
            _put(blob, lay.field(f"{m}.s"), bs)
            tail[i] = gs
    if lay.fmt == "nvfp4":
        _put(blob, lay.field("tail"), tail)
    return blob


def nvfp4_blob(lay: BlobLayout, parts) -> np.ndarray:
    """An expert already in NVFP4 (a checkpoint's: per matrix, in MATRICES order, its packed e2m1 codes [rows,
    cols/2], float8 block scales [rows, cols/16] and global scale) as its blob, bytes as they are: decode_expert
    gives exactly the checkpoint's dequantized values, where encode_expert of them would quantise again."""
    if lay.fmt != "nvfp4":
        raise ValueError(f"nvfp4_blob needs the nvfp4 layout, not {lay.fmt}")
    blob = np.zeros(lay.nbytes, np.uint8)
    tail = np.zeros(4, np.float32)
    for i, (m, (q, bs, g)) in enumerate(zip(MATRICES, parts)):
        _put(blob, lay.field(f"{m}.q"), np.asarray(q, np.uint8))
        _put(blob, lay.field(f"{m}.s"), np.asarray(bs).view(np.uint8).view(ml_dtypes.float8_e4m3fn))
        tail[i] = np.float32(np.asarray(g, np.float32).reshape(()))
    _put(blob, lay.field("tail"), tail)
    return blob


def decode_expert(lay: BlobLayout, blob) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Dequantise one blob (uint8 [>= nbytes]) into float32 (gate [I, H], up [I, H], down [H, I])."""
    blob = np.ascontiguousarray(blob, dtype=np.uint8).reshape(-1)
    if blob.size < lay.nbytes:
        raise ValueError(f"blob has {blob.size} bytes; the layout needs {lay.nbytes}")
    out = []
    for i, m in enumerate(MATRICES):
        rows, cols = lay.shape_of(m)
        if lay.fmt in ("f32", "bf16"):
            w = _get(blob, lay.field(m)).astype(np.float32)
        elif lay.fmt == "int8":
            q = _get(blob, lay.field(f"{m}.q")).astype(np.float32)
            w = q * _get(blob, lay.field(f"{m}.s"))[:, None]
        elif lay.fmt == "int4":
            g = lay.group_of(m)
            q = _unpack_nibbles(_get(blob, lay.field(f"{m}.q"))).astype(np.float32).reshape(rows, cols // g, g)
            s = _get(blob, lay.field(f"{m}.s")).astype(np.float32)
            z = _get(blob, lay.field(f"{m}.z")).astype(np.float32)
            w = ((q - z[..., None]) * s[..., None]).reshape(rows, cols)
        else:
            v = E2M1_LUT[_unpack_nibbles(_get(blob, lay.field(f"{m}.q")))].reshape(rows, cols // NVFP4_BLOCK,
                                                                                 NVFP4_BLOCK)
            bs = _get(blob, lay.field(f"{m}.s")).astype(np.float32)
            gs = _get(blob, lay.field("tail"))[i]
            w = ((v * bs[..., None]) * gs).reshape(rows, cols)
        out.append(np.asarray(w, np.float32))
    return tuple(out)


def expert_reference(lay: BlobLayout, pool, x, slots, weight) -> np.ndarray:
    """The expert op over a pool, in numpy (float64 arithmetic): float32 [T, H].

    pool uint8 [N, nbytes]; x [T, H]; slots int [T, k] (-1: this route is not computed here, contributes 0);
    weight [T, k]. y[t] = sum_j weight[t, j] * down(silu(gate x_t) * up x_t) for the expert in slot slots[t, j]."""
    pool = np.asarray(pool)
    x = np.asarray(x).astype(np.float64)
    slots = np.asarray(slots)
    weight = np.asarray(weight).astype(np.float64)
    y = np.zeros(x.shape, np.float64)
    cache: dict[int, tuple] = {}
    for t in range(slots.shape[0]):
        for j in range(slots.shape[1]):
            s = int(slots[t, j])
            if s < 0:
                continue
            if s not in cache:
                cache[s] = tuple(w.astype(np.float64) for w in decode_expert(lay, pool[s]))
            gate, up, down = cache[s]
            g, u = gate @ x[t], up @ x[t]
            y[t] += weight[t, j] * (down @ (g / (1 + np.exp(-g)) * u))
    return y.astype(np.float32)
