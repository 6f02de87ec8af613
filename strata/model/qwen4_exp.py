"""What qwen4_exp's (Qwen3.8-Flash-Next's) layers compute beyond Qwen3-Next's, for forward.py's one layer loop:
the hyper-connection streams (a row of the residual is hc_count streams of hidden_size), the PLE layer (hashed
n-gram rows from a table, gated by the streams, a dilated causal conv) and QSA attention (top key blocks plus the
tail, strata/model/qsa.py). Written against the Backend ops and ops.xp; exact against transformers' qwen4_exp.

State beyond Qwen3-Next's: a PLE layer's {"ple_ctx": [ngram_size - 1] int32 (the previous tokens),
"ple_conv": [(kernel - 1) * ngram_size, hc * H]}; a QSA layer's {"ik": [Cap, indexer_head_dim]} (raw index keys)
and {"irp": [Cap, 3]} (each position's rotary position: its block key's, when it starts a block).
"""
from __future__ import annotations

from strata.backend import SLOTS, is_rows
from strata.model.config import ModelConfig
from strata.ngram import ngram_ids
from strata.model.ple_table import table_rows
from strata.model.qsa import qsa_block_keys, qsa_select


def grouped_norm(ops, cfg: ModelConfig, x, scale):
    """RMSNorm of each stream of x [T, hc * H] on its own, scaled by scale [hc * H] (fp32 inside, as transformers;
    in xp, since a backend's rms_norm takes one scale for every row)."""
    xp, n, H = ops.xp, cfg.hc_count, cfg.hidden_size
    t = x.shape[0]
    xf = x.reshape(t, n, H).astype(xp.float32)
    y = xf / xp.sqrt(xp.mean(xf * xf, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    return (y * scale.reshape(n, H).astype(xp.float32)).astype(x.dtype).reshape(t, n * H)


def hyper_enter(ops, cfg: ModelConfig, lp: dict, name: str, x):
    """A gated residual's input side: the streams x [T, hc * H] normed, mixed by the low-rank mixer into one row
    [T, H] for the sublayer, and (a layer's, not the final mixer's) each stream's injection weight [T, hc]."""
    n, H = cfg.hc_count, cfg.hidden_size
    t = x.shape[0]
    xn = grouped_norm(ops, cfg, x, lp[name + "norm"])
    m = ops.silu(ops.linear(xn, lp[name + "down"]) / n)
    m = ops.sigmoid(ops.linear(m, lp[name + "up"]))
    mixed = ops.xp.mean((m * xn).reshape(t, n, H), axis=1)
    inject = lp.get(name + "inject")
    return mixed, None if inject is None else 2 * ops.sigmoid(ops.linear(xn, inject) / n)


def hyper_exit(cfg: ModelConfig, x, out, inject):
    """The sublayer's output out [T, H] added to every stream of x [T, hc * H] with its weight inject [T, hc]."""
    t = x.shape[0]
    return x + (out[:, None, :] * inject[:, :, None]).reshape(t, cfg.residual_width)


def ple_layer(ops, cfg: ModelConfig, lp: dict, st: dict, x, tokens, start, n_valid, spec):
    """The PLE layer's addition to the streams x [T, hc * H] for tokens [T] -> (y [T, hc * H], st). Rows mode
    (start [S]): one token of each of S sequences, st their bank; a verify window's (start [steps, S]): steps of
    rows mode, the state after each step kept ([steps, S, ...], for the rollback)."""
    if ops.xp.ndim(start) == 2:      # a verify window's steps [steps, S] (rows step-major): each step's state kept
        steps, rows = start.shape
        ys, kept = [], []
        for j in range(steps):
            at = slice(j * rows, (j + 1) * rows)
            y, st = ple_layer(ops, cfg, lp, st, x[at], tokens[at], start[j], n_valid[j], spec)
            ys.append(y)
            kept.append(st)
        return ops.xp.concatenate(ys), {**st, **{k: ops.xp.stack([s[k] for s in kept]) for k in ("ple_ctx",
                                                                                              "ple_conv")}}
    if is_rows(start):
        def one(x, tok, ctx, conv, s, n):
            y, out = ple_layer(ops, cfg, lp, {"ple_ctx": ctx, "ple_conv": conv}, x[None], tok[None], s, n, spec)
            return y[0], out["ple_ctx"], out["ple_conv"]
        y, ctx, conv = ops.vmap(one)(x, tokens, st["ple_ctx"], st["ple_conv"], start, n_valid)
        return y, {**st, "ple_ctx": ctx, "ple_conv": conv}
    xp, p = ops.xp, cfg.ple
    n, H = cfg.hc_count, cfg.hidden_size
    t = x.shape[0]
    ids, ctx = ngram_ids(xp, spec, st["ple_ctx"], tokens, start, n_valid)              # [T, heads]
    emb = table_rows(ops, lp, ids, x.dtype).reshape(t, p.embed_dim)
    key = grouped_norm(ops, cfg, ops.linear(emb, lp["ple_key"]), lp["ple_norm_key"]).reshape(t, n, H)
    value = ops.linear(emb, lp["ple_value"])                                           # [T, H]
    query = grouped_norm(ops, cfg, x, lp["ple_norm_query"]).reshape(t, n, H)
    gate = xp.sum(key * query, axis=-1, keepdims=True) / H ** 0.5                      # [T, hc, 1]
    gate = xp.sqrt(xp.maximum(xp.abs(gate), 1e-6)) * xp.sign(gate)
    gated = (ops.sigmoid(gate) * value[:, None, :]).reshape(t, n * H)
    conv, conv_state = _dilated_conv(xp, grouped_norm(ops, cfg, gated, lp["ple_norm_conv"]), st["ple_conv"],
                                     lp["ple_conv"], p.ngram_size, start, n_valid)
    return gated + ops.silu(conv), {**st, "ple_ctx": ctx, "ple_conv": conv_state}


def _dilated_conv(xp, u, state, w, dilation: int, start, n_valid):
    """Causal depthwise conv of u [T, C] with kernel w [C, K] dilated by `dilation`, over the rows before (state
    [(K-1) * dilation, C], zeros at a sequence's start) -> (out [T, C], the state after the n_valid real rows)."""
    t = u.shape[0]
    k = w.shape[1]
    state = xp.where(start > 0, state, xp.zeros_like(state)).astype(u.dtype)
    hist = xp.concatenate([state, u], axis=0)                                        # [(K-1)d + T, C]
    out = sum(hist[j * dilation:j * dilation + t] * w[:, j].astype(u.dtype) for j in range(k))
    rows = state.shape[0]
    # the last `rows` rows of hist up to the real rows' end: rows n_valid .. n_valid + rows - 1
    idx = n_valid + xp.arange(rows)
    return out, hist[idx]


def qsa_attention(ops, cfg: ModelConfig, lp: dict, kv: dict, ys: list, start, n_valid, rope_pos=None):
    """Gated attention whose queries see only the keys the QSA indexer selects -> (o [T, Hq * hd], kv). ys: the
    layer's q, k, v, gate and index-query/key projections; kv the layer's cache {"k", "v", "ik", "irp"} (int8: with
    scales). Rows mode (start [S]): one token of each of S sequences, kv their bank (with SLOTS: the bank's rows).
    rope_pos: the rows' rotary positions where they are not their cache positions (forward_hidden's)."""
    if is_rows(start):
        slots = kv.get(SLOTS)
        own = {n: a for n, a in kv.items() if n != SLOTS}
        rows = own if slots is None else {n: ops.take_rows(a, slots) for n, a in own.items()}

        def one(q, k, v, g, qk, kv1, s, n, r):
            o, kv1 = qsa_attention(ops, cfg, lp, kv1, [q[None], k[None], v[None], g[None], qk[None]], s, n,
                                   None if rope_pos is None else r[None])
            return o[0], kv1
        o, rows = ops.vmap(one)(*ys, rows, start, n_valid, start if rope_pos is None else rope_pos)
        return o, rows if slots is None else {n: ops.put_rows(own[n], slots, rows[n]) for n in own}
    xp, eps, qsa = ops.xp, cfg.rms_norm_eps, cfg.qsa
    q, k, v, gate, qk = ys
    t = q.shape[0]
    hd, hkv, hq = cfg.head_dim, cfg.num_kv_heads, cfg.num_heads
    positions = start + xp.arange(t)
    rp = positions if rope_pos is None else rope_pos
    q_pos = xp.where(ops.valid_mask(t, n_valid), positions, 0)
    q = ops.rope(ops.rms_norm(q.reshape(t, hq, hd), lp["q_norm"], eps), rp, cfg.rope)
    k = ops.rope(ops.rms_norm(k.reshape(t, hkv, hd), lp["k_norm"], eps), rp, cfg.rope)
    store = ops.kv_store({n: kv[n] for n in kv if n not in ("ik", "irp")}, k, v.reshape(t, hkv, hd), start)
    di = qsa.head_dim
    iq = ops.rope(ops.rms_norm(qk[:, :qsa.heads * di].reshape(t, qsa.heads, di), lp["idx_q_norm"], eps), rp,
                  cfg.rope)
    ik = ops.kv_write(kv["ik"], qk[:, qsa.heads * di:], start)
    rp3 = xp.stack([rp] * 3, axis=1) if rp.ndim == 1 else rp
    irp = ops.kv_write(kv["irp"], rp3.astype(xp.int32), start)
    cap = ik.shape[0]
    blocks = qsa_block_keys(xp, ik, lp["idx_k_norm"], eps, qsa.ratio,
                            lambda x, pos: ops.rope(x, irp[pos], cfg.rope))
    mask = qsa_select(xp, iq, blocks, q_pos, qsa.ratio, qsa.budget, cap)               # [T, Cap]
    keys, values = _dequantised(xp, store, "k"), _dequantised(xp, store, "v")          # [Cap, Hkv, hd]
    f32 = xp.float32
    qg = q.reshape(t, hkv, hq // hkv, hd).astype(f32)
    scores = xp.einsum("tgrd,cgd->tgrc", qg, keys.astype(f32)) * hd ** -0.5
    scores = xp.where(mask[:, None, None, :], scores, -xp.inf)
    p = ops.softmax(scores)
    o = xp.einsum("tgrc,cgd->tgrd", p, values.astype(f32)).reshape(t, hq * hd).astype(v.dtype)
    return o * ops.sigmoid(gate), {**kv, **store, "ik": ik, "irp": irp}


def _dequantised(xp, kv: dict, name: str):
    """A cache's keys or values in float (int8 ones times their per-row scales)."""
    a = kv[name]
    scale = kv.get(name + "_scale")
    return a if scale is None else a.astype(xp.float32) * scale[..., None]
