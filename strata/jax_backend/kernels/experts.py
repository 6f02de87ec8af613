"""The expert op over a device pool of packed expert blobs, in plain XLA (the baseline the Pallas kernels must match).

The pool is uint8 [N, nbytes], one expert per slot, each ONE contiguous blob in a format of strata/weights/quant.py;
the forward pass names experts by slot. `decode_blobs` turns blobs into float weights with slices and bitcasts only
(in float32 bit for bit quant.decode_expert). `experts_from_pool` is the op, its form picked by the static number of
routes: a gather form for decode (each route's blob gathered; a quantised one multiplied as it is decoded, in
float32, `blob_matvec`) and a grouped form for prompt parts (routes sorted by slot, each slot's group padded to
whole blocks of EXPERT_BLOCK rows, one blob decoded per block). A slot of -1 marks a route not computed here: it
contributes exactly zero. `experts_fetching`: the op with misses copied from host chunks inside the window.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from strata.weights import quant
from strata.weights.quant import BlobLayout

# The same values as strata.jax_backend.backend's (tests check it); defined here so that the backend may import this
# module without an import cycle.
GATHER_ROUTES_MAX = 64   # up to this many (token, route) pairs the op gathers each route's blob
EXPERT_BLOCK = 64        # rows per block of the grouped (prompt-part) form

_E2M1_LUT = quant.E2M1_LUT   # numpy [16] float32: e2m1 code -> value


def _field(layout: BlobLayout, blobs, name: str):
    """Field `name` of every blob, typed: [R, *field.shape] in the field's dtype (bitcast, no conversion)."""
    f = layout.field(name)
    r = blobs.shape[0]
    raw = lax.slice_in_dim(blobs, f.offset, f.end, axis=1)                         # [R, size] uint8
    dt = quant.np_dtype(f.dtype)
    if dt == np.uint8:
        typed = raw
    elif dt.itemsize == 1:
        typed = lax.bitcast_convert_type(raw, dt)
    else:
        typed = lax.bitcast_convert_type(raw.reshape(r, -1, dt.itemsize), dt)     # [R, n]
    return typed.reshape((r,) + f.shape)


def _nibbles(p):
    """uint8 [..., cols/2] -> [..., cols], the low nibble first (= even column)."""
    q = jnp.stack([p & 0xF, p >> 4], axis=-1)
    return q.reshape(p.shape[:-1] + (p.shape[-1] * 2,))


def decode_blobs(layout: BlobLayout, blobs, dtype):
    """blobs uint8 [R, >= nbytes] -> (gate [R, I, H], up [R, I, H], down [R, H, I]) in `dtype`.
    Decoding is done in float32 (equal to quant.decode_expert bit for bit), then cast to `dtype`."""
    f32 = jnp.float32
    r = blobs.shape[0]
    fmt = layout.fmt
    out = []
    for i, m in enumerate(quant.MATRICES):
        rows, cols = layout.shape_of(m)
        if fmt in ("f32", "bf16"):
            w = _field(layout, blobs, m).astype(f32)
        elif fmt == "int8":
            w = _field(layout, blobs, f"{m}.q").astype(f32) * _field(layout, blobs, f"{m}.s")[..., None]
        elif fmt == "int4":
            g = layout.group_of(m)
            q = _nibbles(_field(layout, blobs, f"{m}.q")).astype(f32).reshape(r, rows, cols // g, g)
            s = _field(layout, blobs, f"{m}.s").astype(f32)
            z = _field(layout, blobs, f"{m}.z").astype(f32)
            w = ((q - z[..., None]) * s[..., None]).reshape(r, rows, cols)
        elif fmt == "nvfp4":
            blk = quant.NVFP4_BLOCK
            codes = _nibbles(_field(layout, blobs, f"{m}.q")).astype(jnp.int32)
            v = jnp.asarray(_E2M1_LUT)[codes].reshape(r, rows, cols // blk, blk)
            bs = _field(layout, blobs, f"{m}.s").astype(f32)
            gs = _field(layout, blobs, "tail")[:, i]                                 # [R]
            w = ((v * bs[..., None]) * gs[:, None, None, None]).reshape(r, rows, cols)
        else:
            raise ValueError(f"unknown expert format {fmt!r}")
        out.append(w.astype(dtype))
    return tuple(out)


def blob_matvec(layout: BlobLayout, blobs, m: str, v):
    """Quantised matrix m of each blob times a vector, decoded inside the product: blobs uint8 [R, >= nbytes] of an
    int8, int4 or nvfp4 layout, v float32 [R, cols] -> float32 [R, rows], every weight decoded in float32 (as
    decode_blobs) and multiplied there, in one multiply-and-reduce that XLA fuses with the decoding (no weights
    written out). int4 and nvfp4 read each byte once for its two columns (v's even and odd columns) and each group's
    scale (and int4's zero point) once, broadcast over the group's elements; int8 applies the row's scale once per
    row."""
    f32 = jnp.float32
    r = blobs.shape[0]
    rows, cols = layout.shape_of(m)
    fmt = layout.fmt
    if fmt == "int8":
        q = _field(layout, blobs, f"{m}.q").astype(f32)                                 # [R, rows, cols]
        return jnp.sum(q * v[:, None, :], axis=-1) * _field(layout, blobs, f"{m}.s")
    if fmt not in ("int4", "nvfp4"):
        raise ValueError(f"unknown expert format {fmt!r}")
    g = layout.group_of(m)                                    # columns per scale: int4's group, nvfp4's block
    half, n_g = g // 2, cols // g
    q = _field(layout, blobs, f"{m}.q").reshape(r, rows, n_g, half)                    # 2 columns a byte
    ve = v[:, 0::2].reshape(r, 1, n_g, half)                                           # the low nibbles' columns
    vo = v[:, 1::2].reshape(r, 1, n_g, half)
    s = _field(layout, blobs, f"{m}.s").astype(f32).reshape(r, rows, n_g, 1)
    lo, hi = q & 0xF, q >> 4
    if fmt == "int4":                                         # sum over each row of (q - z) v s
        z = _field(layout, blobs, f"{m}.z").astype(f32).reshape(r, rows, n_g, 1)
        return jnp.sum(((lo.astype(f32) - z) * ve + (hi.astype(f32) - z) * vo) * s, axis=(-2, -1))
    lut = jnp.asarray(_E2M1_LUT)
    gs = _field(layout, blobs, "tail")[:, quant.MATRICES.index(m)]                     # [R] the global scale
    return jnp.sum((lut[lo] * ve + lut[hi] * vo) * s, axis=(-2, -1)) * gs[:, None]


def _take_blobs(pools: tuple, idx):
    """Rows `idx` [R] of the pools laid end to end (pool 0's slots first, then pool 1's, ...) -> uint8 [R, nbytes].
    Each pool is gathered from once; no pool is concatenated (that would copy the whole cache)."""
    out = jnp.take(pools[0], jnp.clip(idx, 0, pools[0].shape[0] - 1), axis=0)
    off = pools[0].shape[0]
    for extra in pools[1:]:
        rows = jnp.take(extra, jnp.clip(idx - off, 0, extra.shape[0] - 1), axis=0)
        out = jnp.where((idx >= off)[:, None], rows, out)
        off += extra.shape[0]
    return out


def experts_from_pool(layout: BlobLayout, pool, x, slots, weight, max_distinct: int):
    """The expert op over a pool: y[t] = sum_j weight[t, j] * down(silu(gate x_t) * up x_t), for the expert in
    slot slots[t, j]; a slot of -1 contributes 0.

    pool uint8 [N, nbytes], or a tuple of such pools read as one laid end to end (a window's staging rows after the
    cache's slots); x [T, H] (float32 or bfloat16); slots int32 [T, k] in [-1, N); weight [T, k].
    Returns [T, H] in x.dtype. `layout` and `max_distinct` are static; `max_distinct` bounds the number of distinct
    slots one call uses (e.g. the layer's expert count): a call that uses more gets wrong results for the excess."""
    t, kk = slots.shape
    hi = lax.Precision.HIGHEST
    flat = slots.reshape(-1).astype(jnp.int32)
    valid = flat >= 0
    pools = tuple(pool) if isinstance(pool, (tuple, list)) else (pool,)
    n_slots = sum(p.shape[0] for p in pools)
    if t * kk <= GATHER_ROUTES_MAX:
        # decode: gather the routed slots' blobs, so only they are read; a quantised blob's matrices multiply each
        # route's vector as they are decoded, in float32 (blob_matvec). Decoded into float weights first and cast to
        # x's dtype (the grouped form's way), int4 moved ~3x the blobs' bytes and was bfloat16-rounded (6.1e-3 from
        # float64 at one token, 1.6e-3 this way)
        blobs = _take_blobs(pools, jnp.where(valid, flat, 0))                        # [T*k, nbytes]
        ok = valid.reshape(t, kk)
        if layout.fmt in ("f32", "bf16"):   # nothing to decode: the dense expert op's arithmetic (JaxBackend.experts)
            dt = x.dtype
            gate, up, down = (w.reshape((t, kk) + w.shape[1:]) for w in decode_blobs(layout, blobs, dt))
            g = jnp.einsum("th,tkih->tki", x, gate, precision=hi)
            u = jnp.einsum("th,tkih->tki", x, up, precision=hi)
            y = jnp.einsum("tki,tkhi->tkh", jax.nn.silu(g) * u, down, precision=hi)
        else:
            dt = jnp.float32
            xr = jnp.repeat(x.astype(dt), kk, axis=0)                                # [T*k, H] route r: x[r // k]
            h = jax.nn.silu(blob_matvec(layout, blobs, "gate", xr)) * blob_matvec(layout, blobs, "up", xr)  # [T*k, I]
            y = blob_matvec(layout, blobs, "down", h).reshape(t, kk, -1)             # [T, k, H]
        y = jnp.where(ok[..., None], y, 0)            # a skipped route's (garbage) expert never reaches the sum
        return jnp.einsum("tkh,tk->th", y, jnp.where(ok, weight, 0).astype(dt), precision=hi).astype(x.dtype)
    # prompt parts: sort routes by slot (skipped routes last) and lay each slot's group out padded to whole blocks
    # of EXPERT_BLOCK rows, so every block belongs to one slot; each block multiplies by its decoded blob.
    rows = t * kk
    bsz = EXPERT_BLOCK
    n_groups = max(1, min(int(max_distinct), rows))
    n_blocks = -(-rows // bsz) + n_groups                                            # static bound on padded blocks
    key = jnp.where(valid, flat, n_slots)                                            # skipped routes sort last
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    sorted_ok = sorted_key < n_slots
    first = jnp.concatenate([jnp.ones((1,), bool), sorted_key[1:] != sorted_key[:-1]])
    gid = jnp.where(sorted_ok, jnp.cumsum(first) - 1, n_groups)                     # [rows] group of route
    sizes = jax.ops.segment_sum(sorted_ok.astype(jnp.int32), gid, num_segments=n_groups,
                                indices_are_sorted=True)                             # skipped routes dropped
    padded = (sizes + bsz - 1) // bsz * bsz
    pad_end = jnp.cumsum(padded)
    pad_start = pad_end - padded                                                     # [G] first padded row
    start = jnp.cumsum(sizes) - sizes                                                # [G] first sorted route
    gc = jnp.minimum(gid, n_groups - 1)
    in_group = sorted_ok & (gid < n_groups)
    dest = jnp.where(in_group, pad_start[gc] + (jnp.arange(rows) - start[gc]), n_blocks * bsz)  # past end: dropped
    tok = order // kk
    xb = jnp.zeros((n_blocks * bsz, x.shape[1]), x.dtype).at[dest].set(x[tok], mode="drop")
    xb = xb.reshape(n_blocks, bsz, -1)                                               # [nb, B, H]
    block_g = jnp.minimum(jnp.searchsorted(pad_end, jnp.arange(n_blocks) * bsz, side="right"), n_groups - 1)
    group_slot = sorted_key[jnp.minimum(start, rows - 1)]                            # [G]; empty groups: any slot
    block_slot = jnp.minimum(group_slot[block_g], n_slots - 1)                       # trailing blocks: unread rows
    gate, up, down = decode_blobs(layout, _take_blobs(pools, block_slot), x.dtype)
    g = jnp.einsum("nbh,nih->nbi", xb, gate, precision=hi)
    u = jnp.einsum("nbh,nih->nbi", xb, up, precision=hi)
    y = jnp.einsum("nbi,nhi->nbh", jax.nn.silu(g) * u, down, precision=hi)
    y = (jnp.take(y.reshape(n_blocks * bsz, -1), dest, axis=0, mode="fill", fill_value=0)
         * weight.reshape(-1)[order][:, None].astype(x.dtype))
    return jnp.zeros_like(x).at[jnp.where(in_group, tok, t)].add(y, mode="drop")


def _reference(layout: BlobLayout, pool, x, slots, weight):
    """The numpy reference of experts_from_pool (float64 arithmetic), float32 [T, H]."""
    return quant.expert_reference(layout, np.asarray(pool), np.asarray(x, np.float32), np.asarray(slots),
                                  np.asarray(weight, np.float32))


def copy_rows_loop(dst, src, rows, lo, hi):
    """dst with dst[i] = src[rows[i]] for lo <= i < hi, by XLA: one device_put of a dynamic slice of the host chunk per
    row in a fori_loop (the same contract as kernels/host_rows.copy_host_rows). Every iteration reads its predicate
    back to the host, which on a GPU costs more than the copy (host_rows.py); on a CPU it is the natural form."""
    def copy(i, st):
        blob = lax.dynamic_index_in_dim(src, rows[i], keepdims=False)               # [nbytes] in host memory
        return lax.dynamic_update_index_in_dim(st, jax.device_put(blob, jax.memory.Space.Device), i, 0)
    return lax.fori_loop(lo, hi, copy, dst)


def experts_fetching(layout: BlobLayout, pool, table_row, chunks, starts, x, ids, weight, valid,
                     copy_rows=copy_rows_loop):
    """The expert op for one MoE layer when not every expert is in the pool: hits read their pool slots, misses are
    copied from host memory into a staging buffer by the device itself, inside the same compiled window (no round
    trip to the host between the router and the experts).

    pool uint8 [N, nbytes]; table_row int32 [E] (slot of each of this layer's experts, -1 if not resident: the
    window's table, by value); chunks: host arrays uint8 [n_c, nbytes] (pinned host memory) holding experts
    starts[c] .. starts[c] + n_c - 1 (starts static); x [T, H]; ids, weight [T, k]; valid [T] bool.
    copy_rows(dst, src, rows, lo, hi) does the copies: copy_rows_loop (XLA) or host_rows.copy_host_rows (a kernel).
    -> (y [T, H], number of experts copied). The experts are computed by ONE experts_from_pool over the pool and
    the staging rows laid end to end, so each route's blob is decoded once, with the same op's arithmetic."""
    t, kk = ids.shape
    n_experts = table_row.shape[0]
    m = t * kk
    resident = table_row[ids]                                                        # [T, k]
    miss = valid[:, None] & (resident < 0)                                           # [T, k]
    # the distinct missing experts, sorted, padded with n_experts: staging row i holds expert wanted[i]
    wanted = jnp.unique(jnp.where(miss, ids, n_experts).reshape(-1), size=m, fill_value=n_experts)   # [M]
    staging = jnp.zeros((m, layout.nbytes), jnp.uint8)
    # Lookups in `wanted` compare against all of it (M is at most a few hundred): jnp.searchsorted's default binary
    # search is a while loop, on a GPU a launch per step and a break in XLA's command buffers.
    for chunk, a in zip(chunks, starts):
        lo = jnp.sum(wanted < a, dtype=jnp.int32)          # the wanted experts this chunk holds: rows lo .. hi-1
        hi = jnp.sum(wanted < a + chunk.shape[0], dtype=jnp.int32)
        staging = copy_rows(staging, chunk, (wanted - a).astype(jnp.int32), lo, hi)
    # a hit reads its slot, a miss staging row r reads "slot" N + r of the pools laid end to end
    n = pool.shape[0]
    row = jnp.searchsorted(wanted, ids, method="compare_all")                       # [T, k]
    slots = jnp.where(miss, n + row, jnp.where(valid[:, None], resident, -1))
    y = experts_from_pool(layout, (pool, staging), x, slots.astype(jnp.int32), weight,
                          max_distinct=min(m, n_experts))    # an expert is a hit or a miss, not both
    return y, jnp.sum(wanted < n_experts).astype(jnp.int32)
