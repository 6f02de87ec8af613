"""The gated delta rule's chunked form (Qwen3-Next's linear attention) for prompt parts: the intra-chunk products in
XLA (chunk_products_xla, batched by JaxBackend.gated_delta_chunked_xla) and the whole rule as two Pallas kernels on
the Triton backend (gated_delta_chunked_pallas: products per (chunk, head), then one sequential walk over the chunks
per (head, block of dv) holding the state in registers), the matmul precisions (DOTS), and float64 references.

Per value head h the state S [dk, dv] is fp32: S <- exp(g_t) S; S <- S + k_t (x) beta_t (v_t - S^T k_t);
o_t = S^T q_t (q, k l2-normed, q scaled). A row with g = beta = 0 leaves S unchanged (how padding works).
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

CHUNK = 64               # chunk_products_xla's default chunk (JaxBackend's GDN_CHUNK)
_HI = lax.Precision.HIGHEST
_F32 = jnp.float32
# How the data matmuls run (static `dots`): "ieee" fp32 (Precision.HIGHEST), or fp32 split over the tensor cores,
# "tf32x3" (3-pass TF32, ~22 significant bits a product; a GPU only: XLA's CPU refuses it by name) or "bf16x6"
# (6-pass bfloat16). The exponent sums (the 0/1-mask matmul over g) stay IEEE whatever `dots` is.
DOTS = ("ieee", "tf32x3", "bf16x6")
DOT_PRECISION = {"ieee": _HI, "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
                 "bf16x6": lax.DotAlgorithmPreset.BF16_BF16_F32_X6}


def _check_dots(dots: str) -> str:
    if dots not in DOTS:
        raise ValueError(f"dots must be one of {DOTS}, not {dots!r}")
    return dots


def chunk_products_xla(q, k, v, g, beta, chunk: int = CHUNK, dots: str = "ieee"):
    """The intra-chunk products in XLA, all chunks and heads at once (batched matmuls and one triangular solve):
    q, k [Tp, Hv, dk], v [Tp, Hv, dv], g, beta [Tp, Hv] with Tp a multiple of `chunk` (padding rows g = beta = 0)
    -> (w [Hv, Tp, dk], u [Hv, Tp, dv], attn [Hv, n, C, C], eq = e^G, ek = e^(G_last - G) [Hv, Tp]), fp32: within
    a chunk G = cumsum(g), A = strict_lower(beta_i k_i.k_j e^(G_i - G_j)), [u | w] = (I + A)^-1 [beta v | beta e^G k]
    (the inverse by one unit lower-triangular solve, then a matmul), attn = lower(q_i.k_j e^(G_i - G_j)); the
    exponents G_i - G_j as sums of g (no difference of prefix sums). dots: the data products' precision (DOTS)."""
    hp = DOT_PRECISION[_check_dots(dots)]
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
    # T = (I + A)^-1 by one solve against the identity (c right-hand sides), then [u | w] = T rhs as one batched
    # matmul: the batched solve's time follows its right-hand sides, and dv + dk > c
    eye = jnp.broadcast_to(jnp.eye(c, dtype=_F32), A.shape)
    inv = lax.linalg.triangular_solve(eye + A, eye, left_side=True, lower=True, unit_diagonal=True)
    uw = jnp.einsum("hnij,hnjd->hnid", inv, rhs, precision=hp)
    attn = jnp.einsum("hnid,hnjd->hnij", q, k, precision=hp) * decay             # lower incl. the diagonal
    rows = lambda x: x.reshape(hv, tp, -1)                                         # noqa: E731
    eq = jnp.exp(G)
    ek = jnp.exp(D[..., c - 1, :])                                                # e^(sum of g over l > i)
    return rows(uw[..., dv:]), rows(uw[..., :dv]), attn, eq.reshape(hv, tp), ek.reshape(hv, tp)


# --- the Pallas form: kernel 1 per (chunk, head), the products; kernel 2 per (head, dv block), the recurrence
#
# Kernel 1 returns chunk_products_xla's arrays. Its exponents: G = cumsum(g) is summed in one sequential loop as a
# compensated pair G = hi + lo (TwoSum: lo gathers each addition's exact rounding error), and G_i - G_j as
# (hi_i - hi_j) + (lo_i - lo_j): near the diagonal hi_i, hi_j are within a factor of 2, so their difference is exact
# and the error is D's own rounding (a plain fp32 prefix sum at |G| ~ hundreds would err by ulp(G) there, what
# chunk_products_xla's mask matmul avoids). T = (I + A)^-1 by forward substitution, one row a step.

BLOCK_V = 32              # kernel 2: columns of the state (of dv) a program; Hv x dv / BLOCK_V programs
PRODUCTS_WARPS, SCAN_WARPS, NUM_STAGES = 4, 4, 2   # Triton warps of kernels 1 and 2 (bench/triton_sass_probe.py)
MIN_DOT = 16              # Triton dots need every dimension >= 16; blocks are powers of two


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_pallas(q, k, v, g, beta, state, chunk: int, block_v: int | None) -> int:
    """The shapes gated_delta_chunked_pallas takes; -> its dv block. Raises ValueError naming the constraint."""
    t, hv, dk = k.shape
    dv = v.shape[-1]
    if q.shape != k.shape or v.shape[:2] != (t, hv) or g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(f"q, k [T, Hv, dk], v [T, Hv, dv], g, beta [T, Hv] disagree: {q.shape}, {k.shape}, "
                         f"{v.shape}, {g.shape}, {beta.shape}")
    if state.shape != (hv, dk, dv):
        raise ValueError(f"state must be [Hv, dk, dv] = [{hv}, {dk}, {dv}], got {state.shape}")
    for name, n in (("dk", dk), ("dv", dv), ("chunk", chunk)):
        if not _pow2(n) or n < MIN_DOT:
            raise ValueError(f"{name}={n} must be a power of two >= {MIN_DOT} (Triton blocks and dots)")
    bv = min(BLOCK_V, dv) if block_v is None else block_v
    if not _pow2(bv) or bv < MIN_DOT or dv % bv:
        raise ValueError(f"block_v={bv} must be a power of two >= {MIN_DOT} dividing dv={dv}")
    return bv


def pallas_supported(q, k, v, g, beta, state, chunk: int = CHUNK) -> bool:
    """Whether gated_delta_chunked_pallas takes these shapes (with its default dv block)."""
    try:
        _check_pallas(q, k, v, g, beta, state, chunk, None)
    except ValueError:
        return False
    return True


def _out(*shape):
    return jax.ShapeDtypeStruct(shape, _F32)


def _dot(a, b, prec, contract=(1, 0)):
    """a . b contracting a's dim contract[0] with b's contract[1], float32 out."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=prec,
                           preferred_element_type=_F32)


def _products_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, attn_ref, eq_ref, ek_ref, *, prec):
    """Program (chunk, head): q_ref, k_ref [C, dk], v_ref [C, dv], g_ref, beta_ref [C] -> w [C, dk], u [C, dv],
    attn [C, C], eq, ek [C] as chunk_products_xla's."""
    c = g_ref.shape[0]
    idx = lax.broadcasted_iota(jnp.int32, (c,), 0)

    def prefix(l, carry):                       # G_l = hi_l + lo_l, compensated (TwoSum)
        hi, lo, g_hi, g_lo = carry
        x = g_ref[l].astype(_F32)
        s = hi + x
        bb = s - hi
        lo = lo + ((hi - (s - bb)) + (x - bb))
        return s, lo, jnp.where(idx == l, s, g_hi), jnp.where(idx == l, lo, g_lo)

    zero = jnp.zeros((c,), _F32)
    hi, lo, g_hi, g_lo = lax.fori_loop(0, c, prefix, (jnp.float32(0), jnp.float32(0), zero, zero))
    rows = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    cols = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    d = (g_hi[:, None] - g_hi[None, :]) + (g_lo[:, None] - g_lo[None, :])       # G_i - G_j
    decay = jnp.exp(jnp.where(rows >= cols, d, -jnp.inf))
    beta = beta_ref[...].astype(_F32)
    # the [C, d] operands go from their refs straight into the dots, and the per-token factors (beta, e^G) scale the
    # [C, C] side: fewer live registers (the FMA dots' operands and the substitution's carry are what spill)
    k = k_ref[...].astype(_F32)
    a = jnp.where(rows > cols, _dot(k, k, prec, (1, 1)) * (beta[:, None] * decay), 0.0)
    attn_ref[...] = jnp.where(rows >= cols, _dot(q_ref[...].astype(_F32), k, prec, (1, 1)) * decay, 0.0)

    # B = (I + A)^-1 - I (strictly lower) row by row: B_i = L_i + L_i B with L = -A; the rows of b at and below i
    # still hold L, whose entries L_ij (j >= i) are 0, so they add nothing
    def substitute(i, b):
        row = jnp.sum(jnp.where(rows == i, b, 0.0), axis=0)                       # L_i
        row = row + jnp.sum(row[:, None] * b, axis=0)
        return jnp.where(rows == i, row[None, :], b)

    inv = lax.fori_loop(1, c, substitute, -a) + jnp.where(rows == cols, 1.0, 0.0)
    eq = jnp.exp(g_hi + g_lo)
    w_ref[...] = _dot(inv * (beta * eq)[None, :], k_ref[...].astype(_F32), prec)        # T (beta e^G k)
    u_ref[...] = _dot(inv * beta[None, :], v_ref[...].astype(_F32), prec)               # T (beta v)
    eq_ref[...] = eq
    ek_ref[...] = jnp.exp((hi - g_hi) + (lo - g_lo))                              # e^(G_last - G)


def _scan_kernel(q_ref, k_ref, w_ref, u_ref, attn_ref, eq_ref, ek_ref, s_ref, o_ref, s_out_ref, *, chunk: int,
                 prec):
    """Program (head, dv block): the chunks in order, S [dk, bv] carried in registers: v' = u - w S,
    o = (q e^G) S + attn v', S <- e^(G_last) S + (k e^(G_last - G))^T v'. q_ref, k_ref, w_ref [Tp, dk], u_ref,
    o_ref [Tp, bv], attn_ref [n, C, C], eq_ref, ek_ref [Tp], s_ref, s_out_ref [dk, bv]."""
    c = chunk

    def step(i, s):
        start = pl.multiple_of(i * c, c)
        r = pl.ds(start, c)
        v_new = u_ref[r, :] - _dot(w_ref[r, :], s, prec)
        # the decays scale the [C, bv] side (rows of q S, of v'), not q and k: their [C, dk] go straight to the dots
        o_ref[r, :] = eq_ref[r][:, None] * _dot(q_ref[r, :].astype(_F32), s, prec) + _dot(attn_ref[i], v_new, prec)
        return eq_ref[start + c - 1] * s + _dot(k_ref[r, :].astype(_F32), ek_ref[r][:, None] * v_new, prec, (0, 0))

    s_out_ref[...] = lax.fori_loop(0, q_ref.shape[0] // c, step, s_ref[...].astype(_F32))


def chunk_products_pallas(q, k, v, g, beta, chunk: int = CHUNK, dots: str = "ieee", warps: int = PRODUCTS_WARPS,
                          interpret: bool = False):
    """chunk_products_xla's contract (Tp a multiple of `chunk`) by kernel 1, one program per (chunk, head); q, k, v
    in any float dtype (read as fp32). dk, dv, chunk powers of two >= 16 (gated_delta_chunked_pallas checks)."""
    prec = DOT_PRECISION[_check_dots(dots)]
    tp, hv, dk = k.shape
    dv, c = v.shape[-1], chunk
    n = tp // c
    rows = lambda d: pl.BlockSpec((c, None, d), lambda i, h: (i, h, 0))       # noqa: E731
    head_rows = lambda d: pl.BlockSpec((None, c, d), lambda i, h: (h, i, 0))  # noqa: E731
    tokens = pl.BlockSpec((c, None), lambda i, h: (i, h))
    head_tokens = pl.BlockSpec((None, c), lambda i, h: (h, i))
    return pl.pallas_call(
        functools.partial(_products_kernel, prec=prec),
        out_shape=(_out(hv, tp, dk), _out(hv, tp, dv), _out(hv, n, c, c), _out(hv, tp), _out(hv, tp)),
        grid=(n, hv),
        in_specs=[rows(dk), rows(dk), rows(dv), tokens, tokens],
        out_specs=(head_rows(dk), head_rows(dv), pl.BlockSpec((None, None, c, c), lambda i, h: (h, i, 0, 0)),
                   head_tokens, head_tokens),
        interpret=interpret, **triton_params(interpret, num_warps=warps, num_stages=1),
    )(q, k, v, g, beta)


@functools.partial(jax.jit, static_argnames=("chunk", "dots", "block_v", "warps", "interpret"))
def gated_delta_chunked_pallas(q, k, v, g, beta, state, chunk: int = CHUNK, dots: str = "ieee",
                               block_v: int | None = None, warps: tuple[int, int] | None = None,
                               interpret: bool = False):
    """JaxBackend.gated_delta_chunked_xla's contract by two Pallas kernels: q, k [T, Hv, dk] (l2-normed, q scaled),
    v [T, Hv, dv], g, beta [T, Hv]; state [Hv, dk, dv] fp32 -> (o [T, Hv, dv] fp32, final state [Hv, dk, dv] fp32).
    T is padded to whole chunks with g = beta = 0 rows. dk, dv, chunk and block_v (dv columns a kernel-2 program,
    default BLOCK_V) powers of two >= 16, else a ValueError. dots: the data matmuls' precision (DOTS); warps: Triton
    warps of kernels 1 and 2 (default PRODUCTS_WARPS, SCAN_WARPS)."""
    bv = _check_pallas(q, k, v, g, beta, state, chunk, block_v)
    prec = DOT_PRECISION[_check_dots(dots)]
    t, hv, dk = k.shape
    dv, c = v.shape[-1], chunk
    pad = (-t) % c
    if pad:
        q, k, v, g, beta = (jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in (q, k, v, g, beta))
    tp = t + pad
    n = tp // c
    warps = warps or (PRODUCTS_WARPS, SCAN_WARPS)
    w, u, attn, eq, ek = chunk_products_pallas(q, k, v, g, beta, chunk=c, dots=dots, warps=warps[0],
                                               interpret=interpret)
    seq = lambda d: pl.BlockSpec((tp, None, d), lambda h, j: (0, h, 0))       # noqa: E731
    per_head = lambda *shape: pl.BlockSpec((None,) + shape, lambda h, j: (h,) + (0,) * len(shape))  # noqa: E731
    block = lambda rows: pl.BlockSpec((None, rows, bv), lambda h, j: (h, 0, j))  # noqa: E731
    o, state = pl.pallas_call(
        functools.partial(_scan_kernel, chunk=c, prec=prec),
        out_shape=(_out(tp, hv, dv), _out(hv, dk, dv)),
        grid=(hv, dv // bv),
        in_specs=[seq(dk), seq(dk), per_head(tp, dk), block(tp), per_head(n, c, c), per_head(tp), per_head(tp),
                  block(dk)],
        out_specs=(pl.BlockSpec((tp, None, bv), lambda h, j: (0, h, j)), block(dk)),
        interpret=interpret, **triton_params(interpret, num_warps=warps[1], num_stages=NUM_STAGES),
    )(q, k, w, u, attn, eq, ek, state)
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
