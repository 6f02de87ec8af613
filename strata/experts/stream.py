"""PartStream: a prompt part's routed experts when every expert is mirrored in pinned host memory: each MoE layer's
experts are copied to the device whole, on the copy engine (HostFetch.stage_layer), while earlier layers compute.

A part of thousands of tokens routes to nearly all of a layer's experts, so the copies need no routes. A copy starts
after the computations queued before it, so copies are issued AHEAD streamed layers early; at most AHEAD + 1 live
(before one is issued, the streamed layer before the current one has finished). A layer whose experts are all in
cache slots is read from the pool, uncopied. No slot is lent; each route reads the same expert bytes as from the
pool, through the same op. Routing counts stay on the device until MoeRunner.settle().
"""
from __future__ import annotations

import numpy as np

AHEAD = 2          # streamed layers whose copies are issued before the current one computes


class PartStream:
    def __init__(self, moe, chunks: list, valid: np.ndarray):
        """moe: the MoeRunner (its op, cache and checks); chunks: per MoE layer, its pinned host chunks, consecutive
        experts from 0 (ExpertSet.window_chunks); valid [T] bool: the part's real rows."""
        self.moe, self.chunks = moe, chunks
        self.n_valid = np.int32(int(np.sum(valid)))
        table = moe.cache.table()
        self.streamed = [p for p in range(len(chunks)) if (table[p] < 0).any()]      # layers to copy, in order
        self.position = {p: i for i, p in enumerate(self.streamed)}
        self.identity = np.arange(table.shape[1], dtype=np.int32)   # a staged layer holds expert e at row e
        self.staged: dict[int, object] = {}       # MoE layer -> its experts on the device
        self.previous = None                      # (the last streamed layer computed, its output)
        for i in range(AHEAD):
            self._issue(i)

    def _issue(self, i: int) -> None:
        """Start copying the i-th streamed layer (if there is one and it is not under way)."""
        if i < len(self.streamed) and self.streamed[i] not in self.staged:
            p = self.streamed[i]
            self.staged[p] = self.moe.ops.host_fetch.stage_layer(self.chunks[p])
            stats = self.moe.cache.stats
            stats.bytes_copied += sum(int(c.shape[0]) for c in self.chunks[p]) * self.moe.layout.nbytes
            stats.streamed_layers += 1

    def __call__(self, p: int, h, w, idx):
        """experts(p, h, w, idx) for the layer loop (strata/model/forward.py, run_layers) -> y [T, H]."""
        moe = self.moe
        i = self.position.get(p)
        if i is None:                                      # every expert resident: the pool, as the table says
            pool, table = moe.cache.pool, moe.cache.table_row(p)
        else:
            if self.previous is not None:
                q, y_q = self.previous
                moe.ops.host_fetch.wait(y_q)               # the streamed layer before is done with its copy
                del self.staged[q]
            for j in range(i, i + AHEAD + 1):
                self._issue(j)
            pool, table = self.staged[p], self.identity
        if moe.check_uses:
            self._check(p, idx, pool, table)
        y, counts = moe.streamed_op(h, idx, w, self.n_valid, pool, table)
        if i is not None:
            self.previous = (p, y)
        moe.pending_counts.append((p, counts))
        return y

    def _check(self, p: int, idx, pool, table) -> None:
        """--debug-slots: the experts this layer's routes read from `pool` (through `table`) hold the pack's bytes."""
        from strata.experts.moe import SlotMismatch
        used = np.unique(np.asarray(self.moe.ops.to_host(idx))[:int(self.n_valid)].reshape(-1)).astype(np.int32)
        if not self.moe.cache.content_matches(pool, table[used], [(p, int(e)) for e in used]):
            raise SlotMismatch(f"layer {p}'s experts {used.tolist()} read by a prompt part do not match the pack")
        self.moe.uses_checked += len(used)
