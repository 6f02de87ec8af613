"""Random weights drawn on the device for a model at real shapes (the `random:` models, benchmarks): a stand-in for a
checkpoint that answers every tensor params_from_reader asks for, scaled so activations stay O(1) through 48 layers.
Each tensor's values follow from its name (a key per name), so two loads give the same weights. No routed experts
(SyntheticStore supplies them) and no MTP head."""
from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np


class RandomDeviceReader:
    """Stands in for a checkpoint: every tensor the model asks for, drawn on the device (no host copy)."""

    xp = jnp                                                   # params_from_reader reshapes with the reader's

    def __init__(self, dtype):
        self.dtype = dtype

    def has(self, name: str) -> bool:
        return not (name.endswith("experts.gate_up_proj") or name.startswith("mtp."))

    def get(self, name, shape, dtype=None):
        key = jax.random.key(zlib.crc32(name.encode()))
        dtype = dtype or self.dtype
        if name.endswith("A_log"):
            return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0))
        if name.endswith("dt_bias"):
            return jnp.ones(shape, jnp.float32)
        if len(shape) == 1:                                    # norms
            return (0.05 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
        return (jax.random.normal(key, shape, jnp.float32) / np.sqrt(shape[-1])).astype(dtype)

    def table_blocks(self, e, rows, dim, why):
        """A PLE table as shipped: float8 e4m3 values in host RAM (where the plan converts and places it), one block
        of random rows repeated (a table of tens of GB is filled at copy speed) and the scale 1."""
        rng = np.random.default_rng(zlib.crc32(e.encode()))
        block = rng.standard_normal((min(rows, 1 << 16), dim), np.float32).astype(ml_dtypes.float8_e4m3fn)
        table = np.empty((rows, dim), ml_dtypes.float8_e4m3fn)
        for lo in range(0, rows, block.shape[0]):
            table[lo:lo + block.shape[0]] = block[:rows - lo]
        return [table], [np.ones(1, np.float32)]

    def norm(self, name, dim, zero_centred):
        w = self.get(name, (dim,), np.float32)
        return 1.0 + w if zero_centred else w
