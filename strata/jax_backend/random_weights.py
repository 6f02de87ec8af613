"""Random weights drawn on the device for a model at real shapes (the `random:` models, benchmarks): a stand-in for a
checkpoint that answers every tensor params_from_reader asks for, scaled so activations stay O(1) through 48 layers.
Each tensor's values follow from its name (a key per name), so two loads give the same weights. No routed experts
(SyntheticStore supplies them) and no MTP head."""
from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
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

    def norm(self, name, dim, zero_centred):
        w = self.get(name, (dim,), np.float32)
        return 1.0 + w if zero_centred else w
