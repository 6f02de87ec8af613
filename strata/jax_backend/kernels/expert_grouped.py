"""The prompt form of the expert op as two Pallas grouped-GEMM kernels (Triton backend) that decode the packed expert
blobs in the kernel, every format of strata/weights/quant.py, for pools of any size. XLA sorts the routes by slot
and lays each slot's group out in whole blocks of block_m rows; kernel 1 gathers a block's x rows by token and
computes h = silu(x gate^T) * (x up^T) from its expert's blob; kernel 2 y_rows = (h down^T) * the route's weight;
XLA gathers each route's row back into (token, choice) order and sums over k in float32. A skipped route (slot -1)
contributes exactly 0. int4 with power-of-two groups of >= 32 columns runs the "v2" kernels (even/odd columns, two
dots a group); every other format and layout the "v1" kernels (K tiles decoded by blob_tiles.weight_tile).

Floor (H200, Qwen3-Next-80B, one MoE layer, 4096 tokens x 10 routes, all 512 experts active): 257.7 GFLOP = 326 us
at ~790 TFLOP/s bf16; the blobs int4 843 MB = 234 us at 3.6 TB/s (nvfp4 252 us): compute-bound; bf16 895 us, int8
449 us: memory-bound.
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

from strata.jax_backend.kernels import blob_tiles as tiles
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
MAX_KERNEL_POOL_BYTES = 2**31 - 1   # a pool at least this large, and at most INT32_OFFSETS_MAX_BYTES, is read
                                    # through compacted sub-pools (pool_chunks): JAX's Triton lowering computes a
                                    # ref's byte offsets in (signed) int32 up to 2^32 bytes, in 64 bits above
INT32_OFFSETS_MAX_BYTES = 2**32     # (jax/_src/pallas/triton/lowering.py, _compute_offsets_from_indices)


def needs_compaction(pool_bytes: int) -> bool:
    """Whether a pool of this many bytes must reach the kernels as compacted sub-pools (int32 offsets overflow)."""
    return MAX_KERNEL_POOL_BYTES <= pool_bytes <= INT32_OFFSETS_MAX_BYTES
VARIANTS = ("v1", "v2")  # v2: the int4 kernels below (even/odd columns, two dots per group); v1: every format
# v2 (int4): columns of h / y per program (the accumulators: two [bm, bn1] in kernel 1, one [bm, bn2] in kernel 2;
# capped by ACC_ELEMS like v1's), pipeline stages per x dtype, and one warpgroup (4 warps) per 64 rows of a block
# (Hopper's wgmma is 64 rows per warpgroup): chosen by compiling the kernels for sm_90 (bench/triton_sass_probe.py).
V2_BLOCK_N = {"bfloat16": (128, 128), "float32": (64, 64)}
V2_STAGES = {"bfloat16": 3, "float32": 2}


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


def _dot_t(a, w, prec):
    """a [M, K] . w [N, K]^T -> float32 [M, N]."""
    return lax.dot_general(a, w, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


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
            xt = x_ref[xrow + tiles.col_range(k0, p.bk1)].astype(dt)                          # [bm, bk1]
            out = []
            for m, a in zip(("gate", "up"), acc):
                w, s = tiles.weight_tile(pool_ref, slot, lay, m, rows, k0, p.bk1, dt)
                out.append(a + tiles.scaled(_dot_t(xt, w, prec), s))
            return tuple(out)

        zero = jnp.zeros((p.bm, p.bi), jnp.float32)
        g, u = lax.fori_loop(0, hidden // p.bk1, step, (zero, zero))
        g = tiles.scaled(g, tiles.matrix_scale(pool_ref, slot, lay, "gate", rows))
        u = tiles.scaled(u, tiles.matrix_scale(pool_ref, slot, lay, "up", rows))
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
            ht = h_ref[hrow + tiles.col_range(k0, p.bk2)]                                     # [bm, bk2] in dt
            w, s = tiles.weight_tile(pool_ref, slot, lay, "down", rows, k0, p.bk2, dt)
            return acc + tiles.scaled(_dot_t(ht, w, prec), s)

        y = lax.fori_loop(0, inter // p.bk2, step, jnp.zeros((p.bm, p.bh), jnp.float32))
        y = tiles.scaled(y, tiles.matrix_scale(pool_ref, slot, lay, "down", rows))
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


# --- v2: int4 as a GEMM over even and odd columns (no nibble interleave)
#
# Within each int4 group of g columns (power of two), XLA permutes the activations' columns once so that the g/2
# even columns come first, then the g/2 odd ones (`_even_odd_columns`). A packed byte holds column 2i (low nibble)
# and 2i + 1 (high nibble) of the group, so the group's contribution is x_even . lo^T + x_odd . hi^T: two dots over
# contiguous loads, with lo / hi decoded elementwise where the bytes were loaded (no join, no reshape into an
# interleaved tile), times the group's float16 scale per output column. lo = (b & 15) - z and hi = (b >> 4) - z are
# built from bits (_nibble_planes: exact, no int-to-float conversion); zero points and scales ([BN] vectors) are
# loaded one group ahead, carried through the K loop. Kernel 1 writes h with its columns already in down's even/odd
# order (program j computes the rows of gate / up that land at its h positions), so kernel 2 reads h the same way
# at no cost. Grid (column block, row block): a row block's programs run together and share its x (or h) rows in L2.

@dataclass(frozen=True)
class PlanV2:
    """Static blocks of the v2 int4 kernels: bm rows, bn1 / bn2 output columns of kernel 1 / 2, g1 / g2 the int4
    groups of gate-up / down (one K step each), and each kernel's (num_warps, num_stages)."""
    bm: int
    bn1: int
    bn2: int
    g1: int
    g2: int
    launch1: tuple[int, int]
    launch2: tuple[int, int]


def plan_v2(layout: BlobLayout, dtype, block_m: int = BLOCK_M) -> PlanV2 | None:
    """The v2 blocks for this layout and x dtype, or None where v2 does not apply (not int4, or an int4 group that
    is not a power of two of at least 2 * MIN_DOT columns: the demo model's 96): those run v1."""
    plan(layout, dtype, block_m)                              # the same refusals as v1
    if layout.fmt != "int4":
        return None
    dt = jnp.dtype(dtype).name
    inter, hidden = layout.shape_of("gate")
    g1, g2 = layout.group_of("gate"), layout.group_of("down")
    if any(g & (g - 1) or g < 2 * MIN_DOT for g in (g1, g2)):
        return None
    n1, n2 = V2_BLOCK_N[dt]
    bn1 = _pow2_divisor(inter, min(n1, ACC_ELEMS // block_m))
    bn2 = _pow2_divisor(hidden, min(n2, 2 * ACC_ELEMS // block_m))
    if min(bn1, bn2) < MIN_DOT:
        return None
    launch = (max(4, 4 * block_m // 64), V2_STAGES[dt])
    return PlanV2(block_m, bn1, bn2, g1, g2, launch, launch)


def kernel_variant(layout: BlobLayout, dtype, variant: str = "v2", block_m: int = BLOCK_M) -> str:
    """Which kernels experts_grouped runs: "v2" for int4 layouts v2 reads when variant is "v2", else "v1"."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    return "v2" if variant == "v2" and plan_v2(layout, dtype, block_m) is not None else "v1"


def _even_odd_columns(a, g: int):
    """[R, C] -> [R, C] with, inside every group of g columns, the g/2 even columns first, then the g/2 odd ones."""
    r, c = a.shape
    return a.reshape(r, c // g, g // 2, 2).swapaxes(-1, -2).reshape(r, c)


def _even_odd_source(pos, g: int):
    """The column `_even_odd_columns` puts at position pos (int32 array): its gather index,
    _even_odd_columns(a, g)[:, p] == a[:, _even_odd_source(p, g)]."""
    half = g // 2                                            # g a power of two: masks and shifts
    within = pos & (g - 1)
    return pos - within + ((within & (half - 1)) << 1) + (within >> (half.bit_length() - 1))


def _nibble_planes(packed, z, dt):
    """uint8 [B, n] packed bytes and int32 zero points [B, 1] -> (lo - z, hi - z) [B, n] in dt, exact (values in
    -15..15). Built from bits: bfloat16 0x4300 | q is 128 + q (float32: 0x4B000000 | q is 2^23 + q), so one OR and one
    subtraction of (magic | z) per element, no integer-to-float conversion."""
    if dt == jnp.bfloat16:
        utype, magic = jnp.uint16, 0x4300
    else:
        utype, magic = jnp.uint32, 0x4B000000
    zf = lax.bitcast_convert_type(z.astype(utype) | magic, dt)
    lo = lax.bitcast_convert_type((packed & 0xF).astype(utype) | magic, dt) - zf
    hi = lax.bitcast_convert_type((packed >> 4).astype(utype) | magic, dt) - zf
    return lo, hi


class _Int4Rows:
    """Where rows `rows` [B] of int4 matrix m sit in the blob, and what one K step (one group kk) reads of them: the
    packed bytes [B, g/2], the zero points [B] and the float16 scales [B] (two bytes each, little-endian)."""

    def __init__(self, lay: BlobLayout, m: str, rows):
        _, cols = lay.shape_of(m)
        self.g = lay.group_of(m)
        self.n_groups = cols // self.g
        self.q = lay.field(f"{m}.q").offset + rows[:, None] * (cols // 2)                   # [B, 1]
        self.s = lay.field(f"{m}.s").offset + rows * (2 * self.n_groups)                    # [B]
        self.z = lay.field(f"{m}.z").offset + rows * self.n_groups                          # [B]

    def params(self, pool_ref, slot, kk):
        """Group kk's (zero points int32 [B], scales float32 [B]). Byte loads that cannot be pipelined the way the
        packed tiles are: the kernels load them one group ahead (loop-carried) so that their latency overlaps a
        step's dots."""
        kk = jnp.minimum(kk, self.n_groups - 1)
        z = pool_ref[slot, self.z + kk].astype(jnp.int32)
        s = lax.bitcast_convert_type(tiles.u16_at(pool_ref, slot, self.s + 2 * kk), jnp.float16).astype(jnp.float32)
        return z, s

    def product(self, a_even, a_odd, pool_ref, slot, kk, zs, dt, prec):
        """Group kk's contribution (a_even . lo^T + a_odd . hi^T) * s -> float32 [M, B], zs = params(kk)."""
        half = self.g // 2
        packed = pool_ref[slot, self.q + kk * half + tiles.col_range(0, half)]                        # uint8 [B, g/2]
        z, s = zs
        lo, hi = _nibble_planes(packed, z[:, None], dt)
        part = _dot_t(a_even, lo, prec) + _dot_t(a_odd, hi, prec)   # Triton chains the second dot onto the first
        return part * s[None, :]


def _gate_up_int4_kernel(bslot_ref, tok_ref, x_ref, pool_ref, h_ref, *, lay: BlobLayout, p: PlanV2, dt, prec):
    """Program (j, b): block b of rows, block j of h's columns. x_ref: x flat with its columns in gate's even/odd
    order; h_ref block [bm, bn1] of h with its columns in down's even/odd order."""
    j, b = pl.program_id(0), pl.program_id(1)      # j fastest: a block's programs run together and share its x rows
    slot = bslot_ref[b]
    _, hidden = lay.shape_of("gate")
    rows = _even_odd_source(j * p.bn1 + lax.broadcasted_iota(jnp.int32, (p.bn1,), 0), p.g2)  # gate/up rows
    half = p.g1 // 2

    @pl.when(slot < 0)
    def _():
        h_ref[...] = jnp.zeros((p.bm, p.bn1), h_ref.dtype)

    @pl.when(slot >= 0)
    def _():
        xrow = tok_ref[...][:, None] * hidden + tiles.col_range(0, half)                              # [bm, g/2]
        mats = (_Int4Rows(lay, "gate", rows), _Int4Rows(lay, "up", rows))

        def step(kk, carry):
            acc, zs = carry
            zs_next = tuple(w.params(pool_ref, slot, kk + 1) for w in mats)
            xe = x_ref[xrow + kk * p.g1]                                                    # even columns
            xo = x_ref[xrow + kk * p.g1 + half]                                             # odd columns
            acc = tuple(a + w.product(xe, xo, pool_ref, slot, kk, c, dt, prec) for a, w, c in zip(acc, mats, zs))
            return acc, zs_next

        zero = jnp.zeros((p.bm, p.bn1), jnp.float32)
        zs0 = tuple(w.params(pool_ref, slot, 0) for w in mats)
        (g, u), _ = lax.fori_loop(0, hidden // p.g1, step, ((zero, zero), zs0))
        h_ref[...] = (g * jax.nn.sigmoid(g) * u).astype(h_ref.dtype)


def _down_int4_kernel(bslot_ref, w_ref, h_ref, pool_ref, y_ref, *, lay: BlobLayout, p: PlanV2, dt, prec):
    """Program (j, b): block b of rows, block j of y's columns. h_ref: h flat [rows * I] with its columns in down's
    even/odd order."""
    j, b = pl.program_id(0), pl.program_id(1)      # j fastest: a block's programs share its h rows in L2
    slot = bslot_ref[b]
    _, inter = lay.shape_of("down")
    rows = j * p.bn2 + lax.broadcasted_iota(jnp.int32, (p.bn2,), 0)
    half = p.g2 // 2
    hrow = (b * p.bm + lax.broadcasted_iota(jnp.int32, (p.bm, 1), 0)) * inter + tiles.col_range(0, half)   # [bm, g/2]

    @pl.when(slot < 0)
    def _():
        y_ref[...] = jnp.zeros((p.bm, p.bn2), y_ref.dtype)

    @pl.when(slot >= 0)
    def _():
        down = _Int4Rows(lay, "down", rows)

        def step(kk, carry):
            acc, zs = carry
            zs_next = down.params(pool_ref, slot, kk + 1)
            he = h_ref[hrow + kk * p.g2]
            ho = h_ref[hrow + kk * p.g2 + half]
            return acc + down.product(he, ho, pool_ref, slot, kk, zs, dt, prec), zs_next

        zero = jnp.zeros((p.bm, p.bn2), jnp.float32)
        y, _ = lax.fori_loop(0, inter // p.g2, step, (zero, down.params(pool_ref, slot, 0)))
        y_ref[...] = (y * w_ref[...][:, None]).astype(y_ref.dtype)


# --- pools of any size: the kernels index a pool with int32 byte offsets up to 2^32 bytes (64-bit above), so one of
# MAX_KERNEL_POOL_BYTES .. INT32_OFFSETS_MAX_BYTES is read through compacted copies of the blobs a call uses: XLA
# finds the distinct slots (jnp.unique at the static size max_distinct, the smallest ones, as the direct path keeps),
# splits them into equal static chunks of fewer than 2^31 bytes of blobs, gathers each chunk's blobs into a compact
# pool, remaps the chunk's routes to it and every other route to -1, runs the kernels per chunk and sums the chunks'
# float32 outputs (a route of slot -1 contributes exactly 0, so the sum is the op). The gather reads and writes the
# used blobs once.

def pool_chunks(pool, slots, n_distinct: int, nbytes: int, limit: int):
    """Split the distinct slots `slots` uses (the n_distinct smallest; -1 and out-of-range slots skipped) into
    chunks of fewer than `limit` bytes of blobs. -> list of (sub_pool uint8 [c, nbytes], sub_slots like slots): the
    chunk's blobs gathered in slot order, and slots remapped to them (-1 for a route of another chunk, a skipped
    route, or a slot past the first n_distinct). Every chunk has the same static shape; the sum over the chunks of
    the op on (sub_pool, sub_slots) is the op on (pool, slots)."""
    n = pool.shape[0]
    per = (limit - 1) // nbytes                          # blobs per chunk: per * nbytes < limit
    if per < 1:
        raise ValueError(f"one expert blob ({nbytes} bytes) does not fit the kernels' pool limit ({limit} bytes)")
    n_distinct = max(1, min(n_distinct, n))
    n_chunks = -(-n_distinct // per)
    size = -(-n_distinct // n_chunks)                    # balanced: the last chunk is padded by < n_chunks
    key = jnp.where((slots >= 0) & (slots < n), slots, n).astype(jnp.int32)
    uniq = jnp.unique(key.reshape(-1), size=n_distinct, fill_value=n)      # sorted; n past the distinct slots
    uniq = jnp.concatenate([uniq, jnp.full((n_chunks * size - n_distinct,), n, jnp.int32)])
    rank = jnp.searchsorted(uniq, key).astype(jnp.int32)
    found = (key < n) & (uniq[jnp.minimum(rank, n_chunks * size - 1)] == key)
    chunks = []
    for c in range(n_chunks):
        ids = jnp.minimum(uniq[c * size:(c + 1) * size], n - 1)             # padding entries: any blob, never read
        sub_pool = pool[ids, :nbytes]                                       # one gather of whole rows
        sub_slots = jnp.where(found & (rank // size == c), rank - c * size, -1).astype(jnp.int32)
        chunks.append((sub_pool, sub_slots))
    return chunks


def _grouped(layout: BlobLayout, pool, x, slots, weight, *, n_groups: int, block_m: int, variant: str,
             interpret: bool):
    """The op on a pool the kernels may index directly (< 2^31 bytes): float32 [T, H]. Dots take operands in x's
    dtype (float32 at HIGHEST precision: Triton would run TF32 otherwise) and accumulate in float32, as the XLA op's
    arithmetic; in bfloat16 the decoded weights of f32 blobs are rounded once (as the XLA op does), those of the other
    formats are exact, and h and y_rows are rounded once each."""
    t, kk = slots.shape
    inter, hidden = layout.shape_of("gate")
    n_slots = pool.shape[0]
    r = t * kk
    dt = x.dtype
    prec = lax.Precision.HIGHEST if dt == jnp.float32 else lax.Precision.DEFAULT
    row_tok, row_weight, block_slot, pos = _sort_routes(slots.reshape(r).astype(jnp.int32),
                                                        weight.reshape(r).astype(jnp.float32),
                                                        n_slots, kk, block_m, n_groups)
    n_rows = row_tok.shape[0]
    n_blocks = n_rows // block_m
    if kernel_variant(layout, dt, variant, block_m) == "v2":
        p2 = plan_v2(layout, dt, block_m)
        k1 = functools.partial(_gate_up_int4_kernel, lay=layout, p=p2, dt=dt, prec=prec)
        k2 = functools.partial(_down_int4_kernel, lay=layout, p=p2, dt=dt, prec=prec)
        xin = _even_odd_columns(x, p2.g1).reshape(-1)                      # one pass over x in XLA
        calls = ((k1, p2.bn1, inter, p2.launch1, xin), (k2, p2.bn2, hidden, p2.launch2, None))
        cols_first = True                 # grid (column block, row block): a row block's programs run together
    else:
        p1 = plan(layout, dt, block_m)
        k1 = functools.partial(_gate_up_kernel, lay=layout, p=p1, dt=dt, prec=prec)
        k2 = functools.partial(_down_kernel, lay=layout, p=p1, dt=dt, prec=prec)
        calls = ((k1, p1.bi, inter, (NUM_WARPS, NUM_STAGES), x.reshape(-1)),
                 (k2, p1.bh, hidden, (NUM_WARPS, NUM_STAGES), None))
        cols_first = False                # grid (row block, column block)

    def call(kernel, bn, n_cols, launch, rows_arg, flat_in):
        if cols_first:
            grid, rows_spec = (n_cols // bn, n_blocks), pl.BlockSpec((block_m,), lambda j, b: (b,))
            out_spec = pl.BlockSpec((block_m, bn), lambda j, b: (b, j))
        else:
            grid, rows_spec = (n_blocks, n_cols // bn), pl.BlockSpec((block_m,), lambda b, j: (b,))
            out_spec = pl.BlockSpec((block_m, bn), lambda b, j: (b, j))
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((n_rows, n_cols), dt),
            grid=grid,
            in_specs=[pl.no_block_spec, rows_spec, pl.no_block_spec, pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=out_spec,
            interpret=interpret, **triton_params(interpret, num_warps=launch[0], num_stages=launch[1]),
        )(block_slot, rows_arg, flat_in, pool)

    (k1, bn1, n1, l1, xin), (k2, bn2, n2, l2, _) = calls
    h = call(k1, bn1, n1, l1, row_tok, xin)
    y_rows = call(k2, bn2, n2, l2, row_weight, h.reshape(-1))
    ok = (pos < n_rows)[:, None]                            # skipped (or dropped) routes: exactly 0
    y = jnp.where(ok, jnp.take(y_rows, jnp.minimum(pos, n_rows - 1), axis=0), 0)
    return y.reshape(t, kk, hidden).astype(jnp.float32).sum(axis=1)


@functools.partial(jax.jit, static_argnames=("layout", "interpret", "max_distinct", "block_m", "variant"))
def experts_grouped(layout: BlobLayout, pool, x, slots, weight, *, interpret: bool = False,
                    max_distinct: int | None = None, block_m: int = BLOCK_M, variant: str = "v2"):
    """The expert op (experts.experts_from_pool's contract) for many routes, by the two grouped kernels.

    pool uint8 [N, >= layout.nbytes], any size; x [T, H] float32 or bfloat16; slots int32 [T, k] in [-1, N) (-1:
    skipped, contributes exactly 0 whatever its weight); weight [T, k] float32. -> [T, H] in x.dtype.
    max_distinct (static, optional): a bound on the distinct slots one call uses (default min(N, T*k)); it sizes the
    static grid (blocks = (T*k + max_distinct * (block_m - 1)) // block_m); routes of slots past the first
    max_distinct distinct ones (in slot order) contribute 0, as in experts_from_pool.
    variant (static): "v2" (default) runs the even/odd int4 kernels where they apply (kernel_variant), "v1" the
    first design's kernels for every format. A pool of 2^31 .. 2^32 bytes (needs_compaction) is read through compacted
    sub-pools of the used blobs (pool_chunks), each chunk one run of the kernels, the chunks' outputs summed."""
    kernel_variant(layout, x.dtype, variant, block_m)        # refuses what no variant reads
    if pool.dtype != jnp.uint8 or pool.ndim != 2 or pool.shape[1] < layout.nbytes:
        raise ValueError(f"pool must be uint8 [N, >= {layout.nbytes}], got {pool.dtype} {pool.shape}")
    t, kk = slots.shape
    _, hidden = layout.shape_of("gate")
    if x.shape != (t, hidden) or weight.shape != (t, kk):
        raise ValueError(f"x {x.shape} must be [T, {hidden}] and weight {weight.shape} [T, k] for slots {slots.shape}")
    n_slots = pool.shape[0]
    n_groups = max(1, min(int(max_distinct) if max_distinct is not None else n_slots, n_slots, t * kk))
    run = functools.partial(_grouped, layout, x=x, weight=weight, block_m=block_m, variant=variant,
                            interpret=interpret)
    if not needs_compaction(pool.size):
        return run(pool, slots=slots, n_groups=n_groups).astype(x.dtype)
    y = None
    for sub_pool, sub_slots in pool_chunks(pool, slots, n_groups, layout.nbytes, MAX_KERNEL_POOL_BYTES):
        part = run(sub_pool, slots=sub_slots, n_groups=min(n_groups, sub_pool.shape[0]))
        y = part if y is None else y + part
    return y.astype(x.dtype)


def _reference(layout: BlobLayout, pool, x, slots, weight):
    """numpy (float64 arithmetic): the expert op over the pool's blobs, float32 [T, H]."""
    return quant.expert_reference(layout, np.asarray(pool), np.asarray(x, np.float32), np.asarray(slots),
                                  np.asarray(weight, np.float32))
