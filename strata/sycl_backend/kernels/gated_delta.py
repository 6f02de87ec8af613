"""gated_delta.cl: the gated delta rule over T tokens and all heads (one work-item per head and state column), from
prepared inputs or straight from the conv output (gated_delta_raw)."""
from __future__ import annotations

import dpnp
import numpy as np

from strata.reference import gated_delta as gated_delta_reference  # noqa: F401 - the kernel's reference
from strata.sycl_backend.kernels import Kernels, f32, i32

DK_MAX = 512


def gated_delta(k: Kernels, q, kk, v, g, beta, state, out=None):
    """-> (o [T, Hv, dv], state). `state` [Hv, dk, dv] fp32 is updated IN PLACE and returned."""
    t, hv, dk = kk.shape
    dv = v.shape[-1]
    assert dk <= DK_MAX
    out = dpnp.empty((t, hv, dv), dtype=dpnp.float32, sycl_queue=k.queue) if out is None else out
    k.launch("gated_delta", [q, kk, v, g, beta, state, out, i32(t), i32(hv), i32(dk), i32(dv)], [hv * dv])
    return out, state


def gated_delta_raw(k: Kernels, u, b, a, a_log, dt_bias, state, hk: int, dk: int, dv: int, n_valid: int,
                    reset: bool = False):
    """The rule from the conv output u [T, 2*hk*dk + hv*dv] with b, a [T, hv] (its inputs formed in the kernel, as
    delta_inputs_reference forms them) -> (o [T, hv, dv], state); `state` [hv, dk, dv] fp32 is updated IN PLACE
    (with reset, from zeros: a sequence starting at 0)."""
    t, hv = b.shape
    assert dk <= DK_MAX
    out = dpnp.empty((t, hv, dv), dtype=dpnp.float32, sycl_queue=k.queue)
    k.launch("gated_delta_raw", [u, b, a, a_log, dt_bias, state, out, i32(t), i32(hk), i32(hv), i32(dk), i32(dv),
                                 f32(np.float32(dk ** -0.5)), i32(n_valid), i32(reset)], [hv * dv])
    return out, state


def gated_delta_raw_rows(k: Kernels, u, b, a, a_log, dt_bias, state, rows, hk: int, dk: int, dv: int):
    """A decode window: gated_delta_raw for one token of each of S sequences, u [S, C], b, a [S, hv], state
    [S, hv, dk, dv] updated IN PLACE, rows int32 [2, S] (positions, active: a row at position 0 starts from zeros,
    an inactive one keeps its state) -> (o [S, hv, dv], state)."""
    s, hv = b.shape
    assert dk <= DK_MAX
    out = dpnp.empty((s, hv, dv), dtype=dpnp.float32, sycl_queue=k.queue)
    k.launch("gated_delta_raw_rows", [u, b, a, a_log, dt_bias, state, out, rows, i32(s), i32(hk), i32(hv), i32(dk),
                                      i32(dv), f32(np.float32(dk ** -0.5))], [s * hv * dv])
    return out, state


def delta_inputs_reference(u, b, a, a_log, dt_bias, hk, dk, dv, n_valid):
    """The rule's inputs (q, k, v, g, beta) from the conv output, as delta_block's composition forms them."""
    u, b, a, a_log, dt_bias = (np.asarray(x, np.float64) for x in (u, b, a, a_log, dt_bias))
    t, hv = b.shape
    r = hv // hk
    l2 = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    q = np.repeat(l2(u[:, :hk * dk].reshape(t, hk, dk)) * dk ** -0.5, r, axis=1)
    kk = np.repeat(l2(u[:, hk * dk:2 * hk * dk].reshape(t, hk, dk)), r, axis=1)
    v = u[:, 2 * hk * dk:].reshape(t, hv, dv)
    valid = (np.arange(t) < n_valid)[:, None]
    x = a + dt_bias
    g = np.where(valid, -np.exp(a_log) * np.logaddexp(x, 0.0), 0.0)
    beta = np.where(valid, 1 / (1 + np.exp(-b)), 0.0)
    return q, kk, v, g, beta
