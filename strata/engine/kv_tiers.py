"""The attention KV's two tiers per slot (kv_resident): each slot's device window holds positions base .. base + R - 1
(R rows; strata/model/forward.py kv_state), its host arrays position p at row p for p < base.

Invariants, kept by fit() before every window: a window writes positions [lo, hi) of a slot only when
base <= lo and hi - base <= R - 1, so every write lands in the device window and its last row stays free for the
scratch position of inactive decode rows; host rows [0, base) are exact (they are written only when base moves up,
from the window, and base never moves past a position a window is about to write, so lookahead's token past a
request's end never reaches the host). Moving base (move) writes the window back at the old base (write_back) and
reads the window at the new one from the host: one compiled function for moves up (spills) and down (a prompt that
resumes below base).
"""
from __future__ import annotations

import logging
from functools import partial

import numpy as np

from strata.backend import HOST, KV_NAMES, TIER_BASE
from strata.config import bucket_for
from strata.plan import WindowPlan

log = logging.getLogger("strata")


def _move(ops, states, slot, new_base, write_back: bool):
    """The bank with slot's window at new_base (written back to the host at its old base first when write_back)."""
    hk = ops.host_kv
    out = []
    for layer in states:
        if TIER_BASE not in layer:
            out.append(layer)
            continue
        layer = dict(layer)
        base = ops.take_row(layer[TIER_BASE], slot)
        for n in KV_NAMES:
            if n in layer:
                host = layer[n + HOST]
                window = ops.take_row(layer[n], slot)
                if write_back:
                    host = hk.host_write(host, window, slot, base)
                layer[n + HOST] = host
                layer[n] = ops.set_row(layer[n], slot, hk.host_window(host, slot, new_base, window.shape[0]))
        layer[TIER_BASE] = ops.set_row(layer[TIER_BASE], slot, new_base)
        out.append(layer)
    return out


class KvTiers:
    """The runner's view of its slots' tiers: the host's copy of each slot's base, and fit/move."""

    def __init__(self, runner, rows: int):
        self.runner, self.rows = runner, rows
        e = runner.engine
        self.base = np.zeros(runner.n_slots, np.int64)
        self._move = [{wb: e.compile_on(st, f"kv_move_{int(wb)}", partial(_move, write_back=wb),
                                        donate_argnums=(0,)) for wb in (False, True)} for st in e.stages]
        self.spills = 0                   # moves up, and the positions they sent to the host
        self.spilled_positions = 0
        self.reloads = 0                  # moves down (a prompt resuming below base)

    def writes(self, plan: WindowPlan) -> list[tuple[int, int, int]]:
        """(slot, lo, hi) of the positions each slot's rows in the plan write: a decode row its position (and its
        drafts'), a prompt part its padded bucket."""
        out = []
        span = 1 + (0 if plan.draft_len is None else int(np.max(plan.draft_len, initial=0)))
        for s in np.flatnonzero(plan.decode_active):
            p = int(plan.decode_pos[s])
            out.append((int(s), p, p + span))
        if plan.part is not None:
            p = plan.part
            out.append((p.slot, p.start, p.start + bucket_for(len(p.tokens))))
        return out

    def fit(self, plan: WindowPlan) -> None:
        """Move each slot's window so that the plan's writes keep the invariants (the module docstring)."""
        for slot, lo, hi in self.writes(plan):
            self.fit_slot(slot, lo, hi)

    def fit_slot(self, slot: int, lo: int, hi: int) -> None:
        b, r = int(self.base[slot]), self.rows
        if b <= lo and hi - b <= r - 1:
            return
        if hi - lo > r - 1:
            raise ValueError(f"a window writes {hi - lo} positions of slot {slot}, more than its device window of "
                             f"{r} rows holds beside its scratch row")
        # keep up to half the window of the positions before lo on the device (the newest, which decode rows read
        # most cheaply there), and room for the writes
        new = lo - min(lo, r // 2, r - 1 - (hi - lo))
        self.move(slot, new)
        if new > b:
            self.spills += 1
            self.spilled_positions += new - b
            log.info(f"strata kv: slot {slot} moved positions {b}..{new - 1} to host RAM ({new} there, "
                     f"{lo - new} on the device of {r - 1})")
        else:
            self.reloads += 1
            log.info(f"strata kv: slot {slot} resumes at position {lo}, below its host part's end {b}: positions "
                     f"{new}..{lo - 1} read back to the device")

    def move(self, slot: int, new_base: int, write_back: bool = True) -> None:
        """Slot's window to new_base (write_back False: the window's rows are dropped, not written to the host)."""
        fns = self._move
        self.runner.each_stage(lambda st, states: fns[st.index][write_back](states, np.int32(slot),
                                                                            np.int32(new_base)))
        self.base[slot] = new_base

    def reset(self, slot: int) -> None:
        """A slot cleared (its window zeroed at base 0 on the device): the host's copy follows."""
        self.base[slot] = 0

    def copied(self, src: int, dst: int) -> None:
        """Slot dst's state became a copy of slot src's (a part's copies, n > 1)."""
        self.base[dst] = self.base[src]
