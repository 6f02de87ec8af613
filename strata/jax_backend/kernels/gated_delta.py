"""The gated delta rule (Qwen3-Next's linear attention) as Pallas kernels: one decode token per sequence with the
state updated in place, the k+1 positions of a speculative verify step with the state after each, and the chunked
(WY / UT-transform) form for prompt parts.

Per value head h the state S [dk, dv] is fp32: S <- exp(g_t) S; S <- S + k_t (x) beta_t (v_t - S^T k_t);
o_t = S^T q_t (q, k l2-normed, q scaled). A row with g = beta = 0 leaves S unchanged (how padding works).

Why: the XLA forms (JaxBackend.gated_delta_step / gated_delta_chunked) spend their time outside the arithmetic. Decode
gathers, updates and scatters the states of a window's rows in separate passes (0.53 ms against 0.10 ms for an
in-place Pallas update at 64 rows, notes/pallas-gpu.md). The chunked form is a lax.scan over chunks whose every step
is a handful of small launches (4.6 ms at T = 8192, 32 heads, dk = dv = 128), against a floor of ~0.7 ms there.

Backend: Pallas' Triton backend, the one verified on the H200 (host_rows.py) and interpretable on the CPU in every
JAX version we run (0.10.2 here, 0.11.2 on the GPU); Mosaic GPU interprets only in newer JAX. The state is fp32, so
every dot is fp32 at Precision.HIGHEST, which the Triton lowering runs as IEEE fp32 (no TF32 rounding of the
state); the decode and verify steps are matrix-vector work done with elementwise products and reductions (no dot).

Floors at Qwen3-Next-80B shapes (Hv = 32, dk = dv = 128) over the H200's 3.6 TB/s HBM (~67 TFLOP/s fp32 off the
tensor cores, where IEEE fp32 dots run):
- decode: the state's read + write, 32 x 128 x 128 x 4 B x 2 = 4.19 MB per sequence and layer -> 1.17 us; 18.6 us
  at S = 16 (q, k, v, o add ~41 KB per sequence; ~4 MFLOP per sequence is nothing).
- verify (Q positions): the state read once and written Q times, (1 + Q) x 2.1 MB per sequence and layer -> 46.6 us
  at S = 16, Q = 4: the per-position states (the interface's rollback points) are 80% of it.
- chunked, T = 4096 (n = 64 chunks of C = 64, 2048 chunk-heads): FLOPs dominate. Per chunk-head the intra kernel
  does four C x C x 128 dots (k k^T, q k^T, T (beta e^G k), T (beta v)) and one C x C x C (the decay exponents):
  4.7 MFLOP, 9.7 GFLOP in all (+1.6 G elementwise operations of the triangular inverse); the recurrence does w S,
  q S, k^T v' (C x 128 x 128) and attn v' (C x C x 128): 7.3 MFLOP, 15.0 GFLOP in all. 24.7 GFLOP / 67 TFLOP/s
  = 0.37 ms. The bytes: q, k, v in bf16 read by the intra kernel and q, k again by the recurrence (168 MB); w, u,
  attn in fp32 written and read back (335 MB); o written in fp32 (67 MB): 571 MB -> 0.16 ms. The recurrence is the
  sequential part (64 steps per program on Hv x dv/32 = 128 programs, ~one wave on the H200's 132 SMs); the intra
  kernel is parallel over 2048 programs. (The intermediates' round trip, ~0.09 ms, is the price of not repeating
  the intra work once per dv block in the recurrence, on its sequential path.)
Not yet measured on the GPU: what is verified is the arithmetic in Pallas interpret mode against the float64
references below, and the Triton lowering (power-of-two loads and stores, dot operand dtypes) by exporting each
kernel for CUDA at real shapes on the CPU (tests/kernels/test_gated_delta.py).

Kernels:
- decode: program (sequence s, head h, dv block j of BV columns) holds S[:, j-block] [dk, BV] in registers for one
  step and writes it back over the donated state (input_output_aliases).
- verify: same grid; the program walks the Q positions (fori_loop) and stores S after each into states[s, t, h].
- chunked, two kernels (the flash-linear-attention split):
  intra, program (chunk i, head h): G = cumsum(g); A = strict_lower(beta_i k_i.k_j e^(D_ij)) with
  D_ij = G_i - G_j; T = (I + A)^-1 by forward substitution (C row steps on a [C, C] block); w = T (beta e^G k),
  u = T (beta v), attn = lower(q k^T e^(D_ij)); all fp32, to HBM (w [Hv, Tp, dk], u [Hv, Tp, dv],
  attn [Hv, n, C, C]).
  recurrence, program (head h, dv block j): S[:, j-block] in registers across the chunks; per chunk
  v' = u - w S; o = (q e^G) S + attn v'; S <- e^(G_last) S + (k e^(G_last - G))^T v'.
  T is padded to a multiple of C with g = beta = q = k = v = 0 rows (they leave the state unchanged and their o is
  dropped).
  Accuracy: the exponents of the decays between two tokens (D_ij, and G_last - G_i) are summed directly over the
  tokens between them, never taken as the difference of two prefix sums: with strongly decaying heads |G| reaches
  hundreds within a chunk, and G_i - G_j in fp32 would be off by ~eps |G| in the exponent of near-diagonal terms
  (on the tests' inputs the XLA form's state measured up to 6.3e-6 relative error, these kernels' 2.4e-7). Every
  other exponent is a prefix sum of same-sign terms, whose absolute error ~e^G |G| eps never exceeds ~eps.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from strata.jax_backend.kernels import triton_params
from strata.model.reference import gated_delta as _gated_delta_reference

CHUNK = 64               # chunk of the chunked form (JaxBackend's GDN_CHUNK)
BLOCK_V = 32             # dv columns of the state per program (a power of two: Triton block shapes must be)
_HI = lax.Precision.HIGHEST
_F32 = jnp.float32


# --- shared pieces

def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


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


def _dot(a, b, *, ta: bool = False, tb: bool = False):
    """a @ b (a^T with ta, b^T with tb) in fp32 at HIGHEST precision (IEEE fp32 in the Triton lowering)."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=_HI, preferred_element_type=_F32)


# --- decode: one token per sequence, the state in place

def _decode_kernel(g_ref, beta_ref, q_ref, k_ref, v_ref, s_in_ref, o_ref, s_ref):
    """Program (s, h, j): the state block [dk, BV] of sequence s, head h, columns j*BV.. one step on; s_ref aliases
    s_in_ref (the donated state)."""
    s, h = pl.program_id(0), pl.program_id(1)
    S, o = _step(s_in_ref[...], q_ref[...].astype(_F32), k_ref[...].astype(_F32), v_ref[...].astype(_F32),
                 g_ref[s, h], beta_ref[s, h])
    s_ref[...] = S
    o_ref[...] = o


@functools.partial(jax.jit, static_argnames=("interpret", "block_v"))
def gated_delta_decode(q, k, v, g, beta, state, *, interpret: bool = False, block_v: int | None = None):
    """One token for each of S sequences. q, k [S, Hv, dk], v [S, Hv, dv] (bf16 or f32); g, beta [S, Hv];
    state [S, Hv, dk, dv] f32 -> (o [S, Hv, dv] f32, new state [S, Hv, dk, dv] f32). The new state is written over
    `state`'s buffer when the caller donates it (jax.jit(..., donate_argnums=...)); otherwise XLA copies it first.
    dk, dv powers of two; block_v: dv columns per program (default min(BLOCK_V, dv))."""
    n, hv, dk = k.shape
    dv = v.shape[-1]
    if state.dtype != _F32 or state.shape != (n, hv, dk, dv):
        raise ValueError(f"state must be float32 [{n}, {hv}, {dk}, {dv}], not {state.dtype} {list(state.shape)}")
    bv = _check(dk, dv, block_v)
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
        interpret=interpret, **triton_params(interpret, num_warps=4, num_stages=1),
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
    states [S, Q, Hv, dk, dv] f32, the state after each position). Any Q; dk, dv powers of two; block_v as in
    gated_delta_decode."""
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
    """Program (chunk i, head h): w = T (beta e^G k), u = T (beta v), attn = lower(q k^T e^D), with T = (I + A)^-1,
    A = strict_lower(beta_i k_i.k_j e^D_ij), D_ij = G_i - G_j. (q, k, v are loaded where they are used, so that
    they are not live across the substitution loop.)"""
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


def _recurrence_kernel(q_ref, k_ref, g_ref, w_ref, u_ref, attn_ref, s0_ref, o_ref, s_ref):
    """Program (head h, dv block j): the state block [dk, BV] across the n chunks, o of the chunk at each."""
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


@functools.partial(jax.jit, static_argnames=("interpret", "block_v"))
def gated_delta_chunked(q, k, v, g, beta, state, *, interpret: bool = False, block_v: int | None = None):
    """A prompt part of one sequence, T tokens (any T). q, k [T, Hv, dk], v [T, Hv, dv] (bf16 or f32); g, beta
    [T, Hv]; state [Hv, dk, dv] f32 -> (o [T, Hv, dv] f32, final state [Hv, dk, dv] f32). dk, dv and block_v
    (default min(BLOCK_V, dv)) powers of two >= 16 (they enter dots)."""
    t, hv, dk = k.shape
    dv = v.shape[-1]
    if state.shape != (hv, dk, dv):
        raise ValueError(f"state must be [{hv}, {dk}, {dv}], not {list(state.shape)}")
    bv = _check(dk, dv, block_v, min_dim=16)
    c = CHUNK
    pad = (-t) % c
    if pad:                          # zero rows (g = beta = 0) leave the state unchanged; their o is cut below
        q, k, v, g, beta = (jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in (q, k, v, g, beta))
    tp = t + pad
    n = tp // c
    g_h, beta_h = g.astype(_F32).T, beta.astype(_F32).T                            # [Hv, Tp]: rows per head
    rows = lambda d: pl.BlockSpec((c, None, d), lambda i, h: (i, h, 0))            # noqa: E731
    per_head = lambda d: pl.BlockSpec((None, c, d), lambda i, h: (h, i, 0))        # noqa: E731
    w, u, attn = pl.pallas_call(
        _intra_kernel,
        out_shape=(jax.ShapeDtypeStruct((hv, tp, dk), _F32), jax.ShapeDtypeStruct((hv, tp, dv), _F32),
                   jax.ShapeDtypeStruct((hv, n, c, c), _F32)),
        grid=(n, hv),
        in_specs=[rows(dk), rows(dk), rows(dv), pl.BlockSpec((None, c), lambda i, h: (h, i)),
                  pl.BlockSpec((None, c), lambda i, h: (h, i))],
        out_specs=(per_head(dk), per_head(dv), pl.BlockSpec((None, None, c, c), lambda i, h: (h, i, 0, 0))),
        interpret=interpret, **triton_params(interpret, num_warps=4, num_stages=1),
    )(q, k, v, g_h, beta_h)
    # the recurrence's blocks span the whole part (Tp rows, walked C at a time inside the program)
    sblk = pl.BlockSpec((None, dk, bv), lambda h, j: (h, 0, j))
    o, state = pl.pallas_call(
        _recurrence_kernel,
        out_shape=(jax.ShapeDtypeStruct((tp, hv, dv), _F32), jax.ShapeDtypeStruct((hv, dk, dv), _F32)),
        grid=(hv, dv // bv),
        in_specs=[pl.BlockSpec((tp, None, dk), lambda h, j: (0, h, 0)),
                  pl.BlockSpec((tp, None, dk), lambda h, j: (0, h, 0)),
                  pl.BlockSpec((None, tp), lambda h, j: (h, 0)),
                  pl.BlockSpec((None, tp, dk), lambda h, j: (h, 0, 0)),
                  pl.BlockSpec((None, tp, bv), lambda h, j: (h, 0, j)),
                  pl.BlockSpec((None, n, c, c), lambda h, j: (h, 0, 0, 0)),
                  sblk],
        out_specs=(pl.BlockSpec((tp, None, bv), lambda h, j: (0, h, j)), sblk),
        interpret=interpret, **triton_params(interpret, num_warps=4, num_stages=1),
    )(q, k, g_h, w, u, attn, state.astype(_F32))
    return (o[:t] if pad else o), state


# --- float64 references (numpy), on strata.model.reference.gated_delta

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
