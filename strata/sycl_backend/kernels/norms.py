"""norms.cl: RMSNorm and softmax over the last axis (one work-group per row)."""
from __future__ import annotations

import dpnp
import numpy as np

from strata.sycl_backend.kernels import Kernels, f32, i32

WG = 64


def rms_norm(k: Kernels, x, scale, eps: float, out=None):
    d = x.shape[-1]
    rows = x.size // d if d else 0
    out = dpnp.empty(x.shape, dtype=dpnp.float32, sycl_queue=k.queue) if out is None else out
    k.launch("rms_norm", [x, scale, out, i32(d), f32(eps)], [rows * WG], [WG])
    return out


def rms_norm_reference(x, scale, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def softmax(k: Kernels, x, out=None):
    n = x.shape[-1]
    rows = x.size // n if n else 0
    out = dpnp.empty(x.shape, dtype=dpnp.float32, sycl_queue=k.queue) if out is None else out
    k.launch("softmax_rows", [x, out, i32(n)], [rows * WG], [WG])
    return out


def softmax_reference(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def gated_rms_norm(k: Kernels, x, z, scale, eps: float):
    """rms_norm(x) * scale * silu(z) over the last axis: x, z [..., d] fp32; scale [d]."""
    d = x.shape[-1]
    rows = x.size // d if d else 0
    out = dpnp.empty(x.shape, dtype=dpnp.float32, sycl_queue=k.queue)
    k.launch("gated_rms_norm", [x, z, scale, out, i32(d), f32(eps)], [rows * WG], [WG])
    return out


def gated_rms_norm_reference(x, z, scale, eps):
    z = np.asarray(z, np.float64)
    return rms_norm_reference(x, scale, eps) * (z / (1 + np.exp(-z)))
