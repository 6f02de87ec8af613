"""The decode form of the expert op over int4 blobs as two Pallas kernels (Triton backend) that dequantize in the
kernel, for pools of any size: gate/up, program (route r, block of rows of I) -> h[r, rows] = silu(gate . x) * (up . x);
down, program (route r, block of rows of H) -> y[r, rows] = weight[r] * (down . h[r]). A program loads its rows'
packed bytes whole, [rows, groups, G/2] in one load, with no K loop, builds each nibble's q - z from its bits
(expert_grouped._nibble_planes), multiplies by the group's scale and reduces once. The routes' sum per token is one
XLA reduction; a route with slot -1 contributes exactly 0. Other formats are refused (ValueError): XLA's op reads them.

Floor (H200, Qwen3-Next-80B, batch 1, one MoE layer, 10 routes of 1.57 MiB): 16.5 MB read / 3.6 TB/s = 4.6 us.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from strata.jax_backend.kernels import blob_tiles as tiles
from strata.jax_backend.kernels import triton_params
from strata.jax_backend.kernels.expert_grouped import _nibble_planes, _pow2_divisor, pool_chunks
from strata.weights import quant
from strata.weights.quant import BlobLayout

BLOCK_ROWS = 8           # gate/up rows a program (16 KB of int4 rows at H = 2048 in one load); down takes H / I x it
WARPS = 4                # Triton warps a program
FORMATS = ("int4",)
MAX_KERNEL_POOL_BYTES = 2**31 - 1   # a pool at least this large is read through compacted sub-pools (the Triton
                                    # lowering computes a ref's byte offsets in int32 up to 2^32 bytes)
INT32_OFFSETS_MAX_BYTES = 2**32     # above it JAX's Triton lowering offsets in 64 bits (expert_grouped.py)


def _slab_dot(pool_ref, slot, rows, lay: BlobLayout, m: str, ve, vo):
    """Rows `rows` [B] of int4 matrix m, whole, times v in one load of their bytes (contiguous, B x cols/2) and no
    loop. ve, vo [NG, G/2]: v's even and odd columns by group. Each nibble's q - z is built from its bits
    (expert_grouped._nibble_planes: no integer-to-float conversion, which issues at 16 a clock per SM on an H200).
    -> f32 [B]."""
    _, cols = lay.shape_of(m)
    g = lay.group_of(m)
    ng, half = cols // g, g // 2
    q, s, z = (lay.field(f"{m}.{n}") for n in ("q", "s", "z"))
    byte = (lax.broadcasted_iota(jnp.int32, (1, ng, half), 1) * half
            + lax.broadcasted_iota(jnp.int32, (1, ng, half), 2))                   # [1, NG, G/2]
    qb = pool_ref[slot, q.offset + rows[:, None, None] * (cols // 2) + byte]        # uint8 [B, NG, G/2]
    at = rows[:, None] * ng + lax.broadcasted_iota(jnp.int32, (1, ng), 1)          # [B, NG] group index in s, z
    zero = pool_ref[slot, z.offset + at]                                            # uint8 [B, NG]
    lo, hi = _nibble_planes(qb, zero[:, :, None], jnp.float32)                      # q - z: even, odd columns
    dots = jnp.sum(lo * ve[None] + hi * vo[None], axis=2)                           # [B, NG]
    scale = lax.bitcast_convert_type(tiles.u16_at(pool_ref, slot, s.offset + 2 * at), jnp.float16).astype(jnp.float32)
    return jnp.sum(dots * scale, axis=1)


def _even_odd_groups(v_ref, row, cols: int, g: int):
    """Row `row` of v_ref [*, cols] as _slab_dot reads it: (even columns [NG, G/2], odd [NG, G/2]) in float32."""
    ng, half = cols // g, g // 2
    col = (lax.broadcasted_iota(jnp.int32, (ng, half), 0) * g
           + 2 * lax.broadcasted_iota(jnp.int32, (ng, half), 1))                   # [NG, G/2] even columns
    return v_ref[row, col].astype(jnp.float32), v_ref[row, col + 1].astype(jnp.float32)


def _route_block(slot, out_ref, block: int, compute):
    """Program (r, j)'s output block: compute(rows j*block ..) for a computed route, zeros for a skipped one (-1).
    (program_id is read here, outside the branches: interpret mode cannot lower it inside one.)"""
    rows = pl.program_id(1) * block + lax.broadcasted_iota(jnp.int32, (block,), 0)

    @pl.when(slot < 0)
    def _():
        out_ref[...] = jnp.zeros((block,), jnp.float32)

    @pl.when(slot >= 0)
    def _():
        out_ref[...] = compute(rows)


def _gate_up_kernel(slots_ref, toks_ref, x_ref, pool_ref, h_ref, *, lay: BlobLayout, block: int):
    slot, t = slots_ref[pl.program_id(0)], toks_ref[pl.program_id(0)]
    _, hidden = lay.shape_of("gate")

    def compute(rows):
        v = _even_odd_groups(x_ref, t, hidden, lay.group_of("gate"))
        gate = _slab_dot(pool_ref, slot, rows, lay, "gate", *v)
        up = _slab_dot(pool_ref, slot, rows, lay, "up", *v)
        return gate * jax.nn.sigmoid(gate) * up

    _route_block(slot, h_ref, block, compute)


def _down_kernel(slots_ref, weight_ref, h_ref, pool_ref, y_ref, *, lay: BlobLayout, block: int):
    r = pl.program_id(0)
    slot = slots_ref[r]
    _, inter = lay.shape_of("down")

    def compute(rows):
        v = _even_odd_groups(h_ref, r, inter, lay.group_of("down"))
        return _slab_dot(pool_ref, slot, rows, lay, "down", *v) * weight_ref[r]

    _route_block(slot, y_ref, block, compute)


@functools.partial(jax.jit, static_argnames=("layout", "interpret", "block", "warps"))
def experts_decode(layout: BlobLayout, pool, x, slots, weight, *, interpret: bool = False, block: int = BLOCK_ROWS,
                   warps: int = WARPS):
    """The expert op (experts.experts_from_pool's contract) for few routes over int4 blobs, by two kernels.

    pool uint8 [N, >= nbytes], any size; x [T, H]; slots int32 [T, k] in [-1, N) (-1: skipped, contributes 0);
    weight [T, k]. -> [T, H] in x.dtype (computed in float32). Groups must be powers of two dividing the columns into
a power of two of them (Qwen3.8-Flash-Next's 640 = 20 x 32 does not: a ValueError, the backend then takes XLA's). A
    pool of MAX_KERNEL_POOL_BYTES .. INT32_OFFSETS_MAX_BYTES is read through compacted copies of the routes' blobs (at
    most T*k of them; expert_grouped.pool_chunks), one run of the kernels per chunk, the chunks' outputs summed.
    block: gate/up rows of a weight matrix per program, a power of two (smaller: more programs of fewer bytes); the
    down kernel takes block x H / I rows (as many bytes a program as gate/up's). warps: Triton warps a program."""
    if layout.fmt not in FORMATS:
        raise ValueError(f"experts_decode reads the formats {', '.join(FORMATS)}, not {layout.fmt!r}")
    if pool.dtype != jnp.uint8 or pool.ndim != 2 or pool.shape[1] < layout.nbytes:
        raise ValueError(f"pool must be uint8 [N, >= {layout.nbytes}], got {pool.dtype} {pool.shape}")
    t, k = slots.shape
    inter, hidden = layout.shape_of("gate")
    for m in quant.MATRICES:
        g, cols = layout.group_of(m), layout.shape_of(m)[1]
        if g & (g - 1) or cols % g:
            raise ValueError(f"{m}: group {g} must be a power of two dividing {cols} columns")
        if (cols // g) & (cols // g - 1):     # Triton lowers power-of-two shapes only: [groups, G/2] slabs
            raise ValueError(f"{m}: {cols // g} groups of {g} a row; the kernel reads a power of two (Triton's "
                             f"blocks), so {cols} columns go through XLA's form")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, not {block}")
    if warps < 1 or warps & (warps - 1):
        raise ValueError(f"warps must be a power of two, not {warps}")
    bi, bh = math.gcd(inter, block), _pow2_divisor(hidden, block * max(1, hidden // inter))   # Triton: powers of 2
    run = functools.partial(_decode, layout, x=x, weight=weight, bi=bi, bh=bh, interpret=interpret, warps=warps)
    if not (MAX_KERNEL_POOL_BYTES <= pool.size <= INT32_OFFSETS_MAX_BYTES):    # int32 offsets overflow only here
        return run(pool, slots=slots).astype(x.dtype)
    y = None
    for sub_pool, sub_slots in pool_chunks(pool, slots, t * k, layout.nbytes, MAX_KERNEL_POOL_BYTES):
        part = run(sub_pool, slots=sub_slots)
        y = part if y is None else y + part
    return y.astype(x.dtype)


def _decode(layout: BlobLayout, pool, x, slots, weight, *, bi: int, bh: int, interpret: bool, warps: int):
    """The two kernels on a pool they may index directly (< 2^31 bytes): float32 [T, H]."""
    t, k = slots.shape
    inter, hidden = layout.shape_of("gate")
    routes = t * k
    flat_slots = slots.reshape(routes).astype(jnp.int32)
    toks = jnp.arange(routes, dtype=jnp.int32) // k
    gate_up = functools.partial(_gate_up_kernel, lay=layout, block=bi)
    down = functools.partial(_down_kernel, lay=layout, block=bh)
    h = _per_route(gate_up, routes, inter, bi, interpret, warps, flat_slots, toks, x, pool)        # [R, I] f32
    y = _per_route(down, routes, hidden, bh, interpret, warps, flat_slots,
                   weight.reshape(routes).astype(jnp.float32), h, pool)                            # [R, H] f32
    return y.reshape(t, k, hidden).sum(axis=1)


def _per_route(kernel, routes: int, cols: int, block: int, interpret: bool, warps: int, *args):
    """One kernel call over grid (route, block of `cols`): the last argument is the pool (read where the kernel
    says), the others whole arrays; -> float32 [routes, cols]."""
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((routes, cols), jnp.float32),
        grid=(routes, cols // block),
        in_specs=[pl.no_block_spec] * (len(args) - 1) + [pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((None, block), lambda r, j: (r, j)),
        interpret=interpret, **triton_params(interpret, num_warps=warps, num_stages=2),
    )(*args)


def _reference(layout: BlobLayout, pool, x, slots, weight):
    """numpy (float64 arithmetic): the expert op over the pool's blobs, float32 [T, H]."""
    return quant.expert_reference(layout, np.asarray(pool), np.asarray(x, np.float32), np.asarray(slots),
                                  np.asarray(weight, np.float32))
