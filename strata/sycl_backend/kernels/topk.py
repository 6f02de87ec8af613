"""topk.cl: top-k over the last axis, ties to the lower index (lax.top_k's order); the router (softmax + top-k) and
the routes' slots."""
from __future__ import annotations

import dpnp
import numpy as np

from strata.sycl_backend.kernels import Kernels, i32, u32

K_MAX = 64
WG = 64          # route's work-group (NORM_WG in norms.cl)


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


def route(k: Kernels, logits, kk: int, renormalize: bool):
    """Router logits [T, E] fp32 -> (weights [T, k] fp32, expert ids [T, k] int32): softmax, top k (ties to the
    lower id), renormalised to sum to 1 when asked."""
    t, n = logits.shape
    assert 1 <= kk <= min(K_MAX, n)
    w = dpnp.empty((t, kk), dtype=dpnp.float32, sycl_queue=k.queue)
    idx = dpnp.empty((t, kk), dtype=dpnp.int32, sycl_queue=k.queue)
    k.launch("route", [logits, w, idx, i32(n), i32(kk), i32(renormalize)], [t * WG], [WG])
    return w, idx


def route_reference(logits, kk, renormalize):
    x = np.asarray(logits, np.float64)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    w, idx = topk_reference(p, kk)
    return (w / w.sum(axis=-1, keepdims=True) if renormalize else w), idx


def expert_slots(k: Kernels, table_row, idx, n_valid: int):
    """idx [T, k] int32 expert ids -> their slots table_row[idx] [T, k] int32, -1 for rows at or past n_valid."""
    t, kk = idx.shape
    out = dpnp.empty((t, kk), dtype=dpnp.int32, sycl_queue=k.queue)
    k.launch("expert_slots", [idx, table_row, out, i32(kk), i32(n_valid), u32(idx.size)], [idx.size])
    return out


def expert_slots_rows(k: Kernels, table_row, idx, rows):
    """A decode window: idx [S, k] -> table_row[idx] [S, k] int32, -1 for the inactive rows (rows int32 [2, S]:
    positions, active)."""
    s, kk = idx.shape
    out = dpnp.empty((s, kk), dtype=dpnp.int32, sycl_queue=k.queue)
    k.launch("expert_slots_rows", [idx, table_row, out, rows, i32(s), i32(kk), u32(idx.size)], [idx.size])
    return out


def expert_slots_reference(table_row, idx, n_valid):
    slots = np.asarray(table_row)[np.asarray(idx)].astype(np.int32)
    slots[n_valid:] = -1
    return slots
