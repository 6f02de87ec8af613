"""The prompt form of the expert op as two Pallas grouped-GEMM kernels that dequantise the packed expert blobs in the
kernel (every format of strata/weights/quant.py: int4 and bf16 first, int8, nvfp4, f32).

Why: a prompt part routes thousands of (token, expert) pairs; the XLA op's grouped form (experts.py,
experts_from_pool) decodes one whole blob per block of rows into float weights in HBM ([blocks, I, H] three times,
in x's dtype) before its einsums, so at real shapes it writes and reads again several times the bytes of the packed
experts. `jax.lax.ragged_dot`, the other XLA route, lowers on the H200 to a dense masked expansion + cuBLAS:
notes/pallas-gpu.md measured it at 12.5 ms against 0.97 ms for a Pallas Triton grouped matmul (grid over row blocks
and groups, each program reading one expert's weights, so only active experts are read) at M=4096, G=512, K=2048,
N=1024 in bf16 (11.7 TFLOP/s for ragged_dot in one test). These kernels are that Triton grouped matmul with the
weights read packed and decoded in registers. Pallas' Triton backend: verified on the H200 for the copy kernel
beside this one, interpretable on the CPU in every JAX version we run.

Floor (Qwen3-Next-80B, one MoE layer, a prompt part of 4096 tokens: H=2048, I=512, k=10, 40,960 routes, ~80 per
expert, all 512 experts active): FLOPs = 2 * routes * 3 * H * I = 257.7 GFLOP = 326 us at ~790 TFLOP/s bf16;
bytes = the active experts' blobs (512 x 1,646,592 B int4 = 843 MB = 234 us at 3.6 TB/s; bf16 3.22 GB = 895 us;
int8 1.62 GB = 449 us; nvfp4 908 MB = 252 us) + activations (x read and y written, 2 x 16.8 MB in bf16, ~9 us).
So int4 and nvfp4 are compute-bound (326 us), bf16 and int8 memory-bound. This design adds to that: the padding of
each expert's group to whole blocks (~80 routes -> 128 rows at BLOCK_M 64 or 128: ~1.6x the FLOPs), each block
reading its expert's blob once (twice per expert at BLOCK_M 64 unless the neighbouring block's read hits L2), and
the intermediates in HBM: h [rows, I] (~67 MB each way) and the per-route rows y [rows, H] (~268 MB each way in
bf16), which a fused combine would save. Not yet measured on the GPU: what is verified is the arithmetic, in Pallas
interpret mode, against the numpy reference (tests/kernels/test_expert_grouped.py), and the Triton limits of the
kernels' traced shapes (powers of two, dot dtypes and sizes, shared memory of the dot tiles).

Design (`experts_grouped`):
- XLA sorts the routes by slot (skipped routes, slot -1, last and dropped) and lays each slot's group out padded to
  whole blocks of BLOCK_M rows: per padded row its token (pad rows: token 0, never read back) and its route weight
  (pad rows 0); per block its slot (-1 for the blocks past the last group: a static bound, they do nothing).
- kernel 1, grid (block, block of BLOCK_I columns of I): loads the block's x rows by token (a gather in the kernel,
  no sorted copy of x in HBM), decodes the slot's gate and up rows K columns at a time and accumulates
  x W^T in float32; h = silu(g) * u, stored in x's dtype.
- kernel 2, grid (block, block of BLOCK_H columns of H): y_rows = (h W_down^T) * the row's route weight.
- XLA gathers each route's row back into (token, choice) order (a permutation: no scatter-add) and sums over k in
  float32. A skipped route contributes exactly 0, whatever its weight.
Decoding in the kernel, one K tile [rows, BK] of a matrix (bytes read from the uint8 pool with computed offsets,
multi-byte fields assembled little-endian and bitcast):
- f32 / bf16: 4 / 2 bytes -> lax.bitcast_convert_type -> x's dtype.
- int8: q (exact in bfloat16) into the dot; the row scale (float32) multiplies the finished accumulator.
- int4: low / high nibbles (even / odd columns), minus the zero point, interleaved (join + reshape: Triton's
  interleave) into q - z in -15..15 (exact in bfloat16); the float16 group scale multiplies the K tile's partial
  product (BK divides the group), as the notes' measured int4 matmul did.
- nvfp4: e2m1 codes -> bfloat16 bits by bit operations (no float4 loads: they fail on Hopper), times the
  float8_e4m3 block scale decoded by bit operations (the product of a 2-bit and a 4-bit significand is exact in
  bfloat16); the matrix's float32 global scale multiplies the finished accumulator.
Dots take operands in x's dtype (float32 at HIGHEST precision: Triton would run TF32 otherwise) and accumulate in
float32, like the XLA op's arithmetic; in bfloat16 the decoded weights of f32 blobs are rounded once to bfloat16
(as the XLA op does), those of the other formats are exact, and h and y_rows are rounded once each.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from strata.jax_backend.kernels import triton_params
from strata.weights import quant
from strata.weights.quant import BlobLayout

FORMATS = ("int4", "bf16", "int8", "nvfp4", "f32")        # all of quant.FORMATS
DTYPES = ("float32", "bfloat16")                           # x's dtypes
BLOCK_M = 64             # rows (routes) per block; the XLA op's EXPERT_BLOCK. Powers of two 16..128.
BLOCK_I = 128            # kernel 1: columns of h (rows of gate/up) per program, at most
BLOCK_H = 128            # kernel 2: columns of y (rows of down) per program, at most
ACC_ELEMS = 8192         # float32 accumulator elements per matrix per program, at most: kernel 1 holds two (gate,
                         # up), 64 registers a thread at 8 warps; so BLOCK_M 128 takes 64 columns of I (a guess to
                         # tune on the GPU)
K_BLOCK = {"bfloat16": 128, "float32": 64}   # columns of a K step (f32 tiles are twice the bytes)
NUM_WARPS, NUM_STAGES = 8, 2
SMEM_BYTES = 227 * 1024  # shared memory per block on the H200 (notes/pallas-gpu.md)
MIN_DOT = 16             # Triton dots need every dimension >= 16


@dataclass(frozen=True)
class Plan:
    """Static block sizes of one call: bm rows per block, bi / bh output columns of kernel 1 / 2, bk1 / bk2 K-step
    columns (over H / over I)."""
    bm: int
    bi: int
    bh: int
    bk1: int
    bk2: int


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n."""
    return math.gcd(n, 1 << (cap.bit_length() - 1))


def plan(layout: BlobLayout, dtype, block_m: int = BLOCK_M) -> Plan:
    """The blocks the kernels use for this layout and x dtype; a ValueError for what they cannot read."""
    if layout.fmt not in FORMATS:
        raise ValueError(f"experts_grouped reads the formats {', '.join(FORMATS)}, not {layout.fmt!r}")
    dt = jnp.dtype(dtype).name
    if dt not in DTYPES:
        raise ValueError(f"experts_grouped computes in {' or '.join(DTYPES)}, not {dt}")
    if block_m & (block_m - 1) or not MIN_DOT <= block_m <= 128:
        raise ValueError(f"block_m must be a power of two in [{MIN_DOT}, 128], got {block_m}")
    inter, hidden = layout.shape_of("gate")
    # K steps: powers of two dividing the columns and (int4) the group, so that a K tile has one scale per row
    bk1 = _pow2_divisor(hidden if layout.fmt != "int4" else math.gcd(hidden, layout.group_of("gate")), K_BLOCK[dt])
    bk2 = _pow2_divisor(inter if layout.fmt != "int4" else math.gcd(inter, layout.group_of("down")), K_BLOCK[dt])
    p = Plan(block_m, _pow2_divisor(inter, min(BLOCK_I, ACC_ELEMS // block_m)),
             _pow2_divisor(hidden, min(BLOCK_H, 2 * ACC_ELEMS // block_m)), bk1, bk2)
    if min(p.bi, p.bh, p.bk1, p.bk2) < MIN_DOT:
        raise ValueError(f"experts_grouped needs H={hidden}, I={inter} (and int4 groups "
                         f"{layout.group_of('gate')}, {layout.group_of('down')}) to be multiples of {MIN_DOT}: "
                         f"Triton blocks are powers of two and dots need dimensions >= {MIN_DOT}")
    return p


# --- reading the pool: fields are little-endian; offsets are int32 arrays (or ints) of byte positions in the blob

def _bytes(pool_ref, slot, off, dtype):
    return pool_ref[slot, off].astype(dtype)


def _f32_at(pool_ref, slot, off):
    u = [_bytes(pool_ref, slot, off + i, jnp.uint32) for i in range(4)]
    return lax.bitcast_convert_type(u[0] | (u[1] << 8) | (u[2] << 16) | (u[3] << 24), jnp.float32)


def _u16_at(pool_ref, slot, off):
    return _bytes(pool_ref, slot, off, jnp.uint16) | (_bytes(pool_ref, slot, off + 1, jnp.uint16) << 8)


def _cols(k0, n: int):
    """[1, n] int32: columns k0 .. k0 + n - 1."""
    return k0 + lax.broadcasted_iota(jnp.int32, (1, n), 1)


def _interleave(even, odd):
    """[B, n] and [B, n] -> [B, 2n] with even[:, i] at column 2i and odd[:, i] at 2i + 1 (tt.join + tt.reshape)."""
    return jnp.stack([even, odd], axis=-1).reshape(even.shape[0], 2 * even.shape[1])


def _e2m1(code):
    """int32 e2m1 codes (bit 3 sign, bits 0..2 magnitude) -> bfloat16 values, by building the bfloat16 bits."""
    mag = code & 7
    exp = jnp.where(mag >= 2, (mag >> 1) + 126, jnp.where(mag == 1, 126, 0))   # 0.5 = 2^-1; 1, 1.5 = 2^0 ...
    man = jnp.where(mag >= 2, mag & 1, 0)                                         # 1.5, 3, 6: half-step mantissa
    bits = ((code >> 3) << 15) | (exp << 7) | (man << 6)
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def _e4m3(byte):
    """int32 float8_e4m3fn bytes -> float32 values, by bit operations (0x7F / 0xFF: NaN, as ml_dtypes decodes)."""
    exp, man = (byte >> 3) & 15, byte & 7
    normal = lax.bitcast_convert_type(((exp + 120) << 23) | (man << 20), jnp.float32)     # 2^(e-7) (1 + m/8)
    mag = jnp.where(exp == 0, man.astype(jnp.float32) * np.float32(2.0 ** -9), normal)    # subnormal m/8 2^-6
    mag = jnp.where((byte & 0x7F) == 0x7F, np.float32(np.nan), mag)
    return jnp.where(byte >= 128, -mag, mag)


def _weight_tile(pool_ref, slot, lay: BlobLayout, m: str, rows, k0, bk: int, dt):
    """Rows `rows` [B], columns k0 .. k0 + bk - 1 of matrix m of the blob in `slot`, decoded: (w [B, bk] in dt,
    scale [B] float32 that multiplies this tile's partial product, or None)."""
    _, cols = lay.shape_of(m)
    r = rows[:, None]
    fmt = lay.fmt
    if fmt == "f32":
        return _f32_at(pool_ref, slot, lay.field(m).offset + (r * cols + _cols(k0, bk)) * 4).astype(dt), None
    if fmt == "bf16":
        bits = _u16_at(pool_ref, slot, lay.field(m).offset + (r * cols + _cols(k0, bk)) * 2)
        return lax.bitcast_convert_type(bits, jnp.bfloat16).astype(dt), None
    if fmt == "int8":
        q = pool_ref[slot, lay.field(f"{m}.q").offset + r * cols + _cols(k0, bk)]
        return lax.bitcast_convert_type(q, jnp.int8).astype(jnp.float32).astype(dt), None
    packed = pool_ref[slot, lay.field(f"{m}.q").offset + r * (cols // 2) + _cols(k0 // 2, bk // 2)]  # [B, bk/2]
    lo, hi = (packed & 0xF).astype(jnp.int32), (packed >> 4).astype(jnp.int32)   # even, odd columns
    if fmt == "int4":
        g = lay.group_of(m)
        at = rows * (cols // g) + k0 // g                                         # [B]: the tile's group
        z = pool_ref[slot, lay.field(f"{m}.z").offset + at].astype(jnp.int32)[:, None]
        w = _interleave((lo - z).astype(dt), (hi - z).astype(dt))                 # q - z: exact in bfloat16
        s = lax.bitcast_convert_type(_u16_at(pool_ref, slot, lay.field(f"{m}.s").offset + 2 * at), jnp.float16)
        return w, s.astype(jnp.float32)
    # nvfp4: columns 2i and 2i + 1 share block (k0 + 2i) // 16 = k0 // 16 + i // 8
    blk = cols // quant.NVFP4_BLOCK
    pair_blk = k0 // quant.NVFP4_BLOCK + _cols(0, bk // 2) // (quant.NVFP4_BLOCK // 2)       # [1, bk/2]
    bs = _e4m3(pool_ref[slot, lay.field(f"{m}.s").offset + r * blk + pair_blk].astype(jnp.int32))  # [B, bk/2]
    even = (_e2m1(lo).astype(jnp.float32) * bs).astype(dt)                       # exact in bfloat16
    odd = (_e2m1(hi).astype(jnp.float32) * bs).astype(dt)
    return _interleave(even, odd), None


def _matrix_scale(pool_ref, slot, lay: BlobLayout, m: str, rows):
    """What multiplies matrix m's finished accumulator: int8's row scales [B], nvfp4's global scale (a scalar),
    or None."""
    if lay.fmt == "int8":
        return _f32_at(pool_ref, slot, lay.field(f"{m}.s").offset + 4 * rows)
    if lay.fmt == "nvfp4":
        return _f32_at(pool_ref, slot, lay.field("tail").offset + 4 * quant.MATRICES.index(m))
    return None


def _dot_t(a, w, prec):
    """a [M, K] . w [N, K]^T -> float32 [M, N]."""
    return lax.dot_general(a, w, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


def _scaled(acc, s):
    if s is None:
        return acc
    return acc * (s[None, :] if getattr(s, "ndim", 0) else s)


def _gate_up_kernel(bslot_ref, tok_ref, x_ref, pool_ref, h_ref, *, lay: BlobLayout, p: Plan, dt, prec):
    b, j = pl.program_id(0), pl.program_id(1)      # read outside the branches (interpret mode needs it)
    slot = bslot_ref[b]
    inter, hidden = lay.shape_of("gate")
    rows = j * p.bi + lax.broadcasted_iota(jnp.int32, (p.bi,), 0)

    @pl.when(slot < 0)
    def _():
        h_ref[...] = jnp.zeros((p.bm, p.bi), h_ref.dtype)

    @pl.when(slot >= 0)
    def _():
        xrow = tok_ref[...][:, None] * hidden                                      # [bm, 1]

        def step(kk, acc):
            k0 = kk * p.bk1
            xt = x_ref[xrow + _cols(k0, p.bk1)].astype(dt)                          # [bm, bk1]
            out = []
            for m, a in zip(("gate", "up"), acc):
                w, s = _weight_tile(pool_ref, slot, lay, m, rows, k0, p.bk1, dt)
                out.append(a + _scaled(_dot_t(xt, w, prec), s))
            return tuple(out)

        zero = jnp.zeros((p.bm, p.bi), jnp.float32)
        g, u = lax.fori_loop(0, hidden // p.bk1, step, (zero, zero))
        g = _scaled(g, _matrix_scale(pool_ref, slot, lay, "gate", rows))
        u = _scaled(u, _matrix_scale(pool_ref, slot, lay, "up", rows))
        h_ref[...] = (g * jax.nn.sigmoid(g) * u).astype(h_ref.dtype)


def _down_kernel(bslot_ref, w_ref, h_ref, pool_ref, y_ref, *, lay: BlobLayout, p: Plan, dt, prec):
    b, j = pl.program_id(0), pl.program_id(1)
    slot = bslot_ref[b]
    hidden, inter = lay.shape_of("down")
    rows = j * p.bh + lax.broadcasted_iota(jnp.int32, (p.bh,), 0)
    hrow = (b * p.bm + lax.broadcasted_iota(jnp.int32, (p.bm, 1), 0)) * inter    # [bm, 1]

    @pl.when(slot < 0)
    def _():
        y_ref[...] = jnp.zeros((p.bm, p.bh), y_ref.dtype)

    @pl.when(slot >= 0)
    def _():
        def step(kk, acc):
            k0 = kk * p.bk2
            ht = h_ref[hrow + _cols(k0, p.bk2)]                                     # [bm, bk2] in dt
            w, s = _weight_tile(pool_ref, slot, lay, "down", rows, k0, p.bk2, dt)
            return acc + _scaled(_dot_t(ht, w, prec), s)

        y = lax.fori_loop(0, inter // p.bk2, step, jnp.zeros((p.bm, p.bh), jnp.float32))
        y = _scaled(y, _matrix_scale(pool_ref, slot, lay, "down", rows))
        y_ref[...] = (y * w_ref[...][:, None]).astype(y_ref.dtype)


def _sort_routes(flat, weight, n_slots: int, kk: int, bm: int, n_groups: int):
    """Routes sorted by slot, each slot's group padded to whole blocks of bm rows.
    -> (row_tok [rows] int32, row_weight [rows] f32, block_slot [blocks] int32 (-1: no rows), pos [R] int32: the
    padded row of each route in (token, choice) order, or `rows` for a route not computed)."""
    r = flat.shape[0]
    n_blocks = (r + n_groups * (bm - 1)) // bm              # sum over groups of ceil(size / bm), at most
    n_rows = n_blocks * bm
    valid = flat >= 0
    key = jnp.where(valid, flat, n_slots)                   # skipped routes sort last
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    sorted_ok = sorted_key < n_slots
    first = jnp.concatenate([jnp.ones((1,), bool), sorted_key[1:] != sorted_key[:-1]])
    gid = jnp.where(sorted_ok, jnp.cumsum(first) - 1, n_groups)
    in_group = sorted_ok & (gid < n_groups)                 # routes of groups past n_groups are dropped
    sizes = jax.ops.segment_sum(in_group.astype(jnp.int32), gid, num_segments=n_groups, indices_are_sorted=True)
    padded = (sizes + bm - 1) // bm * bm
    pad_end = jnp.cumsum(padded)
    pad_start = pad_end - padded
    start = jnp.cumsum(sizes) - sizes
    gc = jnp.minimum(gid, n_groups - 1)
    dest = jnp.where(in_group, pad_start[gc] + (jnp.arange(r) - start[gc]), n_rows)
    row_tok = jnp.zeros((n_rows,), jnp.int32).at[dest].set((order // kk).astype(jnp.int32), mode="drop")
    row_weight = jnp.zeros((n_rows,), jnp.float32).at[dest].set(weight[order], mode="drop")
    bstart = jnp.arange(n_blocks, dtype=jnp.int32) * bm
    bg = jnp.minimum(jnp.searchsorted(pad_end, bstart, side="right", method="compare_all"), n_groups - 1)
    group_slot = sorted_key[jnp.minimum(start, r - 1)]
    block_slot = jnp.where(bstart < pad_end[-1], jnp.minimum(group_slot[bg], n_slots - 1), -1).astype(jnp.int32)
    pos = jnp.zeros((r,), jnp.int32).at[order].set(dest.astype(jnp.int32))
    return row_tok, row_weight, block_slot, pos


@functools.partial(jax.jit, static_argnames=("layout", "interpret", "max_distinct", "block_m"))
def experts_grouped(layout: BlobLayout, pool, x, slots, weight, *, interpret: bool = False,
                    max_distinct: int | None = None, block_m: int = BLOCK_M):
    """The expert op (experts.experts_from_pool's contract) for many routes, by the two grouped kernels.

    pool uint8 [N, >= layout.nbytes]; x [T, H] float32 or bfloat16; slots int32 [T, k] in [-1, N) (-1: skipped,
    contributes exactly 0 whatever its weight); weight [T, k] float32. -> [T, H] in x.dtype.
    max_distinct (static, optional): a bound on the distinct slots one call uses (default min(N, T*k)); it sizes the
    static grid (blocks = (T*k + max_distinct * (block_m - 1)) // block_m); routes of slots past the first
    max_distinct distinct ones contribute 0, as in experts_from_pool."""
    p = plan(layout, x.dtype, block_m)
    if pool.dtype != jnp.uint8 or pool.ndim != 2 or pool.shape[1] < layout.nbytes:
        raise ValueError(f"pool must be uint8 [N, >= {layout.nbytes}], got {pool.dtype} {pool.shape}")
    t, kk = slots.shape
    inter, hidden = layout.shape_of("gate")
    if x.shape != (t, hidden) or weight.shape != (t, kk):
        raise ValueError(f"x {x.shape} must be [T, {hidden}] and weight {weight.shape} [T, k] for slots {slots.shape}")
    n_slots = pool.shape[0]
    r = t * kk
    n_groups = max(1, min(int(max_distinct) if max_distinct is not None else n_slots, n_slots, r))
    dt = x.dtype
    prec = lax.Precision.HIGHEST if dt == jnp.float32 else lax.Precision.DEFAULT
    row_tok, row_weight, block_slot, pos = _sort_routes(slots.reshape(r).astype(jnp.int32),
                                                        weight.reshape(r).astype(jnp.float32),
                                                        n_slots, kk, p.bm, n_groups)
    n_rows = row_tok.shape[0]
    n_blocks = n_rows // p.bm
    params = dict(interpret=interpret, **triton_params(interpret, num_warps=NUM_WARPS, num_stages=NUM_STAGES))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    rows_spec = pl.BlockSpec((p.bm,), lambda b, j: (b,))
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, lay=layout, p=p, dt=dt, prec=prec),
        out_shape=jax.ShapeDtypeStruct((n_rows, inter), dt),
        grid=(n_blocks, inter // p.bi),
        in_specs=[pl.no_block_spec, rows_spec, pl.no_block_spec, any_spec],
        out_specs=pl.BlockSpec((p.bm, p.bi), lambda b, j: (b, j)),
        **params,
    )(block_slot, row_tok, x.reshape(-1), pool)
    y_rows = pl.pallas_call(
        functools.partial(_down_kernel, lay=layout, p=p, dt=dt, prec=prec),
        out_shape=jax.ShapeDtypeStruct((n_rows, hidden), dt),
        grid=(n_blocks, hidden // p.bh),
        in_specs=[pl.no_block_spec, rows_spec, pl.no_block_spec, any_spec],
        out_specs=pl.BlockSpec((p.bm, p.bh), lambda b, j: (b, j)),
        **params,
    )(block_slot, row_weight, h.reshape(-1), pool)
    ok = (pos < n_rows)[:, None]                            # skipped (or dropped) routes: exactly 0
    y = jnp.where(ok, jnp.take(y_rows, jnp.minimum(pos, n_rows - 1), axis=0), 0)
    return y.reshape(t, kk, hidden).astype(jnp.float32).sum(axis=1).astype(dt)


def _reference(layout: BlobLayout, pool, x, slots, weight):
    """numpy (float64 arithmetic): the expert op over the pool's blobs, float32 [T, H]."""
    return quant.expert_reference(layout, np.asarray(pool), np.asarray(x, np.float32), np.asarray(slots),
                                  np.asarray(weight, np.float32))
