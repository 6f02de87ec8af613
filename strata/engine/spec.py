"""Speculative decoding with the MTP head: draft on the device, verify K + 1 positions a row, roll back on the device.

A verify window feeds each row its next token and the drafts the window before left on the device. Projections and
experts run over all positions at once; each mixer runs position by position as decode rows do (stepwise), and the
linear layers keep every position's state. Greedy rows accept the longest prefix equal to their argmax; sampled rows
accept draft d with probability p(d) (drafts are the head's argmax: q(d) = 1) and on a rejection draw from p without
d, renormalised, so each token has the target's distribution. Rollback: the linear layers take the state of the last
accepted position; later keys are never visible and are overwritten. The head then reads the accepted positions and
drafts K tokens. Prompt parts fill the head's cache; the last part drafts. Only accepted state stays in a slot.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from strata.engine.core import SAMPLING, all_greedy
from strata.engine.runner import _padded
from strata.errors import ConfigError
from strata.experts.path import PathKind
from strata.model.config import LINEAR
from strata.model.forward import attention_state, forward_hidden, mix_rows
from strata.model.mtp import draft_logits, final_hidden, hidden_logits, mtp_hidden
from strata.plan import WindowPlan

MTP_PREFIX = "mtp.layers.0.mlp."


@dataclass(frozen=True)
class MtpHead:
    """The MTP head's routed experts (a sparse head; none for a dense one): every one resident in a pool of its
    own (`pool`, device uint8 [E, nbytes], passed to compiled windows as an argument), in the engine's expert
    layout, computed by the one expert op."""
    layout: object
    n_experts: int

    def experts(self, ops, pool, valid):
        """experts(h, w, idx) -> y over rows valid ([T] per row, or a part's n_valid)."""
        table = ops.xp.arange(max(self.n_experts, 1), dtype=ops.xp.int32)

        def routed(h, w, idx):
            slots = ops.expert_slots(table, idx, valid)
            return ops.experts_pool(h, slots, w.astype(h.dtype), pool, self.layout, self.n_experts)
        return routed


def load_mtp(engine, tensors=None, pack=None) -> tuple[MtpHead, object]:
    """The head of a loaded engine (its dense tensors are in engine.params["mtp"]) -> (MtpHead, its pool): its
    routed experts from the checkpoint's tensors or the pack."""
    cfg, ops = engine.cfg, engine.backend
    if "mtp" not in engine.params:
        raise ConfigError("mtp is on but the model has no MTP head (no mtp.fc.weight or mtp.fc_hidden.weight among "
                          "its tensors)")
    if cfg.num_experts == 0:
        return MtpHead(None, 0), engine.backend.pool_alloc(1, 1)
    layout = engine.layout
    if pack is not None:
        if pack.mtp_layer is None:
            raise ConfigError(f"mtp is on but the pack {pack.dir} holds no MTP experts (re-pack the checkpoint)")
        blobs = [np.array(pack.blob(pack.mtp_layer, e)) for e in range(cfg.num_experts)]
    else:
        from strata.model.params import read_experts
        from strata.weights.quant import encode_expert
        g, u, d = read_experts(cfg, tensors, engine.dtype, MTP_PREFIX)
        blobs = [encode_expert(layout, g[e], u[e], d[e]) for e in range(cfg.num_experts)]
    pool = ops.pool_write(ops.pool_alloc(len(blobs), layout.nbytes), np.arange(len(blobs), dtype=np.int32), blobs)
    return MtpHead(layout, cfg.num_experts), pool


def stepwise(steps: int):
    """The mixers' verify form (forward_hidden's mix): rows are [steps * S] step-major, start and n_valid
    [steps, S]; step j is one decode row of each sequence (mix_rows), in order, and a linear layer's state comes back
    with every step's ([steps, S, ...]) for the rollback to pick from."""
    def mix(ops, cfg, kind, lp, st, ys, start, n_valid):
        outs, kept = [], []
        for j in range(steps):
            o, st = mix_rows(ops, cfg, kind, lp, st, [y.reshape((steps, -1) + y.shape[1:])[j] for y in ys],
                             start[j], n_valid[j])
            outs.append(o)
            kept.append(st)
        if kind == LINEAR:        # the mixer's own state at every step (a PLE layer's came kept per step already)
            st = {**st, **{k: ops.xp.stack([s[k] for s in kept]) for k in ("conv", "ssm")}}
        return ops.xp.concatenate(outs, axis=0), st
    return mix


@dataclass(frozen=True)
class Geometry:
    """What a spec compilation is specialised to."""
    k: int                  # drafts a row verifies at most (K)
    scratch: int            # the KV row that writes of invalid positions go to
    limit: int              # max_context: no position at or past it is written
    min_p: float            # a draft below this probability under the head ends the row's drafts


def target_logits(ops, logits, temperature, top_k, top_p, min_p):
    """What a sampled row draws from (JaxBackend.sample's processing), in vocabulary order: the logits over the
    temperature, -inf outside the kept set (top_k, top_p, min_p; the best token always kept). [B, V] fp32."""
    xp = ops.xp
    vocab = logits.shape[-1]
    order = xp.argsort(-logits, axis=-1)
    scaled = xp.take_along_axis(logits, order, axis=-1) / xp.maximum(temperature, 1e-6)[:, None]
    probs = ops.softmax(scaled)
    rank = xp.arange(vocab)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    keep = keep & ((xp.cumsum(probs, axis=-1) - probs) < top_p[:, None])
    keep = keep & (probs >= min_p[:, None] * probs[:, :1])
    keep = keep | (rank == 0)
    masked = xp.where(keep, scaled, -xp.inf)
    return xp.take_along_axis(masked, xp.argsort(order, axis=-1), axis=-1)


def _accept(ops, L, drafts, n, temperature, top_k, top_p, min_p, seeds, steps, greedy: bool):
    """L [T, S, V] logits at each verified position, drafts [K, S], n [S] drafts offered -> (a [S] accepted,
    next [S] the token after them). Position j's draws use key (seed, step + j); the accept draw a key of its own."""
    xp = ops.xp
    T, S, V = L.shape
    K = T - 1
    i32 = xp.int32
    j = xp.arange(T, dtype=i32)[:, None]
    y = xp.argmax(L, axis=-1).astype(i32)                                             # [T, S]
    ok = (drafts == y[:K]) & (j[:K] < n[None])
    pick = y
    if not greedy:
        flat = L.reshape(T * S, V)
        rep = lambda x: xp.tile(x, T)                                                   # noqa: E731 [S] -> [T*S]
        seeds_t = xp.tile(seeds, (T, 1))
        st = (steps[None] + j).reshape(-1).astype(i32)
        keys = ops.prng_keys(seeds_t, st)
        bonus = ops.sample(flat, rep(temperature), rep(top_k), rep(top_p), rep(min_p), keys).reshape(T, S)
        d = xp.concatenate([drafts, xp.zeros((1, S), i32)]).reshape(-1)
        tgt = target_logits(ops, flat, rep(temperature), rep(top_k), rep(top_p), rep(min_p))
        p = ops.softmax(tgt)
        pd = xp.take_along_axis(p, d[:, None], axis=-1)[:, 0]
        two = xp.stack([xp.log(pd), xp.log1p(-xp.minimum(pd, 1.0))], axis=-1)            # [accept, reject]
        ones, zeros = xp.ones(T * S, xp.float32), xp.zeros(T * S, xp.float32)
        acc_seeds = xp.stack([seeds_t[:, 0], seeds_t[:, 1] | xp.uint32(0x80000000)], axis=1)
        draw = ops.sample(two, ones, xp.zeros(T * S, i32), ones, zeros, ops.prng_keys(acc_seeds, st))
        rest = xp.where(xp.arange(V)[None, :] == d[:, None], -xp.inf, tgt)
        resid = ops.sample(rest, ones, xp.zeros(T * S, i32), ones, zeros, keys).reshape(T, S)
        sampled = temperature[None] > 0
        ok = xp.where(sampled[:K], draw.reshape(T, S)[:K] == 0, drafts == y[:K]) & (j[:K] < n[None])
        pick = xp.where(j < n[None], xp.where(sampled, resid, y), bonus).astype(i32)
    a = xp.sum(xp.cumprod(ok.astype(i32), axis=0), axis=0).astype(i32)
    return a, xp.take_along_axis(pick, a[None], axis=0)[0]


def _drafts(ops, cfg, geo: Geometry, params, head: MtpHead, pool, kv, g, at, on):
    """K drafts for each row from g [S, H] (the head's output whose argmax is the first draft; each further draft
    feeds the one before at position at + i) -> (drafted int32 [K + 1, S]: the drafts, then how many to offer, kv)."""
    xp = ops.xp
    drafts, probs = [], []
    for i in range(geo.k):
        lg = draft_logits(ops, cfg, params, g)
        d = xp.argmax(lg, axis=-1).astype(xp.int32)
        drafts.append(d)
        if geo.min_p > 0:               # a softmax over the vocabulary per draft, only when a floor asks for it
            probs.append(xp.max(ops.softmax(lg), axis=-1))
        if i + 1 < geo.k:
            pos = at + i
            ok = on & (pos < geo.limit)
            valid = ok.astype(xp.int32)
            g, kv = mtp_hidden(ops, cfg, params, kv, d, g, xp.where(ok, pos, geo.scratch).astype(xp.int32), valid,
                               head.experts(ops, pool, valid))
    if probs:
        n = xp.sum(xp.cumprod((xp.stack(probs) >= geo.min_p).astype(xp.int32), axis=0), axis=0)
    else:
        n = xp.full(on.shape, geo.k, xp.int32)
    n = n * on.astype(xp.int32)
    return xp.concatenate([xp.stack(drafts), n[None]]).astype(xp.int32), kv


def _verify_inputs(xp, geo: Geometry, rows, drafted, offer, active):
    """A verify window's rows on any stage: rows int32 [3, S] (token, position, step), drafted [K + 1, S] (the
    head's drafts, then how many it offers), offer [S] -> (tokens [T*S] step-major, positions and valid [T, S], the
    drafts each row verifies n [S])."""
    i32 = xp.int32
    T = geo.k + 1
    on = active > 0
    n = xp.minimum(offer, drafted[geo.k]) * on.astype(i32)
    j = xp.arange(T, dtype=i32)[:, None]
    valid = (j <= n[None]) & on[None]                                                  # [T, S]
    pos = xp.where(valid, rows[1][None] + j, geo.scratch).astype(i32)
    return xp.concatenate([rows[0][None], drafted[:geo.k]]).reshape(-1), pos, valid, n


def accepted_states(xp, kinds, states, a):
    """The rollback: each linear layer's state at each row's last accepted position (states [T, S, ...] as the
    verify form keeps them, a [S]); attention layers' states as they are (later keys are never visible)."""
    every = xp.arange(a.shape[0])
    return [{k: v[a, every] for k, v in st.items()} if kind == LINEAR else st for kind, st in zip(kinds, states)]


def _verify_hidden(ops, cfg, path, layout, geo: Geometry, params, args, states, rows, drafted, offer, active, x,
                   taps=None, cv=None):
    """A split's stage before the last in a verify window (x [T*S, H] from the stage before, None on the first) ->
    (its layers' states with the linear layers' as they were, the linear layers' at every position [T, S, ...]
    (`kept`, for _roll_back), x after its layers); window fetch: and the routing counts and experts copied."""
    tokens, pos, valid, _ = _verify_inputs(ops.xp, geo, rows, drafted, offer, active)
    fetching = path.kind is PathKind.WINDOW_FETCH
    counts, copied = ([], []) if fetching else (None, None)
    flat_valid = valid.reshape(-1).astype(ops.xp.int32)
    x, new = forward_hidden(ops, cfg, params, states, tokens, pos, valid.astype(ops.xp.int32),
                            path.traced(layout, args, flat_valid, counts, copied), mix=stepwise(geo.k + 1),
                            taps=taps, x=x, cv=_steps_cv(ops, cv, geo.k + 1))
    kinds = cfg.layer_types
    kept = [st if kind == LINEAR else {} for kind, st in zip(kinds, new)]
    states = [old if kind == LINEAR else st for kind, old, st in zip(kinds, states, new)]
    if fetching:
        return states, kept, x, ops.xp.stack(counts), ops.xp.stack(copied)
    return states, kept, x


def _steps_cv(ops, cv, steps: int):
    """Each row's control vector scale cv [S] for a verify window's rows ([steps * S], step-major); None stays."""
    return None if cv is None else ops.xp.tile(cv, steps)


def _roll_back(ops, states, kept, out, k: int, kinds: tuple):
    """accepted_states on a split's stage before the last (states and kept as _verify_hidden returns them), with
    the accepted counts from the verify window's out [K + 4, S] (row K + 1): the states keep their shapes, so the
    donated buffers take the result."""
    merged = [kp if kind == LINEAR else st for kind, st, kp in zip(kinds, states, kept)]
    return accepted_states(ops.xp, kinds, merged, out[k + 1])


def _verify_rows(ops, cfg, path, layout, geo: Geometry, head: MtpHead, params, args, pool, states, bank, rows, offer,
                 active, temperature, top_k, top_p, min_p, seeds, greedy: bool = False, taps=None, x=None, cv=None):
    """A verify window (a split's last stage: x [T*S, H] from the stage before). rows int32 [3, S]: each row's
    token, position and step; offer [S]: drafts it may verify (of those bank["drafted"] holds); bank: the head's
    state {kv, h, drafted}. -> (states, bank, out int32 [K + 4, S]: the tokens it emits (the accepted drafts, then
    the next token; a + 1 of them), a, finite (the logits at every position it verified), drafts verified); window
    fetch: and the routing counts and experts copied. cv [S]: each row's control vector scale (None: none); the
    head reads the steered hidden state and steers nothing of its own (llama.cpp's vector has no entry for it)."""
    xp = ops.xp
    i32 = xp.int32
    K, S = geo.k, rows.shape[1]
    T = K + 1
    on = active > 0
    drafts = bank["drafted"][:K]
    tokens, pos, valid, n = _verify_inputs(xp, geo, rows, bank["drafted"], offer, active)
    j = xp.arange(T, dtype=i32)[:, None]
    fetching = path.kind is PathKind.WINDOW_FETCH
    counts, copied = ([], []) if fetching else (None, None)
    flat_valid = valid.reshape(-1).astype(i32)
    x, states = forward_hidden(ops, cfg, params, states, tokens, pos, valid.astype(i32),
                               path.traced(layout, args, flat_valid, counts, copied), mix=stepwise(T), taps=taps, x=x,
                               cv=_steps_cv(ops, cv, T))
    hn = final_hidden(ops, cfg, params, x)                                             # [T*S, W]
    L = hidden_logits(ops, cfg, params, hn).reshape(T, S, -1)
    finite = xp.all(xp.isfinite(L) | ~valid[..., None], axis=(0, 2))
    a, nxt = _accept(ops, L, drafts, n, temperature, top_k, top_p, min_p, seeds, rows[2], greedy)
    every = xp.arange(S)
    states = accepted_states(xp, cfg.layer_types, states, a)
    # the head reads the accepted positions: (h_i, t_{i+1}) with t the accepted drafts, then the next token
    padded = xp.concatenate([drafts, xp.zeros((1, S), i32)])
    with ops.scope("mtp"):
        m_tok = xp.where(j < a[None], padded, nxt[None]).reshape(-1)
        m_valid = (j <= a[None]) & on[None]
        m_pos = xp.where(m_valid, rows[1][None] + j, geo.scratch).astype(i32)
        g, kv = mtp_hidden(ops, cfg, params, bank["kv"], m_tok, hn, m_pos, m_valid.astype(i32),
                           head.experts(ops, pool, m_valid.reshape(-1).astype(i32)), mix=stepwise(T))
        g = g.reshape(T, S, -1)[a, every]
        drafted, kv = _drafts(ops, cfg, geo, params, head, pool, kv, g, rows[1] + a + 1, on)
    emitted = xp.where(j < a[None], padded, xp.where(j == a[None], nxt[None], 0))
    out = xp.concatenate([emitted, a[None], finite.astype(i32)[None], n[None]]).astype(i32)
    bank = {"kv": kv, "h": bank["h"], "drafted": xp.where(on[None], drafted, bank["drafted"])}
    if fetching:
        return states, bank, out, xp.stack(counts), xp.stack(copied)
    return states, bank, out


def _mtp_part(ops, cfg, geo: Geometry, head: MtpHead, params, pool, bank, slot, x, tokens, start, n_valid, first,
              last: bool = False):
    """The head over a prompt part of one slot (x [T, H] its last layer's output): its cache gets (h_i, t_{i+1}) for
    the part's positions from the one before it (its h kept in bank["h"]) to the one before its last; the last
    part's last position pairs with the first generated token `first`, and K drafts follow. -> bank."""
    xp = ops.xp
    i32 = xp.int32
    kv = {k: v[slot] for k, v in bank["kv"].items()}
    hn = final_hidden(ops, cfg, params, x)
    later = start > 0
    h_in = xp.where(later, xp.concatenate([bank["h"][slot][None].astype(hn.dtype), hn[:-1]]), hn)
    t_in = xp.where(later, tokens, xp.roll(tokens, -1))
    p0 = xp.where(later, start - 1, 0).astype(i32)
    nv = xp.where(later, n_valid, n_valid - 1).astype(i32)
    _, kv = mtp_hidden(ops, cfg, params, kv, t_in, h_in, p0, nv, head.experts(ops, pool, nv))
    h_last = ops.take_row(hn, n_valid - 1)
    h_bank = ops.set_row(bank["h"], slot, h_last)
    drafted = bank["drafted"]
    kv = {k: v[None] for k, v in kv.items()}
    if last:
        at = (start + n_valid - 1)[None].astype(i32)
        one = xp.ones(1, i32)
        g, kv = mtp_hidden(ops, cfg, params, kv, first.reshape(-1)[:1].astype(i32), h_last[None], at, one,
                           head.experts(ops, pool, one))
        new, kv = _drafts(ops, cfg, geo, params, head, pool, kv, g, at + 1, one > 0)
        drafted = xp.where(xp.arange(drafted.shape[1])[None] == slot, new, drafted)
    kv_bank = {k: ops.set_row(bank["kv"][k], slot, v[0]) for k, v in kv.items()}
    return {"kv": kv_bank, "h": h_bank, "drafted": drafted}


def _copy_head(ops, bank, src, dst):
    """A copy (another choice of the same prompt) takes the head's cache of src; it has no drafts: its first token
    is its own."""
    xp = ops.xp
    col = xp.arange(bank["drafted"].shape[1])[None] == dst
    return {"kv": {k: ops.set_row(v, dst, ops.take_row(v, src)) for k, v in bank["kv"].items()},
            "h": ops.set_row(bank["h"], dst, ops.take_row(bank["h"], src)),
            "drafted": xp.where(col & (xp.arange(bank["drafted"].shape[0])[:, None] == bank["drafted"].shape[0] - 1),
                                0, bank["drafted"])}


def _clear_head(ops, bank, slot):
    """The head's state with slot's cache, hidden state and drafts zeroed (nothing non-finite left after a
    non-finite row)."""
    xp = ops.xp
    zero = lambda v: ops.set_row(v, slot, xp.zeros(v.shape[1:], v.dtype))   # noqa: E731
    col = xp.arange(bank["drafted"].shape[1])[None] == slot
    return {"kv": {k: zero(v) for k, v in bank["kv"].items()}, "h": zero(bank["h"]),
            "drafted": xp.where(col, 0, bank["drafted"])}


@dataclass(eq=False)
class Verify:
    """A dispatched verify window (Spec.dispatch -> collect); fetched: each fetching stage's (ExpertSet, slot table,
    device routing counts, device experts copied) until collect records them."""
    out: object
    fetched: list


class Spec:
    """A runner's speculative decoding: the head's device state (its KV cache per slot, the hidden state a part
    leaves for the next, each slot's drafts), verify windows, and the head's share of prompt parts. A slot's drafts
    on the device are offered only while fresh: made by the window before for the state the slot has now. On a
    layer split the head lives on the last stage: earlier stages get the drafts from it and keep every position's
    linear state until the accepted counts come back, all on the devices."""

    def __init__(self, runner):
        self.runner = r = runner
        e = r.engine
        ops = self.ops = e.backend
        k = e.settings.sched.spec
        if e.mtp is None:
            raise ConfigError(f"spec = {k} drafts with the MTP head: set mtp = true (--mtp) as well")
        if ops.eager or not all(st.path.compiled_rows for st in e.stages):
            raise ConfigError(f"spec = {k} needs compiled decode windows: the jax backend with every expert on the "
                              f"device or window_fetch (this one: {ops.name} backend, experts {e.path.describe()})")
        self.geo = Geometry(k, r.scratch_pos, e.settings.model.max_context, e.settings.sched.spec_min_p)
        s, cfg = r.n_slots, e.cfg
        *self.before, self.last = e.stages
        kv = attention_state(cfg, e.capacity, e.dtype, e.kv_dtype)
        self.bank = ops.zeros_like({"kv": {n: np.broadcast_to(v, (s,) + v.shape) for n, v in kv.items()},
                                    "h": np.zeros((s, cfg.residual_width), e.dtype),
                                    "drafted": np.zeros((k + 1, s), np.int32)})
        self.fresh = np.zeros(s, bool)
        geo, (head, self.pool) = self.geo, e.mtp

        def on(st, name, fn, *bound, **kw):   # fn(ops, cfg, path, layout, geo, ...) compiled over a stage's layers
            return (st.compiled or e.compiled)((name, st.layout, geo), lambda: st.ops.compile(
                partial(fn, st.ops, st.cfg, st.path, st.layout, geo, *bound, taps=e.taps), **kw))
        self._verify = on(self.last, "verify_rows", _verify_rows, head, donate_argnums=(3, 4),
                          static_argnames=("greedy",))
        self._hidden = [on(st, "verify_hidden", _verify_hidden, donate_argnums=(2,)) for st in self.before]
        self._roll_back = [e.compile_on(st, ("roll_back", k), partial(_roll_back, k=k, kinds=tuple(st.cfg.layer_types)),
                                        donate_argnums=(0,)) for st in self.before]
        self._mtp_part = e.compiled(("mtp_part", geo), lambda: ops.compile(
            partial(_mtp_part, ops, self.last.cfg, geo, head), donate_argnums=(2,), static_argnames=("last",)))
        self._copy = e.compiled("copy_head", lambda: ops.compile(partial(_copy_head, ops), donate_argnums=(0,)))
        self._clear = e.compiled("clear_head", lambda: ops.compile(partial(_clear_head, ops), donate_argnums=(0,)))

    def dispatch(self, plan: WindowPlan) -> Verify:
        r, e = self.runner, self.runner.engine
        if plan.shaped:
            raise ValueError("a verify window's rows sample plainly: no penalties, logit bias, grammar or logprobs")
        pos, active = r.decode_rows(plan)
        rows = np.stack([np.asarray(plan.decode_tokens, np.int32), pos, np.asarray(plan.steps, np.int32)])
        offer = np.where(self.fresh & plan.decode_active, plan.draft_len, 0).astype(np.int32)
        fetched, kept = [], [None] * len(self.before)

        def through(st, x):          # a stage before the last: its layers, every position's linear state kept
            a, b = st.layers.start, st.layers.stop
            drafted = st.ops.to_device(self.bank["drafted"])
            res = self._hidden[st.index](st.params, self._args(st, fetched), r.states[a:b], st.ops.to_device(rows),
                                         drafted, offer, active, x, **r.cv(plan, r.stage_args[st.index]))
            r.states[a:b], kept[st.index], x = res[:3]
            self._counts(st, fetched, res[3:])
            return x
        x = e.hidden(self.before, None, through)
        st = self.last
        a, b = st.layers.start, st.layers.stop
        x = st.ops.to_device(x) if x is not None else None
        sampling = [r._args.get(k, v) for k, v in zip(SAMPLING, plan.sampling)]
        greedy = all_greedy(plan.temperature, plan.decode_active)
        res = self._verify(st.params, self._args(st, fetched), self.pool, r.states[a:b], self.bank, rows, offer,
                           active, *sampling, r._args.get("seeds", plan.seeds), greedy=greedy, x=x, **r.cv(plan))
        r.states[a:b], self.bank, out = res[:3]
        self._counts(st, fetched, res[3:])
        # the rollback of the stages before the last: the accepted counts (in out) handed back to their devices
        for early in self.before:
            a, b = early.layers.start, early.layers.stop
            r.states[a:b] = self._roll_back[early.index](r.states[a:b], kept[early.index], early.ops.to_device(out))
        self.fresh |= plan.decode_active
        for y in (out, *(c for f in fetched for c in f[2:])):
            self.ops.start_to_host(y)
        return Verify(out, fetched)

    @staticmethod
    def _args(st, fetched: list):
        """A stage's expert arguments for a verify window; window fetch: its slot table's, noted in fetched (the
        counts and copies the call returns follow: _counts)."""
        if st.path.kind is not PathKind.WINDOW_FETCH:
            return st.path.args()
        args, table = st.experts.fetch_args()
        fetched.append([st.experts, table, None, None])
        return args

    @staticmethod
    def _counts(st, fetched: list, extra: tuple) -> None:
        if st.path.kind is PathKind.WINDOW_FETCH:
            fetched[-1][2:] = extra

    def collect(self, v: Verify) -> tuple:
        """-> (next [S], finite [S], accepted drafts [S, K], how many [S], drafts verified [S])."""
        e = self.runner.engine
        out = np.asarray(e.backend.to_host(v.out))
        k = self.geo.k
        fetched, v.fetched = v.fetched, []
        for experts, table, counts, copied in fetched:
            experts.record_window(table, np.asarray(e.backend.to_host(counts)), np.asarray(e.backend.to_host(copied)))
        a = out[k + 1]
        nxt = out[:k + 1][a, np.arange(out.shape[1])]
        return nxt, out[k + 2].astype(bool), np.ascontiguousarray(out[:k].T), a, out[k + 3]

    def clear(self, slots) -> None:
        """Executor.repair's share: the head's state of these slots zeroed, their drafts gone."""
        for i in slots:
            self.bank = self._clear(self.bank, np.int32(i))
            self.fresh[i] = False

    def stale(self, active: np.ndarray) -> None:
        """Rows of a window that did not verify: their drafts are for a state they no longer have."""
        self.fresh &= ~np.asarray(active, bool)

    def part(self, plan: WindowPlan):
        """A prompt part (runner.part's work, which hands back its last layer's output) and the head's share of it
        -> PartOut."""
        r, p = self.runner, plan.part
        i, n = p.slot, len(p.tokens)
        po, x = r.part.run(plan)
        first = po.next if po.rows is None else po.next[i:i + 1]
        self.bank = self._mtp_part(self.last.params, self.pool, self.bank, np.int32(i), x, _padded(p.tokens),
                                   np.int32(p.start), np.int32(n), first, last=p.last)
        self.fresh[i] = p.last
        for c in p.copies:
            self.bank = self._copy(self.bank, np.int32(i), np.int32(c))
            self.fresh[c] = False
        return po


def sequence_draft_logits(engine, token_ids, control_scale: float = 1.0) -> np.ndarray:
    """The head's draft logits at positions 0..n-2 of a fresh sequence of n tokens (each predicts the token two
    ahead), in the sequence form (every position at once, nothing of verify windows or drafting): the oracle tests'
    view of the head. Compiled once per n; every expert resident, unsplit; control_scale: the control vector's."""
    if engine.split:
        raise ValueError("sequence_draft_logits reads an unsplit engine")
    ops, cfg = engine.backend, engine.cfg
    head, pool = engine.mtp
    f = engine.compiled(("sequence_draft", engine.layout), lambda: ops.compile(
        partial(_sequence_draft, ops, cfg, engine.path, engine.layout, head)))
    state = ops.zeros_like(engine.init_state())
    kv = ops.zeros_like(attention_state(cfg, engine.capacity, engine.dtype, engine.kv_dtype))
    out = f(engine.params, engine.path.args(), pool, state, kv, np.asarray(token_ids, np.int32),
            **engine.cv([control_scale]))
    return np.asarray(ops.to_host(out))


def _sequence_draft(ops, cfg, path, layout, head: MtpHead, params, args, pool, state, kv, tokens, cv=None):
    n = tokens.shape[0]
    x, _ = forward_hidden(ops, cfg, params, state, tokens, np.int32(0), np.int32(n),
                          path.traced(layout, args, np.int32(n)), cv=cv)
    hn = final_hidden(ops, cfg, params, x)
    g, _ = mtp_hidden(ops, cfg, params, kv, tokens[1:], hn[:-1], np.int32(0), np.int32(n - 1),
                      head.experts(ops, pool, np.int32(n - 1)))
    return draft_logits(ops, cfg, params, g)
