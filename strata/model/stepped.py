"""The forward pass one layer at a time, for an expert cache that does not hold every expert.

The same building blocks as forward.py (layer_front, layer_back, head), each compiled once per layer kind and
shape; between a sparse layer's router and the rest of the layer the routes come to the host and the MoeRunner
(strata/experts/moe.py) resolves them to slots, brings in what is missing and runs the expert op. Three shapes of
call: one sequence's state (Engine sequences), one slot of the runner's bank (a prompt part), and all slots of the
bank at once (decode rows, one token each: the layers' rows mode, strata/backend.py).

When every expert is mirrored in pinned host memory, decode rows need no round trip at all: rows_fetching is the same
loop as rows() inside one compiled function, the device copying each layer's misses itself.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from strata.model.config import ModelConfig
from strata.model.forward import embed, head, layer_back, layer_front


class SteppedForward:
    def __init__(self, ops, cfg: ModelConfig, moe, compiled):
        self.ops, self.cfg, self.moe = ops, cfg, moe
        c = ops.compile
        self._embed = compiled("st_embed", lambda: c(embed))
        self._front_seq = compiled("st_front_seq", lambda: c(partial(_front_seq, ops, cfg), donate_argnums=(1,),
                                                             static_argnames=("kind",)))
        self._front_slot = compiled("st_front_slot", lambda: c(partial(_front_slot, ops, cfg), donate_argnums=(1,),
                                                               static_argnames=("kind",)))
        self._front_rows = compiled("st_front_rows", lambda: c(partial(_front_rows, ops, cfg), donate_argnums=(1,),
                                                               static_argnames=("kind",)))
        self._back = compiled("st_back", lambda: c(partial(layer_back, ops, cfg)))
        self._head = compiled("st_head", lambda: c(partial(head, ops, cfg), static_argnames=("all_logits",)))

    def sequence(self, params, state: list, tokens, start: int, n_valid: int, all_logits: bool):
        """One sequence's part (T tokens, the first n_valid real) -> (logits, new state)."""
        def front(lp, st, x, kind):
            return self._front_seq(lp, st, x, np.int32(start), np.int32(n_valid), kind=kind)
        return self._part(params, state, tokens, n_valid, all_logits, front, "sequence")

    def slot_part(self, params, bank: list, slot: int, tokens, start: int, n_valid: int):
        """A prompt part on one slot of the runner's bank -> (logits [1, V] of its last real row, new bank)."""
        def front(lp, st, x, kind):
            return self._front_slot(lp, st, np.int32(slot), x, np.int32(start), np.int32(n_valid), kind=kind)
        return self._part(params, bank, tokens, n_valid, False, front, f"prompt part of slot {slot}")

    def _part(self, params, states: list, tokens, n_valid: int, all_logits: bool, front, owner: str):
        """The layers of one part: front(lp, layer state, x, kind) runs a layer's first half on whichever state."""
        t = len(tokens)
        valid = np.arange(t) < n_valid
        x = self._embed(params, tokens)
        states = list(states)
        p = 0
        for i, (kind, lp) in enumerate(zip(self.cfg.layer_types, params["layers"])):
            x, h, w, idx, shared, states[i] = front(lp, states[i], x, kind)
            if h is not None:
                y = self.moe.compute(p, h, w, idx, valid, part=t > 1, owner=owner)
                x = self._back(lp, x, shared, y)
                p += 1
        return self._head(params, x, np.int32(n_valid), all_logits=all_logits), states

    def rows(self, params, bank: list, tokens, pos, active):
        """One token for each slot of the bank (tokens, pos, active [S]) -> (logits [S, V], new bank)."""
        s = len(tokens)
        valid = np.asarray(active) > 0
        x = self._embed(params, np.asarray(tokens))                                    # [S, H]
        bank = list(bank)
        p = 0
        for i, (kind, lp) in enumerate(zip(self.cfg.layer_types, params["layers"])):
            x, h, w, idx, shared, bank[i] = self._front_rows(lp, bank[i], x, pos, active, kind=kind)  # h [S, H]
            if h is not None:
                y = self.moe.compute(p, h, w, idx, valid, part=False)                  # w, idx [S, k]
                x = self._back(lp, x, shared, y)
                p += 1
        return self._head(params, x, np.int32(s), all_logits=True), bank


def rows_fetching(ops, cfg: ModelConfig, layout, starts: tuple, params, experts: dict, bank: list, tokens, pos,
                  active):
    """Decode rows over a partial cache as ONE compiled function: rows() with each sparse layer's experts computed
    by ops.experts_fetch, which reads hits from the pool and copies misses from the pinned host chunks itself.
    experts = {"pool", "table" [Lp, E] (by value), "chunks": per MoE layer its host chunks}; starts: per MoE layer
    the chunks' first experts (static). -> (logits [S, V], new bank, routing counts [Lp, E], copied [Lp])."""
    s = tokens.shape[0]
    valid = active > 0
    x = embed(params, tokens)                                                            # [S, H]
    bank = list(bank)
    counts, copied = [], []
    p = 0
    for i, (kind, lp) in enumerate(zip(cfg.layer_types, params["layers"])):
        x, h, w, idx, shared, bank[i] = _front_rows(ops, cfg, lp, bank[i], x, pos, active, kind)
        if h is not None:
            y, n = ops.experts_fetch(h, idx, w, valid, experts["pool"], experts["table"][p], experts["chunks"][p],
                                     starts[p], layout)
            x = layer_back(ops, cfg, lp, x, shared, y)
            counts.append(ops.route_counts(idx, valid, cfg.num_experts))
            copied.append(n)
            p += 1
    logits = head(ops, cfg, params, x, s, all_logits=True)
    return logits, bank, ops.xp.stack(counts), ops.xp.stack(copied)


def _front_seq(ops, cfg, lp, st, x, start, n_valid, kind):
    return layer_front(ops, cfg, kind, lp, st, x, start, n_valid)


def _front_slot(ops, cfg, lp, bank, slot, x, start, n_valid, kind):
    st = {k: v[slot] for k, v in bank.items()}
    x, h, w, idx, shared, st = layer_front(ops, cfg, kind, lp, st, x, start, n_valid)
    return x, h, w, idx, shared, {k: ops.set_row(bank[k], slot, v) for k, v in st.items()}


def _front_rows(ops, cfg, lp, bank, x, pos, active, kind):
    """layer_front over the bank's S sequences, one token each (x [S, H]; pos, active [S])."""
    return layer_front(ops, cfg, kind, lp, bank, x, pos, active)

