"""PartStream: a prompt part's routed experts with every MoE layer's experts copied to the device whole, the next
layer's while this one computes (double-buffered), when every expert is mirrored in pinned host memory.

A part of thousands of tokens routes to nearly all of a layer's experts, so it reads each layer's chunks whole: the
copies need no routes from the device, the host issues them ahead on the copy engine (HostFetch.stage_layer) and
they run beside the computation. At most two layers' copies are alive: before layer p + 1's copy is issued, layer
p - 1's experts have finished. The cache's slots are not touched (no loans); each route reads its expert from the
staged layer, so a result equals the pool's for the same routes. Routing counts stay on the device until settle().
"""
from __future__ import annotations

import numpy as np


class PartStream:
    def __init__(self, moe, chunks: list, valid: np.ndarray):
        """moe: the MoeRunner (its op, cache and checks); chunks: per MoE layer, its pinned host chunks, consecutive
        experts from 0 (ExpertSet.window_chunks); valid [T] bool: the part's real rows."""
        self.moe, self.chunks = moe, chunks
        self.n_valid = np.int32(int(np.sum(valid)))
        self.staged: dict[int, object] = {}       # MoE layer -> its experts on the device
        self.done: dict[int, object] = {}         # MoE layer -> its output (waited on before a copy is issued)
        self._issue(0)

    def _issue(self, p: int) -> None:
        if p < len(self.chunks) and p not in self.staged:
            self.staged[p] = self.moe.ops.host_fetch.stage_layer(self.chunks[p])
            self.moe.cache.stats.bytes_copied += sum(int(c.shape[0]) for c in self.chunks[p]) * self.moe.layout.nbytes
            self.moe.cache.stats.streamed_layers += 1

    def __call__(self, p: int, h, w, idx):
        """experts(p, h, w, idx) for the layer loop (strata/model/forward.py, run_layers) -> y [T, H]."""
        before = self.done.pop(p - 1, None)
        if before is not None:
            self.moe.ops.host_fetch.wait(before)           # layer p - 1's experts are done with their copy
            self.staged.pop(p - 1, None)
        self._issue(p)
        self._issue(p + 1)
        staged = self.staged[p]
        if self.moe.check_uses:
            self._check(p, staged, idx)
        y, counts = self.moe.streamed_op(h, idx, w, self.n_valid, staged)
        self.done[p] = y
        self.moe.pending_counts.append((p, counts))
        return y

    def _check(self, p: int, staged, idx) -> None:
        """--debug-slots: every expert this layer's routes read from the staged copy matches the pack."""
        from strata.experts.moe import SlotMismatch
        ids = np.asarray(self.moe.ops.to_host(idx))[:int(self.n_valid)].reshape(-1)
        used = np.unique(ids)
        data = self.moe.ops.pool_read(staged, used.astype(np.int32))
        source = self.moe.source
        bad = [int(e) for e, row in zip(used, data) if _crc(row) != source.checksum(p, int(e))]
        if bad:
            raise SlotMismatch(f"layer {p}'s experts {bad} copied for a prompt part do not match the pack")
        self.moe.uses_checked += len(used)


def _crc(row) -> int:
    import zlib
    return zlib.crc32(np.ascontiguousarray(row))
