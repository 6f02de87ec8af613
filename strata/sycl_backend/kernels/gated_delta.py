"""gated_delta.cl: the gated delta rule over T tokens and all heads (one work-item per head and state column)."""
from __future__ import annotations

import dpnp

from strata.model.reference import gated_delta as gated_delta_reference  # noqa: F401 - the kernel's reference
from strata.sycl_backend.kernels import Kernels, i32

DK_MAX = 512


def gated_delta(k: Kernels, q, kk, v, g, beta, state, out=None):
    """-> (o [T, Hv, dv], state). `state` [Hv, dk, dv] fp32 is updated IN PLACE and returned."""
    t, hv, dk = kk.shape
    dv = v.shape[-1]
    assert dk <= DK_MAX
    out = dpnp.empty((t, hv, dv), dtype=dpnp.float32, sycl_queue=k.queue) if out is None else out
    k.launch("gated_delta", [q, kk, v, g, beta, state, out, i32(t), i32(hv), i32(dk), i32(dv)], [hv * dv])
    return out, state
