"""Sampling with per-row logit processing on the device: penalties, logit bias, grammar masks, and logprobs.

shape_logits applies, in order: the repetition penalty (tokens of the prompt or generated: a positive logit divided by
it, a negative one multiplied), the frequency and presence penalties (generated tokens: minus f * count, minus p once
seen), the logit bias (added), the grammar mask (a disallowed token's logit to -inf). Neutral settings (0, 0, 1, no
bias, every token allowed) leave each logit bit for bit as it was, so such a row samples what the plain sampler does.
Logprobs are the log-softmax of the raw logits (the model's distribution). Written against ops.xp arithmetic and the
Backend's topk and sample; the numpy references below are what the tests hold it to.
"""
from __future__ import annotations

import numpy as np

from strata.plan import TOP_LOGPROBS


def unpack_mask(xp, mask, vocab: int):
    """mask int32 [B, W] (bit t % 32 of word t // 32) -> bool [B, vocab]: token t allowed."""
    shifts = xp.arange(32, dtype=xp.int32)
    bits = (mask[:, :, None] >> shifts[None, None, :]) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab] > 0


def shape_logits(xp, logits, penalties, counts, seen, bias, allowed):
    """logits float32 [B, V]; penalties [B, 3] (presence, frequency, repetition); counts int32 [B, V] (generated);
    seen int32 [B, V] (1: in the prompt); bias float32 [B, V]; allowed bool [B, V] -> the logits sampled from."""
    presence, frequency, repetition = penalties[:, 0:1], penalties[:, 1:2], penalties[:, 2:3]
    generated = counts > 0
    repeated = generated | (seen > 0)
    x = xp.where(repeated, xp.where(logits > 0, logits / repetition, logits * repetition), logits)
    x = x - frequency * counts.astype(xp.float32) - presence * generated.astype(xp.float32)
    return xp.where(allowed, x + bias, -xp.inf)


def token_logprobs(ops, logits, tokens, k: int = TOP_LOGPROBS):
    """Raw logits [B, V], tokens [B] -> (log-probability of each row's token [B], the k most likely tokens [B, k]
    int32 and their log-probabilities [B, k])."""
    xp = ops.xp
    x = logits.astype(xp.float32)
    m = xp.max(x, axis=-1, keepdims=True)
    lp = x - (m + xp.log(xp.sum(xp.exp(x - m), axis=-1, keepdims=True)))
    sampled = xp.take_along_axis(lp, tokens[:, None].astype(xp.int32), axis=-1)[:, 0]
    top, ids = ops.topk(lp, min(k, x.shape[-1]))
    return sampled, ids.astype(xp.int32), top


def sample_shaped(ops, logits, active, temperature, top_k, top_p, min_p, seeds, steps, penalties, counts, seen, bias,
                  mask, reset, greedy: bool = False):
    """One sampling step of S rows with their logit processing. logits [S, V] (or [1, V]: one row's logits for every
    row, a prompt part's last row and its copies); active int32 [S]: the rows that take their token (its count);
    reset int32 [S]: rows whose counts start from zero (a new request). -> (next int32 [S], finite bool [S] (the raw
    logits'), counts [S, V] after this step, (logprob of next [S], top ids [S, K], top logprobs [S, K]))."""
    xp = ops.xp
    s, vocab = counts.shape
    raw = logits.astype(xp.float32)
    if raw.shape[0] != s:
        raw = xp.broadcast_to(raw, (s, vocab))
    counts = xp.where(reset[:, None] > 0, 0, counts)
    x = shape_logits(xp, raw, penalties, counts, seen, bias, unpack_mask(xp, mask, vocab))
    nxt = ops.sample(x, temperature, top_k, top_p, min_p, ops.prng_keys(seeds, steps), all_greedy=greedy)
    nxt = nxt.astype(xp.int32)
    hit = (xp.arange(vocab, dtype=xp.int32)[None, :] == nxt[:, None]) & (active[:, None] > 0)
    counts = counts + hit.astype(xp.int32)
    return nxt, xp.all(xp.isfinite(raw), axis=-1), counts, token_logprobs(ops, raw, nxt)


# --- host helpers and numpy references

def mask_words(vocab: int) -> int:
    """int32 words of one row's token mask."""
    return (vocab + 31) // 32


def pack_mask(allowed: np.ndarray) -> np.ndarray:
    """bool [B, V] -> int32 [B, W], the device's mask layout."""
    b, v = allowed.shape
    padded = np.zeros((b, mask_words(v) * 32), bool)
    padded[:, :v] = allowed
    return np.packbits(padded, axis=-1, bitorder="little").view(np.int32)


def dense_bias(ids: np.ndarray, values: np.ndarray, vocab: int) -> np.ndarray:
    """One row's logit bias entries (id -1: padding) -> float32 [vocab]."""
    row = np.zeros(vocab, np.float32)
    keep = ids >= 0
    row[ids[keep]] = values[keep]
    return row


def shape_logits_reference(logits, penalties, counts, seen, bias, allowed) -> np.ndarray:
    """shape_logits token by token in float64, as the definitions read."""
    out = np.array(logits, np.float64)
    for r in range(out.shape[0]):
        presence, frequency, repetition = (float(v) for v in penalties[r])
        for t in range(out.shape[1]):
            x = out[r, t]
            if counts[r, t] > 0 or seen[r, t]:
                x = x / repetition if x > 0 else x * repetition
            x -= frequency * counts[r, t] + (presence if counts[r, t] > 0 else 0.0)
            out[r, t] = x + bias[r, t] if allowed[r, t] else -np.inf
    return out


def logprobs_reference(logits: np.ndarray) -> np.ndarray:
    """log-softmax over the last axis, in float64."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
