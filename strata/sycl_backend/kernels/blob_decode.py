"""blob_decode.cl: the expert pool's selection and decoding (formats: strata/weights/quant.py).

`pool_select` (one launch, one work-group) turns the routes' pool slots into the distinct slots used (ascending,
then -1 padding, then the all-zero expert at index R), each route's index into them and its weight (0 for a skipped
route); `blob_decode` (one launch for all three matrices) decodes those slots' blobs into fp32 gate / up / down,
bit-identical to quant.decode_expert. The expert op then runs on the decoded [R + 1, ...] matrices with the
existing kernels."""
from __future__ import annotations

import ctypes

import dpnp
import numpy as np

from strata.sycl_backend.kernels import Kernels, i32, u32
from strata.weights import quant

SELECT_WG = 256                      # pool_select's work-group (reqd_work_group_size in the .cl)
CHUNK = 16                           # blob_decode: values of one row per work-item (BD_CHUNK in the .cl)


def layout_args(lay: quant.BlobLayout) -> list:
    """blob_decode's layout arguments: H, I, the data / scale / zero field offsets of gate, up, down, the tail
    offset and the scale groups (of gate/up, of down)."""
    fmt = lay.fmt
    q, s, z = [], [], []
    for m in quant.MATRICES:
        if fmt in ("f32", "bf16"):
            q.append(lay.field(m).offset)
            s.append(0)
            z.append(0)
        else:
            q.append(lay.field(f"{m}.q").offset)
            s.append(lay.field(f"{m}.s").offset)
            z.append(lay.field(f"{m}.z").offset if fmt == "int4" else 0)
    for f in lay.fields:
        if f.dtype in ("float32", "float16", "bfloat16") and f.offset % 4:
            raise ValueError(f"blob field {f.name} at offset {f.offset} is not 4-byte aligned")
    if fmt in ("int4", "nvfp4"):
        for m in quant.MATRICES:
            g, cols = lay.group_of(m), lay.shape_of(m)[1]
            if g % CHUNK and g != cols:
                raise ValueError(f"blob_decode reads one scale per {CHUNK} values: {fmt} {m} groups of {g} of "
                                 f"{cols} columns are neither a multiple of {CHUNK} nor the whole row")
    tail = lay.field("tail").offset if fmt == "nvfp4" else 0
    return ([u32(lay.hidden), u32(lay.inter)] + [u32(v) for v in q + s + z] +
            [u32(tail), u32(max(lay.group_of("gate"), 1)), u32(max(lay.group_of("down"), 1))])


def pool_select(k: Kernels, slots, weight, nslots: int, r: int, sel=None, idx=None, wout=None, mark=None):
    """slots int32 [T, kk] (-1: skipped), weight fp32 [T, kk] -> (sel int32 [r + 1], idx int32 [T, kk],
    wout fp32 [T, kk]). Routes whose slot is not among the first r distinct slots used (or outside 0..nslots-1)
    point at expert r, the all-zero one, with weight 0."""
    q = k.queue
    routes = slots.size
    sel = dpnp.empty(r + 1, dtype=dpnp.int32, sycl_queue=q) if sel is None else sel
    idx = dpnp.empty(slots.shape, dtype=dpnp.int32, sycl_queue=q) if idx is None else idx
    wout = dpnp.empty(slots.shape, dtype=dpnp.float32, sycl_queue=q) if wout is None else wout
    mark = dpnp.empty(max(nslots, 1), dtype=dpnp.int32, sycl_queue=q) if mark is None else mark
    k.launch("pool_select", [slots, weight, mark, sel, idx, wout, u32(routes), i32(nslots), i32(r)], [SELECT_WG],
             [SELECT_WG])
    return sel, idx, wout


def blob_decode(k: Kernels, pool, sel, lay: quant.BlobLayout, out=None):
    """pool uint8 [N, nbytes]; sel int32 [E] (< 0: a zero expert) -> fp32 (gate [E, I, H], up [E, I, H],
    down [E, H, I]), each expert sel[e]'s blob decoded as quant.decode_expert does."""
    if pool.ndim != 2 or pool.shape[1] != lay.nbytes or pool.dtype != np.uint8:
        raise ValueError(f"pool must be uint8 [N, {lay.nbytes}] for this layout; got {pool.dtype} {pool.shape}")
    q = k.queue
    e = sel.shape[0]
    h, i = lay.hidden, lay.inter
    if out is None:
        out = (dpnp.empty((e, i, h), dtype=dpnp.float32, sycl_queue=q),
               dpnp.empty((e, i, h), dtype=dpnp.float32, sycl_queue=q),
               dpnp.empty((e, h, i), dtype=dpnp.float32, sycl_queue=q))
    per_expert = 2 * i * -(-h // CHUNK) + h * -(-i // CHUNK)
    total = e * per_expert
    if total >= 2 ** 32:
        raise ValueError(f"blob_decode: {e} experts of hidden {h}, inter {i} exceed one launch's 2^32 work-items")
    k.launch(f"blob_decode_{lay.fmt}", [pool, sel, *out, ctypes.c_uint64(lay.nbytes), i32(pool.shape[0]),
                                        *layout_args(lay), u32(total)], [total])
    return out


# --- numpy references

def pool_select_reference(slots, weight, nslots: int, r: int):
    slots = np.asarray(slots).astype(np.int64)
    used = np.unique(slots[(slots >= 0) & (slots < nslots)])[:r]
    sel = np.full(r + 1, -1, np.int32)
    sel[:used.size] = used
    pos = {int(s): j for j, s in enumerate(used)}
    idx = np.array([pos.get(int(s), r) for s in slots.reshape(-1)], np.int32).reshape(slots.shape)
    wout = np.where(idx < r, np.asarray(weight, np.float32), np.float32(0)).astype(np.float32)
    return sel, idx, wout


def blob_decode_reference(lay: quant.BlobLayout, pool, sel):
    pool = np.asarray(pool)
    h, i = lay.hidden, lay.inter
    e = len(sel)
    gate, up, down = (np.zeros((e, i, h), np.float32), np.zeros((e, i, h), np.float32),
                      np.zeros((e, h, i), np.float32))
    for j, s in enumerate(np.asarray(sel)):
        if 0 <= s < pool.shape[0]:
            gate[j], up[j], down[j] = quant.decode_expert(lay, pool[s])
    return gate, up, down
