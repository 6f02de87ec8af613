"""linear.cl: y = x w^T for a few rows (decode), fp32 or bfloat16-stored (uint16) weights, one work-group per
output element. Larger row counts use dpnp.matmul (oneMKL)."""
from __future__ import annotations

import dpnp
import numpy as np

from strata.sycl_backend.kernels import Kernels, f32, i32

WG = 64


def linear(k: Kernels, x, w, fmt: str, out=None):
    """x [T, n] fp32; w [O, n] stored as fmt ("f32" | "bf16") -> [T, O] fp32."""
    t, n = x.shape
    o = w.shape[0]
    out = dpnp.empty((t, o), dtype=dpnp.float32, sycl_queue=k.queue) if out is None else out
    k.launch(f"linear_{fmt}", [x, w, out, i32(n), i32(o)], [t * o * WG], [WG])
    return out


def linear_reference(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


MAX_WEIGHTS = 4


def linears(k: Kernels, x, ws, fmt: str, norm=None, residual=None, h=None):
    """Up to MAX_WEIGHTS projections of x [T, n] fp32 in one launch -> (h, [x' w_j^T]): x' = x, or
    rms_norm(x) * scale for norm = (scale [n] fp32, eps) (then h [T, n] holds x'; else h is None); residual [T, O]
    (one weight) is added to the output. ws stored as fmt ("f32" | "bf16")."""
    t, n = x.shape
    assert 1 <= len(ws) <= MAX_WEIGHTS and (residual is None or len(ws) == 1)
    q = k.queue
    outs = [dpnp.empty((t, w.shape[0]), dtype=dpnp.float32, sycl_queue=q) for w in ws]
    if norm is not None and h is None:
        h = dpnp.empty((t, n), dtype=dpnp.float32, sycl_queue=q)
    pad = MAX_WEIGHTS - len(ws)
    sizes = [w.shape[0] for w in ws] + [0] * pad
    scale, eps = norm if norm is not None else (x, 0.0)
    k.launch(f"linears_{fmt}", [x, scale, h if h is not None else x, *ws, *[ws[0]] * pad, *outs, *[outs[0]] * pad,
                                residual if residual is not None else x, i32(n), *[i32(o) for o in sizes],
                                i32(norm is not None), f32(eps), i32(residual is not None)],
             [t * sum(sizes) * WG], [WG])
    return h, outs


def swiglu_down(k: Kernels, g, u, w, fmt: str, residual, add=None, gate=None):
    """residual + (add + sigmoid(gate) * (silu(g) * u) w^T), add and gate optional: g, u [T, n]; w [O, n] stored as
    fmt; gate [T] (one per row); add, residual [T, O] fp32."""
    t, n = g.shape
    o = w.shape[0]
    out = dpnp.empty((t, o), dtype=dpnp.float32, sycl_queue=k.queue)
    k.launch(f"swiglu_down_{fmt}", [g, u, w, gate if gate is not None else g, add if add is not None else residual,
                                    residual, out, i32(n), i32(o), i32(gate is not None), i32(add is not None)],
             [t * o * WG], [WG])
    return out


def swiglu_down_reference(g, u, w, residual, add=None, gate=None):
    g, u, w, residual = (np.asarray(a, np.float64) for a in (g, u, w, residual))
    y = (g / (1 + np.exp(-g)) * u) @ w.T
    if gate is not None:
        y = y / (1 + np.exp(-np.asarray(gate, np.float64).reshape(-1, 1)))
    if add is not None:
        y = np.asarray(add, np.float64) + y
    return residual + y
