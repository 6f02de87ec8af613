"""The MoE router's routing as one Pallas kernel (Triton backend): router logits [T, E] -> the top-k experts of each
row and their weights (ComposedOps.route, the definition: softmax over all experts in fp32, top-k with ties to the
lower expert id, optionally renormalised to sum to 1), one launch where XLA's composition takes three or more.

Program: one row. softmax as max, exp, sum; then k rounds of (the largest probability left, the lowest id holding
it), each taken out before the next, so ties go to the lower id as lax.top_k's do. The outputs are [T, KP] with KP
the next power of two >= k (Triton stores power-of-two blocks), sliced to [:, :k]. A row with a NaN logit gets NaN
weights (its ids clamped into range), so the window's finite flags see it. E must be a power of two (else a
ValueError, and the backend runs the composition).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from strata.jax_backend.kernels import triton_params

_F32 = jnp.float32


def _kernel(logits_ref, w_ref, idx_ref, *, k: int, kp: int, renormalize: bool):
    e = logits_ref.shape[0]
    x = logits_ref[...].astype(_F32)                                        # [E]
    p = jnp.exp(x - jnp.max(x))
    p = p / jnp.sum(p)
    ids = lax.broadcasted_iota(jnp.int32, (e,), 0)
    slot = lax.broadcasted_iota(jnp.int32, (kp,), 0)
    w = jnp.zeros((kp,), _F32)
    idx = jnp.zeros((kp,), jnp.int32)
    left = p
    for i in range(k):
        best = jnp.max(left)
        j = jnp.minimum(jnp.min(jnp.where(left == best, ids, e)), e - 1)   # a NaN row: no match, id clamped
        w = jnp.where(slot == i, best, w)
        idx = jnp.where(slot == i, j, idx)
        left = jnp.where(ids == j, -1.0, left)                             # probabilities are >= 0
    if renormalize:
        w = w / jnp.sum(w)                                                 # the pad entries are 0
    w_ref[...] = w
    idx_ref[...] = idx


@functools.partial(jax.jit, static_argnames=("k", "renormalize", "interpret"))
def route(logits, *, k: int, renormalize: bool, interpret: bool = False):
    """logits [T, E] (any float dtype) -> (weights [T, k] float32, expert ids [T, k] int32)."""
    t, e = logits.shape
    if e & (e - 1) or not 1 <= k <= e:
        raise ValueError(f"the routing kernel needs a power-of-two expert count and 1 <= k <= E, got E = {e}, k = {k}")
    kp = 1 << (k - 1).bit_length()
    out = pl.BlockSpec((None, kp), lambda r: (r, 0))
    w, idx = pl.pallas_call(
        functools.partial(_kernel, k=k, kp=kp, renormalize=renormalize),
        out_shape=(jax.ShapeDtypeStruct((t, kp), _F32), jax.ShapeDtypeStruct((t, kp), jnp.int32)),
        grid=(t,),
        in_specs=[pl.BlockSpec((None, e), lambda r: (r, 0))],
        out_specs=(out, out),
        interpret=interpret, **triton_params(interpret, num_warps=4 if e >= 256 else 1, num_stages=1),
    )(logits)
    return w[:, :k], idx[:, :k]


def _reference(logits, k: int, renormalize: bool):
    """numpy (float64): softmax, the k largest (ties to the lower id, a stable sort), renormalised."""
    x = np.asarray(logits, np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, idx, -1)
    if renormalize:
        w = w / w.sum(-1, keepdims=True)
    return w, idx.astype(np.int32)
