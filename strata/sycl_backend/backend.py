"""The Backend on dpnp + dpctl (SYCL), for Intel GPUs and the OpenCL CPU device: the JAX backend's ops and semantics.

- One queue per device (runtime.queue_for): every array it creates carries `sycl_queue=` and `dtype=`, every kernel
  is built for and submitted to it (Kernels.launch refuses arrays of another queue); cross-device moves are explicit.
- Activations and state are fp32; bfloat16 weights are stored as uint16 bits (`Bf16`: dpnp has no bfloat16) and
  widened where read, so bfloat16 halves the weights' memory but not the math.
- `compile` is the identity: ops run eagerly, in order, on the queue. Host values (positions, token ids, sampling
  settings) stay on the host, so slicing at an offset or picking a state to clear costs no device round trip.
- State ops (kv_write, causal_conv's state, the gated delta rule's state, set_row) update their input in place and
  return it, which is safe because callers never reuse a state they passed (the engine and runner donate it).
"""
from __future__ import annotations

import contextlib
import threading

import ml_dtypes
import numpy as np

from strata.errors import ConfigError
from strata.backend import HOST, SLOTS, TIER_BASE, TIER_ROW, ComposedOps, is_rows, rotary_positions
from strata.sycl_backend import runtime

runtime.prepare_environment()          # before dpctl is first imported

import dpctl  # noqa: E402
import dpctl.utils._order_manager as _order_manager  # noqa: E402
import dpnp  # noqa: E402
from dpctl.utils import SequentialOrderManager  # noqa: E402

from strata.sycl_backend.kernels import Counter, Kernels  # noqa: E402
from strata.sycl_backend.kernels import attention as k_attention  # noqa: E402
from strata.sycl_backend.kernels import blob_decode as k_blob  # noqa: E402
from strata.sycl_backend.kernels import conv as k_conv  # noqa: E402
from strata.sycl_backend.kernels import experts as k_experts  # noqa: E402
from strata.sycl_backend.kernels import gated_delta as k_gdn  # noqa: E402
from strata.sycl_backend.kernels import linear as k_linear  # noqa: E402
from strata.sycl_backend.kernels import norms as k_norms  # noqa: E402
from strata.sycl_backend.kernels import pointwise as k_pointwise  # noqa: E402
from strata.sycl_backend.kernels import rope as k_rope  # noqa: E402
from strata.sycl_backend.kernels import sample as k_sample  # noqa: E402
from strata.sycl_backend.kernels import topk as k_topk  # noqa: E402

# as the JAX backend: at most this many (token, expert) routes use the gathered form of the expert op
GATHER_ROUTES_MAX = 64
LINEAR_KERNEL_ROWS = 16         # linear() rows up to which the kernel beats a oneMKL matmul call
BF16_WIDEN_ELEMENTS = 1 << 24   # a bfloat16 weight is widened for a matmul in blocks of at most this many elements
EXPERT_BLOCK = 64
F32 = np.dtype(np.float32)
BF16 = np.dtype(ml_dtypes.bfloat16)


class Bf16:
    """A bfloat16 tensor stored as its uint16 bits on the device; reads widen to fp32 (its `dtype`, the dtype the
    backend computes in). Indexing (the embedding lookup) gathers rows, then widens them."""

    __slots__ = ("bits", "_ops")

    def __init__(self, bits, ops: "SyclBackend"):
        self.bits, self._ops = bits, ops

    dtype = F32

    @property
    def shape(self):
        return self.bits.shape

    @property
    def ndim(self):
        return self.bits.ndim

    @property
    def size(self):
        return self.bits.size

    @property
    def sycl_queue(self):
        return self.bits.sycl_queue

    def __getitem__(self, index):
        index = self._ops._dev(index) if isinstance(index, np.ndarray) else index
        return self._ops.widen(self.bits[index])

    def widen(self):
        return self._ops.widen(self.bits)


class DeviceInfo:
    """What the engine asks of a backend's device (`platform` picks the default dtype), plus the dpctl device."""

    def __init__(self, sycl_device):
        self.sycl_device = sycl_device
        self.platform = sycl_device.device_type.name          # "cpu" | "gpu" | "accelerator"
        self.backend = sycl_device.backend.name

    def __repr__(self):
        return f"SyclDevice({runtime.describe(self.sycl_device)})"


def _is_host(v) -> bool:
    return isinstance(v, (np.ndarray, np.generic, bool, int, float))


class _Namespace:
    """`ops.xp`: dpnp, with this backend's queue on every array it creates, `where` that takes a host condition
    (a host scalar picks an operand, as a traced condition would select), and the launch counter."""

    CREATORS = frozenset({"arange", "zeros", "ones", "empty", "full", "eye", "identity", "asarray", "array",
                          "linspace", "tri", "ascontiguousarray"})

    def __init__(self, ops: "SyclBackend"):
        self._ops = ops

    def __getattr__(self, name):
        attr = getattr(dpnp, name)
        if isinstance(attr, type) or not callable(attr):
            return attr
        ops = self._ops
        creator = name in self.CREATORS

        def call(*args, **kwargs):
            if ops._counter is not None:
                ops._counter.ops += 1
            if creator:
                kwargs.setdefault("sycl_queue", ops.queue)
            return attr(*args, **kwargs)

        call.__name__ = name
        self.__dict__[name] = call
        return call

    def where(self, cond, x=None, y=None):
        ops = self._ops
        if ops._counter is not None:
            ops._counter.ops += 1
        if x is None:
            return dpnp.where(ops._dev(cond) if _is_host(cond) else cond)
        if (_is_host(cond) and np.ndim(cond) == 0 and isinstance(x, dpnp.ndarray) and isinstance(y, dpnp.ndarray)
                and x.shape == y.shape and x.dtype == y.dtype):
            return x if bool(cond) else y
        return dpnp.where(ops._dev(cond) if _is_host(cond) else cond, x, y)


class SyclBackend(ComposedOps):
    name = "sycl"
    eager = True
    host_fetch = None                    # no compiled windows: misses are copied into slots between layers
    reference = None                     # its kernels are its only ops (the numpy references are not a backend)
    joins_projections = False            # norm_linears / linears take several weights in one launch; a column slice
                                         # of a joined product is strided, which these kernels would copy first

    def __init__(self, device=None, kernels: str = "auto"):
        if kernels != "auto":
            raise ConfigError(f"kernels {kernels!r} applies to the jax backend; the sycl backend runs its own OpenCL "
                              f"kernels (allowed here: auto)")
        self.sycl_device = runtime.select_device(device)
        self.queue = runtime.queue_for(self.sycl_device)
        self.device = DeviceInfo(self.sycl_device)
        self.kernels = Kernels.for_queue(self.queue)
        self.xp = _Namespace(self)
        self._counter: Counter | None = None
        self._consts: dict = {}
        self._consts_lock = threading.Lock()
        self._rows_last: tuple | None = None         # (host [2, S], device copy): see _rows

    def __repr__(self):
        return f"SyclBackend({runtime.describe(self.sycl_device)})"

    # --- Peers: a layer split's stages on the sibling devices (runtime.siblings), one queue each
    @property
    def peers(self) -> "SyclBackend":
        return self

    def device_count(self) -> int:
        return len(runtime.siblings(self.sycl_device))

    def on_device(self, i: int) -> "SyclBackend":
        devices = runtime.siblings(self.sycl_device)
        if not 0 <= i < len(devices):
            raise ConfigError(f"device {i} of {runtime.describe(self.sycl_device)}'s kind: the backend sees "
                              f"{len(devices)}")
        return self if devices[i] is self.sycl_device else SyclBackend(devices[i])

    # --- placement and memory
    def _dev(self, a, dtype=None):
        """A device array on this queue (host values are uploaded; an array of another queue is refused)."""
        if isinstance(a, dpnp.ndarray):
            if a.sycl_queue is not self.queue:
                raise ValueError(f"an array lives on another queue ({runtime.filter_string(a.sycl_device)}); move it "
                                 f"explicitly with this backend's to_device")
            return a if dtype is None or a.dtype == dtype else a.astype(dtype)
        if isinstance(a, Bf16):
            return a.widen()
        a = np.asarray(a, dtype=dtype)
        if self._counter is not None:
            self._counter.uploads += 1
        return dpnp.asarray(np.ascontiguousarray(a), dtype=a.dtype, sycl_queue=self.queue)

    def _f32(self, a):
        """fp32, C-contiguous, on this queue (a no-op for the backend's own activations)."""
        a = self._dev(a, F32)
        return a if a.flags.c_contiguous else dpnp.ascontiguousarray(a)

    def to_device(self, tree):
        """Host trees (dicts, lists, tuples of numpy arrays) -> this device. bfloat16 becomes Bf16 (uint16 bits).
        Arrays of another SYCL device move through the host: cross-device moves are explicit, never implicit."""
        if isinstance(tree, dict):
            return {k: self.to_device(v) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(self.to_device(v) for v in tree)
        if isinstance(tree, Bf16):
            if tree.bits.sycl_queue is self.queue:
                return tree
            return Bf16(self._upload(dpnp.asnumpy(tree.bits)), self)
        if isinstance(tree, dpnp.ndarray):
            if tree.sycl_queue is self.queue:
                return tree
            return self._upload(dpnp.asnumpy(tree))
        if isinstance(tree, np.ndarray) or hasattr(tree, "__array__"):
            a = np.asarray(tree)
            if a.dtype == BF16:
                return Bf16(self._upload(a.view(np.uint16)), self)
            return self._upload(a)
        return tree

    def zeros_like(self, tree):
        """Zeros shaped and typed like a host tree of numpy arrays, allocated and filled on this queue."""
        if isinstance(tree, dict):
            return {k: self.zeros_like(v) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(self.zeros_like(v) for v in tree)
        a = np.asarray(tree)
        if a.dtype == BF16:
            return Bf16(dpnp.zeros(a.shape, dtype=np.uint16, sycl_queue=self.queue), self)
        return dpnp.zeros(a.shape, dtype=a.dtype, sycl_queue=self.queue)

    def _upload(self, a: np.ndarray):
        a = np.ascontiguousarray(a)
        return dpnp.asarray(a, dtype=a.dtype, sycl_queue=self.queue)

    # --- HostKV (strata/backend.py): the attention KV's host tier in USM host memory, which the device reads over
    # the bus; the composition (ComposedOps._attention_tiers) copies a row's positions to the device to attend them
    @property
    def host_kv(self) -> "SyclBackend":
        return self

    def host_zeros_like(self, tree):
        """Zeros shaped like a host tree, in USM host memory on this queue (float32 or int8 KV: a bfloat16 cache,
        stored as bits and widened on every read, is refused)."""
        def zeros(leaf):
            a = np.asarray(leaf)
            if a.dtype == BF16:
                raise ConfigError("kv_resident on the sycl backend keeps float32 or int8 KV in host memory, not "
                                  "bfloat16: set kv = int8 (or float32)")
            return dpnp.zeros(a.shape, dtype=a.dtype, usm_type="host", sycl_queue=self.queue)
        return _tree_map(zeros, tree)

    def from_host_tier(self, x):
        self._op()
        return dpnp.array(x, usm_type="device", copy=True, sycl_queue=self.queue)

    def host_write(self, host, x, slot, start):
        """kv_write into the slot's row of the host array (a view: in place)."""
        self.kv_write(host[self._host_int(slot)], x, start)
        return host

    def host_window(self, host, slot, start, n):
        return self.from_host_tier(self.kv_read(host[self._host_int(slot)], start, n))

    def host_prefix(self, host, n, block):
        """host's rows [0, n) rounded up to whole blocks, on the device (one copy: n is known here), the rest zero."""
        self._op()
        rows = host.shape[0]
        m = min(-(-self._host_int(n) // block) * block, rows)
        out = dpnp.zeros(host.shape, dtype=host.dtype, sycl_queue=self.queue)
        if m:
            out[:m] = host[:m]
        return out

    @staticmethod
    def start_to_host(x):
        """Nothing to start: to_host copies synchronously (dpnp.asnumpy)."""

    def to_host(self, x):
        if isinstance(x, dict):
            return {k: self.to_host(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(self.to_host(v) for v in x)
        if isinstance(x, Bf16):
            return dpnp.asnumpy(x.bits).view(ml_dtypes.bfloat16)
        if isinstance(x, dpnp.ndarray):
            return dpnp.asnumpy(x)
        return np.asarray(x)

    def free_memory_bytes(self) -> int | None:
        try:
            free = dpctl.utils.intel_device_info(self.sycl_device).get("free_memory")
        except Exception:       # noqa: BLE001 - not every device reports it
            free = None
        return int(free) if free else None

    def synchronize(self) -> None:
        SequentialOrderManager[self.queue].wait()

    def widen(self, bits):
        return k_pointwise.widen_bf16(self.kernels, self._dev(bits) if not isinstance(bits, dpnp.ndarray) else
                                      (bits if bits.flags.c_contiguous else dpnp.ascontiguousarray(bits)))

    def _weight(self, w):
        """A weight as fp32 on the device (Bf16 widened)."""
        return w.widen() if isinstance(w, Bf16) else self._f32(w)

    def _const(self, key, make):
        c = self._consts.get(key)
        if c is None:
            with self._consts_lock:
                c = self._consts.get(key)
                if c is None:
                    c = self._consts[key] = self._upload(make())
        return c

    # --- launch counting (the benchmark's launches per layer)
    @contextlib.contextmanager
    def count_launches(self):
        """Counts, while active, every task submitted to this backend's queue through dpctl's order manager
        (dpnp's kernels and copies, and this backend's kernels), the host uploads the backend makes, and the
        ops / xp calls made from Python. Not reentrant; waits for the queue at the end."""
        c = Counter()
        manager = SequentialOrderManager[self.queue]
        cls = _order_manager._SequentialOrderManager
        orig = cls.add_event_pair

        def counting(om, host_ev, comp_ev):
            if om is manager:
                c.tasks += len(comp_ev) if isinstance(comp_ev, (list, tuple)) else 1
            return orig(om, host_ev, comp_ev)

        self.synchronize()
        cls.add_event_pair = counting
        self._counter = self.kernels.counter = c
        try:
            yield c
        finally:
            self.synchronize()
            cls.add_event_pair = orig
            self._counter = self.kernels.counter = None

    def _op(self):
        if self._counter is not None:
            self._counter.ops += 1

    # --- dense math
    def rms_norm(self, x, scale, eps):
        self._op()
        return k_norms.rms_norm(self.kernels, self._f32(x), self._f32(scale), eps)

    def linear(self, x, w):
        """[..., in] x [out, in] -> [..., out]: a work-group-per-output kernel for a few rows (decode; it reads
        bfloat16-stored weights directly), oneMKL's matmul beyond."""
        self._op()
        x = self._f32(x)
        rows = x.size // x.shape[-1] if x.shape[-1] else 0
        if rows <= LINEAR_KERNEL_ROWS:
            fmt = "bf16" if isinstance(w, Bf16) else "f32"
            y = k_linear.linear(self.kernels, x.reshape(rows, x.shape[-1]), w.bits if fmt == "bf16" else
                                self._f32(w), fmt)
            return y.reshape(x.shape[:-1] + (w.shape[0],))
        if isinstance(w, Bf16):
            # widen a block of output rows at a time, so a large matrix (lm_head) never exists whole in fp32
            step = max(1, BF16_WIDEN_ELEMENTS // max(w.shape[1], 1))
            if w.shape[0] > step:
                return dpnp.concatenate([dpnp.matmul(x, self.widen(w.bits[s:s + step]).T)
                                         for s in range(0, w.shape[0], step)], axis=-1)
        return dpnp.matmul(x, self._weight(w).T)

    def _unary(self, name, x):
        self._op()
        return k_pointwise.unary(self.kernels, name, self._f32(x))

    def silu(self, x):
        return self._unary("silu", x)

    def sigmoid(self, x):
        return self._unary("sigmoid", x)

    def softplus(self, x):
        return self._unary("softplus", x)

    def softmax(self, x):
        self._op()
        return k_norms.softmax(self.kernels, self._f32(x))

    def rope(self, x, positions, rope):
        self._op()
        if np.ndim(positions) == 2:         # (t, h, w) rows: each pair's angle from its axis, in dpnp
            return self._rope_sections(self._f32(x), self._dev(positions, np.dtype(np.float32)), rope)
        freqs = self._const(("rope", rope), rope.table)
        return k_rope.rope(self.kernels, self._f32(x), self._positions(positions), freqs, rope.rotary_dim)

    def _rope_sections(self, x, positions, rope):
        f = rotary_positions(positions, rope) * dpnp.asarray(np.array(rope.inv_freq, np.float32), sycl_queue=x.sycl_queue)
        emb = dpnp.concatenate([f, f], axis=-1)[:, None, :]
        cos, sin = dpnp.cos(emb) * np.float32(rope.scale), dpnp.sin(emb) * np.float32(rope.scale)
        d, half = rope.rotary_dim, rope.rotary_dim // 2
        rot = x[..., :d]
        rotated = dpnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
        return dpnp.concatenate([rot * cos + rotated * sin, x[..., d:]], axis=-1)

    def _positions(self, p):
        p = self._dev(p, np.dtype(np.int64))
        return p if p.flags.c_contiguous else dpnp.ascontiguousarray(p)

    # --- sequence state
    @staticmethod
    def _host_int(v) -> int:
        return int(v)                       # a device scalar syncs here; the engine and runner pass host scalars

    def kv_write(self, cache, new, start):
        """cache [Cap, ...] <- new [T, ...] at rows start.., in place (the cache is donated)."""
        self._op()
        t, cap = new.shape[0], cache.shape[0]
        s = min(max(self._host_int(start), 0), cap - t)      # as lax.dynamic_update_slice clamps
        cache[s:s + t] = new if new.dtype == cache.dtype else new.astype(cache.dtype)
        return cache

    def kv_read(self, cache, start, n):
        """cache rows start .. start + n - 1 (a view), start clamped as kv_write clamps it."""
        self._op()
        s = min(max(self._host_int(start), 0), cache.shape[0] - n)
        return cache[s:s + n]

    def attention(self, q, k_cache, v_cache, q_pos, scale, k_scale=None, v_scale=None):
        self._op()
        return k_attention.attention(self.kernels, self._f32(q), self._kv(k_cache, v_cache, k_scale, v_scale),
                                     self._positions(q_pos), scale)

    def _kv(self, k, v, k_scale=None, v_scale=None, update=False):
        """A layer's cache as the attention kernels take it: fp32 caches, or int8 caches with their fp32 scales;
        C-contiguous on this queue. update: the kernel writes into it, so the caller's own arrays are kept where
        they already fit (they are donated), as _state keeps a state."""
        cast = self._state if update else self._f32
        if k_scale is None:
            return {"k": cast(k), "v": cast(v)}
        i8 = np.dtype(np.int8)
        return {"k": self._contiguous(self._dev(k, i8)), "v": self._contiguous(self._dev(v, i8)),
                "k_scale": cast(k_scale), "v_scale": cast(v_scale)}

    def causal_conv(self, u, conv_state, w, n_valid):
        """-> (silu(conv) [T, C], the conv state after row n_valid - 1), the state updated in place (donated)."""
        self._op()
        return k_conv.causal_conv(self.kernels, self._f32(u), self._state(conv_state), self._weight(w),
                                  self._host_int(n_valid))

    def _state(self, state):
        """A state array the op may update in place: the caller's own device array when it is fp32 and contiguous
        (it is donated), else a fresh device copy (a host array, another dtype)."""
        if isinstance(state, dpnp.ndarray) and state.dtype == F32 and state.flags.c_contiguous:
            return self._dev(state)
        return dpnp.array(self._dev(state), dtype=dpnp.float32, copy=True, order="C")

    def _delta_rule(self, q, k, v, g, beta, state):
        self._op()
        f = self._f32
        return k_gdn.gated_delta(self.kernels, f(q), f(k), f(v), f(g), f(beta), self._state(state))

    def gated_delta_chunked(self, q, k, v, g, beta, state):
        """Prompt parts: the same recurrence as the step, run over the part's tokens inside one kernel (every
        head and state column in parallel). Rows with g = beta = 0 leave the state unchanged."""
        return self._delta_rule(q, k, v, g, beta, state)

    def gated_delta_step(self, q, k, v, g, beta, state):
        return self._delta_rule(q, k, v, g, beta, state)

    def valid_mask(self, t, n_valid):
        self._op()
        if _is_host(n_valid):
            return self._dev(np.arange(t) < int(n_valid))
        return dpnp.arange(t, dtype=dpnp.int64, sycl_queue=self.queue) < n_valid

    def take_row(self, x, i):
        self._op()
        n = x.shape[0]
        if _is_host(i) or (isinstance(x, dpnp.ndarray) and x.usm_type == "host"):   # a host-tier row: a view
            return x[min(max(self._host_int(i), 0), n - 1)]     # clamped, as lax.dynamic_index_in_dim
        i = dpnp.clip(self._dev(i), 0, n - 1).reshape(1)
        return dpnp.take(x, i, axis=0)[0]

    def set_row(self, x, i, row):
        """x with x[i] = row, in place (x is donated). A row that is x[i] itself (updated in place) costs nothing."""
        self._op()
        i = min(max(self._host_int(i), 0), x.shape[0] - 1)
        dst = x[i]
        if isinstance(row, dpnp.ndarray) and _same_memory(dst, row):
            return x
        dst[...] = self._dev(row)
        return x

    def take_rows(self, x, idx):
        self._op()
        return dpnp.take(x, self._dev(idx), axis=0)

    def put_rows(self, x, idx, rows):
        """x with x[idx] = rows, in place (x is donated)."""
        self._op()
        x[self._dev(idx)] = self._dev(rows)
        return x

    # --- fused ops (strata/backend.py defines them; here each is one or a few launches, because every launch
    # costs on this eager backend: tests/sycl/test_fused_ops.py holds each to the composition)
    def _fmt(self, ws) -> str | None:
        """The one stored format of the weights ("bf16" | "f32"), or None when they differ."""
        fmts = {"bf16" if isinstance(w, Bf16) else "f32" for w in ws}
        return fmts.pop() if len(fmts) == 1 else None

    def _wbits(self, w):
        return w.bits if isinstance(w, Bf16) else self._f32(w)

    def _linears(self, x, ws, norm=None, residual=None):
        """-> (h, ys) through one linears_ launch, or None when it does not apply (many rows: oneMKL's matmul)."""
        x = self._f32(x)
        n = x.shape[-1]
        lead = x.shape[:-1]
        rows = x.size // n if n else 0
        fmt = self._fmt(ws)
        if rows > LINEAR_KERNEL_ROWS or rows == 0 or len(ws) > k_linear.MAX_WEIGHTS or fmt is None:
            return None
        if norm is not None:
            norm = (self._f32(norm[0]), norm[1])
        if residual is not None:
            residual = self._f32(residual).reshape(rows, ws[0].shape[0])
        h, ys = k_linear.linears(self.kernels, x.reshape(rows, n), [self._wbits(w) for w in ws], fmt, norm, residual)
        return (None if h is None else h.reshape(x.shape)), [y.reshape(lead + (w.shape[0],)) for y, w in zip(ys, ws)]

    def norm_linears(self, x, scale, eps, ws):
        self._op()
        out = self._linears(x, ws, norm=(scale, eps))
        return out if out is not None else super().norm_linears(x, scale, eps, ws)

    def linears(self, x, ws):
        self._op()
        out = self._linears(x, ws)
        return out[1] if out is not None else super().linears(x, ws)

    def linear_add(self, x, w, residual):
        self._op()
        out = self._linears(x, [w], residual=residual)
        return out[1][0] if out is not None else super().linear_add(x, w, residual)

    def swiglu_out(self, g, u, w_down, residual, add=None, gate=None):
        self._op()
        g, u = self._f32(g), self._f32(u)
        n = g.shape[-1]
        rows = g.size // n if n else 0
        if rows > LINEAR_KERNEL_ROWS or rows == 0:
            return super().swiglu_out(g, u, w_down, residual, add, gate)
        o = w_down.shape[0]
        r2 = (rows, o)
        y = k_linear.swiglu_down(self.kernels, g.reshape(rows, n), u.reshape(rows, n), self._wbits(w_down),
                                 self._fmt([w_down]), self._f32(residual).reshape(r2),
                                 None if add is None else self._f32(add).reshape(r2),
                                 None if gate is None else self._f32(gate).reshape(rows))
        return y.reshape(g.shape[:-1] + (o,))

    def route(self, logits, k, renormalize):
        self._op()
        logits = self._f32(logits)
        e = logits.shape[-1]
        w, idx = k_topk.route(self.kernels, logits.reshape(-1, e), int(k), bool(renormalize))
        return w.reshape(logits.shape[:-1] + (k,)), idx.reshape(logits.shape[:-1] + (k,))

    def expert_slots(self, table_row, idx, n_valid):
        self._op()
        if not _is_host(n_valid):
            return super().expert_slots(table_row, idx, n_valid)
        idx = self._contiguous(self._dev(idx, np.dtype(np.int32)))
        table_row = self._contiguous(self._dev(table_row, np.dtype(np.int32)))
        if is_rows(n_valid):
            return k_topk.expert_slots_rows(self.kernels, table_row, idx, self._rows(None, n_valid))
        return k_topk.expert_slots(self.kernels, table_row, idx, int(n_valid))

    @staticmethod
    def _contiguous(a):
        return a if a.flags.c_contiguous else dpnp.ascontiguousarray(a)

    def _rows(self, pos, active):
        """A decode window's rows (strata/backend.py's rows mode) as the device int32 [2, S] (positions,
        active) its kernels read. Every layer of a window passes the same host arrays, so the last upload is kept
        and reused while the values match: one upload per window, not one per layer. pos None: only `active` is
        read (expert_slots), and the positions of the last upload are taken when its `active` matches."""
        active = np.asarray(active, np.int32)
        last = self._rows_last
        if pos is None:
            if last is not None and np.array_equal(last[0][1], active):
                return last[1]
            pos = np.zeros_like(active)
        host = np.stack([np.asarray(pos, np.int32), active])
        if last is not None and last[0].shape == host.shape and np.array_equal(last[0], host):
            return last[1]
        dev = self._dev(host)
        self._rows_last = (host, dev)
        return dev

    def attention_block(self, q, k, v, gate, q_norm, k_norm, eps, kv, start, n_valid, rope, rope_pos=None):
        self._op()
        # rows of the bank gathered, then the rows below; other rotary positions than the cache's: the composition
        if SLOTS in kv or rope_pos is not None:
            return super().attention_block(q, k, v, gate, q_norm, k_norm, eps, kv, start, n_valid, rope, rope_pos)
        if TIER_BASE in kv and is_rows(start):
            return self._tiered_rows(q, k, v, gate, q_norm, k_norm, eps, kv, start, n_valid, rope)
        if not (_is_host(start) and _is_host(n_valid)) or TIER_BASE in kv:     # (two tiers: the composition)
            return super().attention_block(q, k, v, gate, q_norm, k_norm, eps, kv, start, n_valid, rope)
        rotary_dim = rope.rotary_dim
        t = q.shape[0]
        hd = kv["k"].shape[-1]
        kv = self._kv(kv["k"], kv["v"], kv.get("k_scale"), kv.get("v_scale"), update=True)
        freqs = self._const(("rope", rope), rope.table)
        gate = None if gate is None else self._f32(gate)
        if is_rows(start):                     # a decode window: row s on its own caches [S, cap, hkv, hd]
            rows = self._rows(start, n_valid)
            qr = k_attention.attention_inputs_rows(self.kernels, self._f32(q), self._f32(k), self._f32(v),
                                                   self._f32(q_norm), self._f32(k_norm), freqs, kv, rows,
                                                   rotary_dim, eps)
            o = k_attention.attention_gated_rows(self.kernels, qr, kv, gate, rows, hd ** -0.5)
            return o.reshape(t, -1), kv
        s0 = min(max(int(start), 0), kv["k"].shape[0] - t)                  # as kv_write clamps
        qr = k_attention.attention_inputs(self.kernels, self._f32(q), self._f32(k), self._f32(v), self._f32(q_norm),
                                          self._f32(k_norm), freqs, kv, rotary_dim, eps, int(start), s0)
        o = k_attention.attention_gated(self.kernels, qr, kv, gate, int(start), int(n_valid), hd ** -0.5)
        return o.reshape(t, -1), kv

    def _tiered_rows(self, q, k, v, gate, q_norm, k_norm, eps, kv, start, n_valid, rope):
        """Decode rows over a two-tier bank, one active row at a time by the composition for one sequence: its
        window is a view of the bank (written in place) and its host part a view of its own bank row, of which
        only the positions below its base are copied to the device (not every row of the bank, parked ones
        included, as a gather would). An inactive row's output is zero (discarded)."""
        rows, starts, valid = (np.asarray(self.to_host(x)) for x in (kv[TIER_ROW], start, n_valid))
        out = dpnp.zeros((q.shape[0], q.shape[1]), dtype=F32, sycl_queue=self.queue)
        for s in np.flatnonzero(valid > 0):
            one = {n: (a[int(rows[s])] if n.endswith(HOST) else a[s]) for n, a in kv.items()}
            o, _ = super().attention_block(q[s:s + 1], k[s:s + 1], v[s:s + 1], None if gate is None else
                                           gate[s:s + 1], q_norm, k_norm, eps, one, int(starts[s]), 1, rope)
            out[s] = o[0]
        return out, kv

    def delta_block(self, qkv, z, b, a, conv_state, conv_w, ssm, a_log, dt_bias, gnorm, eps, start, n_valid,
                    n_k_heads, gate_act="silu"):
        self._op()
        # the kernels' gated norm is silu's; a sigmoid gate (qwen4_exp) takes the composed form
        if not (_is_host(start) and _is_host(n_valid)) or gate_act != "silu":
            return super().delta_block(qkv, z, b, a, conv_state, conv_w, ssm, a_log, dt_bias, gnorm, eps, start,
                                       n_valid, n_k_heads, gate_act)
        t = qkv.shape[0]
        conv_state, ssm = self._state(conv_state), self._state(ssm)
        hv, dk, dv = ssm.shape[-3:]
        kern = self.kernels
        qkv, conv_w, b, a = self._f32(qkv), self._weight(conv_w), self._f32(b), self._f32(a)
        a_log, dt_bias = self._f32(a_log), self._f32(dt_bias)
        if is_rows(start):                     # a decode window: row s on its own states [S, ...]
            rows = self._rows(start, n_valid)
            u, conv_state = k_conv.causal_conv_rows(kern, qkv, conv_state, conv_w, rows)
            o, ssm = k_gdn.gated_delta_raw_rows(kern, u, b, a, a_log, dt_bias, ssm, rows, n_k_heads, dk, dv)
        else:                                  # a sequence starting at 0 starts from empty states
            reset = not int(start) > 0
            u, conv_state = k_conv.causal_conv(kern, qkv, conv_state, conv_w, int(n_valid), reset=reset)
            o, ssm = k_gdn.gated_delta_raw(kern, u, b, a, a_log, dt_bias, ssm, n_k_heads, dk, dv, int(n_valid),
                                           reset=reset)
        o = k_norms.gated_rms_norm(kern, o, self._f32(z).reshape(t, hv, dv), self._f32(gnorm), eps)
        return o.reshape(t, hv * dv), conv_state, ssm

    # --- mixture of experts
    def topk(self, x, k):
        self._op()
        return k_topk.topk(self.kernels, self._f32(x), int(k))

    def route_counts(self, idx, valid, n_experts):
        """[T, k] routes of the valid rows -> [E] int32 counts."""
        idx = self._dev(idx, np.dtype(np.int64)).reshape(-1)
        kk = idx.shape[0] // max(valid.shape[0], 1)
        w = dpnp.repeat(self._dev(valid).astype(dpnp.float32), kk)
        return dpnp.bincount(idx, weights=w, minlength=n_experts).astype(dpnp.int32)

    # --- the slot pool (uint8 [N, nbytes], written in place on this queue; every task goes through dpctl's sequential
    # order manager, so a computation submitted before a write reads the bytes it was submitted with)
    def pool_alloc(self, n, nbytes):
        return dpnp.zeros((n, nbytes), dtype=dpnp.uint8, sycl_queue=self.queue)

    def pool_write(self, pool, slots, blobs):
        pool[self._dev(np.asarray(slots, np.int64))] = self._upload(np.stack([np.asarray(b, np.uint8) for b in blobs]))
        return pool

    def pool_read(self, pool, slots):
        return dpnp.asnumpy(pool[self._dev(np.asarray(slots, np.int64))])

    def experts_pool(self, x, slots, weight, pool, layout, max_distinct):
        """The expert op over a pool of packed expert blobs (strata/weights/quant.py), as quant.expert_reference:
        y[t] = sum_j weight[t, j] * expert(slots[t, j])(x[t]), a route with slot -1 contributing exactly 0.
        x [T, H] fp32; slots int [T, k] (host or device); weight [T, k]; pool uint8 [N, layout.nbytes] on this
        queue; max_distinct: a bound on the distinct slots one call uses (the experts of one layer).

        Two launches of blob_decode.cl, then the expert op's usual forms: pool_select ranks the distinct slots
        used and remaps the routes to them (a skipped route to an all-zero expert, with weight 0), blob_decode
        decodes those blobs once into fp32 gate / up / down [R + 1, ...] (index R: the zero expert), then the
        gathered kernels (few routes) or the blocked matmuls (prompt parts) run on them. Unreferenced slots are
        never read. With host slots R is the exact count of distinct slots used (more than max_distinct, or a
        slot outside the pool, is a ValueError); with device slots R = min(max_distinct, routes), and routes past
        the first max_distinct distinct slots (or outside the pool) contribute 0: the caller's bound is trusted."""
        self._op()
        if pool.dtype != np.uint8 or pool.ndim != 2 or pool.shape[1] != layout.nbytes:
            raise ValueError(f"experts_pool: pool must be uint8 [N, {layout.nbytes}] for the {layout.fmt} layout; "
                             f"got {pool.dtype} {tuple(pool.shape)}")
        x = self._f32(x)
        t, kk = slots.shape
        if tuple(weight.shape) != (t, kk) or x.shape[0] != t or x.shape[1] != layout.hidden:
            raise ValueError(f"experts_pool: x {tuple(x.shape)}, slots {(t, kk)} and weight {tuple(weight.shape)} "
                             f"do not agree (hidden {layout.hidden})")
        routes = t * kk
        n = pool.shape[0]
        if _is_host(slots):
            s = np.asarray(slots)
            used = np.unique(s[s >= 0])
            if used.size and used[-1] >= n:
                raise ValueError(f"experts_pool: slot {int(used[-1])} is outside the pool of {n} slots")
            if used.size > max_distinct:
                raise ValueError(f"experts_pool: {used.size} distinct slots used, more than max_distinct "
                                 f"{max_distinct}")
            if used.size == 0:
                return dpnp.zeros((t, x.shape[1]), dtype=dpnp.float32, sycl_queue=self.queue)
            r = int(used.size)
        else:
            r = max(1, min(int(max_distinct), routes))
        slots = self._dev(slots, np.dtype(np.int32))
        slots = slots if slots.flags.c_contiguous else dpnp.ascontiguousarray(slots)
        sel, idx, w = k_blob.pool_select(self.kernels, slots, self._f32(weight), n, r)
        gate, up, down = k_blob.blob_decode(self.kernels, pool, sel, layout)
        if routes <= GATHER_ROUTES_MAX:
            return k_experts.experts_gathered(self.kernels, x, idx, w, gate, up, down, "f32")
        return self._experts_blocked(x, idx, w, gate, up, down)

    def _experts_blocked(self, x, idx, weight, gate, up, down):
        # prompt parts, as the JAX backend: routes sorted by expert, each expert's group padded to whole blocks of
        # EXPERT_BLOCK rows, every block multiplied by its expert's weights; then the routes are put back in
        # (token, choice) order and summed over the choices (no scatter-add needed: it is a permutation).
        q = self.queue
        t, kk = idx.shape
        h = x.shape[1]
        e_count = gate.shape[0]
        rows = t * kk
        bsz = EXPERT_BLOCK
        n_blocks = -(-rows // bsz) + e_count
        flat_e = idx.reshape(-1)
        order = dpnp.argsort(flat_e, kind="stable")
        sorted_e = flat_e[order]
        sizes = dpnp.bincount(flat_e, minlength=e_count)
        padded = (sizes + bsz - 1) // bsz * bsz
        cum_padded = dpnp.cumsum(padded)
        pad_start = cum_padded - padded
        start = dpnp.cumsum(sizes) - sizes
        dest = pad_start[sorted_e] + (dpnp.arange(rows, dtype=sizes.dtype, sycl_queue=q) - start[sorted_e])
        tok = order // kk
        xb = dpnp.zeros((n_blocks * bsz, h), dtype=dpnp.float32, sycl_queue=q)
        xb[dest] = x[tok]
        xb = xb.reshape(n_blocks, bsz, h)
        block_e = dpnp.searchsorted(cum_padded, dpnp.arange(n_blocks, dtype=cum_padded.dtype, sycl_queue=q) * bsz,
                                    side="right")
        block_e = dpnp.minimum(block_e, e_count - 1)

        def gather(w):
            return self.widen(w.bits[block_e]) if isinstance(w, Bf16) else self._f32(w)[block_e]

        g = dpnp.matmul(xb, gather(gate).transpose(0, 2, 1))
        u = dpnp.matmul(xb, gather(up).transpose(0, 2, 1))
        a = self.silu(g) * u
        y = dpnp.matmul(a, gather(down).transpose(0, 2, 1)).reshape(n_blocks * bsz, h)[dest]
        y = y * weight.reshape(-1)[order][:, None]
        routes = dpnp.empty((rows, h), dtype=dpnp.float32, sycl_queue=q)
        routes[order] = y
        return routes.reshape(t, kk, h).sum(axis=1)

    # --- compilation and randomness
    @staticmethod
    def compile(fn, donate_argnums=(), static_argnames=()):
        return fn

    def vmap(self, fn):
        """Map fn over the leading axis of every array argument (host or device): a loop, then a stack. An output
        that is exactly the slice fn was given (updated in place) comes back as the input array, uncopied, so a bank
        of per-slot KV caches is never copied."""

        def mapped(*args):
            n = _leading(args)
            made: dict[int, tuple] = {}
            keep = []

            def slice_at(i):
                def f(a):
                    s = a[i]
                    if isinstance(a, dpnp.ndarray):
                        made[id(s)] = (a, i)
                        keep.append(s)
                    return s
                return f

            outs = [fn(*(_tree_map(slice_at(i), a) for a in args)) for i in range(n)]
            return _tree_zip(lambda leaves: self._stack(leaves, made), outs)

        return mapped

    def _stack(self, leaves, made):
        if all(leaf is None for leaf in leaves):
            return None                           # an output fn leaves empty (a dense layer's routes)
        src = [made.get(id(leaf)) for leaf in leaves]
        if all(s is not None for s in src) and all(s[0] is src[0][0] and s[1] == i for i, s in enumerate(src)):
            return src[0][0]                      # every row was updated in place in the input
        if all(isinstance(leaf, dpnp.ndarray) for leaf in leaves):
            return dpnp.stack(leaves, axis=0)
        return self._dev(np.stack([np.asarray(self.to_host(leaf)) for leaf in leaves]))

    def prng_keys(self, seeds, steps):
        """Per-row keys [B, 2] uint32 (a 64-bit hash of (seed, step)), each reproducible from its row's (seed, step)
        alone. Computed on the host (a few integer operations per row); the draws happen on the device."""
        return k_sample.prng_keys_reference(self.to_host(seeds), self.to_host(steps))

    # --- sampling
    def sample(self, logits, temperature, top_k, top_p, min_p, keys, all_greedy: bool = False):
        """logits [B, V]; per-row temperature, top_k (0 = off), top_p (1 = off), min_p (0 = off) and key. A row with
        temperature 0 is greedy (argmax, exactly). Same filters as the JAX backend; a different random stream."""
        self._op()
        logits = self._f32(logits)
        greedy = dpnp.argmax(logits, axis=-1)
        if all_greedy or (_is_host(temperature) and not (np.asarray(temperature) > 0).any()):
            return greedy.astype(dpnp.int32)                  # an all-greedy batch needs no sort
        order = dpnp.argsort(-logits, axis=-1, kind="stable")
        sorted_logits = dpnp.take_along_axis(logits, order, axis=-1)
        if _is_host(temperature):
            scaled = sorted_logits / self._dev(np.maximum(np.asarray(temperature, np.float32),
                                                          np.float32(1e-6)))[:, None]
        else:
            scaled = sorted_logits / dpnp.maximum(self._f32(temperature), 1e-6)[:, None]
        probs = k_norms.softmax(self.kernels, scaled)
        cum = dpnp.cumsum(probs, axis=-1)
        greedy = greedy if greedy.dtype == np.int64 else greedy.astype(dpnp.int64)
        order = order if order.dtype == np.int64 else order.astype(dpnp.int64)
        return k_sample.sample_pick(self.kernels, scaled, probs, cum, order, greedy, self._f32(temperature),
                                    self._dev(top_k, np.dtype(np.int32)), self._f32(top_p), self._f32(min_p),
                                    self._dev(keys, np.dtype(np.uint32)))


def _same_memory(a, b) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype and a.flags.c_contiguous and b.flags.c_contiguous
            and a.get_array()._pointer == b.get_array()._pointer)


def _leading(args) -> int:
    for a in args:
        for leaf in _leaves(a):
            if hasattr(leaf, "shape") and len(leaf.shape):
                return leaf.shape[0]
    raise ValueError("vmap: no array argument to map over")


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


def _tree_map(f, tree):
    if isinstance(tree, dict):
        return {k: _tree_map(f, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_tree_map(f, v) for v in tree)
    return f(tree)


def _tree_zip(f, trees):
    """Combine structurally identical trees leaf by leaf with f(list of leaves)."""
    first = trees[0]
    if isinstance(first, dict):
        return {k: _tree_zip(f, [t[k] for t in trees]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(_tree_zip(f, [t[i] for t in trees]) for i in range(len(first)))
    return f(trees)
