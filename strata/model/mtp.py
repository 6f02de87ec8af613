"""The multi-token-prediction (MTP) head, the draft model of speculative decoding, written against the Backend ops
like the main layers (equations: ../shared/notes/qwen3-next-reference.md, MTP; qwen4_exp's: docs/qwen4-exp.md).

Qwen3-Next: with h_i the main model's final hidden state after its norm and t_{i+1} the next token,
x = fc([pre_fc_norm_embedding(embed(t_{i+1})); pre_fc_norm_hidden(h_i)]), one full-attention decoder layer (its own
KV cache; a sparse MoE block on MoE models) at position i, g = mtp.norm(x); lm_head(g) predicts t_{i+2}.
qwen4_exp: h_i is the main model's streams before its final mixer, normed as one row; each stream is
fc_hidden(stream) + fc_embedding(pre_fc_norm_embedding(embed(t_{i+1}))); one QSA layer with its two hyper-connections;
g is the layer's streams and the logits are lm_head(the head's own mixer(g)). A further draft feeds g as the next h.
"""
from __future__ import annotations

from strata.model.config import FULL, ModelConfig
from strata.model.forward import embed, layer_back, layer_front, mix_rows
from strata.model.qwen4_exp import hyper_enter


def mtp_hidden(ops, cfg: ModelConfig, params: dict, kv: dict, tokens, hidden, start, n_valid, experts, mix=None):
    """The head's output g [T, W] for rows (t_{i+1} = tokens [T], h_i = hidden [T, W]; W the residual's width) at
    positions given by start and n_valid as for layer_front (one sequence or one row per sequence, or the verify
    form's [steps, S] through mix) -> (g, kv). experts(h, w, idx) -> y: the head's routed experts."""
    mp, eps, xp = params["mtp"], cfg.rms_norm_eps, ops.xp
    e = ops.rms_norm(embed(params, tokens), mp["pre_fc_norm_embedding"], eps)
    h = ops.rms_norm(hidden, mp["pre_fc_norm_hidden"], eps).astype(e.dtype)
    if cfg.hyper:
        t, n, H = h.shape[0], cfg.hc_count, cfg.hidden_size
        streams = ops.linear(h.reshape(t, n, H), mp["fc_hidden"]) + ops.linear(e, mp["fc_embedding"])[:, None, :]
        x = streams.reshape(t, n * H)
    else:
        x = ops.linear(xp.concatenate([e, h], axis=-1), mp["fc"])
    lp = mp["layer"]
    x, h, w, idx, shared, kv = layer_front(ops, cfg, FULL, lp, kv, x, start, n_valid, mix or mix_rows)
    if h is not None:
        x = layer_back(ops, cfg, lp, x, shared, experts(h, w, idx))
    return (x if cfg.hyper else ops.rms_norm(x, mp["norm"], eps)), kv


def draft_logits(ops, cfg: ModelConfig, params: dict, g):
    """g [T, W] (mtp_hidden) -> draft logits [T, V] fp32."""
    if cfg.hyper:
        g, _ = hyper_enter(ops, cfg, params["mtp"], "hcf_", g)
    return ops.linear(g, params["lm_head"]).astype(ops.xp.float32)


def final_hidden(ops, cfg: ModelConfig, params: dict, x):
    """The main model's last layer output x [T, W] -> what the head reads as h_i: h after the final norm, or
    qwen4_exp's streams before its final mixer."""
    return x if cfg.hyper else ops.rms_norm(x, params["norm"], cfg.rms_norm_eps)


def hidden_logits(ops, cfg: ModelConfig, params: dict, hn):
    """The main model's logits [T, V] fp32 from final_hidden's rows hn."""
    if cfg.hyper:
        hn, _ = hyper_enter(ops, cfg, params, "hcf_", hn)
    return ops.linear(hn, params["lm_head"]).astype(ops.xp.float32)
