"""The two host tiers experts come from: the store (the pack on SSD, or a checkpoint's experts encoded in memory) and
the host mirror (a RAM copy of as many experts as the resident budget allows).

Every source answers `blob(p, e)` (the expert's bytes, uint8 [nbytes], exactly as in the pack) and
`checksum(p, e)` (zlib.crc32 of those bytes, recorded when the pack was written), where p is the MoE layer's
position (0..Lp-1) and e the expert.
"""
from __future__ import annotations

import time
import zlib

import numpy as np

from strata.errors import ConfigError
from strata.weights.quant import BlobLayout, encode_expert

GIB = 1 << 30


class MemoryStore:
    """A checkpoint's experts encoded into blobs in RAM (format f32 or bf16: the checkpoint's own numbers)."""

    in_memory = True

    def __init__(self, layout: BlobLayout, experts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]):
        """experts: per MoE layer (gate [E, I, H], up [E, I, H], down [E, H, I])."""
        self.layout = layout
        self.n_layers = len(experts)
        self.n_experts = experts[0][0].shape[0] if experts else 0
        self._blobs = np.zeros((self.n_layers, self.n_experts, layout.nbytes), np.uint8)
        for p, (g, u, d) in enumerate(experts):
            for e in range(self.n_experts):
                self._blobs[p, e] = encode_expert(layout, g[e], u[e], d[e])
        self._crc = np.array([[zlib.crc32(b) for b in layer] for layer in self._blobs], np.uint32).reshape(
            self.n_layers, self.n_experts)
        self.where = "memory (the checkpoint's experts)"

    def blob(self, p: int, e: int) -> np.ndarray:
        return self._blobs[p, e]

    def checksum(self, p: int, e: int) -> int:
        return int(self._crc[p, e])


class PackStore:
    """Experts read from a pack (strata/experts/pack.py) on SSD: by explicit reads (`stream=True`, the
    --stream-experts path: every miss is one pread of one blob) or through the page cache via mmap."""

    in_memory = False

    def __init__(self, reader, stream: bool = False):
        self.reader, self.stream = reader, stream
        self.layout = reader.layout
        self.layers = list(reader.expert_layers)
        if reader.mtp_layer is not None and reader.mtp_layer in self.layers:
            self.layers.remove(reader.mtp_layer)            # the MTP head's experts are not served yet
        self.n_layers, self.n_experts = len(self.layers), reader.n_experts
        self.reads = 0
        self.read_bytes = 0
        self.read_seconds = 0.0
        self.where = str(reader.dir)

    def blob(self, p: int, e: int) -> np.ndarray:
        t = time.perf_counter()
        layer = self.layers[p]
        out = self.reader.read_blob(layer, e) if self.stream else np.array(self.reader.blob(layer, e))
        self.reads += 1
        self.read_bytes += out.nbytes
        self.read_seconds += time.perf_counter() - t
        return out

    def checksum(self, p: int, e: int) -> int:
        return int(self.reader.checksum(self.layers[p], e))


class HostMirror:
    """A RAM copy of experts, allocated in chunks of at most `chunk_bytes` each: one huge host allocation fails on
    some drivers (../shared/seeds/002_*.txt, part 1). Experts not mirrored come from the store.

    With `pin` (the backend's host_tier: pinned host memory on a GPU), every mirrored expert is also copied into its
    own pinned buffer, which the device reads by DMA (pageable memory goes through the driver's staging copy, several
    times slower: bench/results/offload_speed_*.json); the chunks are freed once pinned."""

    def __init__(self, store, budget_bytes: int, chunk_bytes: int = GIB, order: list[tuple[int, int]] | None = None,
                 pin=None):
        if chunk_bytes < store.layout.nbytes:
            raise ConfigError(f"host chunk of {chunk_bytes} bytes is smaller than one expert ({store.layout.nbytes} "
                              f"bytes)")
        self.store, self.layout = store, store.layout
        self.n_layers, self.n_experts = store.n_layers, store.n_experts
        nb = self.layout.nbytes
        total = self.n_layers * self.n_experts
        n = min(total, max(0, int(budget_bytes // nb)))
        if order is None:
            order = [(p, e) for p in range(self.n_layers) for e in range(self.n_experts)]
        chosen = order[:n]
        per_chunk = max(1, chunk_bytes // nb)
        self.chunks: list[np.ndarray] = []
        self.where_is = np.full((self.n_layers, self.n_experts, 2), -1, np.int64)   # (chunk, row) or -1
        for k, (p, e) in enumerate(chosen):
            c, r = divmod(k, per_chunk)
            if c == len(self.chunks):
                self.chunks.append(np.empty((min(per_chunk, n - c * per_chunk), nb), np.uint8))
            self.chunks[c][r] = store.blob(p, e)
            self.where_is[p, e] = (c, r)
        self.n_mirrored = n
        self.hits = self.store_reads = 0
        self.pinned = None
        if pin is not None and n:
            self.pinned = pin([self.chunks[c][r] for c, r in (self.where_is[p, e] for p, e in chosen)])
            self.pinned_at = {pe: i for i, pe in enumerate(chosen)}
            self.chunks = []

    @property
    def nbytes(self) -> int:
        return self.n_mirrored * self.layout.nbytes

    def blob(self, p: int, e: int):
        c, r = self.where_is[p, e]
        if c >= 0:
            self.hits += 1
            if self.pinned is not None:
                return self.pinned[self.pinned_at[(p, e)]]
            return self.chunks[c][r]
        self.store_reads += 1
        return self.store.blob(p, e)

    def checksum(self, p: int, e: int) -> int:
        return self.store.checksum(p, e)

    def has(self, p: int, e: int) -> bool:
        return bool(self.where_is[p, e, 0] >= 0)
