"""The attention KV's two tiers per slot (kv_resident): each slot's device window holds positions base .. base + R - 1
(R rows; strata/model/forward.py kv_state), its host row (TIER_ROW: host arrays are banks of slots + parked rows, so a
parked conversation keeps its row while the slot takes a free one) position p at row p for p < base.

Invariants, kept by fit() before every window: a window writes positions [lo, hi) of a slot only when
base <= lo and hi - base <= R - 1, so every write lands in the device window and its last row stays free for the
scratch position of inactive decode rows; host rows [0, base) are exact (written only when base moves up, from the
window, never past a position a window is about to write, so lookahead's token past a request's end never reaches
the host). A move writes the window back at the old base and reads it at the new one: one compiled function for
spills, reloads (a prompt resuming below base), parking (write back, then a free row) and resuming (the parked row).
"""
from __future__ import annotations

import logging
from functools import partial

import numpy as np

from strata.backend import HOST, KV_NAMES, TIER_BASE, TIER_ROW
from strata.config import bucket_for
from strata.model.forward import host_row, put_slot_layer, slot_layer
from strata.plan import WindowPlan

log = logging.getLogger("strata")


def slot_state(ops, states: list, slot) -> list:
    """One slot's sequence state from a bank (forward.slot_layer of each layer)."""
    return [slot_layer(ops, layer, slot) for layer in states]


def put_slot_state(ops, states: list, slot, state: list) -> list:
    """The bank with slot's state set from `state` (forward.put_slot_layer of each layer)."""
    return [put_slot_layer(ops, layer, slot, st) for layer, st in zip(states, state)]


def _move(ops, states, slot, new_base, new_row, write_back: bool):
    """The bank with slot's window at new_base of host row new_row (written back to the host at its old base of its
    old row first when write_back), that row now the slot's."""
    hk = ops.host_kv
    out = []
    for layer in states:
        if TIER_BASE not in layer:
            out.append(layer)
            continue
        layer = dict(layer)
        base, row = ops.take_row(layer[TIER_BASE], slot), host_row(ops, layer, slot)
        for n in KV_NAMES:
            if n in layer:
                host = layer[n + HOST]
                window = ops.take_row(layer[n], slot)
                if write_back:
                    host = hk.host_write(host, window, row, base)
                layer[n + HOST] = host
                layer[n] = ops.set_row(layer[n], slot, hk.host_window(host, new_row, new_base, window.shape[0]))
        layer[TIER_BASE] = ops.set_row(layer[TIER_BASE], slot, new_base)
        layer[TIER_ROW] = ops.set_row(layer[TIER_ROW], slot, new_row)
        out.append(layer)
    return out


def _set_rows(ops, states, rows: np.ndarray):
    """The bank with TIER_ROW set to rows [S] in every two-tier layer (an array each: windows donate them)."""
    return [{**layer, TIER_ROW: ops.to_device(rows.astype(np.int32))} if TIER_ROW in layer else layer
            for layer in states]


class KvTiers:
    """The runner's view of its slots' tiers: the host's copy of each slot's base and host row, the free rows, and
    fit/move/park/resume."""

    def __init__(self, runner, rows: int, parked_rows: int):
        self.runner, self.rows = runner, rows
        e, n = runner.engine, runner.n_slots
        self.base = np.zeros(n, np.int64)
        self.row = np.arange(n)                              # each slot's host row; rows n.. start free
        self.free = list(range(n, n + parked_rows))
        self._move = [{wb: e.compile_on(st, f"kv_move_{int(wb)}", partial(_move, write_back=wb),
                                        donate_argnums=(0,)) for wb in (False, True)} for st in e.stages]
        runner.each_stage(lambda st, states: _set_rows(st.ops, states, self.row))
        self.spills = 0                   # moves up, and the positions they sent to the host
        self.spilled_positions = 0
        self.reloads = 0                  # moves down (a prompt resuming below base)
        self.parks = 0                    # conversations parked by reference (their host row kept)

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

    def move(self, slot: int, new_base: int, write_back: bool = True, new_row: int | None = None) -> None:
        """Slot's window to new_base (write_back False: the window's rows are dropped, not written to the host), of
        host row new_row (None: its own)."""
        fns, row = self._move, int(self.row[slot] if new_row is None else new_row)
        self.runner.each_stage(lambda st, states: fns[st.index][write_back](states, np.int32(slot),
                                                                            np.int32(new_base), np.int32(row)))
        self.base[slot], self.row[slot] = new_base, row

    def park(self, slot: int) -> int | None:
        """Slot's conversation parked by reference: its window written back to its host row, which it keeps, and
        the slot given a free row (at base 0). -> the conversation's row; None when no row is free."""
        if not self.free:
            return None
        row = int(self.row[slot])
        self.move(slot, 0, new_row=self.free.pop())
        self.parks += 1
        return row

    def resume(self, slot: int, row: int, tokens: int) -> None:
        """A conversation parked by reference (park's row, its first `tokens` positions) into slot: the slot's own
        row goes free, and its window is read at the newest positions (the next part starts from there)."""
        self.free.append(int(self.row[slot]))
        self.move(slot, max(0, tokens - self.rows // 2), write_back=False, new_row=row)

    def release(self, row: int) -> None:
        """A parked conversation's row back to the free ones (the conversation dropped)."""
        self.free.append(row)

    def reset(self, slot: int) -> None:
        """A slot cleared (its window zeroed at base 0 on the device): the host's copy follows."""
        self.base[slot] = 0

    def copied(self, src: int, dst: int) -> None:
        """Slot dst's state became a copy of slot src's (a part's copies, n > 1)."""
        self.base[dst] = self.base[src]
