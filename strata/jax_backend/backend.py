"""The Backend on JAX: XLA ops, and Pallas kernels (kernels/) where they measured faster on the GPU.

Every op is a pure function of its arguments, so the forward pass that calls them can be jitted whole, with the
sequence state threaded through as values (donated by the caller). `kernels`: "xla" runs plain XLA everywhere (the
correctness baseline); "auto" runs the Pallas kernels of PALLAS_AUTO on a GPU and XLA elsewhere; "pallas" runs them
everywhere (interpreted off a GPU: tests). A kernel that does not take a call's shapes (its ValueError at trace
time) leaves that call to XLA, so a model of any shape runs. `kernel_config` (KernelConfig): the kernels' settings,
fixed when the backend is made. Measurements behind these choices: docs/performance.md.
"""
from __future__ import annotations

import copy
import math
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from strata.errors import ConfigError
from strata.jax_backend.kernel_config import KernelConfig
from strata.jax_backend.kernels import decode_attention as k_attention
from strata.jax_backend.kernels import expert_decode as k_expert_decode
from strata.jax_backend import cuda_memory
from strata.jax_backend.kernels import expert_grouped as k_expert_grouped
from strata.jax_backend.kernels import gated_delta as k_gated_delta
from strata.jax_backend.kernels import route as k_route
from strata.jax_backend.kernels.experts import GATHER_ROUTES_MAX, copy_rows_loop, experts_fetching, experts_from_pool
from strata.jax_backend.kernels.host_rows import copy_host_rows
from strata.jax_backend.xla_flags import pinned_host_usable
from strata.backend import (HOST, KV_NAMES, SLOTS, TIER_BASE, TIER_ROW, ComposedOps, is_rows, quantize_kv,
                            rotary_positions)
from strata.host_rows import HostRows

KV_BLOCK = 512      # keys per step of the attention's online softmax
ATTN_ONE_PASS_ROWS = 8   # query rows up to which attention reads the whole cache in one pass
FILL_BATCH = 64          # experts per pool_fill call (100 MB at Qwen3-Next-80B int4: the copies dwarf the call)
KERNELS = ("auto", "xla", "pallas")
# The Pallas kernels "auto" runs on a GPU (each faster than XLA's form at Qwen3-Next-80B shapes: docs/performance.md),
# and "pallas" everywhere: attention (decode rows and prompt parts), the expert op's grouped (prompt) and int4 decode
# forms, the routing.
PALLAS_AUTO = frozenset({"attention", "experts_grouped", "experts_decode", "route"})


# a HostRows in a parameter tree is static to compiled functions: they read it through host_call
jax.tree_util.register_pytree_node(HostRows, lambda t: ((), t), lambda t, _: t)


class JaxBackend(ComposedOps):         # fused ops as compositions: XLA fuses them in the jitted window
    name = "jax"
    eager = False
    joins_projections = True             # XLA fuses the product's column slices into their consumers
    xp = jnp

    def __init__(self, device: str | None = None, kernels: str = "auto", kernel_config: KernelConfig | None = None):
        devices = jax.devices(device) if device else jax.devices()
        self.device = devices[0]
        if kernels not in KERNELS:
            raise ConfigError(f"kernels {kernels!r} is not allowed; allowed: {', '.join(KERNELS)}")
        if kernel_config is not None and not isinstance(kernel_config, KernelConfig):
            raise ConfigError(f"kernel_config must be a KernelConfig, not {type(kernel_config).__name__}")
        on_gpu = self.device.platform == "gpu"
        self.kernels = kernels
        self.kernel_config = kernel_config or KernelConfig()
        self.pallas_ops = frozenset() if kernels == "xla" or (kernels == "auto" and not on_gpu) else PALLAS_AUTO
        self.interpret = not on_gpu           # Pallas kernels off a GPU run in interpret mode (tests)
        # how a compiled window copies host rows: on a GPU the kernel (kernels/host_rows.py: XLA's loop waits on the
        # host once per row), elsewhere XLA's loop
        self.copy_rows = copy_host_rows if on_gpu else copy_rows_loop
        self._zeros: dict = {}                # zeros_like's compiled calls, by tree shape

    @property
    def peers(self) -> "JaxBackend":
        return self

    def device_count(self) -> int:
        return len(jax.devices(self.device.platform))

    def on_device(self, i: int) -> "JaxBackend":
        """This backend on device i of its platform (the same kernels and kernel settings)."""
        devices = jax.devices(self.device.platform)
        if not 0 <= i < len(devices):
            raise ConfigError(f"device {i} of {self.device.platform}: the backend sees {len(devices)}")
        other = copy.copy(self)
        other.device, other._zeros = devices[i], {}
        return other

    @property
    def reference(self) -> "JaxBackend | None":
        """This backend with plain XLA in place of its Pallas kernels (same device), when it runs any."""
        if not self.pallas_ops:
            return None
        ref = copy.copy(self)
        ref.kernels, ref.pallas_ops, ref._zeros = "xla", frozenset(), {}
        return ref

    def report(self, fn, *xs):
        """fn(*host values of xs) once they are computed, from inside a compiled window too."""
        jax.debug.callback(fn, *xs)

    @staticmethod
    def host_call(fn, results, *xs):
        """fn on the host from inside a compiled window: the device waits for its arrays (under vmap fn gets the
        rows stacked, as the host function of a gather wants)."""
        specs = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in results)
        return jax.pure_callback(lambda *a: tuple(fn(*a)), specs, *xs, vmap_method="expand_dims")

    # --- placement and memory
    def to_device(self, tree):
        return jax.device_put(tree, self.device)

    def zeros_like(self, tree):
        # filled on the device, not copied from (pageable) host memory; and by one compiled call per tree shape, not
        # one eager op per leaf (each eager op is a dispatch the host waits on)
        leaves, treedef = jax.tree.flatten(tree)
        specs = tuple((tuple(a.shape), np.dtype(a.dtype)) for a in leaves)
        make = self._zeros.get((treedef, specs))
        if make is None:
            make = self._zeros[(treedef, specs)] = jax.jit(
                lambda: [jnp.zeros(shape, dtype) for shape, dtype in specs],
                out_shardings=jax.sharding.SingleDeviceSharding(self.device))
        return jax.tree.unflatten(treedef, make())

    def to_host(self, x):
        return np.asarray(x)

    @staticmethod
    def start_to_host(x):
        # the device-to-host copy is queued behind the computation now, not when the host asks for the value (a
        # window's small result read back on demand cost a large share of a decode window: docs/performance.md)
        x.copy_to_host_async()

    def free_memory_bytes(self, driver=None) -> int | None:
        """The allocator's limit less what it holds; on a GPU whose allocator says nothing (XLA's VMM allocator),
        the CUDA driver's free memory (driver: its library, a stub in tests)."""
        stats = self.device.memory_stats()
        if stats and "bytes_limit" in stats:
            return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
        if self.device.platform == "gpu":
            got = cuda_memory.free_total(self.device.local_hardware_id, driver)
            return None if got is None else got[0]
        return None

    @staticmethod
    def scope(name):
        return jax.named_scope(name)         # in the HLO's op names, so a profile can group kernels by it

    # --- dense math
    @staticmethod
    def rms_norm(x, scale, eps):
        xf = x.astype(jnp.float32)
        y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)

    @staticmethod
    def linear(x, w):
        return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), precision=lax.Precision.HIGHEST)

    @staticmethod
    def silu(x):
        return jax.nn.silu(x)

    @staticmethod
    def sigmoid(x):
        return jax.nn.sigmoid(x)

    @staticmethod
    def softplus(x):
        return jax.nn.softplus(x)

    @staticmethod
    def softmax(x):
        return jax.nn.softmax(x.astype(jnp.float32), axis=-1)

    @staticmethod
    def rope(x, positions, rope):
        # NeoX rotate-half on the first rotary_dim features; the rest pass through.  x: [T, heads, hd]; positions [T]
        # or (t, h, w) rows [T, 3] (rope.sections)
        rotary_dim = rope.rotary_dim
        inv_freq = jnp.asarray(np.array(rope.inv_freq, np.float32))
        freqs = rotary_positions(positions, rope).astype(jnp.float32) * inv_freq[None, :]    # [T, rotary_dim/2]
        emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]                   # [T, 1, rotary_dim]
        # the scale multiplies cos and sin in fp32 before they take x's dtype, as transformers does
        cos, sin = (jnp.cos(emb) * rope.scale).astype(x.dtype), (jnp.sin(emb) * rope.scale).astype(x.dtype)
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        half = rotary_dim // 2
        rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
        return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)

    # --- sequence state
    @staticmethod
    def kv_write(cache, new, start):
        # cache [Cap, ...] (keys, values [Cap, Hkv, hd] or int8 scales [Cap, Hkv]); the engine sizes Cap so that
        # start + T never runs past it (no silent clamping)
        return lax.dynamic_update_slice(cache, new.astype(cache.dtype), (start,) + (0,) * (cache.ndim - 1))

    @staticmethod
    def kv_read(cache, start, n):
        # a start past Cap - n is clamped to it, as kv_write clamps: a block read and written back lands where it was
        return lax.dynamic_slice_in_dim(cache, start, n, axis=0)

    def attention(self, q, k_cache, v_cache, q_pos, scale, k_scale=None, v_scale=None):
        """A prompt part's attention (more than ATTN_ONE_PASS_ROWS rows) by the flash-attention kernel
        (kernels/decode_attention.py, prompt_attention, at kernel_config's prompt_block_k) when chosen and the shapes
        suit it, else attention_xla."""
        block_k = self.kernel_config.prompt_block_k or None
        if (q.shape[0] > ATTN_ONE_PASS_ROWS and "attention" in self.pallas_ops
                and k_attention.prompt_supported(q, k_cache, v_cache, k_scale, v_scale, q_pos, block_k)):
            return k_attention.prompt_attention(q, k_cache, v_cache, k_scale, v_scale, q_pos, scale=scale,
                                                interpret=self.interpret, block_k=block_k)
        return JaxBackend.attention_xla(q, k_cache, v_cache, q_pos, scale, k_scale, v_scale)

    @staticmethod
    def attention_xla(q, k_cache, v_cache, q_pos, scale, k_scale=None, v_scale=None):
        """q [T, Hq, hd]; caches [Cap, Hkv, hd]; a query at position p sees keys 0..p (GQA: r = Hq / Hkv). int8
        caches come with their scales [Cap, Hkv] (the stored row is q * scale).

        Up to ATTN_ONE_PASS_ROWS query rows (decode) attend over the whole cache in one pass: a few fused kernels,
        where a loop over key blocks would be bound by launches. More rows (prompt parts) visit keys in blocks of
        KV_BLOCK with an online softmax, only up to the furthest query's position: cost and memory follow the
        sequence's length, not the cache's capacity."""
        t, hq, hd = q.shape
        cap, hkv, _ = k_cache.shape
        if t <= ATTN_ONE_PASS_ROWS:
            return JaxBackend._attention_one_pass(q, k_cache, v_cache, q_pos, scale, k_scale, v_scale)
        blk = min(KV_BLOCK, cap)
        hi = lax.Precision.HIGHEST
        qg = q.reshape(t, hkv, hq // hkv, hd).astype(jnp.float32) * scale
        n_blocks = jnp.minimum(jnp.max(q_pos) // blk + 1, -(-cap // blk))

        def body(i, carry):
            m, l, acc = carry                                                            # [T,g,r], [T,g,r], [T,g,r,hd]
            start = jnp.minimum(i * blk, cap - blk)                                      # last block may overlap
            kb = _dequantized(lax.dynamic_slice_in_dim(k_cache, start, blk), k_scale, start, blk)  # [B, Hkv, hd]
            vb = _dequantized(lax.dynamic_slice_in_dim(v_cache, start, blk), v_scale, start, blk)
            key_pos = start + jnp.arange(blk)
            fresh = key_pos >= i * blk                                                   # not seen by an earlier block
            s = jnp.einsum("tgrd,cgd->tgrc", qg, kb, precision=hi)
            visible = (key_pos[None, :] <= q_pos[:, None]) & fresh[None, :]              # [T, B]
            s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            return m_new, l * corr + p.sum(axis=-1), acc * corr[..., None] + jnp.einsum("tgrc,cgd->tgrd", p, vb,
                                                                                     precision=hi)

        shape = (t, hkv, hq // hkv)
        init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(shape + (hd,), jnp.float32))
        # every query sees key 0, so after the first block m is finite and corr never computes inf - inf
        _, l, acc = lax.fori_loop(0, n_blocks, body, init)
        return (acc / l[..., None]).reshape(t, hq, hd).astype(q.dtype)

    @staticmethod
    def _attention_one_pass(q, k_cache, v_cache, q_pos, scale, k_scale, v_scale):
        t, hq, hd = q.shape
        cap, hkv, _ = k_cache.shape
        # both products are multiply-reduces that read the cache where it lies, its conversion to float32 fused in: a
        # dot batched over the KV heads (the cache's middle axis) made XLA write a float32, transposed copy of the
        # whole cache first, per layer and window
        qg = q.reshape(t, 1, hkv, hq // hkv, hd).astype(jnp.float32) * scale            # [T, 1, g, r, hd]
        k = _dequantized(k_cache, k_scale, 0, cap)[None, :, :, None, :]                 # [1, Cap, g, 1, hd]
        s = jnp.sum(qg * k, axis=-1)                                                     # [T, Cap, g, r]
        visible = jnp.arange(cap)[None, :] <= q_pos[:, None]                             # [T, Cap]
        p = jax.nn.softmax(jnp.where(visible[:, :, None, None], s, -jnp.inf), axis=1)
        v = _dequantized(v_cache, v_scale, 0, cap)[None, :, :, None, :]
        o = jnp.sum(p[..., None] * v, axis=1)                                            # [T, g, r, hd]
        return o.reshape(t, hq, hd).astype(q.dtype)

    def attention_block(self, q, k, v, gate, q_norm, k_norm, eps, kv, start, n_valid, rope, rope_pos=None):
        """The composition (strata/backend.py), but a decode window's attention (rows mode: one query per
        sequence over its own cache in the bank) is one Pallas kernel over every row (kernels/decode_attention.py),
        whose cost follows each row's length rather than the cache's capacity; with SLOTS, the kernel reads the
        window's rows of the bank in place."""
        if "attention" not in self.pallas_ops or not is_rows(start):
            return super().attention_block(q, k, v, gate, q_norm, k_norm, eps, kv, start, n_valid, rope, rope_pos)
        s = q.shape[0]
        _, _, hkv, hd = kv["k"].shape
        hq = q.shape[1] // hd
        slots = kv.get(SLOTS)
        scales = (kv.get("k_scale"), kv.get("v_scale"))
        rp = start if rope_pos is None else rope_pos
        qr = self.rope(self.rms_norm(q.reshape(s, hq, hd), q_norm, eps), rp, rope)        # [S, Hq, hd]
        if not k_attention.supported(qr[:, None], kv["k"], kv["v"], *scales, start, banked=slots is not None):
            return super().attention_block(q, k, v, gate, q_norm, k_norm, eps, kv, start, n_valid, rope, rope_pos)
        kr = self.rope(self.rms_norm(k.reshape(s, hkv, hd), k_norm, eps), rp, rope)
        kv = {n: a for n, a in kv.items() if n != SLOTS}
        bank = jnp.arange(s, dtype=jnp.int32) if slots is None else slots       # row s's bank row

        def own(name):                       # a per-slot value of each row
            return kv[name] if slots is None else self.take_rows(kv[name], slots)
        tiered = TIER_BASE in kv
        base = own(TIER_BASE) if tiered else jnp.zeros_like(start)
        window = {n: kv[n] for n in KV_NAMES if n in kv}
        rows = window["k"].shape[1]
        # two tiers: the new key at start - base of the device window (an inactive row's scratch position at its
        # last row, which strata/engine/kv_tiers.py keeps free of real positions)
        at = jnp.minimum(start - base, rows - 1) if tiered else start
        window = _store_rows(window, kr, v.reshape(s, hkv, hd), bank, at)
        kv = {**kv, **window}
        # an inactive row attends to key 0 only (as the composition's): its output is discarded
        active = n_valid > 0
        pos = jnp.where(active, start - base, 0).astype(jnp.int32)
        args = (qr[:, None], window["k"], window["v"], window.get("k_scale"), window.get("v_scale"), pos)
        if tiered:     # the host part read in place by the kernel (interpret mode reads device memory only)
            host = [kv[n + HOST] if n in window else None for n in KV_NAMES]
            if self.interpret:
                host = [None if x is None else self.from_host_tier(x) for x in host]
            n_host = jnp.where(active, base, 0).astype(jnp.int32)
            o = k_attention.tiered_decode_attention(*args, *host, n_host, own(TIER_ROW), dev_rows=slots,
                                                    scale=hd ** -0.5, interpret=self.interpret)
        else:
            o = k_attention.decode_attention(*args, rows=slots, scale=hd ** -0.5, interpret=self.interpret)
        o = o[:, 0].reshape(s, hq * hd)
        if gate is not None:
            o = o * self.sigmoid(gate)
        return o, kv

    @staticmethod
    def causal_conv(u, conv_state, w, n_valid):
        # u [T, C]; conv_state [K-1, C] = the last K-1 inputs before this part; w [C, K]
        k = w.shape[1]
        t = u.shape[0]
        ext = jnp.concatenate([conv_state.astype(u.dtype), u], axis=0)                # [K-1+T, C]
        y = sum(ext[j:j + t] * w[:, j].astype(u.dtype) for j in range(k))
        new_state = lax.dynamic_slice_in_dim(ext, n_valid, k - 1, axis=0)
        return jax.nn.silu(y), new_state.astype(conv_state.dtype)

    def gated_delta_chunked(self, q, k, v, g, beta, state):
        """Prompt parts' gated delta rule at kernel_config's gdn_chunk (gated_delta_chunked_xla)."""
        return JaxBackend.gated_delta_chunked_xla(q, k, v, g, beta, state, chunk=self.kernel_config.gdn_chunk)

    @staticmethod
    def gated_delta_chunked_xla(q, k, v, g, beta, state, chunk: int = k_gated_delta.CHUNK):
        """Chunked gated delta rule (chunks of `chunk` tokens). q, k [T, Hv, dk] (l2-normed, q scaled), v [T, Hv, dv],
        g, beta [T, Hv] fp32; state [Hv, dk, dv] fp32. Rows with g = beta = 0 leave the state unchanged (that is how
        padding works). The fp32 matmuls run at Precision.HIGHEST (IEEE)."""
        t, hv, dk = k.shape
        dv = v.shape[-1]
        c = chunk
        pad = (-t) % c
        f32 = jnp.float32
        q, k, v, g, beta = (jnp.pad(x.astype(f32), [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in (q, k, v, g, beta))
        n = (t + pad) // c
        # the intra-chunk products, batched over chunks and heads: w, u [Hv, Tp, d], attn [Hv, n, c, c], decays
        w, u, attn, eq, ek = k_gated_delta.chunk_products_xla(q, k, v, g, beta, chunk=c)
        hi = k_gated_delta.HI
        # [n, Hv, c, ...] for the scan over chunks
        chunks = lambda x: x.reshape(hv, n, c, -1).transpose(1, 0, 2, 3)            # noqa: E731
        per_head = lambda x: x.reshape(n, c, hv, -1).transpose(0, 2, 1, 3)          # noqa: E731
        eq_c, ek_c = chunks(eq), chunks(ek)
        q_dec = per_head(q) * eq_c                                                   # q e^G
        k_dec = per_head(k) * ek_c                                                   # k e^(G_last - G)
        chunk_decay = eq_c[:, :, -1:, :]                                             # [n, Hv, 1, 1]: e^(G_last)

        # The state's recurrence is linear and its coefficients do not depend on the state: with v' = u - w S,
        #   S_{c+1} = e^(G_last) S_c + k'^T v'_c = M_c S_c + b_c,  M_c = e^(G_last) I - k'^T w_c [dk, dk],
        #   b_c = k'^T u_c [dk, dv],
        # so M and b are batched matmuls over every chunk, and the scan's step is one matmul and an add (two matmuls
        # and their elementwise work a step were thousands of small kernels a part). v' and o need S before each chunk:
        # the scan returns those (a 4096-token part: 64 states, 134 MB), and v' and o are batched matmuls after it.
        # Each iteration takes a block of `blk` chunks (SCAN_BLOCK, or what divides n) walked with static indices: a
        # GPU while loop slices its inputs and stacks its outputs by copies.
        k_dec_t = k_dec.swapaxes(-1, -2)                                             # [n, Hv, dk, c]
        eye = jnp.eye(dk, dtype=f32)
        M = chunk_decay * eye - jnp.einsum("nhdc,nhce->nhde", k_dec_t, chunks(w), precision=hi)   # [n, Hv, dk, dk]
        b = jnp.einsum("nhdc,nhce->nhde", k_dec_t, chunks(u), precision=hi)                      # [n, Hv, dk, dv]
        blk = math.gcd(n, k_gated_delta.SCAN_BLOCK)

        def block(S, xs):
            s_in = []
            for j in range(blk):
                M_j, b_j = (x[j] for x in xs)
                s_in.append(S)
                S = jnp.einsum("hde,hef->hdf", M_j, S, precision=hi) + b_j
            return S, jnp.stack(s_in)

        xs = tuple(x.reshape((n // blk, blk) + x.shape[1:]) for x in (M, b))
        state, s_before = lax.scan(block, state.astype(f32), xs)
        s_before = s_before.reshape((n,) + s_before.shape[2:])                       # [n, Hv, dk, dv]
        v_new = chunks(u) - jnp.einsum("nhcd,nhde->nhce", chunks(w), s_before, precision=hi)
        out = (jnp.einsum("nhcd,nhde->nhce", q_dec, s_before, precision=hi)
               + jnp.einsum("nhij,nhje->nhie", attn.transpose(1, 0, 2, 3), v_new, precision=hi))
        out = out.transpose(0, 2, 1, 3).reshape(n * c, hv, dv)[:t]
        return out, state

    @staticmethod
    def gated_delta_step(q, k, v, g, beta, state):
        """Recurrent form for one token: q, k [1, Hv, dk], v [1, Hv, dv], g, beta [1, Hv]; state [Hv, dk, dv]."""
        hi = lax.Precision.HIGHEST
        q, k, v, g, beta = (x[0].astype(jnp.float32) for x in (q, k, v, g, beta))
        S = state * jnp.exp(g)[:, None, None]
        kv_mem = jnp.einsum("hde,hd->he", S, k, precision=hi)
        delta = (v - kv_mem) * beta[:, None]
        S = S + k[:, :, None] * delta[:, None, :]
        o = jnp.einsum("hde,hd->he", S, q, precision=hi)
        return o[None], S

    @staticmethod
    def valid_mask(t, n_valid):
        return jnp.arange(t) < n_valid

    @staticmethod
    def set_row(x, i, row):
        """x with x[i] = row, at a traced index (in place when x is donated)."""
        return lax.dynamic_update_index_in_dim(x, row.astype(x.dtype), i, axis=0)

    @staticmethod
    def take_row(x, i):
        return lax.dynamic_index_in_dim(x, i, axis=0, keepdims=False)

    @staticmethod
    def take_rows(x, idx):
        return jnp.take(x, idx, axis=0, unique_indices=True, mode="clip")

    @staticmethod
    def put_rows(x, idx, rows):
        """x with x[idx] = rows (idx distinct; in place when x is donated)."""
        return x.at[idx].set(rows.astype(x.dtype), unique_indices=True, mode="clip")

    # --- mixture of experts
    @staticmethod
    def topk(x, k):
        return lax.top_k(x, k)

    def experts_pool(self, x, slots, weight, pool, layout, max_distinct):
        """The expert op over the slot pool: x [T, H]; slots, weight [T, k] (slot -1: not computed here); pool uint8
        [N, layout.nbytes]. Windows of int4 blobs with kernel_config.decode_expert_min_tokens tokens or more and at
        most decode_expert_max_routes routes through the decode kernel, other windows of more than GATHER_ROUTES_MAX
        routes (prompt parts) through the grouped kernel, when chosen; otherwise (and for shapes a kernel does not
        take) strata/jax_backend/kernels/experts.py in XLA."""
        t, kk = slots.shape
        single = not isinstance(pool, (tuple, list))
        cfg = self.kernel_config
        try:
            if (single and cfg.decode_expert_min_tokens <= t and t * kk <= cfg.decode_expert_max_routes
                    and "experts_decode" in self.pallas_ops and layout.fmt in k_expert_decode.FORMATS):
                return k_expert_decode.experts_decode(layout, pool, x, slots, weight, interpret=self.interpret,
                                                      block=cfg.decode_expert_rows, warps=cfg.decode_expert_warps)
        except ValueError:                   # shapes or a format the kernel does not take
            pass
        try:
            if single and t * kk > GATHER_ROUTES_MAX and "experts_grouped" in self.pallas_ops:
                return k_expert_grouped.experts_grouped(layout, pool, x, slots, weight, interpret=self.interpret,
                                                        max_distinct=max_distinct)
        except ValueError:
            pass
        return experts_from_pool(layout, pool, x, slots, weight, max_distinct)

    def experts_fetch(self, x, ids, weight, valid, pool, table_row, chunks, starts, layout):
        """The expert op with misses copied from host chunks inside the window (kernels/experts.py,
        experts_fetching, with this device's copy_rows) -> (y [T, H], experts copied)."""
        return experts_fetching(layout, pool, table_row, chunks, starts, x, ids, weight.astype(x.dtype), valid,
                                copy_rows=self.copy_rows)

    def route(self, logits, k, renormalize):
        """The composition (ComposedOps.route), or its one-kernel form (kernels/route.py) when chosen and the
        expert count is a power of two."""
        if "route" in self.pallas_ops:
            try:
                return k_route.route(logits, k=int(k), renormalize=bool(renormalize), interpret=self.interpret)
            except ValueError:               # an expert count the kernel does not take
                pass
        return super().route(logits, k, renormalize)

    @staticmethod
    def route_counts(idx, valid, n_experts):
        """[T, k] routes of the valid rows -> [E] int32 counts."""
        w = jnp.broadcast_to(valid[:, None], idx.shape).astype(jnp.int32)
        return jnp.zeros(n_experts, jnp.int32).at[idx.reshape(-1)].add(w.reshape(-1))

    # --- the slot pool (uint8 [N, nbytes]; a value: every write returns the pool the next computation reads)
    def pool_alloc(self, n, nbytes):
        return jax.device_put(jnp.zeros((n, nbytes), jnp.uint8), self.device)

    def pool_write(self, pool, slots, blobs):
        """pool with rows `slots` [m] replaced by `blobs` (m host uint8 [nbytes] arrays, each copied to the device
        as it is, with no host-side gathering); the old pool is donated. m is padded to a power of two by repeating
        the last one (the same bytes into the same slot), so compilations stay few."""
        slots = np.asarray(slots, np.int32)
        blobs = list(blobs)
        m = len(slots)
        b = 1 << max(0, (m - 1).bit_length())
        if b > m:
            slots = np.concatenate([slots, np.repeat(slots[-1:], b - m)])
            blobs = blobs + [blobs[-1]] * (b - m)
        # an explicit device-memory sharding: blobs in pinned host memory are copied (DMA), not rewrapped
        on_device = jax.sharding.SingleDeviceSharding(self.device, memory_kind="device")
        return _pool_write(pool, jax.device_put(slots, self.device), jax.device_put(blobs, on_device))

    @property
    def host_fetch(self) -> "JaxBackend | None":
        """The HostFetch capability (strata/backend.py): this backend when its device has pinned host memory, which
        a compiled window reads by itself (experts_fetch), and XLA's allocator allows it (xla_flags); else None."""
        kinds = {m.kind for m in self.device.addressable_memories()}
        usable = pinned_host_usable(self.device.platform, os.environ.get("XLA_FLAGS", ""))
        return self if "pinned_host" in kinds and usable else None

    @property
    def host_kv(self) -> "JaxBackend | None":
        """The HostKV capability (strata/backend.py): this backend when its device has pinned host memory that
        XLA's allocator lets it use (xla_flags), else None."""
        kinds = {m.kind for m in self.device.addressable_memories()}
        usable = pinned_host_usable(self.device.platform, os.environ.get("XLA_FLAGS", ""))
        return self if "pinned_host" in kinds and usable else None

    def host_zeros_like(self, tree):
        """Zeros shaped like a host tree, in pinned host memory (one allocation per leaf). Copied from numpy zeros:
        an array a jit makes there (out_shardings) is typed as device memory, and compiled functions then return
        its updates to the device."""
        pinned = jax.sharding.SingleDeviceSharding(self.device, memory_kind="pinned_host")
        return jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), pinned), tree)

    @staticmethod
    def from_host_tier(x):
        return jax.device_put(x, jax.memory.Space.Device)

    @staticmethod
    def host_write(host, x, slot, start):
        # one dynamic_update_slice on the whole (donated) host array: XLA writes it in place
        x = jax.device_put(x.astype(host.dtype), jax.memory.Space.Host)[None]
        return lax.dynamic_update_slice(host, x, (slot, start) + (0,) * (host.ndim - 2))

    @staticmethod
    def host_prefix(host, n, block):
        # one copy per block (a loop over the positions' blocks): the copies follow n, not the host array's rows
        rows = host.shape[0]
        block = min(block, rows)

        def copy(i, out):
            at = jnp.minimum(i * block, rows - block)
            x = jax.device_put(lax.dynamic_slice_in_dim(host, at, block, 0), jax.memory.Space.Device)
            return lax.dynamic_update_slice_in_dim(out, x, at, 0)
        return lax.fori_loop(0, (n + block - 1) // block, copy, jnp.zeros(host.shape, host.dtype))

    @staticmethod
    def host_window(host, slot, start, n):
        rows = lax.dynamic_slice(host, (slot, start) + (0,) * (host.ndim - 2), (1, n) + host.shape[2:])[0]
        return jax.device_put(rows, jax.memory.Space.Device)

    def host_chunk(self, rows):
        """A host chunk: uint8 [n, nbytes] rows copied into pinned host memory (one allocation)."""
        return jax.device_put(rows, jax.sharding.SingleDeviceSharding(self.device, memory_kind="pinned_host"))

    def stage_layer(self, chunks):
        """Host chunks (pinned) copied whole to the device, laid end to end -> uint8 [sum of rows, nbytes]. Returns
        at once: a transfer from pinned memory runs on the copy engine beside the computations queued after it
        (one queued before it delays its start: docs/performance.md, offload prefetch)."""
        on_device = jax.sharding.SingleDeviceSharding(self.device, memory_kind="device")
        parts = [jax.device_put(c, on_device) for c in chunks]
        return parts[0] if len(parts) == 1 else _concat_rows(parts)

    @staticmethod
    def wait(x):
        jax.block_until_ready(x)

    def pool_fill(self, pool, slots, chunks, bounds, rows):
        """pool with rows `slots` [m] replaced by host-chunk rows, copied by the device (one copy per expert):
        entries bounds[c] .. bounds[c+1]-1 come from chunks[c], at rows `rows` [m]. The old pool is donated.
        Calls take FILL_BATCH entries each, the index arrays padded to exactly that (the padding is never copied):
        one compilation serves every fill, so none happens under load."""
        slots, rows = np.asarray(slots, np.int32), np.asarray(rows, np.int32)
        bounds = np.asarray(bounds, np.int64)
        chunks = list(chunks)
        for a in range(0, len(slots), FILL_BATCH):
            pad = np.zeros(FILL_BATCH, np.int32)
            s, r = pad.copy(), pad.copy()
            n = min(FILL_BATCH, len(slots) - a)
            s[:n], r[:n] = slots[a:a + n], rows[a:a + n]
            b = np.clip(bounds - a, 0, n).astype(np.int32)            # this batch's entries of chunk c
            pool = _pool_fill(pool, chunks, *jax.device_put((b, s, r), self.device), copy_rows=self.copy_rows)
        return pool

    def host_rows(self, chunk, rows):
        """rows `rows` [m] of a host chunk -> numpy uint8 [m, nbytes] (through the device: the chunk is pinned host
        memory, which only the device's copies read)."""
        m = len(rows)
        (rows,) = _pad_pow2(np.asarray(rows, np.int32))
        return np.asarray(_host_rows(chunk, jax.device_put(rows, self.device), copy_rows=self.copy_rows))[:m]

    def pool_read(self, pool, slots):
        """rows `slots` [m] of the pool -> host uint8 [m, nbytes] (m padded to a power of two inside, as writes)."""
        m = len(slots)
        (padded,) = _pad_pow2(np.asarray(slots, np.int32))
        return np.asarray(_pool_read(pool, jax.device_put(padded, self.device)))[:m]

    # --- sampling
    @staticmethod
    def sample(logits, temperature, top_k, top_p, min_p, keys, all_greedy: bool = False):
        """logits [B, V] fp32; per-row temperature, top_k (0 = off), top_p (1 = off), min_p (0 = off) and PRNG key
        (keys [B]: a row's draw depends on its own key only, so batching never changes a seeded request).
        A row with temperature 0 is greedy. all_greedy (static): every row is; the argmax alone, without the sort,
        softmax, cumulative sum and draw over the vocabulary that a sampled row needs."""
        b, vocab = logits.shape
        logits = logits.astype(jnp.float32)
        greedy = jnp.argmax(logits, axis=-1)
        if all_greedy:
            return greedy.astype(jnp.int32)
        order = jnp.argsort(-logits, axis=-1)                                         # [B, V] descending
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        scaled = sorted_logits / jnp.maximum(temperature, 1e-6)[:, None]
        probs = jax.nn.softmax(scaled, axis=-1)
        rank = jnp.arange(vocab)[None, :]
        keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
        cum_before = jnp.cumsum(probs, axis=-1) - probs
        keep &= cum_before < top_p[:, None]
        keep &= probs >= min_p[:, None] * probs[:, :1]
        keep = keep.at[:, 0].set(True)                                                # the best token always stays
        choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, scaled, -jnp.inf))
        sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
        return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)

    # --- compilation and randomness
    @staticmethod
    def compile(fn, donate_argnums=(), static_argnames=()):
        return jax.jit(fn, donate_argnums=donate_argnums, static_argnames=static_argnames)

    @staticmethod
    def vmap(fn):
        return jax.vmap(fn)

    @staticmethod
    def prng_keys(seeds, steps):
        """Per-row keys for one sampling step, each reproducible from its row's (seed, step) alone.
        seeds: uint32 [B, 2] (low, high words of 63-bit seeds); steps: int32 [B]."""
        key = lambda s, t: jax.random.fold_in(jax.random.fold_in(jax.random.key(s[0]), s[1]), t)  # noqa: E731
        return jax.vmap(key)(seeds, steps)


def _dequantized(rows, scales, start, n):
    """Cache rows [n, Hkv, hd] as float32: int8 rows times their scales (rows start.. of scales [Cap, Hkv])."""
    rows = rows.astype(jnp.float32)
    if scales is None:
        return rows
    return rows * lax.dynamic_slice_in_dim(scales, start, n)[..., None]


@partial(jax.jit, donate_argnums=(0,))
def _pool_write(pool, slots, blobs):
    return pool.at[slots].set(jnp.stack(blobs))


def _pad_pow2(*arrays):
    """Index arrays [m] padded to a power of two by repeating their last entry (a repeated copy is harmless)."""
    m = len(arrays[0])
    b = 1 << max(0, (m - 1).bit_length())
    return tuple(np.concatenate([a, np.repeat(a[-1:], b - m)]) if b > m else a for a in arrays)


@partial(jax.jit, donate_argnums=(0,), static_argnames=("copy_rows",))
def _pool_fill(pool, chunks, bounds, slots, rows, copy_rows):
    """Entries bounds[c] .. bounds[c+1]-1 come from chunks[c]: copied into a staging buffer by copy_rows, then put
    into their slots on the device (entries past bounds[-1] are padding and write nothing)."""
    m = slots.shape[0]
    staging = jnp.zeros((m, pool.shape[1]), jnp.uint8)
    for c, chunk in enumerate(chunks):
        staging = copy_rows(staging, chunk, rows, bounds[c], bounds[c + 1])
    real = jnp.arange(m) < bounds[-1]
    return pool.at[jnp.where(real, slots, pool.shape[0])].set(staging, mode="drop")


@partial(jax.jit, static_argnames=("copy_rows",))
def _host_rows(chunk, rows, copy_rows):
    out = jnp.zeros((rows.shape[0], chunk.shape[1]), jnp.uint8)
    return copy_rows(out, chunk, rows, jnp.int32(0), jnp.int32(rows.shape[0]))


@jax.jit
def _concat_rows(parts):
    return jnp.concatenate(parts)


@jax.jit
def _pool_read(pool, slots):
    return pool[slots]


def _store_rows(window: dict, k, v, bank, at) -> dict:
    """A decode window's new keys and values [S, Hkv, hd] written into the caches [B, Cap, ...]: row s's at
    (bank[s], at[s]) (int8: quantised, their scales beside them, as kv_store; positions clamped, as kv_write's)."""
    new = {"k": k, "v": v}
    if "k_scale" in window:
        for name in ("k", "v"):
            new[name], new[name + "_scale"] = quantize_kv(jnp, new[name])
    return {n: c.at[bank, at].set(new[n].astype(c.dtype), unique_indices=True, mode="clip") for n, c in window.items()}
