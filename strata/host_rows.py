"""HostRows: a table that compiled code reads rows of on the host (Backend.host_call), kept off the device: in RAM
or memory-mapped from a checkpoint's files. qwen4_exp's PLE table is one (strata/model/ple_table.py). A leaf module
(numpy only), so that parameter trees can hold one without importing a backend.
"""
from __future__ import annotations

import numpy as np


class HostRows:
    """A table compiled code reads rows of through host_call, kept off the device (qwen4_exp's PLE table): row blocks
    `blocks` ([rows_i, dim] each, equal rows but the last; in RAM or memory-mapped) and scales [groups] float32 (None:
    none). In a parameter tree it is a leaf of no array: backends treat it as static (JAX: a pytree node without
    children), and it passes through to_device unchanged."""

    def __init__(self, blocks: list[np.ndarray], scale: np.ndarray | None, place: str):
        self.blocks, self.scale, self.place = blocks, scale, place
        self.block_rows = int(blocks[0].shape[0])
        self.rows = sum(int(b.shape[0]) for b in blocks)
        self.dim = int(blocks[0].shape[1])
        self.dtype = np.dtype(blocks[0].dtype)

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.blocks) + (0 if self.scale is None else int(self.scale.nbytes))

    def gather(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids [...] int32 -> (values [..., dim] in the stored dtype, scales [...] float32 (1 for a float table))."""
        ids = np.asarray(ids, np.int64)
        flat = ids.reshape(-1)
        if len(self.blocks) == 1:
            values = np.asarray(self.blocks[0][flat])
        else:
            values = np.empty((flat.size, self.dim), self.dtype)
            which = flat // self.block_rows
            for b in np.unique(which):
                at = np.flatnonzero(which == b)
                values[at] = self.blocks[b][flat[at] - b * self.block_rows]
        if self.scale is None:
            scales = np.ones(flat.size, np.float32)
        else:
            scales = self.scale[flat // (self.rows // self.scale.shape[0])].astype(np.float32)
        return values.reshape(ids.shape + (self.dim,)), scales.reshape(ids.shape)
