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
        self.identity = np.arange(table.shape[1], dtype=np.int32)   # a staged layer holds expert e at row e
        self.staged: dict[int, object] = {}       # MoE layer -> its experts on the device
        self.done: dict[int, object] = {}         # streamed MoE layer -> its output (waited on before a copy)
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
        if p not in self.streamed:                         # every expert resident: the pool, as the table says
            pool, table = moe.cache.pool, moe.cache.table_row(p)
            if moe.check_uses:
                self._check(p, idx, lambda used: moe.cache.content_matches(pool, table[used], [(p, e) for e in used]))
        else:
            i = self.streamed.index(p)
            before = self.done.pop(self.streamed[i - 1], None) if i else None
            if before is not None:
                moe.ops.host_fetch.wait(before)            # the streamed layer before is done with its copy
                self.staged.pop(self.streamed[i - 1], None)
            for j in range(i, i + AHEAD + 1):
                self._issue(j)
            pool, table = self.staged[p], self.identity
            if moe.check_uses:
                self._check(p, idx, lambda used: all(
                    _crc(row) == moe.source.checksum(p, int(e)) for e, row in zip(used, moe.ops.pool_read(pool, used))))
        y, counts = moe.streamed_op(h, idx, w, self.n_valid, pool, table)
        if p in self.streamed:
            self.done[p] = y
        moe.pending_counts.append((p, counts))
        return y

    def _check(self, p: int, idx, matches) -> None:
        """--debug-slots: the experts this layer's routes read hold the pack's bytes (matches(used experts))."""
        from strata.experts.moe import SlotMismatch
        used = np.unique(np.asarray(self.moe.ops.to_host(idx))[:int(self.n_valid)].reshape(-1)).astype(np.int32)
        if not matches(used):
            raise SlotMismatch(f"layer {p}'s experts {used.tolist()} read by a prompt part do not match the pack")
        self.moe.uses_checked += len(used)


def _crc(row) -> int:
    import zlib
    return zlib.crc32(np.ascontiguousarray(row))
