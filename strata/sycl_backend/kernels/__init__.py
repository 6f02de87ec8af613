"""Custom device code of the SYCL backend: OpenCL C kernels (*.cl beside this file) built with dpctl.program.

Each kernel family is a `<family>.cl` (the device code) and a `<family>.py` (the launcher and its numpy `*_reference`,
which the tests hold the kernel to). All families are built into ONE program per queue, on first use, from OpenCL C
source on an OpenCL device, or from SPIR-V compiled from the same source (clang + llvm-spirv on PATH) on a Level Zero
device, which takes no OpenCL C. `Kernels.launch` is the only way device code is submitted: it refuses an array that
lives on another queue (a foreign-context dependency cannot be built), orders the kernel after every task dpnp has
submitted to the queue (dpctl's SequentialOrderManager), registers it there so later dpnp work waits for it, and keeps
its arguments alive until it completes.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections import deque
from pathlib import Path

import dpctl
import dpctl.memory as dpm
import dpctl.program as dpp
import dpnp
from dpctl.utils import SequentialOrderManager

from strata.errors import ConfigError

HERE = Path(__file__).parent
FAMILIES = ("norms", "pointwise", "rope", "conv", "gated_delta", "topk", "sample", "blob_decode")
# families that read weights are compiled once per stored weight format: (C type, widening to fp32)
PER_FORMAT = ("linear", "experts")
WEIGHT_FORMATS = {"f32": ("float", "((p)[i])"), "bf16": ("ushort", "as_float(((uint)(p)[i]) << 16)")}
# families that read the KV cache are compiled once per KV format: (C type, whether rows carry a scale)
PER_KV = ("attention",)
KV_FORMATS = {"f32": ("float", 0), "i8": ("char", 1)}


def source() -> str:
    parts = [(HERE / f"{f}.cl").read_text() for f in FAMILIES]
    for family in PER_FORMAT:
        text = (HERE / f"{family}.cl").read_text()
        for suffix, (wt, load) in WEIGHT_FORMATS.items():
            parts.append(f"#define SUFFIX {suffix}\n#define WT {wt}\n#define LOAD(p, i) {load}\n{text}\n"
                         "#undef SUFFIX\n#undef WT\n#undef LOAD\n")
    for family in PER_KV:
        text = (HERE / f"{family}.cl").read_text()
        for suffix, (kvt, q8) in KV_FORMATS.items():
            parts.append(f"#define KV_SUFFIX {suffix}\n#define KVT {kvt}\n#define KV_Q8 {q8}\n{text}\n"
                         "#undef KV_SUFFIX\n#undef KVT\n#undef KV_Q8\n")
    return "\n".join(parts)


class Counter:
    """Counts device work while active; see SyclBackend.count_launches."""

    def __init__(self):
        self.tasks = 0            # tasks submitted to the queue: dpnp's kernels and copies, and this module's kernels
        self.kernels = 0          # of which this module's kernel launches
        self.uploads = 0          # host -> device copies the backend makes (blocking copies, not in `tasks`)
        self.ops = 0              # backend ops and xp calls made from Python

    @property
    def device_launches(self) -> int:
        return self.tasks + self.uploads

    def as_dict(self) -> dict:
        return dict(device_launches=self.device_launches, tasks=self.tasks, kernels=self.kernels,
                    uploads=self.uploads, ops=self.ops)


class Kernels:
    """The built program of one queue, and the submission path for its kernels. One per queue (`for_queue`), shared
    by every backend on that queue, so the program is built once per device and process."""

    _by_queue: dict = {}
    _by_queue_lock = threading.Lock()

    @classmethod
    def for_queue(cls, queue) -> "Kernels":
        with cls._by_queue_lock:
            k = cls._by_queue.get(queue)
            if k is None or k.queue is not queue:
                k = cls._by_queue[queue] = cls(queue)
            return k

    def __init__(self, queue):
        self.queue = queue
        # On a CPU device a blocking submit (the kernel has run when it returns) is cheaper than an asynchronous one
        # that depends on dpnp's pending tasks (docs/performance.md); on a GPU, submissions stay asynchronous.
        # STRATA_SYCL_SUBMIT=async|blocking overrides (the tests run the asynchronous path on the CPU with it).
        mode = os.environ.get("STRATA_SYCL_SUBMIT") or ("blocking" if queue.sycl_device.device_type.name == "cpu"
                                                         else "async")
        if mode not in ("async", "blocking"):
            raise ConfigError(f"STRATA_SYCL_SUBMIT={mode!r} is not allowed; allowed: async, blocking")
        self.blocking = mode == "blocking"
        self._program = None
        self._kernels: dict = {}
        self._inflight: deque = deque()
        self._lock = threading.Lock()
        self.counter: Counter | None = None

    # --- building
    def program(self):
        if self._program is None:
            with self._lock:
                if self._program is None:
                    self._program = build_program(self.queue, source())
        return self._program

    def kernel(self, name: str):
        k = self._kernels.get(name)
        if k is None:
            k = self._kernels[name] = self.program().get_sycl_kernel(name)
        return k

    # --- submission
    def launch(self, name: str, args, global_size, local_size=None) -> None:
        q = self.queue
        kargs = []
        for a in args:
            if isinstance(a, dpnp.ndarray):
                if a.sycl_queue is not q:
                    raise ValueError(f"kernel {name}: an argument lives on another queue ({a.sycl_queue!r}), "
                                     f"not on this backend's queue; move it with to_device")
                if not a.flags.c_contiguous:
                    raise ValueError(f"kernel {name}: arguments must be C-contiguous")
                u = a.get_array()
                # the allocation itself when the array starts at it (cheap), else a view's own USM pointer
                kargs.append(u.usm_data if u._element_offset == 0 else dpm.as_usm_memory(a))
            else:
                kargs.append(a)
        # 1-D ranges only: dpctl passes a SYCL range, whose LAST dimension is OpenCL's dimension 0
        gsize = [int(g) for g in global_size]
        assert len(gsize) == 1
        if any(g == 0 for g in gsize):
            return
        om = SequentialOrderManager[q]
        lsize = None if local_size is None else [int(x) for x in local_size]
        counter = self.counter
        if counter is not None:
            counter.kernels += 1
        if self.blocking:
            # after every task dpnp has pending on the queue, and done when this returns: nothing to keep alive
            q.submit(self.kernel(name), kargs, gsize, lsize, om.submitted_events)
            if counter is not None:
                counter.tasks += 1
            return
        ev = q.submit_async(self.kernel(name), kargs, gsize, lsize, om.submitted_events)
        om.add_event_pair([], ev)                 # counted by the backend's order-manager hook
        inflight = self._inflight
        inflight.append((ev, kargs))
        done = dpctl.event_status_type.complete
        while inflight and inflight[0][0].execution_status == done:
            inflight.popleft()


def i32(v) -> ctypes.c_int:
    return ctypes.c_int(int(v))


def u32(v) -> ctypes.c_uint:
    return ctypes.c_uint(int(v))


def f32(v) -> ctypes.c_float:
    return ctypes.c_float(float(v))


def build_program(queue, src: str):
    """OpenCL C source on an OpenCL device, SPIR-V elsewhere (STRATA_SYCL_KERNELS=spirv forces SPIR-V, to test
    the Level Zero route on an OpenCL device)."""
    backend = queue.sycl_device.backend.name
    if backend == "opencl" and os.environ.get("STRATA_SYCL_KERNELS", "source") != "spirv":
        try:
            return dpp.create_program_from_source(queue, src)
        except dpp.SyclProgramCompilationError as exc:
            raise RuntimeError(f"building the SYCL backend's OpenCL C kernels failed on "
                               f"{queue.sycl_device.name}: {exc}") from exc
    return dpp.create_program_from_spirv(queue, spirv(src))


def spirv(src: str) -> bytes:
    """SPIR-V for a device without OpenCL C (Level Zero): clang -> LLVM bitcode -> llvm-spirv, cached on disk."""
    key = hashlib.sha256(src.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("STRATA_CACHE_DIR") or Path.home() / ".cache" / "strata") / "spirv"
    out = cache / f"kernels-{key}.spv"
    if out.exists():
        return out.read_bytes()
    clang = next((shutil.which(n) for n in ("clang", "clang-15", "clang-16", "clang-17", "clang-18")
                  if shutil.which(n)), None)
    tr = next((shutil.which(n) for n in ("llvm-spirv", "llvm-spirv-15", "llvm-spirv-16", "llvm-spirv-17",
                                          "llvm-spirv-18") if shutil.which(n)), None)
    if clang is None or tr is None:
        raise ConfigError("this SYCL device takes no OpenCL C source (Level Zero): its kernels need SPIR-V, built "
                          "with clang and llvm-spirv, which were not found on PATH (looked for clang, clang-15..18, "
                          "llvm-spirv, llvm-spirv-15..18); install them (Debian: apt install clang-15 "
                          "llvm-spirv-15) or use the device's OpenCL driver (--device opencl:gpu)")
    with tempfile.TemporaryDirectory() as tmp:
        cl, bc = Path(tmp) / "k.cl", Path(tmp) / "k.bc"
        cl.write_text(src)
        # -O0 without optnone: llvm-spirv 15 cannot translate what LLVM's optimiser emits (freeze); the device
        # compiler optimises the SPIR-V anyway
        spv = Path(tmp) / "k.spv"
        for cmd in ([clang, "-cc1", "-triple", "spir64-unknown-unknown", "-cl-std=CL1.2", "-O0",
                     "-disable-O0-optnone", "-finclude-default-header", "-emit-llvm-bc", str(cl), "-o", str(bc)],
                    [tr, str(bc), "-o", str(spv)]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"building SPIR-V for the SYCL kernels failed: {' '.join(cmd)}: "
                                   f"{(r.stderr or r.stdout).strip()[-2000:]}")
        data = spv.read_bytes()
    cache.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    return data
