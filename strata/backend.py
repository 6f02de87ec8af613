"""The Backend protocol: the device operations the forward pass is written against, and the registry.

The model code (strata/model/forward.py) is written once against these ops; a backend supplies only device code.
`xp` is the backend's array namespace (jax.numpy, dpnp) for plain array arithmetic that every namespace shares
(reshape, concatenate, einsum, exp, where, ...); everything whose semantics differ between a functional and an
in-place array library (state updates, slices at traced offsets, sorting, sampling) is an op here.

Shapes: T tokens of one prompt part (padded to a bucket; the first `n_valid` are real), H hidden, V vocab.
"""
from __future__ import annotations

import importlib
from typing import Any, Protocol

from strata.errors import ConfigError

Array = Any


class Backend(Protocol):
    name: str
    xp: Any
    eager: bool          # ops run as called (no compile): host arguments (positions, tokens) are read on the host
    # the parameter tree joins the projections that share an input into one matrix (strata/model/params.py): one
    # matmul instead of two to four where each is a launch and a column slice of the product is free (JAX); a
    # backend whose fused ops take several weights in one launch and need contiguous inputs keeps them apart (SYCL)
    joins_projections: bool

    # --- placement and memory
    def to_device(self, tree: Any) -> Any: ...
    def zeros_like(self, tree: Any) -> Any: ...        # zeros shaped and typed like a host tree, made on the device
    def to_host(self, x: Array) -> Any: ...
    def start_to_host(self, x: Array) -> None: ...                                      # begin the copy to_host waits for
    def free_memory_bytes(self) -> int | None: ...

    # --- dense math
    def rms_norm(self, x: Array, scale: Array, eps: float) -> Array: ...               # [..., D] -> [..., D], fp32 inside
    def linear(self, x: Array, w: Array) -> Array: ...                                  # [..., in] x [out, in] -> [..., out]
    def silu(self, x: Array) -> Array: ...
    def sigmoid(self, x: Array) -> Array: ...
    def softplus(self, x: Array) -> Array: ...
    def softmax(self, x: Array) -> Array: ...                                          # over the last axis, fp32
    def rope(self, x: Array, positions: Array, rotary_dim: int, theta: float) -> Array: ...  # [T, heads, hd]

    # --- sequence state
    def kv_write(self, cache: Array, new: Array, start: Array) -> Array: ...    # [Cap, ...] <- [T, ...] at start
    def attention(self, q: Array, k_cache: Array, v_cache: Array, q_pos: Array, scale: float,
                  k_scale: Array | None = None, v_scale: Array | None = None) -> Array: ...  # int8 caches: scales
    def causal_conv(self, u: Array, conv_state: Array, w: Array, n_valid: Array) -> tuple[Array, Array]: ...
    def gated_delta_chunked(self, q, k, v, g, beta, state) -> tuple[Array, Array]: ...  # prompt parts
    def gated_delta_step(self, q, k, v, g, beta, state) -> tuple[Array, Array]: ...     # one token
    def valid_mask(self, t: int, n_valid: Array) -> Array: ...                           # [T] bool: row < n_valid
    def take_row(self, x: Array, i: Array) -> Array: ...                                 # x[i] at a traced index
    def set_row(self, x: Array, i: Array, row: Array) -> Array: ...                      # x with x[i] = row

    def scope(self, name: str) -> Any: ...                 # a context naming the ops inside it (profiles), or nothing

    # --- fused ops (defined in strata/model/blocks.py as compositions of the ops above; a backend inherits
    # ComposedOps or overrides an op with device code that matches the composition)
    def norm_linears(self, x: Array, scale: Array, eps: float, ws: list) -> tuple[Array, list]: ...
    def linears(self, x: Array, ws: list) -> list: ...
    def linear_add(self, x: Array, w: Array, residual: Array) -> Array: ...
    def swiglu_out(self, g, u, w_down, residual, add=None, gate=None) -> Array: ...
    def route(self, logits: Array, k: int, renormalize: bool) -> tuple[Array, Array]: ...
    def expert_slots(self, table_row: Array, idx: Array, n_valid: Array) -> Array: ...
    def attention_block(self, q, k, v, gate, q_norm, k_norm, eps, kv: dict, start, n_valid, rotary_dim,
                        theta) -> tuple[Array, dict]: ...
    def delta_block(self, qkv, z, b, a, conv_state, conv_w, ssm, a_log, dt_bias, gnorm, eps, start, n_valid,
                    n_k_heads) -> tuple[Array, Array, Array]: ...

    # --- mixture of experts: the one expert op, over a pool of expert blobs (strata/weights/quant.py formats)
    def topk(self, x: Array, k: int) -> tuple[Array, Array]: ...                        # values, indices over last axis
    def experts_pool(self, x: Array, slots: Array, weight: Array, pool: Array, layout, max_distinct: int) -> Array:
        ...                     # x [T, H]; slots, weight [T, k] (slot -1: not computed here); pool uint8 [N, nbytes]
    def route_counts(self, idx: Array, valid: Array, n_experts: int) -> Array: ...       # [T, k], [T] -> [E] int32

    # --- the slot pool (strata/experts/cache.py owns which expert is in which slot)
    def pool_alloc(self, n: int, nbytes: int) -> Array: ...                              # uint8 [n, nbytes] zeros
    def pool_write(self, pool: Array, slots, blobs) -> Array: ...                        # the pool after the writes
    def pool_read(self, pool: Array, slots) -> Any: ...                                  # host uint8 [m, nbytes]

    # --- compilation and randomness
    def compile(self, fn, donate_argnums=(), static_argnames=()): ...                    # jit, or identity
    def vmap(self, fn): ...                                                              # map fn over a leading axis
    def prng_keys(self, seeds: Array, steps: Array) -> Array: ...                        # [B, 2], [B] -> [B]

    # --- sampling
    # all_greedy (static): the caller knows every row's temperature is 0, so the argmax alone is the answer (no sort
    # of the vocabulary); the result is the same as the general path's for such rows
    def sample(self, logits: Array, temperature: Array, top_k: Array, top_p: Array, min_p: Array,
               keys: Array, all_greedy: bool = False) -> Array: ...


_BACKENDS = {"jax": "strata.jax_backend.backend:JaxBackend", "sycl": "strata.sycl_backend.backend:SyclBackend"}


def available_backends() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def get_backend(name: str = "auto", **options) -> Backend:
    """Backends are imported lazily, so a backend's library is only imported when chosen."""
    if name == "auto":
        name = _auto()
    if name not in _BACKENDS:
        raise ConfigError(f"backend {name!r} is not known; allowed: auto, {', '.join(_BACKENDS)}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(**options)


def _auto() -> str:
    """JAX when JAX sees an NVIDIA GPU, else SYCL when a SYCL GPU is present, else JAX (on the CPU)."""
    import jax
    try:
        if jax.devices("gpu"):
            return "jax"
    except RuntimeError:
        pass
    from strata.sycl_backend.runtime import has_sycl_gpu  # imports dpctl only if it is installed
    return "sycl" if has_sycl_gpu() else "jax"
