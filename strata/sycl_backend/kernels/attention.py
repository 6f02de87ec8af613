"""attention.cl: causal GQA attention over the KV cache (online softmax, one work-item per query row and head), and
the fused forms attention_block uses (its inputs in one launch; positions from start, an output gate)."""
from __future__ import annotations

import dpnp
import numpy as np

from strata.sycl_backend.kernels import Kernels, f32, i32, u32

HD_MAX = 512
WG = 64          # attention_inputs' work-group (NORM_WG in norms.cl)


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


def attention_inputs(k: Kernels, q, kk, v, q_norm, k_norm, freqs, k_cache, v_cache, rotary_dim: int, eps: float,
                     start: int, s0: int):
    """q [T, hq*hd], kk, v [T, hkv*hd] projections -> q [T, hq, hd] normed and rotated; k (normed, rotated) and v
    written IN PLACE into the caches [cap, hkv, hd] at rows s0.. (positions start..)."""
    cap, hkv, hd = k_cache.shape
    t = q.shape[0]
    hq = q.shape[1] // hd
    assert hd <= HD_MAX and hq % hkv == 0
    out = dpnp.empty((t, hq, hd), dtype=dpnp.float32, sycl_queue=k.queue)
    k.launch("attention_inputs", [q, kk, v, q_norm, k_norm, freqs, out, k_cache, v_cache, i32(hq), i32(hkv), i32(hd),
                                  i32(rotary_dim), f32(eps), i32(start), i32(s0)], [t * (hq + 2 * hkv) * WG], [WG])
    return out


def attention_gated(k: Kernels, q, k_cache, v_cache, gate, start: int, n_valid: int, scale: float):
    """attention() with the rows' positions start + t (rows at or past n_valid: 0), the output times sigmoid(gate)
    [T, hq * hd] when a gate is given. -> [T, hq, hd]."""
    t, hq, hd = q.shape
    cap, hkv, _ = k_cache.shape
    out = dpnp.empty(q.shape, dtype=dpnp.float32, sycl_queue=k.queue)
    k.launch("attention_gated", [q, k_cache, v_cache, gate if gate is not None else q, out, i32(hq), i32(hkv),
                                 i32(hd), i32(cap), f32(scale), i32(start), i32(n_valid), i32(gate is not None),
                                 u32(t * hq)], [t * hq])
    return out


def attention_inputs_rows(k: Kernels, q, kk, v, q_norm, k_norm, freqs, k_cache, v_cache, rows, rotary_dim: int,
                          eps: float):
    """A decode window: attention_inputs for one token of each of S sequences, at positions rows[0] (int32 [2, S]:
    positions, active), each written into its own caches [S, cap, hkv, hd] IN PLACE at its position clamped to the
    capacity. q [S, hq*hd], kk, v [S, hkv*hd] -> q [S, hq, hd] normed and rotated."""
    _, cap, hkv, hd = k_cache.shape
    s = q.shape[0]
    hq = q.shape[1] // hd
    assert hd <= HD_MAX and hq % hkv == 0
    out = dpnp.empty((s, hq, hd), dtype=dpnp.float32, sycl_queue=k.queue)
    k.launch("attention_inputs_rows", [q, kk, v, q_norm, k_norm, freqs, out, k_cache, v_cache, rows, i32(hq),
                                       i32(hkv), i32(hd), i32(rotary_dim), f32(eps), i32(cap)],
             [s * (hq + 2 * hkv) * WG], [WG])
    return out


def attention_gated_rows(k: Kernels, q, k_cache, v_cache, gate, rows, scale: float):
    """A decode window: row s of q [S, hq, hd] attends to keys 0..rows[0, s] of its own caches [S, cap, hkv, hd]
    (an inactive row, rows[1, s] == 0, to key 0 only), times sigmoid(gate) [S, hq * hd] when given -> [S, hq, hd]."""
    s, hq, hd = q.shape
    _, cap, hkv, _ = k_cache.shape
    out = dpnp.empty(q.shape, dtype=dpnp.float32, sycl_queue=k.queue)
    k.launch("attention_gated_rows", [q, k_cache, v_cache, gate if gate is not None else q, out, rows, i32(s),
                                      i32(hq), i32(hkv), i32(hd), i32(cap), f32(scale), i32(gate is not None),
                                      u32(s * hq)], [s * hq])
    return out
