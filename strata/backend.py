"""The Backend protocol: the device operations the forward pass is written against, and the registry.

The model code (strata/model/forward.py) is written once against these ops; a backend supplies only device code.
`xp` is the backend's array namespace (jax.numpy, dpnp) for plain array arithmetic that every namespace shares
(reshape, concatenate, einsum, exp, where, ...); everything whose semantics differ between a functional and an
in-place array library (state updates, slices at traced offsets, sorting, sampling) is an op here.

Shapes: T tokens of one prompt part (padded to a bucket; the first `n_valid` are real), H hidden, V vocab.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Any, Protocol

import numpy as np

from strata.errors import ConfigError

Array = Any


class Rope(Protocol):
    """RoPE as the ops apply it (strata/model/rope.py computes it from the model's config, once): the inverse
    frequencies of the rotated pairs (fp32 values; the first rotary_dim features of a head rotate NeoX-style, the
    rest pass through) and the factor on cos and sin (YaRN's attention factor; 1 otherwise). Hashable: a
    compile-time constant."""
    inv_freq: tuple[float, ...]
    scale: float

    @property
    def rotary_dim(self) -> int: ...

    def table(self) -> np.ndarray: ...     # fp32 [rotary_dim / 2 + 1]: the frequencies, then the scale (for kernels)


class Backend(Protocol):
    name: str
    xp: Any
    eager: bool          # ops run as called (no compile): host arguments (positions, tokens) are read on the host
    # the parameter tree joins the projections that share an input into one matrix (strata/model/params.py): one
    # matmul instead of two to four where each is a launch and a column slice of the product is free (JAX); a
    # backend whose fused ops take several weights in one launch and need contiguous inputs keeps them apart (SYCL)
    joins_projections: bool
    device: Any          # the device it runs on; device.platform is "cpu" or "gpu" (picks the default dtype)
    # the optional HostFetch capability (below): the backend itself when its compiled windows can read pinned host
    # memory by themselves, else None. Declared by the backend, never probed.
    host_fetch: "HostFetch | None"
    # the optional HostKV capability (below): the backend itself when compiled functions can keep arrays in host
    # memory and move them to and from the device (the attention KV's host tier, kv_resident), else None
    host_kv: "HostKV | None"
    # the same backend on the same device with its reference ops in place of its own kernels (JAX: XLA instead of
    # Pallas), when some kernel of its own runs; else None (the numerics guard's reference_ops path)
    reference: "Backend | None"
    # the optional Peers capability (below): the backend itself when it can run on the other devices of its kind
    # (the layer split's stages), else None
    peers: "Peers | None"

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
    def rope(self, x: Array, positions: Array, rope: Rope) -> Array: ...               # [T, heads, hd]

    # --- sequence state
    def kv_write(self, cache: Array, new: Array, start: Array) -> Array: ...    # [Cap, ...] <- [T, ...] at start
    def kv_read(self, cache: Array, start: Array, n: int) -> Array: ...        # [Cap, ...] -> rows start.. [n, ...]
    def attention(self, q: Array, k_cache: Array, v_cache: Array, q_pos: Array, scale: float,
                  k_scale: Array | None = None, v_scale: Array | None = None) -> Array: ...  # int8 caches: scales
    def causal_conv(self, u: Array, conv_state: Array, w: Array, n_valid: Array) -> tuple[Array, Array]: ...
    def gated_delta_chunked(self, q, k, v, g, beta, state) -> tuple[Array, Array]: ...  # prompt parts
    def gated_delta_step(self, q, k, v, g, beta, state) -> tuple[Array, Array]: ...     # one token
    def valid_mask(self, t: int, n_valid: Array) -> Array: ...                           # [T] bool: row < n_valid
    def take_row(self, x: Array, i: Array) -> Array: ...                                 # x[i] at a traced index
    def set_row(self, x: Array, i: Array, row: Array) -> Array: ...                      # x with x[i] = row
    def take_rows(self, x: Array, idx: Array) -> Array: ...              # x[idx] [B, ...] at traced distinct indices
    def put_rows(self, x: Array, idx: Array, rows: Array) -> Array: ...  # x with x[idx] = rows (distinct indices)

    def scope(self, name: str) -> Any: ...                 # a context naming the ops inside it (profiles), or nothing
    def report(self, fn, *xs: Array) -> None: ...          # fn(*host values of xs) once computed (in a window too)
    # fn(*host values of xs) -> host arrays of the (shape, dtype)s in results, back on the device (in a window too;
    # under vmap fn gets every row at once, with a leading axis)
    def host_call(self, fn, results: list, *xs: Array) -> list: ...

    # --- fused ops (defined in strata/backend.py as compositions of the ops above; a backend inherits
    # ComposedOps or overrides an op with device code that matches the composition)
    def norm_linears(self, x: Array, scale: Array, eps: float, ws: list) -> tuple[Array, list]: ...
    def linears(self, x: Array, ws: list) -> list: ...
    def linear_add(self, x: Array, w: Array, residual: Array) -> Array: ...
    def swiglu_out(self, g, u, w_down, residual, add=None, gate=None) -> Array: ...
    def route(self, logits: Array, k: int, renormalize: bool) -> tuple[Array, Array]: ...
    def expert_slots(self, table_row: Array, idx: Array, n_valid: Array) -> Array: ...
    def attention_block(self, q, k, v, gate, q_norm, k_norm, eps, kv: dict, start, n_valid,
                        rope: Rope, rope_pos=None) -> tuple[Array, dict]: ...
    def delta_block(self, qkv, z, b, a, conv_state, conv_w, ssm, a_log, dt_bias, gnorm, eps, start, n_valid,
                    n_k_heads, gate_act: str = "silu") -> tuple[Array, Array, Array]: ...

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


class HostFetch(Protocol):
    """Compiled windows that copy from pinned host memory by themselves: the host mirror keeps its chunks there and
    a decode window fetches its misses inside the window (strata/experts/path.py, window fetch)."""

    def host_chunk(self, rows) -> Array: ...                       # uint8 [n, nbytes] -> one pinned host allocation
    def host_rows(self, chunk: Array, rows) -> Any: ...            # rows of a chunk -> host uint8 [m, nbytes]
    def pool_fill(self, pool: Array, slots, chunks, bounds, rows) -> Array: ...   # pool rows from chunk rows
    def experts_fetch(self, x: Array, ids: Array, weight: Array, valid: Array, pool: Array, table_row: Array,
                      chunks: list, starts: tuple, layout) -> tuple[Array, Array]: ...  # -> (y [T, H], copied)
    def stage_layer(self, chunks: list) -> Array: ...   # chunks copied whole to the device, end to end; returns at once
    def wait(self, x: Array) -> None: ...               # until x is computed


class HostKV(Protocol):
    """The attention KV's host tier (kv_resident): arrays kept in host memory (pinned on a GPU) that compiled
    functions write into and read from (strata/engine/kv_tiers.py; forward.py's state names them "*_host")."""

    def host_zeros_like(self, tree: Any) -> Any: ...     # zeros shaped like a host tree, placed in host memory
    def from_host_tier(self, x: Array) -> Array: ...     # traced: a host array moved to the device (a copy)
    # traced, on a host array [S, Cap, ...]: device rows x [n, ...] written at (slot, start); rows start..start+n-1
    # of a slot copied to the device
    def host_write(self, host: Array, x: Array, slot: Array, start: Array) -> Array: ...
    def host_window(self, host: Array, slot: Array, start: Array, n: int) -> Array: ...
    # traced, on one row's host array [Cap_h, ...]: its rows [0, n) on the device in blocks of `block` rows (the last
    # block clamped to the end), the rest zeros
    def host_prefix(self, host: Array, n: Array, block: int) -> Array: ...


class Peers(Protocol):
    """The same backend on each device of its kind (the layer split: strata/engine/stages.py)."""

    def device_count(self) -> int: ...                 # devices of this backend's kind (its own included)
    def on_device(self, i: int) -> "Backend": ...      # this backend (kernels, settings) on device i of its kind


_BACKENDS = {"jax": "strata.jax_backend.backend:JaxBackend", "sycl": "strata.sycl_backend.backend:SyclBackend"}
_SYCL_GPU_PROBE = "strata.sycl_backend.runtime:has_sycl_gpu"       # "auto": whether a SYCL GPU is present

# The backends that can keep their compiled functions across restarts: name -> "module:function", where
# function(path) enables that cache before anything compiles and returns a CompileCache. Declared here rather than
# probed on a backend, and imported only when enabled.
_COMPILE_CACHES = {"jax": "strata.jax_backend.compile_cache:open_cache"}


class CompileCache(Protocol):
    """A backend's persistent compilation cache, enabled at start-up (enable_compile_cache)."""
    path: str
    entries: int                                  # files the directory held before start-up
    bytes: int

    def stop(self) -> tuple[int, int]: ...        # stop counting -> (compilations loaded from it, compilations
                                                  # that asked it) since it was enabled


def resolve_backend(name: str = "auto") -> str:
    """The backend `name` stands for ("auto" picks one: _auto); ConfigError for a name that is not known."""
    if name == "auto":
        name = _auto()
    if name not in _BACKENDS:
        raise ConfigError(f"backend {name!r} is not known; allowed: auto, {', '.join(_BACKENDS)}")
    return name


def get_backend(name: str = "auto", **options) -> Backend:
    """Backends are imported lazily, so a backend's library is only imported when chosen."""
    return _load(_BACKENDS[resolve_backend(name)])(**options)


def compile_cache_backends() -> tuple[str, ...]:
    """The backends with a persistent compilation cache (enable_compile_cache)."""
    return tuple(_COMPILE_CACHES)


def enable_compile_cache(name: str, path: str) -> CompileCache:
    """Point backend `name`'s persistent compilation cache at the directory `path`; call it before anything compiles.
    ConfigError when that backend has none, or when the directory cannot be used."""
    name = resolve_backend(name)
    if name not in _COMPILE_CACHES:
        raise ConfigError(f"compile_cache = {path!r}: the {name} backend has no persistent compilation cache "
                          f"(backends with one: {', '.join(_COMPILE_CACHES)})")
    return _load(_COMPILE_CACHES[name])(path)


def _load(spec: str):
    """"module:attribute" -> the attribute, importing the module now (a backend's library loads only when chosen)."""
    module, attr = spec.split(":")
    return getattr(importlib.import_module(module), attr)


def _auto() -> str:
    """JAX when JAX sees an NVIDIA GPU, else SYCL when a SYCL GPU is present, else JAX (on the CPU)."""
    import jax
    try:
        if jax.devices("gpu"):
            return "jax"
    except RuntimeError:
        pass
    return "sycl" if _load(_SYCL_GPU_PROBE)() else "jax"          # imports dpctl only if it is installed


# --- ComposedOps: the protocol's fused ops, defined as compositions of its basic ops.
# The forward pass (strata/model/forward.py) calls these: each groups what one layer does between two points where a
# device kernel would naturally end (a normalised input feeding several projections, the attention mixer from
# projections to the gated output, the Gated DeltaNet mixer likewise, routing, the shared expert's down projection
# with its gate and the residual). This is their definition. A backend inherits it when its compiler fuses the
# composition anyway
# (JAX: XLA inside one jitted window); a backend that runs ops eagerly overrides an op with device code, because there
# each op is at least one launch (SYCL: tests/sycl/test_fused_ops.py holds every override to this composition on the
# same device, with fresh inputs).
#
# Shapes: T rows, H hidden; projections are flat ([T, heads * head_dim]); states as in forward.py.
#
# Two modes, told apart by `start`: a scalar start means the T rows are consecutive tokens of ONE sequence (n_valid a
# scalar: the first n_valid rows are real); a vector start [S] means the rows are S sequences with one token each (a
# decode window: row s at position start[s], real when n_valid[s] > 0, its state at index s of a bank [S, ...]).


# a two-tier attention cache (kv_resident; strata/model/forward.py kv_state): the device window's arrays, their host
# twins (name + HOST), the window's first position (TIER_BASE) and, in a bank, the host arrays' row that holds each
# slot's (TIER_ROW: host banks have more rows than slots, parked conversations keep theirs)
KV_NAMES = ("k", "v", "k_scale", "v_scale")
HOST = "_host"
TIER_BASE = "base"
TIER_ROW = "row"
# in a decode window's attention layer (rows mode): int32 [B], the bank rows of the window's B rows when it is
# compiled for fewer rows than the bank has (the window's other arrays are [B]; the layer's are the bank's [S, ...])
SLOTS = "slots"
STAGE_BLOCK = 4096       # rows of host KV a prompt part stages a copy at a time (it copies the positions it reads)


def rotary_positions(positions, rope: Rope):
    """Each row's position for each rotated pair, [T, pairs] (or [T, 1] for them all): positions [T], or (t, h, w)
    rows [T, 3] of which each pair takes its axis's (interleaved MRoPE: rope.sections)."""
    if positions.ndim == 1:
        return positions[:, None]
    if not rope.sections:
        raise ValueError("(t, h, w) positions need a model with MRoPE sections (an image-text family)")
    return positions[:, np.array(rope.sections)]


def is_rows(start) -> bool:
    """True when start is per row ([S]): one token of each of S sequences (a decode window)."""
    return np.ndim(start) == 1


class ComposedOps:
    """Mixin: fused ops over the backend's basic ops (self.rms_norm, self.linear, ...)."""

    def scope(self, name: str):
        """A context naming the ops traced inside it (the JAX backend: jax.named_scope, so a profile of a compiled
        window groups its kernels by the part of the layer they belong to: bench/prompt_probe.py); here nothing."""
        return contextlib.nullcontext()

    def report(self, fn, *xs):
        """fn(*the values of xs on the host); an eager backend's are computed already (JAX: jax.debug.callback)."""
        fn(*(np.asarray(self.to_host(x)) for x in xs))

    def host_call(self, fn, results, *xs):
        """fn(*the values of xs on the host), its arrays moved to the device (an eager backend's xs are computed)."""
        return [self.to_device(np.asarray(a, dtype)) for a, (_, dtype) in zip(fn(*(np.asarray(self.to_host(x))
                                                                                   for x in xs)), results)]

    def norm_linears(self, x, scale, eps, ws):
        """-> (h = rms_norm(x) [T, H], [h @ w.T for w in ws])."""
        h = self.rms_norm(x, scale, eps)
        return h, [self.linear(h, w) for w in ws]

    def linears(self, x, ws):
        """-> [x @ w.T for w in ws] (projections that share their input)."""
        return [self.linear(x, w) for w in ws]

    def linear_add(self, x, w, residual):
        """-> residual + x @ w.T (an output projection into the residual stream)."""
        return residual + self.linear(x, w)

    def swiglu_out(self, g, u, w_down, residual, add=None, gate=None):
        """-> residual + (add + sigmoid(gate) * (silu(g) * u) @ w_down.T): an MLP's down projection, with the shared
        expert's scalar gate [T, 1] and the routed experts' sum [T, H] (`add`) when given."""
        y = self.linear(self.silu(g) * u, w_down)
        if gate is not None:
            y = self.sigmoid(gate) * y
        if add is not None:
            y = add + y
        return residual + y

    def route(self, logits, k, renormalize):
        """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k]): softmax over all experts in fp32,
        top-k (ties to the lower id), optionally renormalised to sum to 1."""
        w, idx = self.topk(self.softmax(logits), k)
        if renormalize:
            w = w / self.xp.sum(w, axis=-1, keepdims=True)
        return w, idx

    def expert_slots(self, table_row, idx, n_valid):
        """Expert ids [T, k] -> their slots in the pool (table_row [E] int32); padded rows -> -1."""
        valid = n_valid > 0 if is_rows(n_valid) else self.valid_mask(idx.shape[0], n_valid)
        return self.xp.where(valid[:, None], table_row[idx], -1)

    def attention_block(self, q, k, v, gate, q_norm, k_norm, eps, kv, start, n_valid, rope, rope_pos=None):
        """Gated attention from its projections to the gated output (before o_proj): q/k RMSNorm per head, partial
        NeoX RoPE at positions start.. (rope_pos: the rows' rotary positions instead, [T] or (t, h, w) rows [T, 3]:
        a prompt with images, and the text after them), the new keys and values written at rows start.. of the layer's cache,
        causal GQA attention, the output times sigmoid(gate) (gate None: ungated).
        q [T, Hq * hd], k, v [T, Hkv * hd]; kv the layer's cache: {"k", "v": [Cap, Hkv, hd]}, plus
        {"k_scale", "v_scale": [Cap, Hkv] fp32} when it is int8 (quantize_kv) -> (o [T, Hq * hd], kv).
        Rows mode (start [S]): kv holds the bank's [S, ...], or with SLOTS [B] the bank's rows of the B rows (the
        kv returned is the bank, without SLOTS)."""
        if is_rows(start) and SLOTS in kv:
            return self._attention_slots(q, k, v, gate, q_norm, k_norm, eps, kv, start, n_valid, rope, rope_pos)
        if is_rows(start):
            def one(q, k, v, g, kv, s, n, r):
                o, kv = self.attention_block(q[None], k[None], v[None], None if gate is None else g[None], q_norm,
                                             k_norm, eps, kv, s, n, rope, None if rope_pos is None else r[None])
                return o[0], kv
            # a two-tier bank: each row's own host row copied to the device (not the bank's other rows)
            host = {n: a for n, a in kv.items() if n.endswith(HOST)}
            rows = {n: self.xp.stack([self.host_window(a, kv[TIER_ROW][i], 0, a.shape[1]) for i in range(q.shape[0])])
                    for n, a in host.items()}
            o, kv = self.vmap(one)(q, k, v, q if gate is None else gate, {**kv, **rows}, start, n_valid,
                                   start if rope_pos is None else rope_pos)
            return o, {**kv, **host}
        xp = self.xp
        t = q.shape[0]
        _, hkv, hd = kv["k"].shape
        hq = q.shape[1] // hd
        positions = start + xp.arange(t)
        valid = self.valid_mask(t, n_valid)
        rp = positions if rope_pos is None else rope_pos
        q = self.rope(self.rms_norm(q.reshape(t, hq, hd), q_norm, eps), rp, rope)
        k = self.rope(self.rms_norm(k.reshape(t, hkv, hd), k_norm, eps), rp, rope)
        # padded rows look at key 0 only (their output is discarded), so the keys visited follow the real rows
        q_pos = xp.where(valid, positions, 0)
        if TIER_BASE in kv:
            o, kv = self._attention_tiers(q, k, v.reshape(t, hkv, hd), kv, start, q_pos)
        else:
            kv = self.kv_store(kv, k, v.reshape(t, hkv, hd), start)
            o = self.attention(q, kv["k"], kv["v"], q_pos, hd ** -0.5, kv.get("k_scale"), kv.get("v_scale"))
        o = o.reshape(t, hq * hd)
        if gate is not None:
            o = o * self.sigmoid(gate)
        return o, kv

    def _attention_slots(self, q, k, v, gate, q_norm, k_norm, eps, kv, start, n_valid, rope, rope_pos=None):
        """attention_block's rows mode on the bank rows kv[SLOTS] [B]: those rows' caches gathered (a copy of B
        whole rows: the composition's way; a kernel reads them in place), attended, their caches put back."""
        slots = kv[SLOTS]
        own = [n for n in kv if n != SLOTS and not n.endswith(HOST)]       # per-slot arrays [S, ...]
        sub = {**{n: kv[n] for n in kv if n.endswith(HOST)}, **{n: self.take_rows(kv[n], slots) for n in own}}
        o, sub = self.attention_block(q, k, v, gate, q_norm, k_norm, eps, sub, start, n_valid, rope, rope_pos)
        return o, {**{n: kv[n] for n in kv if n != SLOTS},
                   **{n: self.put_rows(kv[n], slots, sub[n]) for n in own if n in KV_NAMES}}

    def _attention_tiers(self, q, k, v, kv, start, q_pos):
        """attention_block's store and attention for a two-tier cache (kv_resident; forward.kv_state): the new keys
        go to the device window at start - base, and the attention reads the host part [0, base) staged on the
        device (copied in blocks up to base, not the tier's capacity) with the window written over it at base, so
        it is the one-tier attention over the same keys. -> (o [T, Hq, hd], kv)."""
        xp, t = self.xp, q.shape[0]
        base = kv[TIER_BASE]
        window = {n: kv[n] for n in KV_NAMES if n in kv}
        rows = window["k"].shape[0]
        # the scratch position of an inactive decode row lands on the window's last row, which the tiers keep free
        # of real positions (strata/engine/kv_tiers.py); a real row is always inside the window
        window = self.kv_store(window, k, v, xp.minimum(start - base, rows - t))
        full = {n: self.kv_write(self.host_prefix(kv[n + HOST], base, STAGE_BLOCK), w, base)
                for n, w in window.items()}
        o = self.attention(q, full["k"], full["v"], q_pos, q.shape[-1] ** -0.5, full.get("k_scale"),
                           full.get("v_scale"))
        return o, {**kv, **window}

    def kv_store(self, kv, k, v, start):
        """The layer's cache with keys and values [T, Hkv, hd] written at rows start.. (int8: quantised, their
        scales beside them)."""
        if "k_scale" not in kv:
            return {"k": self.kv_write(kv["k"], k, start), "v": self.kv_write(kv["v"], v, start)}
        out = {}
        for name, x in (("k", k), ("v", v)):
            q8, scale = quantize_kv(self.xp, x)
            out[name] = self.kv_write(kv[name], q8, start)
            out[name + "_scale"] = self.kv_write(kv[name + "_scale"], scale, start)
        return out

    def delta_block(self, qkv, z, b, a, conv_state, conv_w, ssm, a_log, dt_bias, gnorm, eps, start, n_valid,
                    n_k_heads, gate_act="silu"):
        """The Gated DeltaNet mixer from its projections to the gated output (before out_proj): causal conv + SiLU
        over [q|k|v], l2-normed q (times dk^-0.5) and k shared by r = Hv / Hk value heads, beta = sigmoid(b),
        g = -exp(A_log) * softplus(a + dt_bias) (both 0 on padded rows, which leaves the state unchanged), the gated
        delta rule, then a gated RMSNorm per head with gate_act(z) (silu; qwen4_exp: sigmoid). A sequence at start 0
        starts from empty states.
        qkv [T, C]; z [T, Hv * dv]; b, a [T, Hv]; conv_state [K-1, C]; ssm [Hv, dk, dv] fp32
        -> (o [T, Hv * dv], conv_state, ssm)."""
        if is_rows(start):
            def one(qkv, z, b, a, conv_state, ssm, s, n):
                o, conv_state, ssm = self.delta_block(qkv[None], z[None], b[None], a[None], conv_state, conv_w, ssm,
                                                      a_log, dt_bias, gnorm, eps, s, n, n_k_heads, gate_act)
                return o[0], conv_state, ssm
            return self.vmap(one)(qkv, z, b, a, conv_state, ssm, start, n_valid)
        xp = self.xp
        t = qkv.shape[0]
        f32 = xp.float32
        conv_state = xp.where(start > 0, conv_state, xp.zeros_like(conv_state))
        ssm = xp.where(start > 0, ssm, xp.zeros_like(ssm))
        hv, dk, dv = ssm.shape
        hk = n_k_heads
        r = hv // hk
        valid = self.valid_mask(t, n_valid)
        qkv, conv_state = self.causal_conv(qkv, conv_state, conv_w, n_valid)                # [T, C]
        q = qkv[:, :hk * dk].reshape(t, hk, dk).astype(f32)
        k = qkv[:, hk * dk:2 * hk * dk].reshape(t, hk, dk).astype(f32)
        v = qkv[:, 2 * hk * dk:].reshape(t, hv, dv).astype(f32)
        q = _l2norm(xp, q) * (dk ** -0.5)
        k = _l2norm(xp, k)
        if r > 1:  # key head j serves value heads j*r .. j*r + r-1
            q, k = xp.repeat(q, r, axis=1), xp.repeat(k, r, axis=1)
        vmask = valid[:, None]
        beta = xp.where(vmask, self.sigmoid(b).astype(f32), 0.0)                                # [T, Hv]
        g = xp.where(vmask, -xp.exp(a_log) * self.softplus(a.astype(f32) + dt_bias), 0.0)      # [T, Hv], <= 0
        rule = self.gated_delta_step if t == 1 else self.gated_delta_chunked
        o, ssm = rule(q, k, v, g, beta, ssm)                                                   # [T, Hv, dv]
        # gated RMSNorm per head: w * x_hat (in the activation dtype), times gate_act(z) in fp32
        o = self.rms_norm(o.astype(z.dtype), gnorm, eps)
        act = self.sigmoid if gate_act == "sigmoid" else self.silu
        o = (o.astype(f32) * act(z.reshape(t, hv, dv).astype(f32))).astype(z.dtype).reshape(t, hv * dv)
        return o, conv_state, ssm


def quantize_kv(xp, x):
    """x [..., hd] -> (int8 [..., hd], float32 scale [...]): strata/reference.py quantize_kv, in xp. A row with
    a NaN gets a NaN scale, so whatever reads it is non-finite (the numerics guard sees it)."""
    x = x.astype(xp.float32)
    scale = xp.max(xp.abs(x), axis=-1) / 127.0
    div = xp.where(scale > 0, scale, 1.0)[..., None]
    return xp.clip(xp.round(x / div), -127, 127).astype(xp.int8), scale


def _l2norm(xp, x):
    return x / xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True) + 1e-6)
