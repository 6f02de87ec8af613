"""pointwise.cl: SiLU, sigmoid, softplus (fp32) and the bfloat16 -> fp32 widening of uint16-stored weights."""
from __future__ import annotations

import dpnp
import numpy as np

from strata.sycl_backend.kernels import Kernels, u32

UNARY = ("silu", "sigmoid", "softplus")


def unary(k: Kernels, name: str, x, out=None):
    assert name in UNARY
    out = dpnp.empty(x.shape, dtype=dpnp.float32, sycl_queue=k.queue) if out is None else out
    k.launch(name, [x, out, u32(x.size)], [x.size])
    return out


def unary_reference(name: str, x):
    x = np.asarray(x, np.float64)
    sig = 1.0 / (1.0 + np.exp(-x))
    return {"silu": x * sig, "sigmoid": sig, "softplus": np.logaddexp(x, 0.0)}[name]


def widen_bf16(k: Kernels, bits, out=None):
    out = dpnp.empty(bits.shape, dtype=dpnp.float32, sycl_queue=k.queue) if out is None else out
    k.launch("widen_bf16", [bits, out, u32(bits.size)], [bits.size])
    return out


def widen_bf16_reference(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)
