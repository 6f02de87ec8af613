"""Plain numpy (float64) references for the model's device math, shared by every backend's tests and kernels."""
from __future__ import annotations

import numpy as np


def experts(x, idx, weight, gate, up, down):
    """y[t] = sum_j weight[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = idx[t, j].
    x [T, H]; idx, weight [T, k]; gate, up [E, I, H]; down [E, H, I]."""
    x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            g, u = gate[e] @ x[t], up[e] @ x[t]
            y[t] += weight[t, j] * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return y


def gated_delta(q, k, v, g, beta, state):
    """The gated delta rule, one token at a time. q, k [T, Hv, dk]; v [T, Hv, dv]; g, beta [T, Hv];
    state [Hv, dk, dv]. -> (o [T, Hv, dv], final state)."""
    S = np.asarray(state, np.float64).copy()
    out = np.zeros(v.shape)
    for t in range(q.shape[0]):
        S *= np.exp(g[t])[:, None, None]
        kv = np.einsum("hde,hd->he", S, k[t])
        S += k[t][:, :, None] * ((v[t] - kv) * beta[t][:, None])[:, None, :]
        out[t] = np.einsum("hde,hd->he", S, q[t])
    return out, S


def quantize_kv(x):
    """The int8 KV format: each row of the last axis (one token's key or value of one KV head, [..., hd]) stored as
    q int8 [..., hd] with one float32 scale [...] = amax / 127 of the row; q = round-half-even(x / scale), clipped
    to +-127 (a zero row: scale 0, q 0). Computed in float32, as every backend computes it."""
    x = np.asarray(x, np.float32)
    scale = (np.abs(x).max(axis=-1) / np.float32(127.0)).astype(np.float32)
    div = np.where(scale > 0, scale, np.float32(1.0))[..., None]
    q = np.clip(np.rint(x / div), -127, 127).astype(np.int8)
    return q, scale


def dequantize_kv(q, scale):
    """int8 KV rows back to float32: q * scale (per row)."""
    return np.asarray(q, np.float32) * np.asarray(scale, np.float32)[..., None]
