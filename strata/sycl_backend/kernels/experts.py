"""experts.cl: the expert op's gathered (decode) form, for fp32 and bfloat16-stored (uint16) weights:
two launches, one for silu(gate x) * up x of every route, one for down and the weighted sum over the routes."""
from __future__ import annotations

import dpnp

from strata.reference import experts as experts_reference  # noqa: F401 - the kernel's reference
from strata.sycl_backend.kernels import Kernels, i32, u32


def experts_gathered(k: Kernels, x, idx, weight, gate, up, down, fmt: str, out=None, act=None):
    """x [T, H] fp32; idx [T, kk] int32; weight [T, kk] fp32; gate, up [E, I, H], down [E, H, I] stored as `fmt`
    ("f32": fp32, "bf16": uint16 bits)."""
    t, kk = idx.shape
    h = x.shape[1]
    i = gate.shape[1]
    routes = t * kk
    act = dpnp.empty((routes, i), dtype=dpnp.float32, sycl_queue=k.queue) if act is None else act
    out = dpnp.empty((t, h), dtype=dpnp.float32, sycl_queue=k.queue) if out is None else out
    k.launch(f"experts_act_{fmt}", [x, idx, gate, up, act, i32(kk), i32(h), i32(i), u32(routes)], [routes * i])
    k.launch(f"experts_down_{fmt}", [act, idx, weight, down, out, i32(kk), i32(h), i32(i), u32(t)], [t * h])
    return out
