"""The forward pass of Qwen3-Next (hybrid Gated DeltaNet + gated attention, sparse MoE) and Qwen3-MoE, written once
against the Backend ops (strata/backend.py). See ../shared/notes/qwen3-next-reference.md for the equations.

One call reads one part of one sequence: tokens [T] (padded to a bucket; the first n_valid are real) at positions
start..start+T-1, and returns the logits and the sequence state after the part. Padded rows are harmless by
construction: their keys land beyond the real ones (overwritten before any real query can see them), their delta-rule
gates are zeroed (g = beta = 0 leaves the recurrent state unchanged), and the conv state is taken at n_valid.

State per layer: FULL {"k", "v": [Cap, Hkv, hd]}; LINEAR {"conv": [K-1, C], "ssm": [Hv, dk, dv] fp32}.
"""
from __future__ import annotations

import numpy as np

from strata.model.config import LINEAR, ModelConfig


def init_state(cfg: ModelConfig, capacity: int, dtype) -> list[dict]:
    """Fresh (empty) sequence state, on the host; the engine moves it to the device."""
    state = []
    for kind in cfg.layer_types:
        if kind == LINEAR:
            state.append({
                "conv": np.zeros((cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim), dtype),
                "ssm": np.zeros((cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                                np.float32),
            })
        else:
            shape = (capacity, cfg.num_kv_heads, cfg.head_dim)
            state.append({"k": np.zeros(shape, dtype), "v": np.zeros(shape, dtype)})
    return state


def forward(ops, cfg: ModelConfig, layout, params: dict, experts: dict, state: list, tokens, start, n_valid,
            all_logits: bool):
    """-> (logits [T, V] fp32 if all_logits else [1, V] at row n_valid - 1, new state, routing counts [Lp, E]).

    tokens [T] int32; start, n_valid: int32 scalars (traced: one compilation per bucket T). Every routed expert is
    resident: experts = {"pool": uint8 [N, layout.nbytes], "table": int32 [Lp, E] slot of (MoE layer p, expert)}.
    (With a partial cache the layers run one at a time instead: strata/model/stepped.py.)"""
    t = tokens.shape[0]
    x = embed(params, tokens)                                                     # [T, H]
    valid = ops.valid_mask(t, n_valid)                                            # [T]
    new_state, counts = [], []
    p = 0
    for lp, st, kind in zip(params["layers"], state, cfg.layer_types):
        x, h, w, idx, st = layer_front(ops, cfg, kind, lp, st, x, start, n_valid)
        if h is not None:
            slots = ops.xp.where(valid[:, None], experts["table"][p][idx], -1)     # [T, k]; padded rows: none
            y = ops.experts_pool(h, slots, w.astype(h.dtype), experts["pool"], layout, cfg.num_experts)
            x = layer_back(ops, cfg, lp, x, h, y)
            counts.append(ops.route_counts(idx, valid, cfg.num_experts))
            p += 1
        new_state.append(st)
    counts = ops.xp.stack(counts) if counts else ops.xp.zeros((0, cfg.num_experts), ops.xp.int32)
    return head(ops, cfg, params, x, n_valid, all_logits), new_state, counts


def embed(params: dict, tokens):
    return params["embed"][tokens]


def layer_front(ops, cfg: ModelConfig, kind: str, lp: dict, st: dict, x, start, n_valid):
    """One layer up to its routed experts: the mixer and, for a dense layer, its MLP.
    -> (x, h, w, idx, st): for a sparse layer h [T, H] is the experts' input and (w, idx) [T, k] the routes, and the
    layer ends with layer_back(.., y) once the experts' output y is known; for a dense layer h = w = idx = None."""
    t = x.shape[0]
    positions = start + ops.xp.arange(t)
    valid = ops.valid_mask(t, n_valid)
    h = ops.rms_norm(x, lp["in_norm"], cfg.rms_norm_eps)
    if kind == LINEAR:
        y, st = gated_deltanet(ops, cfg, lp, st, h, start, valid, n_valid)
    else:
        y, st = attention(ops, cfg, lp, st, h, positions, start, valid)
    x = x + y
    h = ops.rms_norm(x, lp["post_norm"], cfg.rms_norm_eps)
    if "router" not in lp:
        return x + _swiglu(ops, h, lp["mlp_gate"], lp["mlp_up"], lp["mlp_down"]), None, None, None, st
    w, idx = route(ops, cfg, lp, h)
    return x, h, w, idx, st


def layer_back(ops, cfg: ModelConfig, lp: dict, x, h, y):
    """The rest of a sparse layer: y (the routed experts' weighted sum) plus the gated shared expert."""
    if "sh_gate" in lp:
        y = y + ops.sigmoid(ops.linear(h, lp["sh_router"])) * _swiglu(ops, h, lp["sh_gate"], lp["sh_up"],
                                                                      lp["sh_down"])
    return x + y


def head(ops, cfg: ModelConfig, params: dict, x, n_valid, all_logits: bool):
    if not all_logits:
        x = ops.take_row(x, n_valid - 1)[None]
    x = ops.rms_norm(x, params["norm"], cfg.rms_norm_eps)
    return ops.linear(x, params["lm_head"]).astype(ops.xp.float32)


def attention(ops, cfg: ModelConfig, lp: dict, st: dict, h, positions, start, valid):
    """Softmax attention with GQA, q/k norms and partial RoPE; Qwen3-Next adds a sigmoid output gate per head."""
    xp = ops.xp
    t = h.shape[0]
    hd = cfg.head_dim
    q = ops.rms_norm(ops.linear(h, lp["q"]).reshape(t, cfg.num_heads, hd), lp["q_norm"], cfg.rms_norm_eps)
    k = ops.rms_norm(ops.linear(h, lp["k"]).reshape(t, cfg.num_kv_heads, hd), lp["k_norm"], cfg.rms_norm_eps)
    v = ops.linear(h, lp["v"]).reshape(t, cfg.num_kv_heads, hd)
    q = ops.rope(q, positions, cfg.rotary_dim, cfg.rope_theta)
    k = ops.rope(k, positions, cfg.rotary_dim, cfg.rope_theta)
    kc = ops.kv_write(st["k"], k, start)
    vc = ops.kv_write(st["v"], v, start)
    # padded rows look at key 0 only (their output is discarded), so the keys visited follow the real rows
    o = ops.attention(q, kc, vc, xp.where(valid, positions, 0), hd ** -0.5).reshape(t, cfg.num_heads * hd)
    if cfg.gated_attention:
        o = o * ops.sigmoid(ops.linear(h, lp["gate"]))
    return ops.linear(o, lp["o"]), {"k": kc, "v": vc}


def gated_deltanet(ops, cfg: ModelConfig, lp: dict, st: dict, h, start, valid, n_valid):
    """Gated DeltaNet: causal conv over [q|k|v], l2-normed q/k shared by r value heads, the gated delta rule,
    a gated RMSNorm with z, out_proj."""
    xp = ops.xp
    t = h.shape[0]
    # a sequence that starts at position 0 starts from an empty state, whatever the slot held before
    st = {name: xp.where(start > 0, st[name], xp.zeros_like(st[name])) for name in ("conv", "ssm")}
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = hv // hk
    qkv, conv_state = ops.causal_conv(ops.linear(h, lp["qkv"]), st["conv"], lp["conv"], n_valid)  # [T, C]
    f32 = xp.float32
    q = qkv[:, :hk * dk].reshape(t, hk, dk).astype(f32)
    k = qkv[:, hk * dk:2 * hk * dk].reshape(t, hk, dk).astype(f32)
    v = qkv[:, 2 * hk * dk:].reshape(t, hv, dv).astype(f32)
    q = _l2norm(xp, q) * (dk ** -0.5)
    k = _l2norm(xp, k)
    if r > 1:  # key head j serves value heads j*r .. j*r + r-1
        q, k = xp.repeat(q, r, axis=1), xp.repeat(k, r, axis=1)
    vmask = valid[:, None]
    beta = xp.where(vmask, ops.sigmoid(ops.linear(h, lp["b"])).astype(f32), 0.0)          # [T, Hv]
    a = ops.linear(h, lp["a"]).astype(f32)
    g = xp.where(vmask, -xp.exp(lp["A_log"]) * ops.softplus(a + lp["dt_bias"]), 0.0)     # [T, Hv], <= 0
    rule = ops.gated_delta_step if t == 1 else ops.gated_delta_chunked
    o, ssm = rule(q, k, v, g, beta, st["ssm"])                                            # [T, Hv, dv]
    z = ops.linear(h, lp["z"]).reshape(t, hv, dv)
    # gated RMSNorm per head: w * x_hat (in the activation dtype), times silu(z) in fp32
    o = ops.rms_norm(o.astype(h.dtype), lp["gnorm"], cfg.rms_norm_eps)
    o = (o.astype(f32) * ops.silu(z.astype(f32))).astype(h.dtype).reshape(t, hv * dv)
    return ops.linear(o, lp["out"]), {"conv": conv_state, "ssm": ssm}


def _l2norm(xp, x):
    return x / xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _swiglu(ops, h, w_gate, w_up, w_down):
    return ops.linear(ops.silu(ops.linear(h, w_gate)) * ops.linear(h, w_up), w_down)


def route(ops, cfg: ModelConfig, lp: dict, h):
    """Router: softmax over all experts in fp32, top-k, optional renormalisation. -> (weights [T, k], ids [T, k]).
    A "router_bias" [E] (no checkpoint has one; benchmarks set it to skew routing) is added to the logits."""
    logits = ops.linear(h, lp["router"])
    if "router_bias" in lp:
        logits = logits.astype(ops.xp.float32) + lp["router_bias"]
    probs = ops.softmax(logits)                                                           # [T, E] fp32
    w, idx = ops.topk(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        w = w / ops.xp.sum(w, axis=-1, keepdims=True)
    return w, idx
