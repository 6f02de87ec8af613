"""The two host tiers experts come from: the store (the pack on SSD, or a checkpoint's experts encoded in memory) and
the host mirror (a RAM copy of as many experts as the resident budget allows).

Every source is an ExpertSource: `blob(p, e)` (the expert's bytes, uint8 [nbytes], exactly as in the pack),
`checksum(p, e)` (zlib.crc32 of those bytes, recorded when the pack was written), `blobs(p, experts)` and
`write_pool(ops, pool, slots, pairs)`, where p is the MoE layer's position (0..Lp-1) and e the expert.
"""
from __future__ import annotations

import abc
import zlib

import numpy as np

from strata.errors import ConfigError
from strata.weights.quant import BlobLayout, encode_expert

GIB = 1 << 30
# experts written to the pool per pool_write call: the bytes bound the device memory a call stacks, the count bounds
# its arguments (each blob is one; thousands of small blobs compile for minutes)
WRITE_BATCH_BYTES = 256 << 20
WRITE_BATCH_BLOBS = 256


class ExpertSource(abc.ABC):
    """The host tiers' common answers, built on blob(p, e) and checksum(p, e), which each source defines."""

    in_memory = False          # the experts are already in RAM (a checkpoint's): a host mirror would be a copy
    layout: BlobLayout

    @abc.abstractmethod
    def blob(self, p: int, e: int) -> np.ndarray: ...

    @abc.abstractmethod
    def checksum(self, p: int, e: int) -> int: ...

    def blobs(self, p: int, experts) -> np.ndarray:
        """Experts `experts` of MoE layer p -> uint8 [m, nbytes] on the host."""
        return np.stack([self.blob(p, int(e)) for e in experts])

    def write_pool(self, ops, pool, slots, pairs):
        """pool with `slots` [m] filled with experts `pairs` [(p, e)] -> the new pool (the old one donated)."""
        per = max(1, min(WRITE_BATCH_BLOBS, WRITE_BATCH_BYTES // self.layout.nbytes))
        for a in range(0, len(pairs), per):
            blobs = [self.blob(p, e) for p, e in pairs[a:a + per]]          # uint8 [nbytes] each, views if any
            pool = ops.pool_write(pool, np.asarray(slots[a:a + per], np.int32), blobs)
        return pool


class MemoryStore(ExpertSource):
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


class PackStore(ExpertSource):
    """Experts read from a pack (strata/experts/pack.py) on SSD: by explicit reads (`stream=True`, the
    --stream-experts path: every miss is one pread of one blob) or through the page cache via mmap."""

    def __init__(self, reader, stream: bool = False):
        self.reader, self.stream = reader, stream
        self.layout = reader.layout
        self.layers = list(reader.expert_layers)
        if reader.mtp_layer is not None and reader.mtp_layer in self.layers:
            self.layers.remove(reader.mtp_layer)            # the MTP head's experts are not served yet
        self.n_layers, self.n_experts = len(self.layers), reader.n_experts
        self.reads = 0                                      # blobs read from the pack so far
        self.where = str(reader.dir)

    def blob(self, p: int, e: int) -> np.ndarray:
        self.reads += 1
        layer = self.layers[p]
        return self.reader.read_blob(layer, e) if self.stream else np.array(self.reader.blob(layer, e))

    def checksum(self, p: int, e: int) -> int:
        return int(self.reader.checksum(self.layers[p], e))


class HostMirror(ExpertSource):
    """A RAM copy of experts, allocated in chunks of at most `chunk_bytes` each: one huge host allocation fails on
    some drivers (../shared/seeds/002_*.txt, part 1). Experts not mirrored come from the store. A chunk holds
    experts of one layer only, in expert order, so a layer's complete set is a few chunks of consecutive experts.

    With `device` (a backend's HostFetch capability: its compiled windows read pinned host memory), every chunk is
    one pinned allocation, which the device copies from by DMA (pageable memory goes through the driver's staging
    copy, several times slower: bench/results/offload_speed_*.json), and, when every expert is mirrored, which a
    decode window copies its misses from by itself (`window_chunks`)."""

    def __init__(self, store, budget_bytes: int, chunk_bytes: int = GIB, order: list[tuple[int, int]] | None = None,
                 device=None):
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
        chosen = np.zeros((self.n_layers, self.n_experts), bool)
        for p, e in order[:n]:
            chosen[p, e] = True
        self.device = device                        # HostFetch or None
        per_chunk = max(1, chunk_bytes // nb)
        self.chunks: list = []                      # uint8 [n_c, nbytes]: numpy, or pinned host arrays
        self.chunk_at: list[tuple[int, int]] = []   # per chunk (layer, first expert)
        self.where_is = np.full((self.n_layers, self.n_experts, 2), -1, np.int64)   # (chunk, row) or -1
        for p in range(self.n_layers):
            es = np.flatnonzero(chosen[p])
            for a in range(0, len(es), per_chunk):
                part = es[a:a + per_chunk]
                rows = np.stack([store.blob(p, int(e)) for e in part])
                c = len(self.chunks)
                self.chunks.append(self.device.host_chunk(rows) if self.device is not None else rows)
                self.chunk_at.append((p, int(part[0])))
                self.where_is[p, part] = np.stack([np.full(len(part), c), np.arange(len(part))], axis=1)
        self.n_mirrored = n

    @property
    def nbytes(self) -> int:
        return self.n_mirrored * self.layout.nbytes

    def blob(self, p: int, e: int):
        c, r = self.where_is[p, e]
        if c >= 0:
            if self.device is not None:
                return self.device.host_rows(self.chunks[c], [r])[0]
            return self.chunks[c][r]
        return self.store.blob(p, e)

    def checksum(self, p: int, e: int) -> int:
        return self.store.checksum(p, e)

    def blobs(self, p: int, experts) -> np.ndarray:
        """Experts `experts` of MoE layer p -> uint8 [m, nbytes] on the host; pinned chunks are read with one
        device call per chunk rather than one per expert."""
        where = self.where_is[p, np.asarray(experts, np.int64)].reshape(-1, 2)          # [m, (chunk, row)]
        out = np.empty((len(where), self.layout.nbytes), np.uint8)
        pinned = where[:, 0] >= 0 if self.device is not None else np.zeros(len(where), bool)
        for c in np.unique(where[pinned, 0]):
            sel = pinned & (where[:, 0] == c)
            out[sel] = self.device.host_rows(self.chunks[c], where[sel, 1])
        for i in np.flatnonzero(~pinned):
            out[i] = self.blob(p, int(experts[i]))
        return out

    def has(self, p: int, e: int) -> bool:
        return bool(self.where_is[p, e, 0] >= 0)

    def write_pool(self, ops, pool, slots, pairs):
        """pool with `slots` [m] filled with experts `pairs` [(p, e)] -> the new pool (the old one donated). Pinned
        chunks are copied from by the device, all in one call; everything else goes through ops.pool_write."""
        slots = np.asarray(slots, np.int32)
        where = np.array([self.where_is[p, e] for p, e in pairs], np.int64).reshape(-1, 2)
        from_chunk = where[:, 0] >= 0 if self.device is not None else np.zeros(len(pairs), bool)
        if from_chunk.any():
            idx = np.flatnonzero(from_chunk)
            idx = idx[np.argsort(where[idx, 0], kind="stable")]                      # grouped by chunk
            bounds = np.searchsorted(where[idx, 0], np.arange(len(self.chunks) + 1))  # chunk c: bounds[c]..[c+1]
            pool = ops.pool_fill(pool, slots[idx], self.chunks, bounds, where[idx, 1])
        rest = np.flatnonzero(~from_chunk)
        if len(rest):
            pool = ops.pool_write(pool, slots[rest], [self.blob(*pairs[i]) for i in rest])
        return pool

    def window_chunks(self) -> list[tuple[list, tuple[int, ...]]] | None:
        """Per MoE layer (its pinned chunks, their first experts), when every expert is mirrored in pinned memory:
        what a decode window copies its misses from (kernels/experts.py, experts_fetching); else None."""
        if self.device is None or self.n_mirrored < self.n_layers * self.n_experts:
            return None
        out = [([], []) for _ in range(self.n_layers)]
        for chunk, (p, a) in zip(self.chunks, self.chunk_at):   # complete: a chunk's experts are consecutive
            out[p][0].append(chunk)
            out[p][1].append(a)
        return [(chunks, tuple(starts)) for chunks, starts in out]
