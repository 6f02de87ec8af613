"""Copies of one slot's sequence state for the prompt cache (the Executor's snapshot, restore, to_host, save_kv,
load_kv and copy_kv in strata/plan.py), built on the row take/put that copies a slot for an n-choice request.

A snapshot is the recurrent state of the linear layers (conv + delta rule) of one slot, a device copy; the attention
KV is not copied, since a part that continues a restored state overwrites the positions beyond it before any query
sees them. Parking copies the KV of a sequence's first n positions to host RAM and back (a branch: slot to slot) in
blocks of two sizes (two compiled shapes); with a host tier it keeps the slot's host row instead while one is free
(ParkedRow). With speculative decoding the MTP head's hidden state and KV go along. Every function runs on the bank
as the windows dispatched so far leave it (threaded through as a value: device order follows data).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from strata.backend import HOST, KV_NAMES, TIER_ROW
from strata.model.config import LINEAR
from strata.model.forward import host_row
from strata.plan import Saved

# rows per block of a parked KV: large blocks for the bulk (each copy has a fixed cost besides its bytes), small
# ones for the rest (a short conversation parks its own rows, not a large block's)
KV_BLOCK_MAX, KV_BLOCK_MIN = 4096, 256
# blocks of a parked KV whose copies to the host are queued before the oldest is read: the copies overlap the next
# blocks' device work instead of the host waiting on each in turn, and the device holds at most this many extra blocks
KV_BLOCKS_IN_FLIGHT = 4


def take_slot(ops, states, slot, layers):
    """Slot `slot`'s rows of the given layers of a bank: [{name: [...]}] (each a fresh array on the device; a
    two-tier KV's host rows, the slot's row of its host banks, stay in host memory, where adding a device constant
    is refused)."""
    return [{k: ops.take_row(v, host_row(ops, states[i], slot)) if k.endswith(HOST) else ops.take_row(v, slot) + 0
             for k, v in states[i].items() if k != TIER_ROW} for i in layers]


def put_slot(ops, states, slot, layers, rows):
    """The bank with slot `slot`'s rows of the given layers set to `rows` (take_slot's form; a two-tier KV's host
    rows into the slot's own row of its host banks)."""
    states = list(states)
    for i, row in zip(layers, rows):
        at = {k: host_row(ops, states[i], slot) if k.endswith(HOST) else slot for k in row}
        states[i] = {**states[i], **{k: ops.set_row(states[i][k], at[k], x) for k, x in row.items()}}
    return states


def _take_block(ops, layers, block, states, slot, start):
    """KV rows start .. start + block - 1 of one slot, per attention layer (a start past the cache's last block is
    clamped to it: kv_read and kv_write clamp alike, so a block goes back where it came from)."""
    return [{k: ops.kv_read(ops.take_row(v, slot), start, block) + 0 for k, v in states[i].items()}
            for i in layers]


def _put_block(ops, layers, block, states, slot, start, rows):
    states = list(states)
    for i, row in zip(layers, rows):
        states[i] = {k: ops.set_row(v, slot, ops.kv_write(ops.take_row(v, slot), row[k], start))
                     for k, v in states[i].items()}
    return states


def _take_host_block(ops, layers, block, states, slot, start):
    """_take_block of a two-tier cache: the positions' rows of its host arrays (the window written back first)."""
    return [{n: ops.host_kv.host_window(states[i][n + HOST], host_row(ops, states[i], slot), start, block)
             for n in KV_NAMES if n in states[i]} for i in layers]


def _take_row_block(ops, layers, block, states, row, start):
    """_take_host_block of host row `row` (a conversation parked by reference)."""
    return [{n: ops.host_kv.host_window(states[i][n + HOST], row, start, block)
             for n in KV_NAMES if n in states[i]} for i in layers]


def _put_host_block(ops, layers, block, states, slot, start, rows):
    """_put_block of a two-tier cache: into its host arrays (the window read from them after the last block)."""
    states = list(states)
    for i, row in zip(layers, rows):
        at = host_row(ops, states[i], slot)
        states[i] = dict(states[i], **{n + HOST: ops.host_kv.host_write(states[i][n + HOST], x, at, start)
                                       for n, x in row.items()})
    return states


def kv_blocks(n: int, sizes: tuple[int, int]) -> list[tuple[int, int]]:
    """The (start, rows) blocks that copy positions 0..n-1: large blocks while they fit in n, then small ones."""
    large, small = sizes
    out = [(a, large) for a in range(0, n - large + 1, large)]
    at = len(out) * large
    return out + [(a, small) for a in range(at, n, small)]


class SlotCopies:
    """The runner's state copies (WindowRunner delegates the Executor's prompt-cache methods here), each stage's
    layers copied by that stage's own compiled functions on its device (a Saved lists the model's layers in order)."""

    def __init__(self, runner):
        self.runner = r = runner
        e = r.engine
        self.ops = e.backend
        large = min(KV_BLOCK_MAX, e.capacity)
        self.sizes = (large, min(KV_BLOCK_MIN, large))
        take_kv, put_kv = (_take_host_block, _put_host_block) if r.tiers is not None else (_take_block, _put_block)
        self._copying: list[list[dict]] = []     # to_host's snapshots whose copies are under way
        self._head_fns = None                     # the MTP head's copies (runner.spec), compiled at first use
        self._fns = []
        for st in e.stages:
            ops, c = st.ops, st.ops.compile
            types = st.cfg.layer_types
            linear = tuple(i for i, t in enumerate(types) if t == LINEAR)
            full = tuple(i for i, t in enumerate(types) if t != LINEAR)
            memo = st.compiled or e.compiled
            self._fns.append((st, linear, full,
                              memo("take_recurrent", lambda: c(partial(take_slot, ops, layers=linear))),
                              memo("put_recurrent", lambda: c(partial(put_slot, ops, layers=linear),
                                                              donate_argnums=(0,))),
                              {b: memo(f"take_kv_block_{b}", lambda b=b: c(partial(take_kv, ops, full, b)))
                               for b in self.sizes},
                              {b: memo(f"put_kv_block_{b}", lambda b=b: c(partial(put_kv, ops, full, b),
                                                                          donate_argnums=(0,)))
                               for b in self.sizes},
                              {b: memo(f"take_row_kv_block_{b}", lambda b=b: c(partial(_take_row_block, ops, full, b)))
                               for b in self.sizes} if r.tiers is not None else {}))

    def snapshot(self, slot: int) -> Saved:
        states = self.runner.states
        rows = [row for st, linear, _, take, *_ in self._fns if linear
                for row in take(st.of(states), np.int32(slot))]
        head = self._head()
        if head is not None:                      # the MTP head's hidden state that the next part starts from
            rows.append({"h": head["take_h"](self.runner.spec.bank["h"], np.int32(slot))})
        return Saved(rows, _nbytes(rows), on_host=False)

    def restore(self, slot: int, saved: Saved) -> None:
        r, at = self.runner, 0
        for st, linear, _, _, put, *_ in self._fns:
            if linear:
                a, b = st.layers.start, st.layers.stop
                rows = [st.ops.to_device(x) for x in saved.data[at:at + len(linear)]] if saved.on_host else \
                    saved.data[at:at + len(linear)]
                r.states[a:b] = put(r.states[a:b], np.int32(slot), rows=rows)
                at += len(linear)
        head = self._head()
        if head is not None and at < len(saved.data):
            bank = r.spec.bank
            r.spec.bank = {**bank, "h": head["put_h"](bank["h"], np.int32(slot), self.ops.to_device(saved.data[at]["h"]))}

    def _head(self) -> dict | None:
        """The MTP head's copies (None without speculative decoding): its hidden-state row, and its KV in blocks."""
        if self.runner.spec is None:
            return None
        if self._head_fns is None:
            e, ops = self.runner.engine, self.ops
            c = ops.compile
            self._head_fns = {
                "take_h": e.compiled("take_head_h", lambda: c(lambda h, slot: ops.take_row(h, slot) + 0)),
                "put_h": e.compiled("put_head_h", lambda: c(lambda h, slot, x: ops.set_row(h, slot, x),
                                                          donate_argnums=(0,))),
                "take": {b: e.compiled(f"take_head_kv_{b}", lambda b=b: c(partial(_take_block, ops, (0,), b)))
                         for b in self.sizes},
                "put": {b: e.compiled(f"put_head_kv_{b}", lambda b=b: c(partial(_put_block, ops, (0,), b),
                                                                         donate_argnums=(0,))) for b in self.sizes}}
        return self._head_fns

    def _head_block(self, size: int, slot: int, start: int) -> list[dict]:
        """The head's KV rows start .. start + size - 1 of a slot ([one layer's dict], on the device)."""
        return self._head()["take"][size]([self.runner.spec.bank["kv"]], np.int32(slot), np.int32(start))

    def _put_head_block(self, slot: int, start: int, rows: list[dict]) -> None:
        spec = self.runner.spec
        size = next(iter(rows[0].values())).shape[0]
        kv = self._head()["put"][size]([spec.bank["kv"]], np.int32(slot), np.int32(start), rows)[0]
        spec.bank = {**spec.bank, "kv": kv}

    def to_host(self, saved: Saved) -> Saved:
        """The snapshot's copy to host RAM started, not waited for: its arrays are read into host memory (in place
        in the Saved's layers) at the next to_host, by when the copy has long finished (a checkpoint at real shapes
        is tens of MB over pageable memory, which the scheduler's loop would otherwise wait for at each take); until
        then its device arrays stay (at most the last call's), and restore() takes either form."""
        if saved.on_host:
            return saved
        self.settle()
        for layer in saved.data:
            for v in layer.values():
                self.ops.start_to_host(v)
        layers = [dict(layer) for layer in saved.data]
        self._copying.append(layers)
        return Saved(layers, saved.nbytes, on_host=True)

    def settle(self) -> None:
        """The snapshots whose copies to_host started: read into host memory (their device arrays released)."""
        to_host = self.ops.to_host
        for layers in self._copying:
            for layer in layers:
                layer.update({k: np.asarray(to_host(v)) for k, v in layer.items()})
        self._copying = []

    def save_kv(self, slot: int, n: int) -> Saved:
        ops, tiers = self.ops, self.runner.tiers
        head = self._head() is not None
        if tiers is not None:         # by reference: the slot's host row stays the conversation's
            row = tiers.park(slot)
            if row is not None:
                blocks = self._to_host_blocks(n, lambda size, start: self._head_block(size, slot, start)) \
                    if head else []
                return Saved(ParkedRow(row, tuple(blocks)), sum(_nbytes(rows) for _, rows in blocks), on_host=True,
                             tokens=n)
            tiers.move(slot, int(tiers.base[slot]))   # else the window written back: the host row holds every position

        def take(size, start):
            rows = [row for st, _, full, _, _, take_kv, *_ in self._fns if full
                    for row in take_kv[size](st.of(self.runner.states), np.int32(slot), np.int32(start))]
            return rows + (self._head_block(size, slot, start) if head else [])
        blocks = self._to_host_blocks(n, take)
        return Saved(blocks, sum(_nbytes(rows) for _, rows in blocks), on_host=True, tokens=n)

    def _to_host_blocks(self, n: int, take) -> list[tuple[int, list[dict]]]:
        """[(start, rows)] of take(size, start) over the blocks of n positions, in host memory: each block's copy to
        the host queued behind its take, read KV_BLOCKS_IN_FLIGHT blocks later."""
        ops, blocks, pending = self.ops, [], []

        def read_oldest():
            start, rows = pending.pop(0)
            blocks.append((start, [{k: np.asarray(ops.to_host(v)) for k, v in layer.items()} for layer in rows]))
        for start, size in kv_blocks(n, self.sizes):
            rows = take(size, start)
            for layer in rows:
                for v in layer.values():
                    ops.start_to_host(v)
            pending.append((start, rows))
            if len(pending) == KV_BLOCKS_IN_FLIGHT:
                read_oldest()
        while pending:
            read_oldest()
        return blocks

    def load_kv(self, slot: int, saved: Saved) -> None:
        r = self.runner
        if isinstance(saved.data, ParkedRow):
            r.tiers.resume(slot, saved.data.row, saved.tokens)
            self._load_head(slot, saved.data.head)
            return
        for start, rows in saved.data:
            at = 0
            for st, _, full, _, _, _, put_kv, _ in self._fns:
                if full:
                    a, z = st.layers.start, st.layers.stop
                    size = next(iter(rows[at].values())).shape[0]
                    r.states[a:z] = put_kv[size](r.states[a:z], np.int32(slot), np.int32(start),
                                                 rows[at:at + len(full)])
                    at += len(full)
            if at < len(rows) and self._head() is not None:
                self._put_head_block(slot, start, rows[at:])
        if r.tiers is not None:       # the window read at the newest positions (the next part starts from there)
            r.tiers.move(slot, max(0, saved.tokens - r.tiers.rows // 2), write_back=False)

    def _load_head(self, slot: int, blocks) -> None:
        if self._head() is not None:
            for start, rows in blocks:
                self._put_head_block(slot, start, rows)

    def drop_kv(self, saved: Saved) -> None:
        if isinstance(saved.data, ParkedRow):
            self.runner.tiers.release(saved.data.row)

    def copy_kv(self, slot: int, n: int, src) -> None:
        """Slot's KV positions 0..n-1 set to those of slot `src` or of a parked KV (a Saved, which stays parked),
        block by block on the device (with a host tier: host row to host row, then the slot's window read)."""
        r, tiers = self.runner, self.runner.tiers
        if isinstance(src, Saved) and not isinstance(src.data, ParkedRow):
            self.load_kv(slot, Saved([(a, rows) for a, rows in src.data if a < n], src.nbytes, True, tokens=n))
            return
        if tiers is not None and not isinstance(src, Saved):
            tiers.move(src, int(tiers.base[src]))    # its window written back: the host row holds every position
        for start, size in kv_blocks(n, self.sizes):
            for st, _, full, _, _, take_kv, put_kv, take_row_kv in self._fns:
                if full:
                    a, z = st.layers.start, st.layers.stop
                    rows = take_row_kv[size](st.of(r.states), np.int32(src.data.row), np.int32(start)) \
                        if isinstance(src, Saved) else take_kv[size](st.of(r.states), np.int32(src), np.int32(start))
                    r.states[a:z] = put_kv[size](r.states[a:z], np.int32(slot), np.int32(start), rows)
            if self._head() is not None and not isinstance(src, Saved):
                self._put_head_block(slot, start, self._head_block(size, src, start))
        if isinstance(src, Saved):
            self._load_head(slot, [(a, rows) for a, rows in src.data.head if a < n])
        if tiers is not None:         # the window read at the newest positions (the next part starts from there)
            tiers.move(slot, max(0, n - tiers.rows // 2), write_back=False)


@dataclass(frozen=True)
class ParkedRow:
    """A conversation parked by reference: the host-tier row (of every two-tier layer's banks) holding its KV, and
    the MTP head's KV blocks (copied: the head has no host tier)."""
    row: int
    head: tuple = ()


def _nbytes(rows) -> int:
    return int(sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for layer in rows for v in layer.values()))
