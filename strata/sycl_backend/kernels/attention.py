"""attention.cl: causal GQA attention over the KV cache (online softmax, one work-item per query row and head), and
the fused forms attention_block uses (its inputs in one launch; positions from start, an output gate; the rows mode
of a decode window). Every kernel comes in two KV formats: fp32 caches, and int8 caches with a float32 scale per
token and KV head (`kv` below: {"k", "v"} or {"k", "v", "k_scale", "v_scale"}, as strata/model/forward.py keeps it).
"""
from __future__ import annotations

import dpnp
import numpy as np

from strata.reference import dequantize_kv
from strata.sycl_backend.kernels import Kernels, f32, i32, u32

HD_MAX = 512
WG = 64          # attention_inputs' work-group (NORM_WG in norms.cl)


def _kv_args(kv: dict):
    """-> (kernel suffix, [k, v, k_scale, v_scale]); an fp32 cache passes its own arrays where the scales go (the
    kernel's f32 variant never touches them)."""
    k, v = kv["k"], kv["v"]
    if "k_scale" in kv:
        assert k.dtype == np.int8 and v.dtype == np.int8
        return "i8", [k, v, kv["k_scale"], kv["v_scale"]]
    assert k.dtype == np.float32 and v.dtype == np.float32
    return "f32", [k, v, k, v]


def attention(k: Kernels, q, kv: dict, q_pos, scale: float, out=None):
    """q [T, hq, hd] fp32; kv caches [cap, hkv, hd]; q_pos [T] int64: query t sees keys 0..q_pos[t]."""
    t, hq, hd = q.shape
    cap, hkv, _ = kv["k"].shape
    assert hd <= HD_MAX and hq % hkv == 0
    fmt, caches = _kv_args(kv)
    out = dpnp.empty(q.shape, dtype=dpnp.float32, sycl_queue=k.queue) if out is None else out
    k.launch(f"attention_{fmt}", [q, *caches, q_pos, out, i32(hq), i32(hkv), i32(hd), i32(cap), f32(scale),
                                  u32(t * hq)], [t * hq])
    return out


def attention_reference(q, k_cache, v_cache, q_pos, scale, k_scale=None, v_scale=None):
    if k_scale is not None:
        k_cache, v_cache = dequantize_kv(k_cache, k_scale), dequantize_kv(v_cache, v_scale)
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


def attention_inputs(k: Kernels, q, kk, v, q_norm, k_norm, freqs, kv: dict, rotary_dim: int, eps: float,
                     start: int, s0: int):
    """q [T, hq*hd], kk, v [T, hkv*hd] projections -> q [T, hq, hd] normed and rotated; k (normed, rotated) and v
    written IN PLACE into the caches [cap, hkv, hd] at rows s0.. (positions start..), quantised for int8."""
    cap, hkv, hd = kv["k"].shape
    t = q.shape[0]
    hq = q.shape[1] // hd
    assert hd <= HD_MAX and hq % hkv == 0
    fmt, caches = _kv_args(kv)
    out = dpnp.empty((t, hq, hd), dtype=dpnp.float32, sycl_queue=k.queue)
    k.launch(f"attention_inputs_{fmt}", [q, kk, v, q_norm, k_norm, freqs, out, *caches, i32(hq), i32(hkv), i32(hd),
                                         i32(rotary_dim), f32(eps), i32(start), i32(s0)],
             [t * (hq + 2 * hkv) * WG], [WG])
    return out


def attention_gated(k: Kernels, q, kv: dict, gate, start: int, n_valid: int, scale: float):
    """attention() with the rows' positions start + t (rows at or past n_valid: 0), the output times sigmoid(gate)
    [T, hq * hd] when a gate is given. -> [T, hq, hd]."""
    t, hq, hd = q.shape
    cap, hkv, _ = kv["k"].shape
    fmt, caches = _kv_args(kv)
    out = dpnp.empty(q.shape, dtype=dpnp.float32, sycl_queue=k.queue)
    k.launch(f"attention_gated_{fmt}", [q, *caches, gate if gate is not None else q, out, i32(hq), i32(hkv),
                                        i32(hd), i32(cap), f32(scale), i32(start), i32(n_valid),
                                        i32(gate is not None), u32(t * hq)], [t * hq])
    return out


def attention_inputs_rows(k: Kernels, q, kk, v, q_norm, k_norm, freqs, kv: dict, rows, rotary_dim: int,
                          eps: float):
    """A decode window: attention_inputs for one token of each of S sequences, at positions rows[0] (int32 [2, S]:
    positions, active), each written into its own caches [S, cap, hkv, hd] IN PLACE at its position clamped to the
    capacity. q [S, hq*hd], kk, v [S, hkv*hd] -> q [S, hq, hd] normed and rotated."""
    _, cap, hkv, hd = kv["k"].shape
    s = q.shape[0]
    hq = q.shape[1] // hd
    assert hd <= HD_MAX and hq % hkv == 0
    fmt, caches = _kv_args(kv)
    out = dpnp.empty((s, hq, hd), dtype=dpnp.float32, sycl_queue=k.queue)
    k.launch(f"attention_inputs_rows_{fmt}", [q, kk, v, q_norm, k_norm, freqs, out, *caches, rows, i32(hq),
                                              i32(hkv), i32(hd), i32(rotary_dim), f32(eps), i32(cap)],
             [s * (hq + 2 * hkv) * WG], [WG])
    return out


def attention_gated_rows(k: Kernels, q, kv: dict, gate, rows, scale: float):
    """A decode window: row s of q [S, hq, hd] attends to keys 0..rows[0, s] of its own caches [S, cap, hkv, hd]
    (an inactive row, rows[1, s] == 0, to key 0 only), times sigmoid(gate) [S, hq * hd] when given -> [S, hq, hd]."""
    s, hq, hd = q.shape
    _, cap, hkv, _ = kv["k"].shape
    fmt, caches = _kv_args(kv)
    out = dpnp.empty(q.shape, dtype=dpnp.float32, sycl_queue=k.queue)
    k.launch(f"attention_gated_rows_{fmt}", [q, *caches, gate if gate is not None else q, out, rows, i32(s),
                                             i32(hq), i32(hkv), i32(hd), i32(cap), f32(scale),
                                             i32(gate is not None), u32(s * hq)], [s * hq])
    return out
