"""sample.cl: the sampling draw (filters + Gumbel-max with a counter-based hash of (row key, token id)).

Keys: a row's key is a 64-bit hash of (seed, step) (`prng_keys_reference`, computed on the host: it is a few
integer operations per row); the per-token uniforms are hashed on the device from (key, token id), so a seeded
request draws the same tokens whatever batch it is in. It does not reproduce JAX's random bits.
"""
from __future__ import annotations

import dpnp
import numpy as np

from strata.sycl_backend.kernels import Kernels, i32, u32

M64 = (1 << 64) - 1


def _mix64(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def prng_keys_reference(seeds, steps) -> np.ndarray:
    """seeds uint32 [B, 2] (low, high words), steps [B] -> keys uint32 [B, 2] (low, high words)."""
    seeds = np.asarray(seeds, np.uint64).reshape(-1, 2)
    steps = np.asarray(steps).astype(np.int64).astype(np.uint64).reshape(-1)
    with np.errstate(over="ignore"):
        s = seeds[:, 0] | (seeds[:, 1] << np.uint64(32))
        key = _mix64(_mix64(s ^ np.uint64(0x5EED5EED5EED5EED)) + steps * np.uint64(0x9E3779B97F4A7C15))
    return np.stack([(key & np.uint64(0xFFFFFFFF)).astype(np.uint32), (key >> np.uint64(32)).astype(np.uint32)],
                    axis=-1)


def uniform_reference(keys, tokens) -> np.ndarray:
    keys = np.asarray(keys, np.uint64)
    key = keys[..., 0] | (keys[..., 1] << np.uint64(32))
    with np.errstate(over="ignore"):
        h = _mix64(key[..., None] + np.uint64(0x9E3779B97F4A7C15) * (np.asarray(tokens, np.uint64) + np.uint64(1)))
    return ((h >> np.uint64(40)).astype(np.float64) + 0.5) / 16777216.0


def sample_pick(k: Kernels, scaled, probs, cum, order, greedy, temperature, top_k, top_p, min_p, keys, out=None):
    b, v = scaled.shape
    out = dpnp.empty((b,), dtype=dpnp.int32, sycl_queue=k.queue) if out is None else out
    k.launch("sample_pick", [scaled, probs, cum, order, greedy, temperature, top_k, top_p, min_p, keys, out,
                             i32(v), u32(b)], [b])
    return out


def sample_pick_reference(scaled, probs, cum, order, greedy, temperature, top_k, top_p, min_p, keys):
    b, v = scaled.shape
    out = np.zeros(b, np.int32)
    rank = np.arange(v)
    for r in range(b):
        if not temperature[r] > 0:
            out[r] = greedy[r]
            continue
        p = probs[r]
        keep = ((top_k[r] <= 0) | (rank < top_k[r])) & (cum[r] - p < top_p[r]) & (p >= np.float32(min_p[r]) * p[0])
        keep[0] = True
        u = uniform_reference(keys[r], order[r]).astype(np.float32)
        val = np.where(keep, scaled[r] - np.log(-np.log(u)), -np.inf)
        out[r] = order[r][int(np.argmax(val))]
    return out
