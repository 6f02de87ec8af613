"""QSA (indexed attention, transformers' qwen4_exp): which cached tokens each query of an indexed-attention layer sees.

A query at position p sees tokens 0..p. Its complete blocks j < (p+1)//r (r the compress ratio) each get a key: the
mean of their r raw index keys, the indexer's k RMSNorm (scale 1 + w), RoPE at j*r. A block's score is
sum over indexer heads of relu(q_h . key_j) / sqrt(head_dim) in fp32; the top min(budget // r, complete blocks) blocks
are kept, ties going to the lower block index, plus the incomplete tail (p+1)//r*r..p. Within the budget this is
the causal mask. `qsa_block_keys` and `qsa_select` take an array namespace `xp` (numpy or jax.numpy; static shapes,
jit-traceable); `qsa_mask_reference` is the per-query numpy loop they are checked against. The mask is combined
with the layer's causal mask by AND.
"""
from __future__ import annotations

import math

import numpy as np


def _rms_norm(xp, x, scale, eps):
    """RMSNorm as the indexer's norms compute it: fp32 inside, times scale (1 + w, as params.py loads it), cast back
    to x's dtype."""
    x32 = x.astype(xp.float32)
    y = x32 / xp.sqrt(xp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(xp.float32)).astype(x.dtype)


def qsa_block_keys(xp, keys, k_scale, eps, ratio, rope_fn):
    """The block keys [Cap // ratio, di] of a raw index-key cache `keys` [Cap, di]; rows past the last complete
    block are ignored. `k_scale` [di] is the k norm's scale 1 + w; `rope_fn(x [n, 1, di], positions [n] int32)` rotates
    the first rotary_dim features of x. A block holding keys past a query's position is never chosen for it
    (`qsa_select`), so whatever those rows hold does not matter."""
    n_blocks = keys.shape[0] // ratio
    blocks = keys[:n_blocks * ratio].reshape(n_blocks, ratio, keys.shape[-1])
    # the mean is taken in fp32 and rounded back to the cache's dtype before the norm, as the reference does
    pooled = xp.mean(blocks.astype(xp.float32), axis=1).astype(keys.dtype)
    normed = _rms_norm(xp, pooled, k_scale, eps)
    starts = xp.arange(n_blocks, dtype=xp.int32) * ratio
    return rope_fn(normed[:, None, :], starts)[:, 0, :]


def qsa_select(xp, q, block_keys, q_pos, ratio, budget, cap):
    """The selection mask [T, cap] bool of queries q [T, Hi, di] (after the q norm and RoPE) at positions q_pos [T]
    int32 against `block_keys` [cap // ratio, di] (`qsa_block_keys` of a cache of cap rows; q_pos < cap).

    Ties in score go to the lower block index (as jax.lax.top_k and a stable argsort order them; torch.topk, which
    the reference uses, does not promise an order). Method: blocks a query cannot use score -inf, one sort per row
    finds the k-th largest score (k = min(budget // ratio, cap // ratio), static), and the blocks above it plus the
    first of those equal to it, by index, make up k. Cost: O(T * n log n) time and O(T * n) memory for n blocks."""
    n_blocks = block_keys.shape[0]
    if n_blocks != cap // ratio:
        raise ValueError(f"block_keys has {n_blocks} rows, expected cap // ratio = {cap // ratio}")
    t = q.shape[0]
    q_pos = q_pos.astype(xp.int32)
    n_complete = (q_pos + 1) // ratio                                           # [T]
    k = min(budget // ratio, n_blocks)
    if k > 0:
        q32, b32 = q.astype(xp.float32), block_keys.astype(xp.float32)
        dots = xp.einsum("thd,nd->thn", q32, b32)
        scores = xp.sum(xp.maximum(dots, 0.0), axis=1) / math.sqrt(q.shape[-1])  # [T, n]
        complete = xp.arange(n_blocks, dtype=xp.int32)[None, :] < n_complete[:, None]
        # where, not arithmetic: blocks past p may hold garbage keys (NaN included) and must not leak into the sort
        masked = xp.where(complete, scores, -xp.inf)
        kth = xp.sort(masked, axis=-1)[:, n_blocks - k][:, None]
        above = masked > kth
        at = masked == kth
        room = k - xp.sum(above, axis=-1, keepdims=True)
        chosen = (above | (at & (xp.cumsum(at, axis=-1) <= room))) & complete
        per_token = xp.repeat(chosen, ratio, axis=1)                            # [T, n * ratio]
        per_token = xp.concatenate([per_token, xp.zeros((t, cap - n_blocks * ratio), dtype=bool)], axis=1)
    else:
        per_token = xp.zeros((t, cap), dtype=bool)
    c = xp.arange(cap, dtype=xp.int32)[None, :]
    tail = c >= (n_complete * ratio)[:, None]
    return (per_token | tail) & (c <= q_pos[:, None])


def qsa_mask_reference(q, keys, k_scale, eps, q_pos, ratio, budget, rope_fn_np):
    """The selection mask [T, Cap] bool, one query at a time in numpy: pool, norm and rotate that query's complete
    blocks, score them, keep the best min(budget // ratio, blocks) (ties: lower index), add the tail."""
    q, keys = np.asarray(q), np.asarray(keys)
    cap, di = keys.shape
    mask = np.zeros((q.shape[0], cap), dtype=bool)
    for row, p in enumerate(np.asarray(q_pos).tolist()):
        n = (p + 1) // ratio
        scores = []
        for j in range(n):
            pooled = keys[j * ratio:(j + 1) * ratio].astype(np.float32).mean(axis=0).astype(keys.dtype)
            x = pooled.astype(np.float32)
            x = x / np.sqrt(np.mean(x * x) + eps) * np.asarray(k_scale, np.float32)
            key = rope_fn_np(x.astype(keys.dtype)[None, None, :], np.array([j * ratio], np.int32))[0, 0]
            dots = q[row].astype(np.float32) @ key.astype(np.float32)
            scores.append(float(np.maximum(dots, 0.0).sum() / math.sqrt(di)))
        best = sorted(range(n), key=lambda j: (-scores[j], j))[:min(budget // ratio, n)]
        for j in best:
            mask[row, j * ratio:(j + 1) * ratio] = True
        mask[row, n * ratio:p + 1] = True
    return mask
