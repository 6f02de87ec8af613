"""The decode form of the expert op as Pallas kernels that dequantize the blobs in the kernel (issue 4): int4, the
format the benchmarks run, by three variants (slab, the default, and the earlier v1 and v2), and every format of
strata/weights/quant.py by the tiles variant; for pools of any size.

Why: the XLA op (experts.py, experts_from_pool) gathered each route's whole blob, decoded it into float weights in
HBM and multiplied: at Qwen3-Next-80B shapes and batch 1 that was ~3x the blob's bytes written and read again, in a
chain of small launches. These kernels read each route's packed bytes once and keep the decoded weights in registers.
Since 2026-12-02 the XLA op's gather form multiplies quantised blobs as it decodes them too (experts.blob_matvec);
the measurements up to 35253ad below are against the former XLA form.

The slab variant (the default for int4 since 59544fd): a program (route, 8 rows of gate and up, or 32 of down) loads
its rows' packed bytes whole, [rows, groups, G/2] in one load of 16 (8) KB, with no K loop, and reduces once at the
end. Why: v1 and v2 reduced every group (a barrier each), which kept each program's loads in a chain of DRAM
latencies.
MEASURED at 59544fd (kernel_speed_decode_experts_h200_59544fd.json, other experts each call so that blobs come from
HBM, not L2): 1 / 2 / 4 / 16 tokens x 10 routes, slab 27.4 / 42.0 / 66.7 / 172 us, XLA's blob_matvec form 33.2 /
45.2 / 67.6 / 1757, v1 48.3 / 66.6 / 85.3 / 246, v2 (8 rows) 44.1 / 58.2 / 107 / 296; 16 rows or 8 warps no better.
The profiler (kernel_trace_decode_experts_h200_1c03f95.log) split 1 token into gate/up 10.4 us (floor 2.9) and down
5.8 (1.5), the rest of a chained call being the routes' sum and launch gaps; 16 tokens gate/up 103 us, down 49. The
integer-to-float conversion of every nibble (16 a clock per SM) accounted for ~5 and ~80 us of gate/up's: since
770b404 a nibble's q - z is built from its bits as the prompt kernels build it (expert_grouped._nibble_planes), an
OR and a float subtraction per nibble at 64 and 128 a clock (compiled for sm_90a on the CPU by
bench/triton_sass_probe.py: no spills, 128-bit loads of the weights, 2 conversions left per program against 256).

Floor (H200, batch 1, one MoE layer, 10 routes of 1.57 MiB): 16.5 MB read / 3.6 TB/s = 4.6 us, against ~40 us the
XLA gather form spends per layer in the all-resident decode (8.2 ms / 48 layers, of which the experts are a part).

MEASURED on the H200 (bench/kernel_speed.py at commit 9546310, JAX 0.11.2, Qwen3-Next-80B shapes H=2048, I=512,
512 slots, k=10; bench/results/kernel_speed_h200_9546310.log): 39.1 us at 1 token x 10 routes (XLA 33.7 us, floor
4.6 us: 12% of the HBM bound), 84.2 us at 4 tokens (XLA 86.4 us), 245.8 us at 16 tokens (XLA 1700 us; floor
64.5 us). Its pool there is 0.84 GB; the grouped kernels' bf16 run showed that a pool past 2^31 bytes gives wrong
results (Pallas' Triton lowering computes a ref's offsets in int32 up to 2^32 bytes), and an engine pool is 12-40
GB: so a pool of MAX_KERNEL_POOL_BYTES or more is read through compacted copies of the blobs the routes use (at most
T*k of them: expert_grouped.pool_chunks; at 16 tokens 160 blobs, 263 MB gathered). Not yet measured on the GPU: the
compaction (its gather is part of the decode time of a large pool: time it at 1 and 16 tokens over a > 2 GiB pool).
Verified here: the arithmetic in Pallas interpret mode against the numpy reference, the compaction of 1, 2 and 3
chunks with the limit monkeypatched small (tests/kernels/test_expert_decode.py).

Two kernels per call, both on Pallas' Triton backend (interpretable on the CPU in every JAX version we run):
- gate/up: program (route r, block of BI rows of I) -> h[r, rows] = silu(gate[rows] . x) * (up[rows] . x);
- down: program (route r, block of BH rows of H) -> y[r, rows] = weight[r] * (down[rows] . h[r]).
The routes' sum per token is one XLA reduction (and, over a compacted pool, the chunks' sum). A route with slot -1
contributes exactly 0.
Within a group of G = 128 columns an int4 row is (q - z) * s: the kernel sums (q - z) * x over the group's even and
odd columns (low and high nibbles) and multiplies by s once per group.

MEASURED again at 35253ad (kernel_speed_decode_h200_35253ad.json; every call read the same 16.5 MB, L2-resident):
1 token, v1 41.4 us, v2 at 32 / 16 / 8 rows a program 47.7 / 36.2 / 33.0, XLA 35.4 (floor 4.6); 4 tokens v1 79.5,
XLA 92.3; 16 tokens v1 242, XLA 423. v2's prediction (10-15 us at 1 token) missed: independent loads did not cut
the latency. Tiles: int8 2.0x XLA at 16 tokens (190 us) but 0.5-0.8x at 1-4;
bf16 0.3-0.4x; NVFP4 0.4-0.6x, so "auto" leaves every format but int4 to XLA.

Variants (static `variant`): "slab" (above); "v1" (the first design) walks the groups in a fori_loop, each step's
loads issued after the previous step's (16 dependent rounds of small loads for gate/up at H = 2048, 4 for down),
and reads x's even and odd columns by stride-2 loads. "v2" (timed above) writes the groups out in
straight-line code, so that every group's loads are independent instructions the compiler can issue together, and
reads x with each group's even columns then odd ones made contiguous by XLA beforehand (expert_grouped's
_even_odd_columns; one pass over x, [T, H]). Reasoning for the prediction: at batch 1 a program moves 64 KB
(gate and up, 32 rows) in 16 rounds of ~4 KB; a round is a DRAM latency (~1 us) with little in flight, so v1's
gate/up kernel is latency-bound (39 us for the op against a 4.6 us floor); v2 should approach a few rounds, i.e.
the op at ~10-15 us. What v2 costs: registers (the unrolled groups' loads live at once) and the x permutation.
"tiles" (bf16, int8, nvfp4, f32 and int4; the default for every format but int4) decodes [block, TILE_COLS] weight
tiles with blob_tiles.weight_tile, the decoder of the prompt-form kernels (expert_grouped.py), so one piece of code
reads each format's bytes, scales and zero points on both paths; each tile's partial matvec is scaled by the tile's
scale (int4's group scale), the finished sums by the matrix's (int8's row scales, nvfp4's global scale). Its floor
at batch 1 over bf16 blobs is 10 routes x 6.3 MB = 63 MB, 17.5 us (measured 120.6 us, above); kernels "auto" takes
it for no format (the backend's DECODE_KERNEL_FORMATS_AUTO), "pallas" for every one.
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
from strata.jax_backend.kernels.expert_grouped import _even_odd_columns, _nibble_planes, _pow2_divisor, pool_chunks
from strata.weights import quant
from strata.weights.quant import BlobLayout

BLOCK_ROWS = 32          # rows of a weight matrix per program (a power of two: Triton block shapes must be)
SLAB_ROWS = 8            # the slab variant's gate/up rows a program: 16 KB of int4 rows at H = 2048 in one load
WARPS = 4                # Triton warps a program
VARIANTS = ("v1", "v2", "slab", "tiles")   # v1, v2, slab: int4 only; tiles: every format
FORMATS = quant.FORMATS
TILE_COLS = 128          # tiles: columns of a weight tile per step (a power of two dividing the columns and, for
                         # int4, the group; 128 x 32 rows of f32 weights is 16 KB of loads a step)
MAX_KERNEL_POOL_BYTES = 2**31 - 1   # a pool at least this large is read through compacted sub-pools (the Triton
                                    # lowering computes a ref's byte offsets in int32 up to 2^32 bytes)
INT32_OFFSETS_MAX_BYTES = 2**32     # above it JAX's Triton lowering offsets in 64 bits (expert_grouped.py)


def _group_dot(pool_ref, slot, rows, lay: BlobLayout, m: str, kk, ve, vo):
    """sum over group kk of row `rows` [B] of int4 matrix m times v: ve, vo [G/2] are v's even and odd columns of
    the group. -> f32 [B]."""
    _, cols = lay.shape_of(m)
    g = lay.group_of(m)
    q, s, z = (lay.field(f"{m}.{n}") for n in ("q", "s", "z"))
    half = g // 2
    byte = kk * half + lax.broadcasted_iota(jnp.int32, (1, half), 1)                # [1, G/2]
    qb = pool_ref[slot, q.offset + rows[:, None] * (cols // 2) + byte]             # uint8 [B, G/2]
    lo = (qb & 0xF).astype(jnp.float32)                                            # even columns
    hi = (qb >> 4).astype(jnp.float32)                                             # odd columns
    at = rows * (cols // g) + kk                                                   # [B] group index in s, z
    scale = lax.bitcast_convert_type(tiles.u16_at(pool_ref, slot, s.offset + 2 * at), jnp.float16).astype(jnp.float32)
    zero = pool_ref[slot, z.offset + at].astype(jnp.float32)
    part = jnp.sum((lo - zero[:, None]) * ve[None, :] + (hi - zero[:, None]) * vo[None, :], axis=1)
    return part * scale


def _slab_dot(pool_ref, slot, rows, lay: BlobLayout, m: str, ve, vo):
    """The slab variant's matvec: rows `rows` [B] of int4 matrix m, whole, times v in one load of their bytes
    (contiguous, B x cols/2) and no loop. ve, vo [NG, G/2]: v's even and odd columns by group. Each nibble's q - z is
    built from its bits (expert_grouped._nibble_planes: no integer-to-float conversion, which issues at 16 a clock
    per SM on an H200 and bounded these kernels at 770b404's parent). -> f32 [B]."""
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
    """Row `row` of v_ref [*, cols] as the slab variant reads it: (even columns [NG, G/2], odd [NG, G/2]) in
    float32."""
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


def _groups(n: int, step, init, unrolled: bool):
    """acc after step(kk, acc) for kk = 0 .. n-1: a fori_loop (v1) or written out (v2: independent loads). Written
    out in Python because Pallas' Triton lowering refuses fori_loop's unroll (scan with unroll != 1)."""
    if not unrolled:
        return lax.fori_loop(0, n, step, init)
    acc = init
    for kk in range(n):
        acc = step(kk, acc)
    return acc


def _gate_up_kernel(slots_ref, toks_ref, x_ref, pool_ref, h_ref, *, lay: BlobLayout, block: int, v2: bool):
    slot, t = slots_ref[pl.program_id(0)], toks_ref[pl.program_id(0)]
    _, hidden = lay.shape_of("gate")
    g = lay.group_of("gate")

    def compute(rows):
        def group(kk, acc):
            if v2:                  # x's columns even-then-odd within each group (_even_odd_columns)
                ve = x_ref[t, pl.ds(kk * g, g // 2)].astype(jnp.float32)
                vo = x_ref[t, pl.ds(kk * g + g // 2, g // 2)].astype(jnp.float32)
            else:
                ve = x_ref[t, pl.ds(kk * g, g // 2, stride=2)].astype(jnp.float32)
                vo = x_ref[t, pl.ds(kk * g + 1, g // 2, stride=2)].astype(jnp.float32)
            return (acc[0] + _group_dot(pool_ref, slot, rows, lay, "gate", kk, ve, vo),
                    acc[1] + _group_dot(pool_ref, slot, rows, lay, "up", kk, ve, vo))

        zero = jnp.zeros((block,), jnp.float32)
        gate, up = _groups(hidden // g, group, (zero, zero), v2)
        return gate * jax.nn.sigmoid(gate) * up

    _route_block(slot, h_ref, block, compute)


def _down_kernel(slots_ref, weight_ref, h_ref, pool_ref, y_ref, *, lay: BlobLayout, block: int, v2: bool):
    r = pl.program_id(0)
    slot = slots_ref[r]
    _, inter = lay.shape_of("down")
    g = lay.group_of("down")

    def compute(rows):
        def group(kk, acc):
            ve = h_ref[r, pl.ds(kk * g, g // 2, stride=2)]
            vo = h_ref[r, pl.ds(kk * g + 1, g // 2, stride=2)]
            return acc + _group_dot(pool_ref, slot, rows, lay, "down", kk, ve, vo)

        return _groups(inter // g, group, jnp.zeros((block,), jnp.float32), v2) * weight_ref[r]

    _route_block(slot, y_ref, block, compute)


def _gate_up_slab_kernel(slots_ref, toks_ref, x_ref, pool_ref, h_ref, *, lay: BlobLayout, block: int):
    slot, t = slots_ref[pl.program_id(0)], toks_ref[pl.program_id(0)]
    _, hidden = lay.shape_of("gate")

    def compute(rows):
        v = _even_odd_groups(x_ref, t, hidden, lay.group_of("gate"))
        gate = _slab_dot(pool_ref, slot, rows, lay, "gate", *v)
        up = _slab_dot(pool_ref, slot, rows, lay, "up", *v)
        return gate * jax.nn.sigmoid(gate) * up

    _route_block(slot, h_ref, block, compute)


def _down_slab_kernel(slots_ref, weight_ref, h_ref, pool_ref, y_ref, *, lay: BlobLayout, block: int):
    r = pl.program_id(0)
    slot = slots_ref[r]
    _, inter = lay.shape_of("down")

    def compute(rows):
        v = _even_odd_groups(h_ref, r, inter, lay.group_of("down"))
        return _slab_dot(pool_ref, slot, rows, lay, "down", *v) * weight_ref[r]

    _route_block(slot, y_ref, block, compute)


def _tile_rows(pool_ref, slot, lay: BlobLayout, ms, rows, vec_at, bk: int):
    """The tiles variant's matvecs: for each matrix m in ms, rows `rows` [B] of m (decoded a [B, bk] tile at a time
    by blob_tiles.weight_tile, the prompt kernels' decoder) times the vector vec_at(k0) -> f32 [bk] of its columns
    k0 .. k0 + bk - 1. -> one f32 [B] per matrix, with every scale of the format applied."""
    _, cols = lay.shape_of(ms[0])

    def step(kk, acc):
        k0 = kk * bk
        v = vec_at(k0)[None, :]                                                     # [1, bk]
        out = []
        for m, a in zip(ms, acc):
            w, s = tiles.weight_tile(pool_ref, slot, lay, m, rows, k0, bk, jnp.float32)   # [B, bk], [B] | None
            part = jnp.sum(w * v, axis=1)
            out.append(a + (part if s is None else part * s))
        return tuple(out)

    zero = jnp.zeros(rows.shape, jnp.float32)
    acc = lax.fori_loop(0, cols // bk, step, tuple(zero for _ in ms))
    out = []
    for m, a in zip(ms, acc):
        s = tiles.matrix_scale(pool_ref, slot, lay, m, rows)                       # [B], a scalar or None
        out.append(a if s is None else a * s)
    return out


def _gate_up_tiles_kernel(slots_ref, toks_ref, x_ref, pool_ref, h_ref, *, lay: BlobLayout, block: int, bk: int):
    slot, t = slots_ref[pl.program_id(0)], toks_ref[pl.program_id(0)]

    def compute(rows):
        gate, up = _tile_rows(pool_ref, slot, lay, ("gate", "up"), rows,
                              lambda k0: x_ref[t, pl.ds(k0, bk)].astype(jnp.float32), bk)
        return gate * jax.nn.sigmoid(gate) * up

    _route_block(slot, h_ref, block, compute)


def _down_tiles_kernel(slots_ref, weight_ref, h_ref, pool_ref, y_ref, *, lay: BlobLayout, block: int, bk: int):
    r = pl.program_id(0)
    slot = slots_ref[r]

    def compute(rows):
        (down,) = _tile_rows(pool_ref, slot, lay, ("down",), rows, lambda k0: h_ref[r, pl.ds(k0, bk)], bk)
        return down * weight_ref[r]

    _route_block(slot, y_ref, block, compute)


def tile_cols(layout: BlobLayout, m: str) -> int:
    """The tiles variant's K step for matrix m: the largest power of two <= TILE_COLS dividing its columns (and its
    int4 group, so that a tile has one scale per row; nvfp4 tiles hold whole pairs of columns)."""
    _, cols = layout.shape_of(m)
    n = math.gcd(cols, layout.group_of(m)) if layout.fmt == "int4" else cols
    bk = math.gcd(n, TILE_COLS)
    if layout.fmt == "nvfp4" and bk < 2:
        raise ValueError(f"{m}: nvfp4 tiles need an even number of columns, got {cols}")
    return bk


@functools.partial(jax.jit, static_argnames=("layout", "interpret", "variant", "block", "warps"))
def experts_decode(layout: BlobLayout, pool, x, slots, weight, *, interpret: bool = False, variant: str | None = None,
                   block: int | None = None, warps: int = WARPS):
    """The expert op (experts.experts_from_pool's contract) for few routes, by two kernels (gate/up, down).

    pool uint8 [N, >= nbytes], any size; x [T, H]; slots int32 [T, k] in [-1, N) (-1: skipped, contributes 0);
    weight [T, k]. -> [T, H] in x.dtype (computed in float32). A pool of MAX_KERNEL_POOL_BYTES or more is read
    through compacted copies of the routes' blobs (at most T*k of them; expert_grouped.pool_chunks), one run of the
    kernels per chunk, the chunks' outputs summed. variant: "slab", "v1" or "v2" over int4 blobs, "tiles" over any
    format (module docstring); None: slab for int4, tiles otherwise. block: rows of a weight matrix per program, a power of
    two (smaller: more programs of fewer bytes; at batch 1 the gate/up kernel runs routes x I / block programs, 160
    at 32 rows, for the 132 SMs of an H200); None: BLOCK_ROWS, or SLAB_ROWS for the slab variant, whose down kernel
    takes block x H / I rows (as many bytes a program as gate/up's). warps: Triton warps a program."""
    if variant is None:
        variant = "slab" if layout.fmt == "int4" else "tiles"
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, not {variant!r}")
    if layout.fmt not in FORMATS:
        raise ValueError(f"experts_decode reads the formats {', '.join(FORMATS)}, not {layout.fmt!r}")
    if variant != "tiles" and layout.fmt != "int4":
        raise ValueError(f"variant {variant} reads int4 blobs, not {layout.fmt!r}; the tiles variant reads every "
                         f"format")
    if pool.dtype != jnp.uint8 or pool.ndim != 2 or pool.shape[1] < layout.nbytes:
        raise ValueError(f"pool must be uint8 [N, >= {layout.nbytes}], got {pool.dtype} {pool.shape}")
    t, k = slots.shape
    inter, hidden = layout.shape_of("gate")
    for m in quant.MATRICES if variant != "tiles" else ():
        g = layout.group_of(m)
        if g & (g - 1) or layout.shape_of(m)[1] % g:
            raise ValueError(f"{m}: group {g} must be a power of two dividing {layout.shape_of(m)[1]} columns")
    if block is None:
        block = SLAB_ROWS if variant == "slab" else BLOCK_ROWS
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, not {block}")
    if warps < 1 or warps & (warps - 1):
        raise ValueError(f"warps must be a power of two, not {warps}")
    down_block = block * max(1, hidden // inter) if variant == "slab" else block
    bi, bh = math.gcd(inter, block), _pow2_divisor(hidden, down_block)    # powers of two (Triton blocks)
    if variant == "v2":             # each group's even columns, then its odd ones: contiguous loads in the kernel
        x = _even_odd_columns(x, layout.group_of("gate"))
    run = functools.partial(_decode, layout, x=x, weight=weight, bi=bi, bh=bh, interpret=interpret, variant=variant,
                            warps=warps)
    if not (MAX_KERNEL_POOL_BYTES <= pool.size <= INT32_OFFSETS_MAX_BYTES):    # int32 offsets overflow only here
        return run(pool, slots=slots).astype(x.dtype)
    y = None
    for sub_pool, sub_slots in pool_chunks(pool, slots, t * k, layout.nbytes, MAX_KERNEL_POOL_BYTES):
        part = run(sub_pool, slots=sub_slots)
        y = part if y is None else y + part
    return y.astype(x.dtype)


def _decode(layout: BlobLayout, pool, x, slots, weight, *, bi: int, bh: int, interpret: bool, variant: str,
            warps: int):
    """The two kernels on a pool they may index directly (< 2^31 bytes): float32 [T, H]."""
    t, k = slots.shape
    inter, hidden = layout.shape_of("gate")
    routes = t * k
    flat_slots = slots.reshape(routes).astype(jnp.int32)
    toks = jnp.arange(routes, dtype=jnp.int32) // k
    if variant == "tiles":
        gate_up = functools.partial(_gate_up_tiles_kernel, lay=layout, block=bi, bk=tile_cols(layout, "gate"))
        down = functools.partial(_down_tiles_kernel, lay=layout, block=bh, bk=tile_cols(layout, "down"))
    elif variant == "slab":
        gate_up = functools.partial(_gate_up_slab_kernel, lay=layout, block=bi)
        down = functools.partial(_down_slab_kernel, lay=layout, block=bh)
    else:
        gate_up = functools.partial(_gate_up_kernel, lay=layout, block=bi, v2=variant == "v2")
        down = functools.partial(_down_kernel, lay=layout, block=bh, v2=variant == "v2")
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
