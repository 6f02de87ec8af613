"""Random experts at real shapes (benchmarks, the `random:` models), without writing tens of GB: an expert source (blob(p, e),
checksum(p, e): strata/experts/tiers.py's ExpertSource) over `distinct` genuinely encoded random experts, expert (p, e)
being distinct blob (p * E + e) % distinct. Bytes moved per expert are the real format's; only the number of
different contents is small, which no timing depends on."""
from __future__ import annotations

import zlib

import numpy as np

from strata.experts.tiers import ExpertSource
from strata.weights.quant import encode_expert, layout


class SyntheticStore(ExpertSource):
    in_memory = True            # it is the host tier itself

    def __init__(self, fmt: str, hidden: int, inter: int, n_layers: int, n_experts: int, distinct: int = 64,
                 seed: int = 0):
        self.layout = layout(fmt, hidden, inter)
        self.n_layers, self.n_experts = n_layers, n_experts
        rng = np.random.default_rng(seed)
        self.distinct = min(distinct, n_layers * n_experts)
        self._blobs = np.empty((self.distinct, self.layout.nbytes), np.uint8)
        for d in range(self.distinct):
            # scaled like a trained expert: activations stay O(1) through 48 layers
            g = rng.standard_normal((inter, hidden), np.float32) / np.sqrt(hidden)
            u = rng.standard_normal((inter, hidden), np.float32) / np.sqrt(hidden)
            w = rng.standard_normal((hidden, inter), np.float32) / np.sqrt(inter)
            self._blobs[d] = encode_expert(self.layout, g, u, w)
        self._crc = [zlib.crc32(b) for b in self._blobs]
        self.where = f"synthetic ({self.distinct} distinct random {fmt} experts)"
        self.reads = 0

    def _d(self, p: int, e: int) -> int:
        return (p * self.n_experts + e) % self.distinct

    def blob(self, p: int, e: int) -> np.ndarray:
        self.reads += 1
        return self._blobs[self._d(p, e)]

    def checksum(self, p: int, e: int) -> int:
        return self._crc[self._d(p, e)]
