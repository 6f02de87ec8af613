"""linear.cl: y = x w^T for a few rows (decode), fp32 or bfloat16-stored (uint16) weights, one work-group per
output element. Larger row counts use dpnp.matmul (oneMKL)."""
from __future__ import annotations

import dpnp
import numpy as np

from strata.sycl_backend.kernels import Kernels, i32

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
