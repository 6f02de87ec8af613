"""attention.cl: causal GQA attention over the KV cache (online softmax, one work-item per query row and head)."""
from __future__ import annotations

import dpnp
import numpy as np

from strata.sycl_backend.kernels import Kernels, f32, i32, u32

HD_MAX = 512


def attention(k: Kernels, q, k_cache, v_cache, q_pos, scale: float, out=None):
    t, hq, hd = q.shape
    cap, hkv, _ = k_cache.shape
    assert hd <= HD_MAX and hq % hkv == 0
    out = dpnp.empty(q.shape, dtype=dpnp.float32, sycl_queue=k.queue) if out is None else out
    k.launch("attention", [q, k_cache, v_cache, q_pos, out, i32(hq), i32(hkv), i32(hd), i32(cap), f32(scale),
                           u32(t * hq)], [t * hq])
    return out


def attention_reference(q, k_cache, v_cache, q_pos, scale):
    q, kc, vc = (np.asarray(a, np.float64) for a in (q, k_cache, v_cache))
    t, hq, hd = q.shape
    cap, hkv, _ = kc.shape
    r = hq // hkv
    out = np.zeros_like(q)
    for i in range(t):
        n = min(int(q_pos[i]), cap - 1) + 1
        for h in range(hq):
            s = kc[:n, h // r] @ q[i, h] * scale
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ vc[:n, h // r]
    return out
