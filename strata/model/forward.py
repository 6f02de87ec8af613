"""The forward pass of Qwen3-Next (hybrid Gated DeltaNet + gated attention, sparse MoE) and Qwen3-MoE, written once
against the Backend ops (strata/backend.py; its fused ops are ComposedOps). See ../shared/notes/qwen3-next-reference.md for the equations.

One call reads one part of one sequence: tokens [T] (padded to a bucket; the first n_valid are real) at positions
start..start+T-1, and returns the logits and the sequence state after the part. Padded rows are harmless by
construction: their keys land beyond the real ones (overwritten before any real query can see them), their delta-rule
gates are zeroed (g = beta = 0 leaves the recurrent state unchanged), and the conv state is taken at n_valid.

State per layer: FULL {"k", "v": [Cap, Hkv, hd]} (int8 KV: plus {"k_scale", "v_scale": [Cap, Hkv] fp32});
LINEAR {"conv": [K-1, C], "ssm": [Hv, dk, dv] fp32}.
"""
from __future__ import annotations

import numpy as np

from strata.model.config import LINEAR, ModelConfig
from strata.model.params import is_sparse, projections


def init_state(cfg: ModelConfig, capacity: int, dtype, kv_dtype=None) -> list[dict]:
    """Fresh (empty) sequence state, on the host; the engine moves it to the device. kv_dtype: the attention
    layers' cache (None: dtype; int8: with a float32 scale per token and KV head, see backend.quantize_kv)."""
    kv_dtype = np.dtype(dtype if kv_dtype is None else kv_dtype)
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
            layer = {"k": np.zeros(shape, kv_dtype), "v": np.zeros(shape, kv_dtype)}
            if kv_dtype == np.int8:
                layer.update(k_scale=np.zeros(shape[:2], np.float32), v_scale=np.zeros(shape[:2], np.float32))
            state.append(layer)
    return state


def forward(ops, cfg: ModelConfig, layout, params: dict, experts: dict, state: list, tokens, start, n_valid,
            all_logits: bool, with_counts: bool = False):
    """-> (logits [T, V] fp32 if all_logits else [1, V] at row n_valid - 1, new state, routing counts [Lp, E] if
    with_counts else None).

    tokens [T] int32; start, n_valid: int32 scalars (traced: one compilation per bucket T). Every routed expert is
    resident: experts = {"pool": uint8 [N, layout.nbytes], "table": int32 [Lp, E] slot of (MoE layer p, expert)}.
    (With a partial cache the layers run one at a time instead: strata/model/stepped.py.)"""
    x = embed(params, tokens)                                                     # [T, H]
    new_state, counts = [], []
    p = 0
    for lp, st, kind in zip(params["layers"], state, cfg.layer_types):
        x, h, w, idx, shared, st = layer_front(ops, cfg, kind, lp, st, x, start, n_valid)
        if h is not None:
            with ops.scope("routed_experts"):
                slots = ops.expert_slots(experts["table"][p], idx, n_valid)       # [T, k]; padded rows: -1
                w = w if w.dtype == h.dtype else w.astype(h.dtype)  # (an eager backend copies on a no-op astype)
                y = ops.experts_pool(h, slots, w, experts["pool"], layout, cfg.num_experts)
            x = layer_back(ops, cfg, lp, x, shared, y)
            if with_counts:
                counts.append(ops.route_counts(idx, ops.valid_mask(tokens.shape[0], n_valid), cfg.num_experts))
            p += 1
        new_state.append(st)
    if with_counts:
        counts = ops.xp.stack(counts) if counts else ops.xp.zeros((0, cfg.num_experts), ops.xp.int32)
    return head(ops, cfg, params, x, n_valid, all_logits), new_state, counts if with_counts else None


def forward_rows(ops, cfg: ModelConfig, layout, params: dict, experts: dict, bank: list, tokens, pos, active):
    """A decode window: one token of each of S sequences -> (logits [S, V] fp32, new bank).

    tokens, pos, active [S] int32 (a row with active 0 is padding: its key goes to the position given, beyond every
    real one, and its recurrent state is unchanged); bank: per layer the states of the S sequences, {name: [S, ...]}.
    The same layers as forward(), in their rows mode (strata/backend.py): projections, routing and experts run
    over the S rows together, the state ops per row."""
    x = embed(params, tokens)                                                     # [S, H]
    new_bank = []
    p = 0
    for lp, st, kind in zip(params["layers"], bank, cfg.layer_types):
        x, h, w, idx, shared, st = layer_front(ops, cfg, kind, lp, st, x, pos, active)
        if h is not None:
            with ops.scope("routed_experts"):
                slots = ops.expert_slots(experts["table"][p], idx, active)        # [S, k]; padding rows: -1
                w = w if w.dtype == h.dtype else w.astype(h.dtype)
                y = ops.experts_pool(h, slots, w, experts["pool"], layout, cfg.num_experts)
            x = layer_back(ops, cfg, lp, x, shared, y)
            p += 1
        new_bank.append(st)
    return head(ops, cfg, params, x, tokens.shape[0], all_logits=True), new_bank


def embed(params: dict, tokens):
    return params["embed"][tokens]


def layer_front(ops, cfg: ModelConfig, kind: str, lp: dict, st: dict, x, start, n_valid):
    """One layer up to its routed experts: the mixer and, for a dense layer, its MLP. x [T, H]: T tokens of one
    sequence (start, n_valid scalars; st its state) or one token of each of T sequences (start, n_valid [T]; st their
    bank).
    -> (x, h, w, idx, shared, st): for a sparse layer h [T, H] is the experts' input, (w, idx) [T, k] the routes and
    shared the shared expert's gate, up and scalar-gate projections of h (or None), and the layer ends with
    layer_back(.., shared, y) once the experts' output y is known; for a dense layer h = w = idx = shared = None."""
    eps = cfg.rms_norm_eps
    sparse = is_sparse(lp)
    parts = projections(cfg, kind, sparse)
    if kind == LINEAR:
        with ops.scope("delta_proj"):
            _, (qkv, z, b, a) = project(ops, lp, "in_proj", parts, x, lp["in_norm"], eps)
        with ops.scope("delta_rule"):
            o, conv, ssm = ops.delta_block(qkv, z, b, a, st["conv"], lp["conv"], st["ssm"], lp["A_log"],
                                           lp["dt_bias"], lp["gnorm"], eps, start, n_valid, cfg.linear_num_key_heads)
        with ops.scope("delta_out"):
            x, st = ops.linear_add(o, lp["out"], x), {"conv": conv, "ssm": ssm}
    else:
        # Qwen3-Next adds a sigmoid output gate per head (gated_attention)
        with ops.scope("attn_proj"):
            _, ys = project(ops, lp, "in_proj", parts, x, lp["in_norm"], eps)
        with ops.scope("attn"):
            o, st = ops.attention_block(ys[0], ys[1], ys[2], ys[3] if cfg.gated_attention else None, lp["q_norm"],
                                        lp["k_norm"], eps, st, start, n_valid, cfg.rotary_dim, cfg.rope_theta)
        with ops.scope("attn_out"):
            x = ops.linear_add(o, lp["o"], x)
    if not sparse:
        with ops.scope("mlp"):
            _, (g, u) = project(ops, lp, "post_proj", parts, x, lp["post_norm"], eps)
            return ops.swiglu_out(g, u, lp["mlp_down"], x), None, None, None, None, st
    with ops.scope("router"):
        # the router and the shared expert's projections read the same normed input
        h, ys = project(ops, lp, "post_proj", parts, x, lp["post_norm"], eps)
        w, idx = route(ops, cfg, lp, ys[0])
    return x, h, w, idx, (tuple(ys[1:]) if len(ys) > 1 else None), st


def layer_back(ops, cfg: ModelConfig, lp: dict, x, shared, y):
    """The rest of a sparse layer: y (the routed experts' weighted sum) plus the gated shared expert, whose gate, up
    and scalar gate projections (shared: ([T, Is], [T, Is], [T, 1])) layer_front computed."""
    with ops.scope("shared_expert"):
        if shared is None:
            return x + y
        g, u, s = shared
        return ops.swiglu_out(g, u, lp["sh_down"], x, add=y, gate=s)


def project(ops, lp: dict, joined: str, parts: dict, x, scale, eps):
    """rms_norm(x) and its projections by the matrices of parts[joined] ((name, rows) pairs): one matmul over the
    joined matrix, its columns split (a tree built with join_projections), or one per matrix. -> (h, [y, ...])."""
    if joined in lp:
        h, (y,) = ops.norm_linears(x, scale, eps, [lp[joined]])
        out, at = [], 0
        for _, n in parts[joined]:
            out.append(y[:, at:at + n])
            at += n
        return h, out
    return ops.norm_linears(x, scale, eps, [lp[name] for name, _ in parts[joined]])


def head(ops, cfg: ModelConfig, params: dict, x, n_valid, all_logits: bool):
    with ops.scope("head"):
        if not all_logits:
            x = ops.take_row(x, n_valid - 1)[None]
        x = ops.rms_norm(x, params["norm"], cfg.rms_norm_eps)
        return ops.linear(x, params["lm_head"]).astype(ops.xp.float32)


def route(ops, cfg: ModelConfig, lp: dict, logits):
    """Router logits [T, E] -> (weights [T, k], ids [T, k]). A "router_bias" [E] (no checkpoint has one;
    benchmarks set it to skew routing) is added to the logits."""
    if "router_bias" in lp:
        logits = logits.astype(ops.xp.float32) + lp["router_bias"]
    return ops.route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
