"""The forward pass of Qwen3-Next (hybrid Gated DeltaNet + gated attention, sparse MoE), Qwen3-MoE and qwen4_exp
(its own layer parts: strata/model/qwen4_exp.py), written once against the Backend ops, with ONE layer loop
(run_layers) whose routed experts are a function the caller passes. Equations: ../shared/notes/qwen3-next-reference.md.
Padded rows are harmless by construction: their keys land beyond the real ones (overwritten before any real query
can see them), their delta-rule gates are zeroed (g = beta = 0 leaves the recurrent state unchanged), and the conv
state is taken at n_valid.
State per layer: FULL {"k", "v": [Cap, Hkv, hd]} (int8 KV: plus {"k_scale", "v_scale": [Cap, Hkv] fp32}; two
tiers: see kv_state); LINEAR {"conv": [K-1, C], "ssm": [Hv, dk, dv] fp32}; qwen4_exp adds to both.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np

from strata.backend import HOST, SLOTS, TIER_BASE, TIER_ROW
from strata.model.config import LINEAR, ModelConfig
from strata.model.control import CONTROL
from strata.model.params import is_sparse, ngram_spec_for, projections
from strata.model.qwen4_exp import hyper_enter, hyper_exit, ple_layer, qsa_attention


def init_state(cfg: ModelConfig, capacity: int, dtype, kv_dtype=None, resident: int = 0) -> list[dict]:
    """Fresh (empty) sequence state, on the host; the engine moves it to the device. kv_dtype: the attention
    layers' cache (None: dtype; int8: with a float32 scale per token and KV head, see backend.quantize_kv);
    resident: the device window's rows of a two-tier cache (kv_state), 0 for one tier."""
    kv_dtype = np.dtype(dtype if kv_dtype is None else kv_dtype)
    state = []
    for i, kind in enumerate(cfg.layer_types):
        if kind == LINEAR:
            state.append({
                "conv": np.zeros((cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim), dtype),
                "ssm": np.zeros((cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                                np.float32),
            })
            if cfg.ple is not None and cfg.first_layer + i in cfg.ple.layers:
                state[-1].update(ple_ctx=np.zeros(cfg.ple.ngram_size - 1, np.int32),
                                 ple_conv=np.zeros((cfg.ple.conv_rows, cfg.residual_width), dtype))
        else:
            state.append(attention_state(cfg, capacity, dtype, kv_dtype, resident))
    return state


def attention_state(cfg: ModelConfig, capacity: int, dtype, kv_dtype, resident: int = 0) -> dict:
    """An empty attention layer's state (host): its cache (kv_state) and, for QSA, the raw index keys "ik"
    [capacity, indexer_head_dim] in dtype and each position's (t, h, w) rotary position "irp" [capacity, 3] int32
    (a block key rotates by its first token's: an image's tokens are not at their cache positions)."""
    state = kv_state(cfg, capacity, kv_dtype, resident)
    if cfg.qsa is not None:
        if resident:      # Engine.load refuses kv_resident for these first (core._refuse_unsupported)
            raise NotImplementedError("QSA attention layers keep every position on the device "
                                      "(kv_resident is not supported for qwen4_exp yet)")
        state["ik"] = np.zeros((capacity, cfg.qsa.head_dim), dtype)
        state["irp"] = np.zeros((capacity, 3), np.int32)
    return state


def kv_state(cfg: ModelConfig, capacity: int, kv_dtype, resident: int = 0) -> dict:
    """An empty attention layer's cache (host): {"k", "v"} (int8: with their scales). resident > 0: two tiers, the
    device window of `resident` rows (positions base .. base + resident - 1), the host arrays "*_host" of
    capacity + resident rows (position p at row p; the window is written back at base, so the extra rows keep that
    in bounds), "base" (int32 0-d) and "row" (int32 0-d: in a bank, the host arrays' row that is this slot's)."""
    kv_dtype = np.dtype(kv_dtype)

    def arrays(rows: int) -> dict:
        shape = (rows, cfg.num_kv_heads, cfg.head_dim)
        layer = {"k": np.zeros(shape, kv_dtype), "v": np.zeros(shape, kv_dtype)}
        if kv_dtype == np.int8:
            layer.update(k_scale=np.zeros(shape[:2], np.float32), v_scale=np.zeros(shape[:2], np.float32))
        return layer
    if not resident:
        return arrays(capacity)
    return {**arrays(resident), **{n + HOST: a for n, a in arrays(capacity + resident).items()},
            TIER_BASE: np.zeros((), np.int32), TIER_ROW: np.zeros((), np.int32)}


@dataclass(frozen=True)
class Taps:
    """Debug hooks on the layer loop, fixed when the engine loads. debug_nan: every layer's mixer, routed experts
    and output are checked for non-finite values in the real rows, and report(names, flags) gets the checks' names
    and results once per pass (on the host). nonfinite (test-only fault injection): (layer, position) whose output
    row is made NaN, whatever the numerics path."""
    debug_nan: bool = False
    nonfinite: tuple[int, int] | None = None
    report: Callable | None = None

    def on(self, ops, positions, valid) -> "Tapping | None":
        """positions, valid [T]: the rows' positions and which are real -> one pass's tapping, or None when off."""
        if not self.debug_nan and self.nonfinite is None:
            return None
        return Tapping(self, ops, positions, valid)


NO_TAPS = Taps()


class Tapping:
    """One pass of the layer loop under Taps: after(i, op, x) -> x at each checkpoint, done() at the end."""

    def __init__(self, taps: Taps, ops, positions, valid):
        self.taps, self.ops, self.positions, self.valid = taps, ops, positions, valid
        self.names: list[str] = []
        self.flags: list = []

    def after(self, i: int, op: str, x):
        xp = self.ops.xp
        if op == "output" and self.taps.nonfinite is not None and self.taps.nonfinite[0] == i:
            hit = (self.positions == self.taps.nonfinite[1]) & self.valid
            x = xp.where(hit[:, None], xp.asarray(float("nan"), x.dtype), x)
        if self.taps.debug_nan:
            self.names.append(f"layer {i} {op}")
            self.flags.append(xp.all(xp.isfinite(x) | ~self.valid[:, None]))
        return x

    def done(self) -> None:
        if self.flags and self.taps.report is not None:
            self.ops.report(partial(self.taps.report, tuple(self.names)), self.ops.xp.stack(self.flags))


def row_positions(xp, t: int, start, n_valid):
    """(positions [T], real [T] bool) of a pass's rows: a part's (start, n_valid scalars), decode rows' ([T]) or a
    verify window's ([steps, S], step-major like its rows)."""
    if xp.ndim(start) == 0:
        at = xp.arange(t)
        return start + at, at < n_valid
    return start.reshape(-1), n_valid.reshape(-1) > 0


def run_layers(cfg: ModelConfig, params: dict, states: list, x, front, experts, back, tap: Tapping | None = None,
               steer=None):
    """THE layer loop, for prompt parts and decode rows on every expert path. x [T, H]; for each layer
    front(lp, st, x, kind, ple) -> layer_front's tuple (ple: the layer's index among the PLE layers, or None); for a sparse layer y = experts(p, h, w, idx) (p: the MoE layer's
    position, counted from 0) and x = back(lp, x, shared, y); a layer with a control vector (lp[CONTROL]) then
    x = steer(x, lp[CONTROL]) (the rows' scales bound in; strata/model/control.py). -> (x, new states). tap: Taps'
    hooks, when on.
    Traced inside one compiled window (front/back/experts traced), or driven from the host with each half compiled
    on its own and the routed experts resolved between them (LayerByLayer; strata/experts/path.py)."""
    states = list(states)
    p = 0
    for i, (kind, lp) in enumerate(zip(cfg.layer_types, params["layers"])):
        layer = cfg.first_layer + i     # the whole model's index, which the taps name (a split's stage: past 0)
        ple = cfg.ple.layers.index(layer) if cfg.ple is not None and layer in cfg.ple.layers else None
        x, h, w, idx, shared, states[i] = front(lp, states[i], x, kind, ple)
        if h is not None:
            if tap is not None:
                x = tap.after(layer, "gated delta rule" if kind == LINEAR else "attention", x)
            y = experts(p, h, w, idx)
            if tap is not None:
                y = tap.after(layer, "routed experts", y)
            x = back(lp, x, shared, y)
            p += 1
        if CONTROL in lp:
            if steer is None:
                raise ValueError(f"layer {layer} has a control vector but this pass was given no rows' scales")
            x = steer(x, lp[CONTROL])
        if tap is not None:
            x = tap.after(layer, "output", x)
    if tap is not None:
        tap.done()
    return x, states


def forward(ops, cfg: ModelConfig, params: dict, state: list, tokens, start, n_valid, experts, all_logits: bool,
            taps: Taps | None = None, x=None, slots=None, cv=None, images=None, rope_pos=None):
    """Traced: one part of one sequence, or a decode window, through run_layers -> (logits, new state).

    One sequence: tokens [T] int32 at positions start..start+T-1 (start, n_valid int32 scalars: one compilation per
    bucket T), state its state; logits [T, V] fp32 if all_logits else [1, V] at row n_valid - 1.
    A decode window: tokens, start (positions), n_valid (active, 0 = padding) [S] int32, state the bank of S
    sequences ({name: [S, ...]} per layer); all_logits True: logits [S, V]. (A padding row's key goes to the
    position given, beyond every real one, and its recurrent state is unchanged.)
    experts(p, h, w, idx) -> y: the routed experts of MoE layer p (strata/experts/path.py). x: the rows' hidden
    state from the stage before (a layer split's last stage), in place of the tokens' embedding. slots [B]: a decode
    window of B rows over a bank of more, row b on bank row slots[b] (distinct; the other rows left as they are).
    cv: the rows' control vector scales (steer's; None when the model has no control vector). images, rope_pos:
    forward_hidden's."""
    x, state = forward_hidden(ops, cfg, params, state, tokens, start, n_valid, experts, taps=taps, x=x, slots=slots,
                              cv=cv, images=images, rope_pos=rope_pos)
    return head(ops, cfg, params, x, n_valid, all_logits), state


def forward_hidden(ops, cfg: ModelConfig, params: dict, state: list, tokens, start, n_valid, experts, mix=None,
                   taps: Taps | None = None, x=None, slots=None, cv=None, images=None, rope_pos=None):
    """forward() up to the final norm -> (x [T, H], new state). mix: the mixers' form (mix_rows's signature; None:
    mix_rows), e.g. the verify form that runs several positions of each row and keeps each position's state.
    x: the rows' hidden state from the stage before (a layer split's later stage), in place of tokens' embedding.
    slots, cv: as forward's. images: embed_rows's. rope_pos: the rows' rotary positions where they are not their
    cache positions ([T], or (t, h, w) rows [T, 3]: a prompt with images, and the text after them)."""
    if x is None:
        x = embed_rows(cfg, params, tokens, images)
    if rope_pos is not None:
        if mix is not None:
            raise ValueError("rotary positions other than the cache's (images) are not supported in verify windows")
        mix = partial(mix_rows, rope_pos=rope_pos)

    def front(lp, st, x, kind, ple):
        if slots is None:
            return layer_front(ops, cfg, kind, lp, st, x, start, n_valid, mix, tokens, ple)
        # the recurrent states of the window's rows gathered and put back; attention reads the bank in place
        rows = {**st, SLOTS: slots} if kind != LINEAR else {k: ops.take_rows(v, slots) for k, v in st.items()}
        x, h, w, idx, shared, rows = layer_front(ops, cfg, kind, lp, rows, x, start, n_valid, mix, tokens, ple)
        if kind == LINEAR:
            rows = {k: ops.put_rows(st[k], slots, v) for k, v in rows.items()}
        return x, h, w, idx, shared, rows
    tap = taps.on(ops, *row_positions(ops.xp, x.shape[0], start, n_valid)) if taps is not None else None
    return run_layers(cfg, params, state, x, front, experts, partial(layer_back, ops, cfg), tap,
                      None if cv is None else partial(steer, ops, cfg, cv))


def steer(ops, cfg: ModelConfig, scale, x, direction):
    """x [T, W] after a layer plus each row's scale times the layer's control vector direction [H] (in every stream
    of a hyper-connected model), summed in float32 as llama.cpp adds its float32 vector. scale: [T] (a row each) or
    [1] (a part's rows alike); 0 leaves x as it was."""
    xp = ops.xp
    d = direction.astype(xp.float32)
    if cfg.hyper:
        d = xp.concatenate([d] * cfg.hc_count)
    return (x.astype(xp.float32) + scale.astype(xp.float32).reshape(-1, 1) * d).astype(x.dtype)


def finite_rows(xp, x, valid):
    """Whether every real row (valid [T]) of x [T, H] is finite."""
    return xp.all(xp.isfinite(x) | ~valid[:, None])


class LayerByLayer:
    """run_layers driven from the host, for an expert cache that does not hold every expert: each layer's halves
    compiled once per kind and shape, the routes brought to the host between them and resolved by
    experts(p, h, w, idx) (strata/experts/moe.py). Three shapes of state: one sequence's (Engine sequences), one
    slot of a runner's bank (a prompt part), all slots of the bank (decode rows, one token each)."""

    def __init__(self, ops, cfg: ModelConfig, compiled, taps: Taps = NO_TAPS):
        self.ops, self.cfg, self.taps = ops, cfg, taps
        c = ops.compile
        self._embed = compiled("st_embed", lambda: c(partial(embed_rows, cfg)))
        self._front = compiled("st_front", lambda: c(partial(_front, ops, cfg), donate_argnums=(1,),
                                                     static_argnames=("kind", "ple")))
        self._front_slot = compiled("st_front_slot", lambda: c(partial(_front_slot, ops, cfg), donate_argnums=(1,),
                                                               static_argnames=("kind", "ple")))
        self._back = compiled("st_back", lambda: c(partial(layer_back, ops, cfg)))
        self._head = compiled("st_head", lambda: c(partial(head, ops, cfg), static_argnames=("all_logits",)))
        self._finite = compiled("st_finite", lambda: c(partial(_finite_part, ops)))
        self._steer = compiled("st_steer", lambda: c(partial(steer, ops, cfg)))

    def sequence(self, params, state: list, tokens, start: int, n_valid: int, all_logits: bool, experts, cv=None,
                 images=None, rope_pos=None):
        """One sequence's part (T tokens, the first n_valid real) -> (logits, new state). cv: the control vector's
        scale for its rows ([1]; None without one); images, rope_pos: forward's (a prompt with images)."""
        x, state, _ = self.sequence_hidden(params, state, tokens, start, n_valid, experts, cv=cv, images=images,
                                           rope_pos=rope_pos)
        return self.head(params, x, n_valid, all_logits), state

    def sequence_hidden(self, params, state: list, tokens, start: int, n_valid: int, experts, x=None, cv=None,
                        images=None, rope_pos=None):
        """sequence()'s last layer output instead of its logits -> (x, new state, finite); x: the hidden rows
        from the stage before (a layer split's later stage) in place of the tokens' embedding."""
        def front(lp, st, x, kind, ple):
            return self._front(lp, st, x, np.int32(start), np.int32(n_valid), tokens, rope_pos, kind=kind, ple=ple)
        rows = (start + np.arange(len(tokens)), np.arange(len(tokens)) < n_valid)
        return self._hidden(params, state, tokens, front, experts, np.int32(n_valid), rows, x, cv, images)

    def slot_part(self, params, bank: list, slot: int, tokens, start: int, n_valid: int, experts, cv=None):
        """A prompt part on one slot of a bank -> (logits [1, V] of its last real row, new bank, whether its real
        rows' residual at the end is finite (a device scalar)); cv: as sequence's."""
        x, bank, finite = self.slot_part_hidden(params, bank, slot, tokens, start, n_valid, experts, cv=cv)
        return self.head(params, x, n_valid), bank, finite

    def slot_part_hidden(self, params, bank: list, slot: int, tokens, start: int, n_valid: int, experts, x=None,
                         cv=None, images=None, rope_pos=None):
        """slot_part's last layer output x [T, H] (before the final norm) instead of its logits -> (x, new bank,
        finite); x: as sequence_hidden's; images, rope_pos: forward's."""
        def front(lp, st, x, kind, ple):
            return self._front_slot(lp, st, np.int32(slot), x, np.int32(start), np.int32(n_valid), tokens, rope_pos,
                                    kind=kind, ple=ple)
        rows = (start + np.arange(len(tokens)), np.arange(len(tokens)) < n_valid)
        return self._hidden(params, bank, tokens, front, experts, np.int32(n_valid), rows, x, cv, images)

    def head(self, params, x, n_valid: int, all_logits: bool = False):
        """The logits of a last layer output x: of row n_valid - 1 [1, V], or of every row."""
        return self._head(params, x, np.int32(n_valid), all_logits=all_logits)

    def rows(self, params, bank: list, tokens, pos, active, experts, cv=None):
        """One token for each slot of the bank (tokens, pos, active [S]) -> (logits [S, V], new bank). cv: each
        row's control vector scale [S] (None without one)."""
        x, bank, _ = self.rows_hidden(params, bank, tokens, pos, active, experts, cv=cv)
        return self.head(params, x, len(tokens), all_logits=True), bank

    def rows_hidden(self, params, bank: list, tokens, pos, active, experts, x=None, cv=None, rope_pos=None):
        """rows()'s last layer output instead of its logits -> (x [S, H], new bank, finite); x: as
        sequence_hidden's; rope_pos [S]: the rows' rotary positions (None: pos)."""
        def front(lp, st, x, kind, ple):
            return self._front(lp, st, x, pos, active, tokens, rope_pos, kind=kind, ple=ple)
        rows = (np.asarray(pos), np.asarray(active) > 0)
        return self._hidden(params, bank, np.asarray(tokens), front, experts, np.int32(len(tokens)), rows, x, cv)

    def _hidden(self, params, states, tokens, front, experts, n_valid, rows, x=None, cv=None, images=None):
        """run_layers under the taps -> (x, states, whether x's first n_valid rows are finite)."""
        tap = self.taps.on(self.ops, *(self.ops.to_device(r) for r in rows)) if self.taps.debug_nan or \
            self.taps.nonfinite is not None else None
        x = self._embed(params, tokens, images) if x is None else x
        scale = None if cv is None else self.ops.to_device(np.asarray(cv, np.float32))
        x, states = run_layers(self.cfg, params, states, x, front, experts, self._back, tap,
                               None if cv is None else (lambda x, d: self._steer(scale, x, d)))
        return x, states, self._finite(x, n_valid)


def _finite_part(ops, x, n_valid):
    """Whether x's first n_valid rows are finite (a part's residual at its end)."""
    return finite_rows(ops.xp, x, ops.valid_mask(x.shape[0], n_valid))


def _front(ops, cfg, lp, st, x, start, n_valid, tokens, rope_pos, kind, ple):
    return layer_front(ops, cfg, kind, lp, st, x, start, n_valid, _mix_at(rope_pos), tokens=tokens, ple=ple)


def _mix_at(rope_pos):
    """layer_front's mix for rows at rotary positions other than their cache positions (None: mix_rows)."""
    return None if rope_pos is None else partial(mix_rows, rope_pos=rope_pos)


def _front_slot(ops, cfg, lp, bank, slot, x, start, n_valid, tokens, rope_pos, kind, ple):
    st = slot_layer(ops, bank, slot)
    x, h, w, idx, shared, st = layer_front(ops, cfg, kind, lp, st, x, start, n_valid, _mix_at(rope_pos),
                                           tokens=tokens, ple=ple)
    return x, h, w, idx, shared, put_slot_layer(ops, bank, slot, st)


def host_row(ops, layer: dict, slot):
    """The row of a two-tier layer's host banks that holds slot's positions (traced)."""
    return ops.take_row(layer[TIER_ROW], slot)


def slot_layer(ops, layer: dict, slot) -> dict:
    """One slot's state of a layer's bank ({name: [S, ...]}): a two-tier cache's host arrays are the row of its
    host banks that the slot owns (TIER_ROW: the banks have more rows than slots)."""
    row = host_row(ops, layer, slot) if TIER_ROW in layer else slot
    return {k: ops.take_row(v, row) if k.endswith(HOST) else ops.take_row(v, slot) for k, v in layer.items()}


def put_slot_layer(ops, layer: dict, slot, st: dict) -> dict:
    """The layer's bank with slot's state set from st (slot_layer's form) but the host arrays and TIER_ROW, which a
    window never changes (it writes the device window; only moves and parked copies write the host rows)."""
    return {k: v if k.endswith(HOST) or k == TIER_ROW else ops.set_row(v, slot, st[k]) for k, v in layer.items()}


def embed(params: dict, tokens):
    return params["embed"][tokens]


def embed_rows(cfg: ModelConfig, params: dict, tokens, images=None):
    """The residual rows the layer loop starts from: the tokens' embeddings [T, H], in each of the hc_count
    streams for a hyper-connected model ([T, hc * H]). images: (rows [T, H], is_image [T] bool), the vision tower's
    output in place of the image tokens' embeddings (strata/model/vision.py)."""
    x = embed(params, tokens)
    if images is not None:
        rows, is_image = images
        x = rows.astype(x.dtype) * is_image[:, None] + x * ~is_image[:, None]
    return x if not cfg.hyper else x.reshape(x.shape[0], 1, -1).repeat(cfg.hc_count, axis=1).reshape(x.shape[0], -1)


def layer_front(ops, cfg: ModelConfig, kind: str, lp: dict, st: dict, x, start, n_valid, mix=None, tokens=None,
                ple: int | None = None):
    """One layer up to its routed experts: the mixer and, for a dense layer, its MLP. x [T, H]: T tokens of one
    sequence (start, n_valid scalars; st its state) or one token of each of T sequences (start, n_valid [T]; st their
    bank).
    -> (x, h, w, idx, shared, st): for a sparse layer h [T, H] is the experts' input, (w, idx) [T, k] the routes and
    shared the shared expert's gate, up and scalar-gate projections of h (or None), and the layer ends with
    layer_back(.., shared, y) once the experts' output y is known; for a dense layer h = w = idx = shared = None.
    mix: the mixer from the input projections to the output before its projection (None: mix_rows). tokens: the
    rows' token ids and ple the layer's index among the PLE layers (a PLE layer's n-gram ids come from them)."""
    eps = cfg.rms_norm_eps
    sparse = is_sparse(lp)
    parts = projections(cfg, kind, sparse)
    mix = mix or mix_rows
    if cfg.hyper:
        return _hyper_front(ops, cfg, kind, lp, st, x, start, n_valid, mix, tokens, parts, ple)
    if kind == LINEAR:
        with ops.scope("delta_proj"):
            _, ys = project(ops, lp, "in_proj", parts, x, lp["in_norm"], eps)
        with ops.scope("delta_rule"):
            o, st = mix(ops, cfg, kind, lp, st, ys, start, n_valid)
        with ops.scope("delta_out"):
            x = ops.linear_add(o, lp["out"], x)
    else:
        with ops.scope("attn_proj"):
            _, ys = project(ops, lp, "in_proj", parts, x, lp["in_norm"], eps)
        with ops.scope("attn"):
            o, st = mix(ops, cfg, kind, lp, st, ys, start, n_valid)
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


def _hyper_front(ops, cfg: ModelConfig, kind: str, lp: dict, st: dict, x, start, n_valid, mix, tokens, parts,
                 ple):
    """layer_front for hyper-connected streams (qwen4_exp): the PLE layer's addition, then each sublayer reads
    its gated residual's mixed input (no norm of its own) and its output is injected into every stream; the
    shared tuple carries the MLP's injection weights for layer_back."""
    if ple is not None:
        with ops.scope("ple"):
            y, st = ple_layer(ops, cfg, lp, st, x, tokens, start, n_valid, ngram_spec_for(cfg, ple))
            x = x + y
    with ops.scope("delta_proj" if kind == LINEAR else "attn_proj"):
        h, inject = hyper_enter(ops, cfg, lp, "hca_", x)
        ys = _split(ops, lp, "in_proj", parts, h)
    with ops.scope("delta_rule" if kind == LINEAR else "attn"):
        o, st = mix(ops, cfg, kind, lp, st, ys, start, n_valid)
    with ops.scope("delta_out" if kind == LINEAR else "attn_out"):
        x = hyper_exit(cfg, x, ops.linear(o, lp["out" if kind == LINEAR else "o"]), inject)
    with ops.scope("router"):
        h, inject = hyper_enter(ops, cfg, lp, "hcm_", x)
        ys = _split(ops, lp, "post_proj", parts, h)
        w, idx = route(ops, cfg, lp, ys[0])
    return x, h, w, idx, (*ys[1:], inject), st


def _split(ops, lp: dict, joined: str, parts: dict, h):
    """project's projections of an input h that is already normed (a gated residual's mixed rows) -> [y, ...]."""
    if joined not in lp:
        return ops.linears(h, [lp[name] for name, _ in parts[joined]])
    (y,) = ops.linears(h, [lp[joined]])
    return _columns(y, parts[joined])


def _columns(y, parts):
    """A joined projection's product y split into its parts' columns ((name, rows) pairs, in order)."""
    out, at = [], 0
    for _, n in parts:
        out.append(y[:, at:at + n])
        at += n
    return out


def mix_rows(ops, cfg: ModelConfig, kind: str, lp: dict, st: dict, ys: list, start, n_valid, rope_pos=None):
    """A layer's mixer from its input projections ys to its output before the output projection -> (o, state):
    the gated delta rule (LINEAR; ys = qkv, z, b, a) or attention over the KV cache (ys = q, k, v and, Qwen3-Next's
    gated attention, a sigmoid output gate per head). rope_pos: attention's rotary positions (forward_hidden's)."""
    eps = cfg.rms_norm_eps
    if kind == LINEAR:
        qkv, z, b, a = ys
        o, conv, ssm = ops.delta_block(qkv, z, b, a, st["conv"], lp["conv"], st["ssm"], lp["A_log"], lp["dt_bias"],
                                       lp["gnorm"], eps, start, n_valid, cfg.linear_num_key_heads, cfg.linear_gate)
        return o, {**st, "conv": conv, "ssm": ssm}
    if cfg.qsa is not None:
        return qsa_attention(ops, cfg, lp, st, ys, start, n_valid, rope_pos)
    return ops.attention_block(ys[0], ys[1], ys[2], ys[3] if cfg.gated_attention else None, lp["q_norm"],
                               lp["k_norm"], eps, st, start, n_valid, cfg.rope, rope_pos)


def layer_back(ops, cfg: ModelConfig, lp: dict, x, shared, y):
    """The rest of a sparse layer: y (the routed experts' weighted sum) plus the gated shared expert, whose gate, up
    and scalar gate projections (shared: ([T, Is], [T, Is], [T, 1])) layer_front computed."""
    with ops.scope("shared_expert"):
        if shared is None:
            return x + y
        if cfg.hyper:                  # the MLP's output injected into every stream (layer_front's weights)
            g, u, s, inject = shared
            return hyper_exit(cfg, x, ops.swiglu_out(g, u, lp["sh_down"], y, gate=s), inject)
        g, u, s = shared
        return ops.swiglu_out(g, u, lp["sh_down"], x, add=y, gate=s)


def project(ops, lp: dict, joined: str, parts: dict, x, scale, eps):
    """rms_norm(x) and its projections by the matrices of parts[joined] ((name, rows) pairs): one matmul over the
    joined matrix, its columns split (a tree built with join_projections), or one per matrix. -> (h, [y, ...])."""
    if joined in lp:
        h, (y,) = ops.norm_linears(x, scale, eps, [lp[joined]])
        return h, _columns(y, parts[joined])
    return ops.norm_linears(x, scale, eps, [lp[name] for name, _ in parts[joined]])


def head(ops, cfg: ModelConfig, params: dict, x, n_valid, all_logits: bool):
    with ops.scope("head"):
        if not all_logits:
            x = ops.take_row(x, n_valid - 1)[None]
        if cfg.hyper:                  # the final mixer contracts the streams (its norm is the model's last)
            x, _ = hyper_enter(ops, cfg, params, "hcf_", x)
        else:
            x = ops.rms_norm(x, params["norm"], cfg.rms_norm_eps)
        return ops.linear(x, params["lm_head"]).astype(ops.xp.float32)


def route(ops, cfg: ModelConfig, lp: dict, logits):
    """Router logits [T, E] -> (weights [T, k], ids [T, k]). A "router_bias" [E] (no checkpoint has one;
    benchmarks set it to skew routing) is added to the logits."""
    if "router_bias" in lp:
        logits = logits.astype(ops.xp.float32) + lp["router_bias"]
    return ops.route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
