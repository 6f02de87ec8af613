"""topk.cl: top-k over the last axis, ties to the lower index (lax.top_k's order)."""
from __future__ import annotations

import dpnp
import numpy as np

from strata.sycl_backend.kernels import Kernels, i32, u32

K_MAX = 64


def topk(k: Kernels, x, kk: int, out_vals=None, out_idx=None):
    n = x.shape[-1]
    assert 1 <= kk <= min(K_MAX, n)
    lead = x.shape[:-1]
    rows = x.size // n
    vals = dpnp.empty(lead + (kk,), dtype=dpnp.float32, sycl_queue=k.queue) if out_vals is None else out_vals
    idx = dpnp.empty(lead + (kk,), dtype=dpnp.int32, sycl_queue=k.queue) if out_idx is None else out_idx
    k.launch("topk", [x, vals, idx, i32(n), i32(kk), u32(rows)], [rows])
    return vals, idx


def topk_reference(x, kk):
    x = np.asarray(x)
    idx = np.argsort(-x, axis=-1, kind="stable")[..., :kk]
    return np.take_along_axis(x, idx, axis=-1), idx.astype(np.int32)
