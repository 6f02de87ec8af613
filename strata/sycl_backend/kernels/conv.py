"""conv.cl: the Gated DeltaNet's causal depthwise conv with SiLU, and its conv state (updated in place)."""
from __future__ import annotations

import dpnp
import numpy as np

from strata.sycl_backend.kernels import Kernels, i32


def causal_conv(k: Kernels, u, state, w, n_valid: int, out=None, reset: bool = False):
    """-> (y [T, C], state): `state` [K-1, C] fp32 is updated IN PLACE to the state after row n_valid - 1; with
    reset the old state is taken as zeros (a sequence starting at 0)."""
    t, c = u.shape
    kw = w.shape[1]
    out = dpnp.empty((t, c), dtype=dpnp.float32, sycl_queue=k.queue) if out is None else out
    k.launch("causal_conv", [u, state, w, out, i32(t), i32(c), i32(kw), i32(n_valid), i32(reset)], [c])
    return out, state


def causal_conv_rows(k: Kernels, u, state, w, rows):
    """A decode window: u [S, C] one token of each of S sequences, state [S, K-1, C] fp32 updated IN PLACE, rows int32
    [2, S] (positions, active: a row at position 0 starts from zeros, an inactive one keeps its state) -> y [S, C]."""
    s, c = u.shape
    out = dpnp.empty((s, c), dtype=dpnp.float32, sycl_queue=k.queue)
    k.launch("causal_conv_rows", [u, state, w, out, rows, i32(s), i32(c), i32(w.shape[1])], [s * c])
    return out, state


def causal_conv_reference(u, state, w, n_valid):
    u, state, w = (np.asarray(a, np.float64) for a in (u, state, w))
    t, kw = u.shape[0], w.shape[1]
    ext = np.concatenate([state, u], axis=0)
    y = sum(ext[j:j + t] * w[:, j] for j in range(kw))
    return y / (1 + np.exp(-y)), ext[n_valid:n_valid + kw - 1]
