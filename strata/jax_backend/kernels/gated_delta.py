"""The gated delta rule (Qwen3-Next's linear attention) as Pallas kernels: one decode token per sequence with the
state updated in place, the k+1 positions of a speculative verify step with the state after each, and the chunked
(WY / UT-transform) form for prompt parts.

Per value head h the state S [dk, dv] is fp32: S <- exp(g_t) S; S <- S + k_t (x) beta_t (v_t - S^T k_t);
o_t = S^T q_t (q, k l2-normed, q scaled). A row with g = beta = 0 leaves S unchanged (how padding works).

Why: the XLA forms (JaxBackend.gated_delta_step / gated_delta_chunked) spend their time outside the arithmetic. Decode
gathers, updates and scatters the states of a window's rows in separate passes (0.53 ms against 0.10 ms for an
in-place Pallas update at 64 rows, notes/pallas-gpu.md). The chunked form is a lax.scan over chunks whose every step
is a handful of small launches.

Backend: Pallas' Triton backend, the one verified on the H200 (host_rows.py) and interpretable on the CPU in every
JAX version we run (0.10.2 here, 0.11.2 on the GPU); Mosaic GPU interprets only in newer JAX. The state is fp32, so
every dot is fp32 at Precision.HIGHEST, which the Triton lowering runs as IEEE fp32 on the FMA units (no TF32
rounding of the state); the decode and verify steps are matrix-vector work done with elementwise products and
reductions (no dot).

Measured on the H200 (bench/kernel_speed.py at commit 9546310, bench/results/kernel_speed_h200_gated_delta.json;
Hv = 32, dk = dv = 128; the v1 kernels, the only ones then):
- chunked, T = 4096: Pallas 38.6 ms, XLA (JaxBackend's triangular_solve per chunk + lax.scan) 3.10 ms; floor ~0.08 ms
  by the bench's bytes (272 MB), ~0.37 ms by FLOPs at the fp32 rate (below).
- decode: Pallas 19.7 / 27.4 / 66.2 us at S = 1 / 4 / 16, XLA 13.9 / 31.7 / 34.1 us; floors (the fp32 state read
  and written) 1.2 / 4.7 / 18.6 us. Read these with care: the bench's loop carries the *input* state on
  (a_dep + 0 * out[0]), so the aliased input is still live when the kernel overwrites it and XLA copies the state
  before every Pallas call (one more read + write of it, 18.6 us at S = 16; with the carry's add, the Pallas figure
  holds >= 37 us that are not the kernel), while XLA's step, of which only element [0] is used, is free to compute
  less than the whole state (its 34.1 us is under the 37 us of a full step and the add as two passes). Timing the
  in-place kernel needs the kernel's new state as the loop carry.
- verify (S = 4, Q = 4): Pallas 29.9 us, XLA 96.6 us (floor 11.7 us).
Then (commit 733f897, kernel_speed_gated_delta_h200_733f897.json, the decode loop carrying the new state; and
b3d2b6f, kernel_speed_h200_b3d2b6f.json):
- decode v1 / v2: 9.8 / 10.3 us at S = 1, 22.5 / 24.7 us at S = 16; XLA 10.1-11.3 and 24.5-27.7 us: level.
- chunked, T = 4096: v2 5.45 ms, v1 31.3 ms, xla_intra 2.60 ms (its recurrence kernel alone 2.1 ms in the engine:
  the fp32 dots on the FMA units), XLA 1.61-1.67 ms. So the backend's `auto` runs XLA's forms of the rule.
- a112ed3 (kernel_speed_gated_delta_h200_a112ed3.log): xla_intra 2.45 ms with IEEE dots, 2.09 ms with the
  recurrence's dots as tf32x3 (its XLA products then IEEE; they follow `dots` since), XLA 1.29 ms (its scan in
  blocks since abe5ff2). The tensor cores took 15% off: the recurrence is bound by its 64 dependent chunk steps
  (~26 us each, one program per SM), not by its dots' rate.
  The v2 tf32x3 and the stages = 2 cases did not finish compiling inside the run's 300 s.
Not yet timed on the GPU: the v2 chunked kernels with tf32x3 or bf16x6 dots, and stages = 2. Verified on the CPU:
the arithmetic in Pallas interpret mode against the float64 references below, and the Triton lowering (power-of-two
loads and stores, dot operand dtypes, the grid and warps) by exporting each kernel for CUDA at real shapes
(tests/kernels/test_gated_delta.py); on the H200 the same tests compiled (all of tests/kernels at f2417c9).

Kernels (variant="v2" is the default wherever there is a choice; "v1" keeps the first design, for timing):
- decode: program (sequence s, head h, dv block j of BV columns) holds S[:, j-block] [dk, BV] in registers for one
  step and writes it back over the donated state (input_output_aliases). The variants differ only in the shape:
  v1: BV = 32, 4 warps: 128 programs at S = 1, each moving a [128, 32] block (16 KB in, 16 KB out), 32 state
  elements per thread.
  v2 (_decode_shape): 64 state elements (256 B) per thread, and the widest block that leaves >= 128 programs (about
  one per SM of the 132): S = 1: BV = 32, 2 warps (the v1 grid); S = 2: 64, 4 warps; S >= 4: a head's whole state
  [128, 128] (64 KB in, 64 KB out) per program, 8 warps (128 programs at S = 4, 512 at S = 16). Reasoning (not
  measured): at S = 1 the step is latency-bound (one DRAM round trip, two cross-warp reductions over dk, a store;
  every SM's loads are in flight at once), so the grid keeps the SMs covered and no shape gets near the 1.2 us floor,
  which is below a launch. At S = 16 it is bandwidth-bound, and the rate follows the bytes in flight per SM,
  ~ (65536 registers / registers per thread) x state bytes per thread: with the same per-thread overhead (addresses,
  q, k, the reduction temporaries) 64 elements per thread put ~1.4x the bytes in flight of 32; and at S >= 4 there
  are 4x fewer programs, so 4x fewer of the per-program costs (the g, beta scalar loads, q and k loaded once per head
  rather than once per 32 columns, the reductions' prologue). More than one head per program would cut the program
  count further but uncover SMs at small S, and a head at a time already moves 64 KB.
- verify: the v1 grid; the program walks the Q positions (fori_loop) and stores S after each into states[s, t, h].
- chunked, two kernels (the flash-linear-attention split), T padded to a multiple of C = 64 with
  g = beta = q = k = v = 0 rows (they leave the state unchanged and their o is dropped):
  intra, program (chunk i, head h): G = cumsum(g); A = strict_lower(beta_i k_i.k_j e^(D_ij)) with D_ij = G_i - G_j;
  T = (I + A)^-1; w = T (beta e^G k), u = T (beta v), attn = lower(q k^T e^(D_ij)); all fp32, to HBM
  (w [Hv, Tp, dk], u [Hv, Tp, dv], attn [Hv, n, C, C]).
    v1 inverts (I + A) by C = 64 steps of forward substitution, each a masked row extraction and a [C, C] column
    reduction (cross-warp, through shared memory), sequential within the program.
    v2 has no sequential loop: the chunk's rows in C / SUB blocks of SUB = 32; the blocks A_IJ (J <= I) and attn_IJ
    by SUB x SUB x dk dots; each diagonal T_II = (I + A_II)^-1 by recursive doubling (_unit_lower_inverse:
    T_2s = T_s - T_s E_s T_s, 4 levels of two 32 x 32 x 32 products); then block forward substitution
    W_I = T_II (X_I - sum_{J<I} A_IJ W_J) for X = beta e^G k and X = beta v (3 dots of 32 x 32 x dk each). It also
    writes e^G and e^(G_last - G) [Hv, Tp] for the recurrence. 30 dots per program, no loop.
    Why doubling and not the power series (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...(I + A^32) (A^64 = 0): in fp32 the
    series cancels terms that grow like binomial coefficients when A's entries approach 1 (keys aligned, beta ~ 1,
    slow decay: C(63, 31) ~ 1e18 at C = 64, C(15, 7) = 6435 even in 16-row blocks). Measured relative error of the
    inverse at C = 64 on such inputs (keys with cosines ~0.9): series 5e6 to 1e9 (useless), substitution 1.0e-7,
    doubling 0.8-1.1e-7, XLA's triangular_solve 3e-8; on the tests' random keys (|A| <= 0.04) all are ~1e-9. The
    tests hold both kinds of input (aligned_inputs).
  recurrence, program (head h, dv block j): S[:, j-block] in registers across the chunks; per chunk
  v' = u - w S; o = (q e^G) S + attn v'; S <- e^(G_last) S + (k e^(G_last - G))^T v'. v1 forms the decays from g
  with C x C masked sums on its sequential path, 4 warps; v2 reads them from the intra kernel, 8 warps (its
  Hv x dv/BV = 128 programs are one per SM, so 4 warps left one warp per SM sub-partition to hide every latency).
  Accuracy: the exponents of the decays between two tokens (D_ij, and G_last - G_i) are summed directly over the
  tokens between them, never taken as the difference of two prefix sums (v2: in-block prefix and suffix sums plus
  whole blocks' totals, all of one sign): with strongly decaying heads |G| reaches hundreds within a chunk, and
  G_i - G_j in fp32 would be off by ~eps |G| in the exponent of near-diagonal terms (on the tests' inputs the XLA
  form's state measured up to 6.3e-6 relative error, these kernels' 2.5e-7; 5.2e-7 with aligned keys). Every other
  exponent is a prefix sum of same-sign terms, whose absolute error ~e^G |G| eps never exceeds ~eps.
  The split and not one fused kernel (grid (Hv, dv/BV), the intra work inside the recurrence's chunk loop, so that
  w, u, attn never go to HBM): it would fit, but loses. Registers at dk = dv = 128, C = 64, BV = 32: the state block
  (16 KB), the chunk's q and k in fp32 (32 KB each), w (32 KB), A / T and attn (16 KB each), u and v' (8 KB):
  ~150 KB live, 300 registers a thread at 4 warps (spills), ~150 at 8 (fits; 39K of the SM's 64K registers);
  shared memory for the largest dot's operands, [64, 128] + [128, 64] fp32 = 64 KB of 227 KB. The cost is work on
  the sequential path: the intra work does not depend on the state, but fused it runs once per dv block (4 times a
  head at BV = 32) inside the chunk loop: ~1.9 M FMAs per chunk next to the recurrence's 0.9 M, 3x the arithmetic of
  the sequential path, on only Hv x dv/BV = 128 programs; split, it runs once, over 2048 parallel programs. What
  fusion saves is the intermediates' round trip, w, u, attn: 168 MB written and read back at T = 4096, ~0.09 ms.
  (Fusing with BV = dv repeats nothing but leaves 32 programs for 132 SMs; fusion pays where Hv x dv/BV programs,
  e.g. many sequences' parts in one call, cover the SMs several times over.)

FLOPs and bytes at Qwen3-Next-80B shapes (Hv = 32, dk = dv = 128) over the H200's 3.6 TB/s HBM (~67 TFLOP/s fp32
off the tensor cores, where IEEE fp32 dots run):
- decode: the state's read + write, 32 x 128 x 128 x 4 B x 2 = 4.19 MB per sequence and layer -> 1.17 us; 18.6 us
  at S = 16 (q, k, v, o add ~41 KB per sequence; ~4 MFLOP per sequence is nothing).
- verify (Q positions): the state read once and written Q times, (1 + Q) x 2.1 MB per sequence and layer -> 46.6 us
  at S = 16, Q = 4: the per-position states (the interface's rollback points) are 80% of it.
- chunked, T = 4096 (n = 64 chunks of C = 64, 2048 chunk-heads): FLOPs dominate. Per chunk-head v1's intra kernel
  does four C x C x 128 dots and one C x C x C: 4.7 MFLOP, 9.7 GFLOP in all (+1.6 G elementwise operations of the
  substitution); v2's does 2.2 M FMAs = 4.3 MFLOP, 8.9 GFLOP in all (A, attn: 3 blocks each of 32 x 32 x 128; the
  decays and inverses 18 dots of 32^3; w, u: 3 each of 32 x 32 x 128). The recurrence does w S, q S, k^T v'
  (C x 128 x 128) and attn v' (C x C x 128): 7.3 MFLOP, 15.0 GFLOP in all. ~24 GFLOP / 67 TFLOP/s = 0.36 ms. The
  bytes: q, k, v in bf16 read by the intra kernel and q, k again by the recurrence (168 MB); w, u, attn in fp32
  written and read back (335 MB); o written in fp32 (67 MB): 571 MB -> 0.16 ms. The recurrence is the sequential
  part (64 steps per program on 128 programs, ~one wave on the 132 SMs), so it sets the pace: 15 GFLOP on one
  program per SM is ~0.23 ms at the full fp32 FMA rate, more as the Triton FMA dots fall short of it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from strata.jax_backend.kernels import triton_params
from strata.reference import gated_delta as _gated_delta_reference

CHUNK = 64               # chunk of the chunked form (JaxBackend's GDN_CHUNK)
BLOCK_V = 32             # dv columns of the state per program (a power of two: Triton block shapes must be)
SUB = 32                 # v2 intra kernel: rows per block of the chunk (diagonal blocks inverted by doubling)
VARIANTS = ("v1", "v2")
CHUNKED_VARIANTS = VARIANTS + ("xla_intra",)   # xla_intra: chunk_products_xla, then the v2 recurrence kernel
_PROGRAMS = 128          # v2 decode: dv is split until the grid has this many programs (~one per SM; H200: 132)
_PER_THREAD = 64         # v2 decode: fp32 state elements held per thread (num_warps = dk * BV / (32 * this))
_HI = lax.Precision.HIGHEST
_F32 = jnp.float32
# How the chunked kernels' data dots run (static `dots`): "ieee" fp32 on the FMA units (Precision.HIGHEST), or fp32
# split over the tensor cores, "tf32x3" (Triton's 3-pass TF32: a = hi + lo, hi.hi + hi.lo + lo.hi; ~22 significant
# bits a product) or "bf16x6" (Pallas' 6-pass bfloat16 split, three bfloat16 parts an operand). The exponent sums
# (the 0/1-mask dots over g) stay IEEE whatever `dots` is. XLA's CPU has no TF32, so interpret mode takes ieee or
# bf16x6. Measured (module docstring, a112ed3): tf32x3 made the xla_intra recurrence 15% faster, no more.
DOTS = ("ieee", "tf32x3", "bf16x6")
DOT_PRECISION = {"ieee": _HI, "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
                 "bf16x6": lax.DotAlgorithmPreset.BF16_BF16_F32_X6}


# --- shared pieces

def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}")
    return variant


def _check(dk: int, dv: int, block_v: int | None, *, min_dim: int = 1) -> int:
    """The dv block: block_v or min(BLOCK_V, dv). Every block the kernels load or store has dims dk, the block and
    (chunked) CHUNK: powers of two for Triton, at least 16 where they enter a dot."""
    bv = min(BLOCK_V, dv) if block_v is None else block_v
    for name, d in (("dk", dk), ("dv", dv), ("dv block", bv)):
        if not _pow2(d) or d < min_dim:
            least = f" >= {min_dim} (it enters a dot)" if min_dim > 1 else ""
            raise ValueError(f"{name} = {d} must be a power of two{least}: Triton block shapes")
    if dv % bv:
        raise ValueError(f"dv block {bv} does not divide dv = {dv}")
    return bv


def _step(S, q, k, v, g, beta):
    """One token on a state block S [dk, BV] fp32; q, k [dk], v [BV] fp32, g, beta scalars -> (S', o [BV])."""
    S = S * jnp.exp(g)
    kv = jnp.sum(k[:, None] * S, axis=0)                                          # S^T k  [BV]
    S = S + k[:, None] * (beta * (v - kv))[None, :]
    return S, jnp.sum(q[:, None] * S, axis=0)                                     # S^T q  [BV]


def _dot(a, b, *, ta: bool = False, tb: bool = False, dots: str = "ieee"):
    """a @ b (a^T with ta, b^T with tb) in fp32: IEEE (HIGHEST precision) by default, or split over the tensor
    cores (DOTS)."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=DOT_PRECISION[dots], preferred_element_type=_F32)


def _check_dots(dots: str, interpret: bool) -> str:
    if dots not in DOTS:
        raise ValueError(f"dots must be one of {DOTS}, not {dots!r}")
    if interpret and dots == "tf32x3":
        raise ValueError("dots 'tf32x3' needs a GPU (XLA's CPU has no TF32); interpret mode takes 'ieee' or 'bf16x6'")
    return dots


# --- decode: one token per sequence, the state in place

def _decode_kernel(g_ref, beta_ref, q_ref, k_ref, v_ref, s_in_ref, o_ref, s_ref):
    """Program (s, h, j): the state block [dk, BV] of sequence s, head h, columns j*BV.. one step on; s_ref aliases
    s_in_ref (the donated state)."""
    s, h = pl.program_id(0), pl.program_id(1)
    S, o = _step(s_in_ref[...], q_ref[...].astype(_F32), k_ref[...].astype(_F32), v_ref[...].astype(_F32),
                 g_ref[s, h], beta_ref[s, h])
    s_ref[...] = S
    o_ref[...] = o


def _decode_shape(n: int, hv: int, dk: int, dv: int, block_v: int | None, variant: str) -> tuple[int, int]:
    """(dv block, num_warps) of the decode kernel. v1: min(BLOCK_V, dv) columns, 4 warps. v2: the widest block
    (up to all dv columns of a head) that leaves the grid n x hv x dv/BV at least _PROGRAMS programs (never below
    BLOCK_V by this rule), and warps for _PER_THREAD state elements a thread; block_v overrides the block."""
    if _variant(variant) == "v1":
        return _check(dk, dv, block_v), 4
    bv = block_v
    if bv is None:
        bv = dv
        while bv > BLOCK_V and n * hv * (dv // bv) < _PROGRAMS:
            bv //= 2
    bv = _check(dk, dv, bv)
    return bv, min(8, max(1, dk * bv // (32 * _PER_THREAD)))


@functools.partial(jax.jit, static_argnames=("interpret", "block_v", "variant"))
def gated_delta_decode(q, k, v, g, beta, state, *, interpret: bool = False, block_v: int | None = None,
                       variant: str = "v2"):
    """One token for each of S sequences. q, k [S, Hv, dk], v [S, Hv, dv] (bf16 or f32); g, beta [S, Hv];
    state [S, Hv, dk, dv] f32 -> (o [S, Hv, dv] f32, new state [S, Hv, dk, dv] f32). The new state is written over
    `state`'s buffer when the caller donates it (jax.jit(..., donate_argnums=...)); otherwise XLA copies it first.
    dk, dv powers of two; block_v: dv columns per program (default: by the variant's shape, _decode_shape);
    variant "v2" (default) or "v1" (the first shape: 32 columns and 4 warps a program)."""
    n, hv, dk = k.shape
    dv = v.shape[-1]
    if state.dtype != _F32 or state.shape != (n, hv, dk, dv):
        raise ValueError(f"state must be float32 [{n}, {hv}, {dk}, {dv}], not {state.dtype} {list(state.shape)}")
    bv, warps = _decode_shape(n, hv, dk, dv, block_v, variant)
    vec = lambda d: pl.BlockSpec((None, None, d), lambda s, h, j: (s, h, 0))      # noqa: E731
    blk = pl.BlockSpec((None, None, bv), lambda s, h, j: (s, h, j))
    sblk = pl.BlockSpec((None, None, dk, bv), lambda s, h, j: (s, h, 0, j))
    return pl.pallas_call(
        _decode_kernel,
        out_shape=(jax.ShapeDtypeStruct((n, hv, dv), _F32), jax.ShapeDtypeStruct(state.shape, _F32)),
        grid=(n, hv, dv // bv),
        in_specs=[pl.no_block_spec, pl.no_block_spec, vec(dk), vec(dk), blk, sblk],
        out_specs=(blk, sblk),
        input_output_aliases={5: 1},
        interpret=interpret, **triton_params(interpret, num_warps=warps, num_stages=1),
    )(g.astype(_F32), beta.astype(_F32), q, k, v, state)


# --- verify: Q consecutive positions per sequence, the state after each

def _verify_kernel(g_ref, beta_ref, q_ref, k_ref, v_ref, s0_ref, o_ref, states_ref):
    """Program (s, h, j): walks the Q positions of sequence s from its state block, storing o and S after each."""
    s, h = pl.program_id(0), pl.program_id(1)

    def position(t, S):
        S, o = _step(S, q_ref[t].astype(_F32), k_ref[t].astype(_F32), v_ref[t].astype(_F32),
                     g_ref[s, t, h], beta_ref[s, t, h])
        o_ref[t] = o
        states_ref[t] = S
        return S

    lax.fori_loop(0, q_ref.shape[0], position, s0_ref[...])


@functools.partial(jax.jit, static_argnames=("interpret", "block_v"))
def gated_delta_verify(q, k, v, g, beta, state, *, interpret: bool = False, block_v: int | None = None):
    """Q consecutive tokens per sequence (a speculative step's k+1 positions). q, k [S, Q, Hv, dk], v [S, Q, Hv, dv];
    g, beta [S, Q, Hv]; state [S, Hv, dk, dv] f32 (not modified) -> (o [S, Q, Hv, dv] f32,
    states [S, Q, Hv, dk, dv] f32, the state after each position). Any Q; dk, dv powers of two; block_v: dv columns
    per program (default min(BLOCK_V, dv))."""
    n, nq, hv, dk = k.shape
    dv = v.shape[-1]
    if state.shape != (n, hv, dk, dv):
        raise ValueError(f"state must be [{n}, {hv}, {dk}, {dv}], not {list(state.shape)}")
    bv = _check(dk, dv, block_v)
    # the Q axis is walked inside the program (rows t of these blocks): Q itself need not be a power of two
    rows = pl.BlockSpec((None, nq, None, dk), lambda s, h, j: (s, 0, h, 0))
    cols = pl.BlockSpec((None, nq, None, bv), lambda s, h, j: (s, 0, h, j))
    return pl.pallas_call(
        _verify_kernel,
        out_shape=(jax.ShapeDtypeStruct((n, nq, hv, dv), _F32), jax.ShapeDtypeStruct((n, nq, hv, dk, dv), _F32)),
        grid=(n, hv, dv // bv),
        in_specs=[pl.no_block_spec, pl.no_block_spec, rows, rows, cols,
                  pl.BlockSpec((None, None, dk, bv), lambda s, h, j: (s, h, 0, j))],
        out_specs=(cols,
                   pl.BlockSpec((None, nq, None, dk, bv), lambda s, h, j: (s, 0, h, 0, j))),
        interpret=interpret, **triton_params(interpret, num_warps=4, num_stages=1),
    )(g.astype(_F32), beta.astype(_F32), q, k, v, state.astype(_F32))


# --- chunked: a prompt part of one sequence

def _prefix_sums(g):
    """g [C] -> (G [C] with G_i = sum_{l <= i} g_l, lower [C, C] mask j <= i, row and column index [C, C]).
    Masked row sums: every term has g's sign, so no cancellation (C^2 adds, cheap next to the dots)."""
    c = g.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    lower = col <= row
    return jnp.sum(jnp.where(lower, g[None, :], 0.0), axis=1), lower, row, col


def _intra_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, attn_ref):
    """v1, program (chunk i, head h): w = T (beta e^G k), u = T (beta v), attn = lower(q k^T e^D), with
    T = (I + A)^-1 by C steps of forward substitution, A = strict_lower(beta_i k_i.k_j e^D_ij), D_ij = G_i - G_j.
    (q, k, v are loaded where they are used, so that they are not live across the substitution loop.)"""
    beta = beta_ref[...]                                                           # [C]
    g = g_ref[...]
    G, lower, row, col = _prefix_sums(g)
    # D_ij = sum_{j < l <= i} g_l, summed directly as a 0/1 matrix times g (IEEE fp32, same-sign terms): G_i - G_j
    # in fp32 would carry eps |G| of error into the exponent, and |G| reaches hundreds in a fast-decaying head
    D = _dot(jnp.where(lower, 1.0, 0.0), jnp.where(row > col, g[:, None], 0.0))
    decay = jnp.where(lower, jnp.exp(D), 0.0)                                      # [C, C], 0 above the diagonal
    k = k_ref[...].astype(_F32)                                                    # [C, dk]
    A = jnp.where(col < row, beta[:, None] * _dot(k, k, tb=True) * decay, 0.0)

    def substitute(i, inv):
        # row i of (I + A)^-1 = e_i - sum_{j<i} A_ij row_j (rows >= i are still 0, and A_ij = 0 for j >= i)
        a_i = jnp.sum(jnp.where(row == i, A, 0.0), axis=0)                         # A[i, :]
        r = jnp.sum(a_i[:, None] * inv, axis=0)
        return jnp.where(row == i, jnp.where(col == i, 1.0, 0.0) - r[None, :], inv)

    inv = lax.fori_loop(0, A.shape[0], substitute, jnp.zeros_like(A))
    k = k_ref[...].astype(_F32)
    w_ref[...] = _dot(inv, k * (beta * jnp.exp(G))[:, None])
    u_ref[...] = _dot(inv, v_ref[...].astype(_F32) * beta[:, None])               # [C, dv]
    attn_ref[...] = _dot(q_ref[...].astype(_F32), k, tb=True) * decay


def _unit_lower_inverse(N, row, col, dots: str = "ieee"):
    """(I + N)^-1 of a strictly lower triangular block N [B, B] (B a power of two) by recursive doubling: T_s, the
    inverse of the diagonal s x s blocks of I + N, gives T_2s = T_s - T_s E_s T_s, where E_s holds N's entries in
    the lower-left s x s quadrant of each diagonal 2s x 2s block (the block inverse [[T11, 0], [-T22 E21 T11, T22]]).
    T_2 = I - E_1 is elementwise; then log2(B) - 1 levels of two B x B x B products. Each level is a triangular
    block inversion, stable as substitution is; the Neumann product (I - N)(I + N^2)(I + N^4)... sums powers whose
    entries grow like binomials when N's entries near 1 (aligned keys, beta ~ 1, no decay) and cancel."""
    b = N.shape[0]
    apart = jnp.bitwise_xor(row, col)                    # i and j lie in one 2s-block, not one s-block: s <= i^j < 2s
    T = jnp.where(row == col, 1.0, 0.0) - jnp.where(apart == 1, N, 0.0)
    s = 2
    while s < b:
        E = jnp.where((apart >= s) & (apart < 2 * s), N, 0.0)
        T = T - _dot(_dot(T, E, dots=dots), T, dots=dots)
        s *= 2
    return T


def _intra_kernel_v2(q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, attn_ref, eq_ref, ek_ref, *, sub: int,
                     dots: str = "ieee"):
    """v2, program (chunk i, head h): the products of v1 on the C / sub row blocks of the chunk, with no sequential
    loop: A_IJ = beta_I k_I k_J^T e^D_IJ (J <= I; strictly lower where J = I); T_II = (I + A_II)^-1 by doubling
    (_unit_lower_inverse); then block forward substitution W_I = T_II (X_I - sum_{J<I} A_IJ W_J) for
    X = beta e^G k (-> w) and X = beta v (-> u); attn_IJ = q_I k_J^T e^D_IJ (0 above the diagonal). Also writes
    e^G (eq) and e^(G_last - G) (ek), which the v2 recurrence would otherwise recompute on its sequential path.
    Exponents: within a block, prefix and suffix sums of g (masked row sums); across blocks, sums of whole blocks'
    totals: every decay exponent is a sum of same-sign terms over the tokens it spans, never a difference."""
    c = g_ref.shape[0]
    nb = c // sub
    row = lax.broadcasted_iota(jnp.int32, (sub, sub), 0)
    col = lax.broadcasted_iota(jnp.int32, (sub, sub), 1)
    lower, strict = col <= row, col < row
    blk = [slice(i * sub, (i + 1) * sub) for i in range(nb)]
    g = [g_ref[b] for b in blk]
    beta = [beta_ref[b] for b in blk]
    pre = [jnp.sum(jnp.where(lower, x[None, :], 0.0), axis=1) for x in g]       # sum_{l <= i} g_l in the block
    suf = [jnp.sum(jnp.where(lower, 0.0, x[None, :]), axis=1) for x in g]       # sum_{l > i} g_l in the block
    tot = [jnp.sum(x) for x in g]
    span = lambda lo, hi: sum(tot[lo:hi], 0.0)                                  # noqa: E731  blocks lo..hi-1
    ones = jnp.where(lower, 1.0, 0.0)
    decay = {}
    for i in range(nb):
        for j in range(i + 1):
            if i == j:                  # D_ab = sum_{b < l <= a} g_l: a 0/1 matrix times g, as in v1
                d = _dot(ones, jnp.where(row > col, g[i][:, None], 0.0))
                decay[i, j] = jnp.where(lower, jnp.exp(d), 0.0)
            else:                       # block i's head up to a, the whole blocks between, block j's tail after b
                decay[i, j] = jnp.exp(pre[i][:, None] + (suf[j] + span(j + 1, i))[None, :])
    k = [k_ref[b, :].astype(_F32) for b in blk]
    A = {}
    for i in range(nb):
        q_i = q_ref[blk[i], :].astype(_F32)
        for j in range(nb):
            if j > i:
                attn_ref[blk[i], blk[j]] = jnp.zeros((sub, sub), _F32)
                continue
            attn_ref[blk[i], blk[j]] = _dot(q_i, k[j], tb=True, dots=dots) * decay[i, j]
            a = beta[i][:, None] * _dot(k[i], k[j], tb=True, dots=dots) * decay[i, j]
            A[i, j] = jnp.where(strict, a, 0.0) if i == j else a
    inv = [_unit_lower_inverse(A[i, i], row, col, dots) for i in range(nb)]
    G = [pre[i] + span(0, i) for i in range(nb)]                                # G_a, a sum of same-sign terms
    for i in range(nb):
        eq_ref[blk[i]] = jnp.exp(G[i])
        ek_ref[blk[i]] = jnp.exp(suf[i] + span(i + 1, nb))                       # G_last - G_a, summed directly

    def substitute(out_ref, rhs):
        done = []
        for i in range(nb):
            r = rhs(i)
            for j in range(i):
                r = r - _dot(A[i, j], done[j], dots=dots)
            done.append(_dot(inv[i], r, dots=dots))
            out_ref[blk[i], :] = done[i]

    # k and v are loaded again here rather than kept live across the inverse (Triton does not merge the loads)
    substitute(w_ref, lambda i: k_ref[blk[i], :].astype(_F32) * (beta[i] * jnp.exp(G[i]))[:, None])
    substitute(u_ref, lambda i: v_ref[blk[i], :].astype(_F32) * beta[i][:, None])


def _recurrence_kernel(q_ref, k_ref, g_ref, w_ref, u_ref, attn_ref, s0_ref, o_ref, s_ref):
    """v1, program (head h, dv block j): the state block [dk, BV] across the n chunks, o of the chunk at each."""
    c = attn_ref.shape[-1]

    def chunk(i, S):
        at = pl.ds(i * c, c)
        g = g_ref[at]
        G, lower, _, _ = _prefix_sums(g)
        rest = jnp.sum(jnp.where(lower, 0.0, g[None, :]), axis=1)                  # G_last - G_i, summed directly
        q = q_ref[at, :].astype(_F32) * jnp.exp(G)[:, None]                        # q e^G  [C, dk]
        k = k_ref[at, :].astype(_F32) * jnp.exp(rest)[:, None]                     # k e^(G_last - G)
        v_new = u_ref[at, :] - _dot(w_ref[at, :], S)                               # [C, BV]
        o_ref[at, :] = _dot(q, S) + _dot(attn_ref[i], v_new)
        return S * jnp.exp(jnp.sum(g)) + _dot(k, v_new, ta=True)

    s_ref[...] = lax.fori_loop(0, attn_ref.shape[0], chunk, s0_ref[...])


def _recurrence_kernel_v2(q_ref, k_ref, eq_ref, ek_ref, w_ref, u_ref, attn_ref, s0_ref, o_ref, s_ref, *,
                          dots: str = "ieee"):
    """v2, program (head h, dv block j): as v1, with the decays e^G, e^(G_last - G) read from the intra kernel (no
    C x C masked sums on the sequential path) and e^(G_last) = e^G at the chunk's last row; its dots by `dots`."""
    c = attn_ref.shape[-1]

    def chunk(i, S):
        start = pl.multiple_of(i * c, c)
        at = pl.ds(start, c)
        q = q_ref[at, :].astype(_F32) * eq_ref[at][:, None]                        # q e^G  [C, dk]
        k = k_ref[at, :].astype(_F32) * ek_ref[at][:, None]                        # k e^(G_last - G)
        v_new = u_ref[at, :] - _dot(w_ref[at, :], S, dots=dots)                    # [C, BV]
        o_ref[at, :] = _dot(q, S, dots=dots) + _dot(attn_ref[i], v_new, dots=dots)
        return S * eq_ref[start + c - 1] + _dot(k, v_new, ta=True, dots=dots)

    s_ref[...] = lax.fori_loop(0, attn_ref.shape[0], chunk, s0_ref[...])


def _pad_part(q, k, v, g, beta):
    """Pad T to a multiple of CHUNK with zero rows (g = beta = 0 leaves the state unchanged; their o is cut)."""
    pad = (-k.shape[0]) % CHUNK
    if pad:
        q, k, v, g, beta = (jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in (q, k, v, g, beta))
    return q, k, v, g.astype(_F32).T, beta.astype(_F32).T                         # g, beta [Hv, Tp]: rows per head


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def _chunked_intra_v1(q, k, v, g_h, beta_h, *, interpret: bool = False, num_warps: int = 4):
    """v1 intra-chunk kernel over padded q, k [Tp, Hv, dk], v [Tp, Hv, dv], g_h, beta_h [Hv, Tp] ->
    w [Hv, Tp, dk], u [Hv, Tp, dv], attn [Hv, n, C, C] (fp32)."""
    tp, hv, dk = k.shape
    dv, c = v.shape[-1], CHUNK
    n = tp // c
    rows = lambda d: pl.BlockSpec((c, None, d), lambda i, h: (i, h, 0))            # noqa: E731
    per_head = lambda d: pl.BlockSpec((None, c, d), lambda i, h: (h, i, 0))        # noqa: E731
    return pl.pallas_call(
        _intra_kernel,
        out_shape=(jax.ShapeDtypeStruct((hv, tp, dk), _F32), jax.ShapeDtypeStruct((hv, tp, dv), _F32),
                   jax.ShapeDtypeStruct((hv, n, c, c), _F32)),
        grid=(n, hv),
        in_specs=[rows(dk), rows(dk), rows(dv), pl.BlockSpec((None, c), lambda i, h: (h, i)),
                  pl.BlockSpec((None, c), lambda i, h: (h, i))],
        out_specs=(per_head(dk), per_head(dv), pl.BlockSpec((None, None, c, c), lambda i, h: (h, i, 0, 0))),
        interpret=interpret, **triton_params(interpret, num_warps=num_warps, num_stages=1),
    )(q, k, v, g_h, beta_h)


@functools.partial(jax.jit, static_argnames=("interpret", "sub", "num_warps", "dots"))
def _chunked_intra_v2(q, k, v, g_h, beta_h, *, interpret: bool = False, sub: int = SUB, num_warps: int = 4,
                      dots: str = "ieee"):
    """v2 intra-chunk kernel: as _chunked_intra_v1, and eq = e^G, ek = e^(G_last - G) [Hv, Tp] (fp32). sub: rows of
    the blocks inverted by doubling (a power of two from 16 to CHUNK: it enters dots)."""
    tp, hv, dk = k.shape
    dv, c = v.shape[-1], CHUNK
    if not _pow2(sub) or not 16 <= sub <= c:
        raise ValueError(f"sub = {sub} must be a power of two from 16 to {c}")
    n = tp // c
    rows = lambda d: pl.BlockSpec((c, None, d), lambda i, h: (i, h, 0))            # noqa: E731
    per_head = lambda d: pl.BlockSpec((None, c, d), lambda i, h: (h, i, 0))        # noqa: E731
    vec = pl.BlockSpec((None, c), lambda i, h: (h, i))
    return pl.pallas_call(
        functools.partial(_intra_kernel_v2, sub=sub, dots=dots),
        out_shape=(jax.ShapeDtypeStruct((hv, tp, dk), _F32), jax.ShapeDtypeStruct((hv, tp, dv), _F32),
                   jax.ShapeDtypeStruct((hv, n, c, c), _F32), jax.ShapeDtypeStruct((hv, tp), _F32),
                   jax.ShapeDtypeStruct((hv, tp), _F32)),
        grid=(n, hv),
        in_specs=[rows(dk), rows(dk), rows(dv), vec, vec],
        out_specs=(per_head(dk), per_head(dv), pl.BlockSpec((None, None, c, c), lambda i, h: (h, i, 0, 0)), vec, vec),
        interpret=interpret, **triton_params(interpret, num_warps=num_warps, num_stages=1),
    )(q, k, v, g_h, beta_h)


@functools.partial(jax.jit, static_argnames=("interpret", "block_v", "num_warps", "num_stages", "dots"))
def _chunked_recurrence(q, k, decays, w, u, attn, state, *, interpret: bool = False, block_v: int = BLOCK_V,
                        num_warps: int = 4, num_stages: int = 1, dots: str = "ieee"):
    """The recurrence kernel over padded q, k [Tp, Hv, dk] and the intra kernel's outputs -> (o [Tp, Hv, dv],
    final state [Hv, dk, dv]) fp32. decays: (g_h,) for the v1 kernel (it forms the decays from g), (eq, ek) for v2.
    Its blocks span the whole part (Tp rows, walked C at a time inside the program)."""
    tp, hv, dk = k.shape
    dv, c = u.shape[-1], CHUNK
    n, bv = tp // c, block_v
    kernel = _recurrence_kernel if len(decays) == 1 else functools.partial(_recurrence_kernel_v2, dots=dots)
    sblk = pl.BlockSpec((None, dk, bv), lambda h, j: (h, 0, j))
    vec = pl.BlockSpec((None, tp), lambda h, j: (h, 0))
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((tp, hv, dv), _F32), jax.ShapeDtypeStruct((hv, dk, dv), _F32)),
        grid=(hv, dv // bv),
        in_specs=[pl.BlockSpec((tp, None, dk), lambda h, j: (0, h, 0)),
                  pl.BlockSpec((tp, None, dk), lambda h, j: (0, h, 0)),
                  *[vec] * len(decays),
                  pl.BlockSpec((None, tp, dk), lambda h, j: (h, 0, 0)),
                  pl.BlockSpec((None, tp, bv), lambda h, j: (h, 0, j)),
                  pl.BlockSpec((None, n, c, c), lambda h, j: (h, 0, 0, 0)),
                  sblk],
        out_specs=(pl.BlockSpec((tp, None, bv), lambda h, j: (0, h, j)), sblk),
        interpret=interpret, **triton_params(interpret, num_warps=num_warps, num_stages=num_stages),
    )(q, k, *decays, w, u, attn, state.astype(_F32))


def chunk_products_xla(q, k, v, g, beta, chunk: int = CHUNK, dots: str = "ieee"):
    """The intra-chunk products in XLA, all chunks and heads at once (batched matmuls and one triangular solve):
    q, k [Tp, Hv, dk], v [Tp, Hv, dv], g, beta [Tp, Hv] with Tp a multiple of CHUNK (padding rows g = beta = 0)
    -> (w [Hv, Tp, dk], u [Hv, Tp, dv], attn [Hv, n, C, C], eq = e^G, ek = e^(G_last - G) [Hv, Tp]), fp32, the
    v2 intra kernel's outputs: within a chunk G = cumsum(g), A = strict_lower(beta_i k_i.k_j e^(G_i - G_j)),
    [u | w] = (I + A)^-1 [beta v | beta e^G k] (the inverse by one unit lower-triangular solve, then a matmul),
    attn = lower(q_i.k_j e^(G_i - G_j)); the exponents G_i - G_j as sums of g (no difference of prefix sums).
    Also the intra-chunk part of the backend's XLA form (JaxBackend.gated_delta_chunked_xla); chunk: C, the kernels'
    CHUNK unless that form asks for another; dots: the data products' precision (DOTS; the exponent sums stay
    IEEE; tf32x3 compiles on a GPU only)."""
    hp = DOT_PRECISION[_check_dots(dots, interpret=False)]     # tf32x3 off a GPU: XLA's CPU refuses it by name
    tp, hv, dk = k.shape
    dv, c = v.shape[-1], chunk
    n = tp // c
    q, k, v, g, beta = (x.astype(_F32) for x in (q, k, v, g, beta))
    # [Hv, n, c, ...]
    q, k, v = (x.reshape(n, c, hv, -1).transpose(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.reshape(n, c, hv).transpose(2, 0, 1) for x in (g, beta))
    G = jnp.cumsum(g, axis=-1)                                                    # [Hv, n, c]
    # D_ij = G_i - G_j = the sum of g over j < l <= i, summed directly (one matmul with a 0/1 mask): with strongly
    # decaying heads |G| reaches hundreds within a chunk, and the difference of two such prefix sums loses the
    # small exponents near the diagonal (5e-6 relative in the final state, against 1e-7 summed directly)
    ii, jj, ll = np.ogrid[:c, :c, :c]
    between = ((jj < ll) & (ll <= ii)).astype(np.float32).reshape(c * c, c)         # [(i, j), l]
    D = jnp.einsum("hnl,pl->hnp", g, jnp.asarray(between), precision=_HI).reshape(hv, n, c, c)
    lower = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.exp(jnp.where(lower, D, -jnp.inf))                                # [Hv, n, c, c]
    k_beta = k * beta[..., None]
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    A = jnp.where(strict, jnp.einsum("hnid,hnjd->hnij", k_beta, k, precision=hp) * decay, 0.0)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(G)[..., None]], axis=-1)   # [Hv, n, c, dv + dk]
    # T = (I + A)^-1 by one solve against the identity, then [u | w] = T rhs as one batched matmul: the batched
    # solve's time follows its right-hand sides (dv + dk = 256 of them took 0.8 ms a layer on the H200, c = 64 take
    # 0.2: prompt_probe at 733f897 and 9c442a3)
    eye = jnp.broadcast_to(jnp.eye(c, dtype=_F32), A.shape)
    inv = lax.linalg.triangular_solve(eye + A, eye, left_side=True, lower=True, unit_diagonal=True)
    uw = jnp.einsum("hnij,hnjd->hnid", inv, rhs, precision=hp)
    attn = jnp.einsum("hnid,hnjd->hnij", q, k, precision=hp) * decay             # lower incl. the diagonal
    rows = lambda x: x.reshape(hv, tp, -1)                                         # noqa: E731
    eq = jnp.exp(G)
    ek = jnp.exp(D[..., c - 1, :])                                                # e^(sum of g over l > i)
    return rows(uw[..., dv:]), rows(uw[..., :dv]), attn, eq.reshape(hv, tp), ek.reshape(hv, tp)


# v2 and xla_intra: a recurrence program is alone on its SM (Hv x dv/BV ~ 132 programs)
_RECURRENCE_WARPS = {"v1": 4, "v2": 8, "xla_intra": 8}


@functools.partial(jax.jit, static_argnames=("interpret", "block_v", "variant", "dots", "stages"))
def gated_delta_chunked(q, k, v, g, beta, state, *, interpret: bool = False, block_v: int | None = None,
                        variant: str = "v2", dots: str = "ieee", stages: int = 1):
    """A prompt part of one sequence, T tokens (any T). q, k [T, Hv, dk], v [T, Hv, dv] (bf16 or f32); g, beta
    [T, Hv]; state [Hv, dk, dv] f32 -> (o [T, Hv, dv] f32, final state [Hv, dk, dv] f32). dk, dv and block_v
    (default min(BLOCK_V, dv)) powers of two >= 16 (they enter dots). variant "v2" (default: the blocked inverse,
    module docstring), "v1" (forward substitution) or "xla_intra" (the intra-chunk products in XLA,
    chunk_products_xla, and v2's recurrence kernel). dots: how the v2 kernels' data dots run (DOTS; v1's are IEEE
    only); stages: the recurrence kernel's pipeline stages (Triton num_stages: loads of the next chunk in flight)."""
    t, hv, dk = k.shape
    dv = v.shape[-1]
    if state.shape != (hv, dk, dv):
        raise ValueError(f"state must be [{hv}, {dk}, {dv}], not {list(state.shape)}")
    bv = _check(dk, dv, block_v, min_dim=16)
    if variant not in CHUNKED_VARIANTS:
        raise ValueError(f"variant must be one of {CHUNKED_VARIANTS}, not {variant!r}")
    if _check_dots(dots, interpret) != "ieee" and variant == "v1":
        raise ValueError(f"variant v1 runs IEEE dots only, not dots {dots!r}")
    if stages not in (1, 2, 3):
        raise ValueError(f"stages must be 1, 2 or 3, not {stages!r}")
    q, k, v, g_h, beta_h = _pad_part(q, k, v, g, beta)
    if variant == "v1":
        w, u, attn = _chunked_intra_v1(q, k, v, g_h, beta_h, interpret=interpret)
        decays = (g_h,)
    else:
        intra = chunk_products_xla(q, k, v, g_h.T, beta_h.T, dots=dots) if variant == "xla_intra" else \
            _chunked_intra_v2(q, k, v, g_h, beta_h, interpret=interpret, dots=dots)
        w, u, attn, eq, ek = intra
        decays = (eq, ek)
    o, state = _chunked_recurrence(q, k, decays, w, u, attn, state, interpret=interpret, block_v=bv,
                                   num_warps=_RECURRENCE_WARPS[variant], num_stages=stages, dots=dots)
    return o[:t], state


# --- float64 references (numpy), on strata.reference.gated_delta

def _f64(*xs):
    return [np.asarray(x, np.float64) for x in xs]


def _reference_chunked(q, k, v, g, beta, state):
    """The rule over T tokens of one sequence, one token at a time in float64 -> (o [T, Hv, dv], final state)."""
    return _gated_delta_reference(*_f64(q, k, v, g, beta, state))


def _reference_verify(q, k, v, g, beta, state):
    """Q positions of each of S sequences in float64 -> (o [S, Q, Hv, dv], states [S, Q, Hv, dk, dv])."""
    q, k, v, g, beta, state = _f64(q, k, v, g, beta, state)
    n, nq = q.shape[:2]
    o = np.zeros(v.shape)
    states = np.zeros((n, nq) + state.shape[1:])
    for s in range(n):
        S = state[s]
        for t in range(nq):
            o_t, S = _gated_delta_reference(q[s, t:t + 1], k[s, t:t + 1], v[s, t:t + 1], g[s, t:t + 1],
                                            beta[s, t:t + 1], S)
            o[s, t], states[s, t] = o_t[0], S
    return o, states


def _reference_decode(q, k, v, g, beta, state):
    """One token of each of S sequences in float64 -> (o [S, Hv, dv], new state [S, Hv, dk, dv])."""
    o, states = _reference_verify(*(x[:, None] for x in _f64(q, k, v, g, beta)), state)
    return o[:, 0], states[:, 0]
