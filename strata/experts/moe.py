"""Routed experts with a partial cache: resolve one layer's routes to slots, bring in what is missing, compute.

Called between a layer's router and the rest of the layer (LayerByLayer, strata/model/forward.py), routes on the host.
Hits: routes whose expert is RESIDENT in the table the call took (by value) at its start. Decode misses are copied into
cache slots, evicting the least valuable experts, and stay RESIDENT (miss_policy "fetch"), or computed on the CPU from
the host copy (miss_policy "cpu"). Prompt-part misses stream through staging slots borrowed from the cache (LOANED to
the part: out of the table before anything is written to them) or, with borrowing off, reserved at start. Misses that do
not fit run in passes of the same expert op, summed. Every expert computation, the CPU's too, is an `experts_pool` call,
so a format's scales apply the same way on every path; with `check_uses` (tests, --debug-slots) each pass first checks
that every slot it reads holds exactly the (layer, expert) it is read as, in the very pool value the pass computes with.
"""
from __future__ import annotations

import time
from functools import partial

import numpy as np

from strata.experts.cache import ExpertCache

MISS_POLICIES = ("fetch", "cpu")


class SlotMismatch(AssertionError):
    """A computation was about to read a slot whose bytes are not the expert it claims: the seed-000 bug."""


class MoeRunner:
    def __init__(self, ops, cache: ExpertCache, source, layout, n_experts: int, compiled, miss_policy: str = "fetch",
                 cpu_ops=None, borrow: bool = True, staging: int = 0, check_uses: bool = False,
                 verify_fills: bool = False, peer_ops=None):
        """source: where misses' bytes come from on the host (the mirror, else the store).
        cpu_ops: a backend on the CPU, where miss_policy "cpu" computes the misses.
        peer_ops: a backend on another device that computes a share of each prompt part's experts (prefill_help).
        staging: with borrow off, how many slots are reserved for prompt parts at start.
        compiled(name, make): the engine's memo of compiled functions."""
        if miss_policy not in MISS_POLICIES:
            raise ValueError(f"miss policy {miss_policy!r}; allowed: {', '.join(MISS_POLICIES)}")
        if miss_policy == "cpu" and cpu_ops is None:
            raise ValueError("miss policy 'cpu' needs a CPU backend (cpu_ops) to compute the misses on")
        self.ops, self.cache, self.source, self.layout = ops, cache, source, layout
        self.n_experts = n_experts
        self.miss_policy, self.borrow = miss_policy, borrow
        self.check_uses, self.verify_fills = check_uses, verify_fills
        self.staging = cache.reserve(staging, "staging") if (not borrow and staging) else []
        self.borrow_limit = max(1, cache.n_slots // 2)
        self._op = compiled(("experts_pool", layout), lambda: ops.compile(partial(_op, ops, layout, n_experts)))
        self.streamed_op = compiled(("experts_streamed", layout),
                                    lambda: ops.compile(partial(_streamed, ops, layout, n_experts)))
        self.pending_counts: list = []      # (MoE layer, routing counts [E] on the device) of streamed parts
        self.cpu_ops = cpu_ops
        self._cpu_op = cpu_ops.compile(partial(_cpu_op, cpu_ops, layout, n_experts)) if cpu_ops is not None else None
        self.peer_ops = peer_ops
        self._peer_op = peer_ops.compile(partial(_op, peer_ops, layout, n_experts)) if peer_ops is not None else None
        self.uses_checked = 0

    # --- one layer
    def compute(self, p: int, h, w, idx, valid: np.ndarray, part: bool, owner: str = "part"):
        """h [T, H], w [T, k] (device), idx [T, k] (device or host), valid [T] bool (host) -> y [T, H] (device)."""
        ids = np.asarray(self.ops.to_host(idx)).astype(np.int32)
        ids = np.where(valid[:, None], ids, -1)                                       # [T, k]; -1: no route
        routed = ids >= 0
        self.cache.observe(p, np.bincount(ids[routed], minlength=self.n_experts))
        table = self.cache.table_row(p)                                               # by value
        slots = np.where(routed, table[np.maximum(ids, 0)], -1).astype(np.int32)
        hit = slots >= 0
        missing = np.unique(ids[routed & ~hit])
        st = self.cache.stats
        st.hits += int(hit.sum())
        st.misses += int((routed & ~hit).sum())
        if part and self.peer_ops is not None:
            return self._helped(p, h, w, ids, slots, missing)
        if len(missing) == 0:
            return self._run(h, slots, w, p, ids)
        if part:
            return self._staged(p, h, w, ids, slots, missing, owner)
        if self.miss_policy == "cpu":
            return self._cpu(p, h, w, ids, slots, missing)
        return self._fetch(p, h, w, ids, slots, missing)

    def _fetch(self, p, h, w, ids, slots, missing):
        """Copy the missing experts into cache slots (evicting by score), then compute; in passes if they do not
        all fit beside this call's hits."""
        cache = self.cache
        keep = set(int(s) for s in np.unique(slots[slots >= 0]))
        victims = cache.victims(len(missing), keep)
        if len(victims) == len(missing):
            self._refill(victims, p, missing)
            table = cache.table_row(p)
            slots = np.where(ids >= 0, table[np.maximum(ids, 0)], -1).astype(np.int32)
            return self._run(h, slots, w, p, ids)
        # passes: this call's hits first, then the misses as many at a time as there are slots to reuse (slots on
        # loan, such as reserved staging slots, are not among them)
        y = self._run(h, slots, w, p, ids)
        room = len(cache.victims(cache.n_slots))
        for start in range(0, len(missing), room):
            chunk = missing[start:start + room]
            self._refill(cache.victims(len(chunk)), p, chunk)
            table = cache.table_row(p)
            sel = np.isin(ids, chunk)
            s = np.where(sel, table[np.maximum(ids, 0)], -1).astype(np.int32)
            y = y + self._run(h, s, w, p, ids)
        return y

    def _refill(self, victims, p, experts):
        cache = self.cache
        for i in victims:
            if cache.slot(i).state.name == "RESIDENT":
                cache.evict(i)
        cache.fill(victims, [(p, int(e)) for e in experts], verify=self.verify_fills)

    def _staged(self, p, h, w, ids, slots, missing, owner):
        """A prompt part's misses, streamed through staging slots (borrowed, or reserved when borrowing is off)."""
        cache = self.cache
        hits = slots >= 0
        if self.borrow:
            keep = set(int(s) for s in np.unique(slots[hits]))
            staging = cache.loan(min(len(missing), self.borrow_limit), owner, keep)
            loaned = staging
        else:
            staging, loaned = self.staging, []
        y = None
        if not staging:                     # every other slot holds this call's hits: compute them, then borrow
            y = self._run(h, slots, w, p, ids)
            staging = loaned = cache.loan(min(len(missing), self.borrow_limit), owner)
            hits = np.zeros_like(hits)
        try:
            for start in range(0, len(missing), len(staging)):
                chunk = missing[start:start + len(staging)]
                dest = np.asarray(staging[:len(chunk)], np.int32)
                cache.write_loaned(dest, [(p, int(e)) for e in chunk], owner if self.borrow else "staging")
                lut = np.full(self.n_experts, -1, np.int32)
                lut[chunk] = dest
                sel = np.isin(ids, chunk)
                s = np.where(sel, lut[np.maximum(ids, 0)], -1)
                if start == 0:
                    s = np.where(hits, slots, s)                      # the first pass also computes the hits
                s = s.astype(np.int32)
                part = self._run(h, s, w, p, ids)
                y = part if y is None else y + part
        finally:
            if loaned:
                cache.give_back(loaned, owner)
        return y

    def _helped(self, p, h, w, ids, slots, missing):
        """A prompt part with a peer's help: the peer computes the misses and, up to half of the experts the part
        routes to, the highest-numbered hits, from host copies sent to it; this device computes the other hits."""
        t = time.perf_counter()
        used = np.unique(ids[ids >= 0])
        hits = np.setdiff1d(used, missing)
        extra = max(0, len(used) // 2 - len(missing))
        share = np.concatenate([missing, hits[len(hits) - extra:] if extra else hits[:0]]).astype(np.int32)
        sel = np.isin(ids, share) & (ids >= 0)
        y = self._run(h, np.where(sel, -1, slots).astype(np.int32), w, p, ids)
        if len(share):
            lut = np.full(self.n_experts, -1, np.int32)
            lut[share] = np.arange(len(share))
            s = np.where(sel, lut[np.maximum(ids, 0)], -1).astype(np.int32)
            peer = self.peer_ops
            y_peer = self._peer_op(peer.to_device(h), s, peer.to_device(w), peer.to_device(self.source.blobs(p, share)))
            y = y + self.ops.to_device(y_peer)
            self.cache.stats.peer_routes += int(sel.sum())
        self.cache.stats.peer_seconds += time.perf_counter() - t
        return y

    def _cpu(self, p, h, w, ids, slots, missing):
        """Hits on the device; misses on the CPU from the host copy (the same expert op, run there)."""
        t = time.perf_counter()
        y = self._run(h, slots, w, p, ids)
        lut = np.full(self.n_experts, -1, np.int32)
        lut[missing] = np.arange(len(missing))                        # expert -> row of the host blobs
        blobs = self.source.blobs(p, missing)
        sel = (ids >= 0) & (slots < 0)
        s = np.where(sel, lut[np.maximum(ids, 0)], -1).astype(np.int32)
        h_host = np.asarray(self.ops.to_host(h))
        y_cpu = self._cpu_compute(h_host, s, self.ops.to_host(w), blobs)
        self.cache.stats.cpu_routes += int(sel.sum())
        self.cache.stats.cpu_seconds += time.perf_counter() - t
        return y + self.ops.to_device(y_cpu.astype(h_host.dtype))

    def compute_cpu(self, p: int, h, w, idx, valid: np.ndarray):
        """Every route of MoE layer p computed on the CPU from the host tier (no device slot is read): the numerics
        guard's cpu_experts path. Arguments as compute()."""
        if self.cpu_ops is None:
            raise ValueError("experts on the CPU need a CPU backend (cpu_ops)")
        t = time.perf_counter()
        ids = np.asarray(self.ops.to_host(idx)).astype(np.int32)
        ids = np.where(valid[:, None], ids, -1)
        used = np.unique(ids[ids >= 0])
        h_host = np.asarray(self.ops.to_host(h))
        if len(used) == 0:
            return self.ops.to_device(np.zeros_like(h_host))
        lut = np.full(self.n_experts, -1, np.int32)
        lut[used] = np.arange(len(used))
        s = np.where(ids >= 0, lut[np.maximum(ids, 0)], -1).astype(np.int32)
        y = self._cpu_compute(h_host, s, np.asarray(self.ops.to_host(w)).astype(h_host.dtype),
                              self.source.blobs(p, used))
        self.cache.stats.cpu_routes += int((ids >= 0).sum())
        self.cache.stats.cpu_seconds += time.perf_counter() - t
        return self.ops.to_device(y.astype(h_host.dtype))

    def _cpu_compute(self, h, s, w, blobs):
        c = self.cpu_ops
        return np.asarray(c.to_host(self._cpu_op(*c.to_device((np.asarray(h), s, np.asarray(w), blobs)))))

    def settle(self) -> None:
        """Record streamed parts' routing counts (strata/experts/stream.py), read back after their parts ran."""
        pending, self.pending_counts = self.pending_counts, []
        for p, counts in pending:
            c = np.asarray(self.ops.to_host(counts)).astype(np.int64)
            self.cache.observe(p, c)
            hits = int(c[self.cache.table_row(p) >= 0].sum())
            self.cache.stats.hits += hits
            self.cache.stats.misses += int(c.sum()) - hits

    # --- every device pass
    def _run(self, h, slots, w, p: int, ids):
        """One pass of the expert op: route (t, j) reads slot slots[t, j] (-1: not in this pass) as expert
        (p, ids[t, j])."""
        if self.check_uses:
            use = slots >= 0
            used = slots[use]
            if len(used):
                claimed = [(p, int(e)) for e in ids[use]]
                if not self.cache.content_matches(self.cache.pool, [int(s) for s in used], claimed):
                    raise SlotMismatch(f"a pass would read slots {sorted(set(int(s) for s in used))} whose bytes "
                                       f"are not the experts it claims")
                self.uses_checked += len(used)
        return self._op(h, slots, w, self.cache.pool)


def _op(ops, layout, n_experts, h, slots, w, pool):
    return ops.experts_pool(h, slots, w.astype(h.dtype), pool, layout, n_experts)


def _cpu_op(ops, layout, n_experts, h, slots, w, blobs):
    """The misses' pass on the CPU: w as the host gave it (the device passes cast it to h's dtype)."""
    return ops.experts_pool(h, slots, w, blobs, layout, n_experts)


def _streamed(ops, layout, n_experts, h, idx, w, n_valid, pool, table_row):
    """A prompt part's routed experts of one MoE layer from `pool` (the cache's slots, or the layer's experts staged
    whole) through table_row [E] (the slot of each expert) -> (y [T, H], routing counts [E] of the real rows)."""
    valid = ops.valid_mask(h.shape[0], n_valid)
    slots = ops.expert_slots(table_row, idx, n_valid)
    return ops.experts_pool(h, slots, w.astype(h.dtype), pool, layout, n_experts), ops.route_counts(idx, valid,
                                                                                                    n_experts)
