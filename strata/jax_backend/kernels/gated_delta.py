"""The gated delta rule's chunked form (Qwen3-Next's linear attention) for prompt parts: the intra-chunk products in
XLA (chunk_products_xla, batched by JaxBackend.gated_delta_chunked_xla; fp32 matmuls at Precision.HIGHEST), and
float64 references. (A Pallas form lost to this one on the H200 in every case timed: docs/performance.md.)

Per value head h the state S [dk, dv] is fp32: S <- exp(g_t) S; S <- S + k_t (x) beta_t (v_t - S^T k_t);
o_t = S^T q_t (q, k l2-normed, q scaled). A row with g = beta = 0 leaves S unchanged (how padding works).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from strata.reference import gated_delta as _gated_delta_reference

CHUNK = 64               # chunk_products_xla's default chunk (KernelConfig.gdn_chunk)
SCAN_BLOCK = 16          # chunks an iteration of the chunk-state scan walks, at most (gated_delta_chunked_xla)
HI = lax.Precision.HIGHEST
_F32 = jnp.float32


def chunk_products_xla(q, k, v, g, beta, chunk: int = CHUNK):
    """The intra-chunk products in XLA, all chunks and heads at once (batched matmuls and one triangular solve):
    q, k [Tp, Hv, dk], v [Tp, Hv, dv], g, beta [Tp, Hv] with Tp a multiple of `chunk` (padding rows g = beta = 0)
    -> (w [Hv, Tp, dk], u [Hv, Tp, dv], attn [Hv, n, C, C], eq = e^G, ek = e^(G_last - G) [Hv, Tp]), fp32: within
    a chunk G = cumsum(g), A = strict_lower(beta_i k_i.k_j e^(G_i - G_j)), [u | w] = (I + A)^-1 [beta v | beta e^G k]
    (the inverse by one unit lower-triangular solve, then a matmul), attn = lower(q_i.k_j e^(G_i - G_j)); the
    exponents G_i - G_j as sums of g (no difference of prefix sums)."""
    hp = HI
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
    D = jnp.einsum("hnl,pl->hnp", g, jnp.asarray(between), precision=HI).reshape(hv, n, c, c)
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
