"""Qwen3-Next's multi-token-prediction (MTP) head, the draft model of speculative decoding, written against the
Backend ops like the main layers (equations: ../shared/notes/qwen3-next-reference.md, MTP).

With h_i the main model's final hidden state after its norm and t_{i+1} the next token:
x = fc([pre_fc_norm_embedding(embed(t_{i+1})); pre_fc_norm_hidden(h_i)]), one full-attention decoder layer (its own
KV cache; a sparse MoE block on MoE models) at position i, g = mtp.norm(x); the draft logits lm_head(g) predict
t_{i+2}. The embedding and lm_head are the main model's. A further draft feeds g as the next h (the head's own
normed output), with the draft token as t.
"""
from __future__ import annotations

from strata.model.config import FULL, ModelConfig
from strata.model.forward import embed, layer_back, layer_front, mix_rows


def mtp_hidden(ops, cfg: ModelConfig, params: dict, kv: dict, tokens, hidden, start, n_valid, experts, mix=None):
    """The head's normed output g [T, H] for rows (t_{i+1} = tokens [T], h_i = hidden [T, H]) at positions given
    by start and n_valid as for layer_front (one sequence or one row per sequence, or the verify form's
    [steps, S] through mix) -> (g, kv). experts(h, w, idx) -> y: the head's routed experts."""
    mp, eps = params["mtp"], cfg.rms_norm_eps
    e = ops.rms_norm(embed(params, tokens), mp["pre_fc_norm_embedding"], eps)
    h = ops.rms_norm(hidden, mp["pre_fc_norm_hidden"], eps)
    x = ops.linear(ops.xp.concatenate([e, h.astype(e.dtype)], axis=-1), mp["fc"])
    lp = mp["layer"]
    x, h, w, idx, shared, kv = layer_front(ops, cfg, FULL, lp, kv, x, start, n_valid, mix or mix_rows)
    if h is not None:
        x = layer_back(ops, cfg, lp, x, shared, experts(h, w, idx))
    return ops.rms_norm(x, mp["norm"], eps), kv


def draft_logits(ops, params: dict, g):
    """g [T, H] (mtp_hidden) -> draft logits [T, V] fp32."""
    return ops.linear(g, params["lm_head"]).astype(ops.xp.float32)


def final_hidden(ops, cfg: ModelConfig, params: dict, x):
    """The main model's last layer output x [T, H] -> h after the final norm (what the head reads as h_i)."""
    return ops.rms_norm(x, params["norm"], cfg.rms_norm_eps)
