"""rope.cl: NeoX rotate-half rotary embedding on the first rotary_dim features of each head."""
from __future__ import annotations

import dpnp
import numpy as np

from strata.sycl_backend.kernels import Kernels, i32, u32


def rope(k: Kernels, x, positions, freqs, rotary_dim: int, out=None):
    """freqs: Rope.table() on the device."""
    t, heads, hd = x.shape
    out = dpnp.empty(x.shape, dtype=dpnp.float32, sycl_queue=k.queue) if out is None else out
    k.launch("rope", [x, positions, freqs, out, i32(heads), i32(hd), i32(rotary_dim), u32(x.size)], [x.size])
    return out


def rope_reference(x, positions, rope):
    """rope: strata/backend.py's Rope (inverse frequencies, factor on cos and sin)."""
    x = np.asarray(x, np.float64)
    # the angles in fp32, as the JAX backend forms them (at positions in the thousands their rounding is the
    # dominant error, and it is the op's definition); cos and sin in float64
    f = (np.asarray(positions).astype(np.float32)[:, None] *
         np.array(rope.inv_freq, np.float32)[None, :]).astype(np.float64)
    emb = np.concatenate([f, f], axis=-1)[:, None, :]
    rotary_dim = rope.rotary_dim
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = np.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return np.concatenate([(rot * np.cos(emb) + rotated * np.sin(emb)) * rope.scale, rest], axis=-1)
