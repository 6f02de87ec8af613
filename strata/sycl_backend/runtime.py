"""The SYCL runtime: setting up the OpenCL CPU runtime, finding devices, one queue per device.

The OpenCL CPU device shipped in the `intel-opencl-rt` wheel (a dependency of dpnp) is invisible until the OpenCL ICD
loader is pointed at its `libintelocl.so`: the wheel's own .icd file holds an unsubstituted build path. This module
finds the library from the installed distribution's file list and sets `OCL_ICD_FILENAMES` (unless the user set it)
BEFORE dpctl is first imported, so neither a user nor CI has to export anything; nothing here imports dpctl at module
import time (`dpctl()` does, after `prepare_environment()`). Devices: "<backend>:<type>[:<index>]" ("opencl:cpu:0",
"level_zero:gpu:1"), "<type>[:<index>]" ("gpu", "cpu:0") for any backend, or a `dpctl.SyclDevice` (sub-devices too);
a bad string or a missing runtime is a ConfigError naming what was looked for and the devices that exist.
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from strata.errors import ConfigError

OPENCL_CPU_DIST = "intel-opencl-rt"
OPENCL_CPU_LIB = "libintelocl.so"
# Intel compiler runtime libraries the OpenCL CPU runtime needs when the SYCL loader opens it through the ICD
# (with ONEAPI_DEVICE_SELECTOR set); the wheels put them in the venv's lib/, which is not on the loader's path.
_PRELOAD = ("libintlc.so.5", "libimf.so", "libirng.so", "libsvml.so")
BACKENDS = ("opencl", "level_zero", "cuda", "hip")
TYPES = ("cpu", "gpu", "accelerator")


@dataclass
class RuntimeSetup:
    """What prepare_environment() looked for and did (doctor and error messages report it)."""
    looked_for: str = ""
    found: str | None = None               # path of libintelocl.so, or None
    icd: str | None = None                 # OCL_ICD_FILENAMES as the process now has it
    icd_set_by_us: bool = False
    dpctl_imported_before: bool = False    # dpctl was imported before we could set OCL_ICD_FILENAMES
    notes: list[str] = field(default_factory=list)


_setup: RuntimeSetup | None = None
_lock = threading.Lock()


def find_opencl_cpu_runtime() -> tuple[str | None, str]:
    """-> (path of libintelocl.so from the installed intel-opencl-rt distribution or None, what was looked for)."""
    looked = f"{OPENCL_CPU_LIB} in the files of the installed {OPENCL_CPU_DIST} distribution"
    try:
        files = importlib.metadata.files(OPENCL_CPU_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        return None, looked + f" ({OPENCL_CPU_DIST} is not installed: pip install 'strata[sycl]')"
    for f in files:
        if f.name == OPENCL_CPU_LIB:
            p = Path(f.locate()).resolve()
            if p.exists():
                return str(p), looked
    return None, looked + f" ({OPENCL_CPU_DIST} is installed but lists no existing {OPENCL_CPU_LIB})"


def prepare_environment() -> RuntimeSetup:
    """Point the OpenCL ICD loader at the wheel's CPU runtime (setdefault), extend LD_LIBRARY_PATH for child
    processes, and preload the compiler runtime libraries the CPU runtime links against. Idempotent; must run
    before dpctl is imported to take effect."""
    global _setup
    with _lock:
        if _setup is not None:
            return _setup
        s = RuntimeSetup()
        s.dpctl_imported_before = "dpctl" in sys.modules
        s.found, s.looked_for = find_opencl_cpu_runtime()
        if s.found:
            if "OCL_ICD_FILENAMES" not in os.environ:
                os.environ["OCL_ICD_FILENAMES"] = s.found
                s.icd_set_by_us = True
            libdir = str(Path(s.found).parent)
            paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
            if libdir not in paths:
                # the running process's loader read LD_LIBRARY_PATH at start; this is for child processes
                os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([libdir] + paths)
            # only the SYCL loader's path under ONEAPI_DEVICE_SELECTOR needs them (measured); otherwise load nothing
            for name in _PRELOAD if os.environ.get("ONEAPI_DEVICE_SELECTOR") else ():
                lib = Path(libdir) / name
                if lib.exists():
                    try:
                        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
                    except OSError as exc:
                        s.notes.append(f"could not preload {lib}: {exc}")
        s.icd = os.environ.get("OCL_ICD_FILENAMES")
        if s.dpctl_imported_before and s.icd_set_by_us:
            s.notes.append("dpctl was imported before Strata set OCL_ICD_FILENAMES, so the OpenCL CPU device may be "
                           "missing in this process; import strata.sycl_backend first")
        if s.icd and not s.icd_set_by_us and s.found and os.path.realpath(s.icd) != s.found:
            s.notes.append(f"OCL_ICD_FILENAMES was already set to {s.icd} (Strata would have used {s.found})")
        _setup = s
        return s


def dpctl_installed() -> bool:
    return importlib.util.find_spec("dpctl") is not None


def dpctl():
    """Import dpctl after preparing the environment; a ConfigError when it is not installed."""
    prepare_environment()
    if not dpctl_installed():
        raise ConfigError("the SYCL backend needs dpctl and dpnp, which are not installed: "
                          "pip install 'strata[sycl]' (or pip install dpnp)")
    import dpctl as _dpctl
    return _dpctl


def filter_string(dev) -> str:
    try:
        return dev.filter_string
    except Exception:           # noqa: BLE001 - sub-devices have no filter string
        return f"{dev.backend.name}:{dev.device_type.name}(sub-device)"


def describe(dev) -> str:
    return f"{filter_string(dev)} {dev.name} ({dev.max_compute_units} compute units, " \
           f"{dev.global_mem_size / 2 ** 30:.1f} GiB)"


def list_devices() -> list:
    """Every SYCL device the runtime sees (root devices), in the runtime's order; [] when dpctl is missing."""
    if not dpctl_installed():
        return []
    try:
        return list(dpctl().get_devices())
    except Exception:           # noqa: BLE001 - a broken runtime shows as "no devices"; doctor says why
        return []


def has_sycl_gpu() -> bool:
    """Whether a SYCL GPU is present (never raises; "auto" backend selection uses it)."""
    return any(d.device_type.name == "gpu" for d in list_devices())


def why_no_devices() -> str:
    """A sentence on why no SYCL device is visible (for errors and `strata doctor`)."""
    s = prepare_environment()
    parts = []
    if not dpctl_installed():
        parts.append("dpctl is not installed (pip install 'strata[sycl]')")
    if s.found is None:
        parts.append(f"the OpenCL CPU runtime was not found (looked for {s.looked_for})")
    else:
        parts.append(f"OpenCL CPU runtime: {s.found} (OCL_ICD_FILENAMES={s.icd})")
    sel = os.environ.get("ONEAPI_DEVICE_SELECTOR")
    if sel:
        parts.append(f"ONEAPI_DEVICE_SELECTOR={sel} limits the devices the SYCL runtime shows")
    parts.extend(s.notes)
    if not any(Path("/dev/dri").glob("renderD*")):
        parts.append("no GPU render node in /dev/dri (no Intel GPU driver visible, or the container lacks the "
                     "device and its render/video groups)")
    return "; ".join(parts)


def parse_device(spec: str) -> tuple[str | None, str, int | None]:
    """'opencl:cpu:0' -> ('opencl', 'cpu', 0); 'gpu' -> (None, 'gpu', None). A ConfigError names what is allowed."""
    allowed = ("device strings look like 'opencl:cpu', 'opencl:cpu:0', 'level_zero:gpu:0', 'gpu' or 'cpu:1' "
               f"(backends {', '.join(BACKENDS)}; types {', '.join(TYPES)})")
    parts = spec.strip().lower().split(":") if isinstance(spec, str) else []
    backend = None
    if parts and parts[0] in BACKENDS:
        backend = parts.pop(0)
    if not parts or parts[0] not in TYPES or len(parts) > 2:
        raise ConfigError(f"SYCL device {spec!r} is not a device string; {allowed}")
    kind = parts[0]
    index = None
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise ConfigError(f"SYCL device {spec!r}: the index {parts[1]!r} is not a non-negative integer; {allowed}")
        index = int(parts[1])
    return backend, kind, index


def select_device(spec=None):
    """A dpctl.SyclDevice for a device string, a SyclDevice (returned as is), or None (a GPU if one is present:
    OpenCL first, since the kernels are OpenCL C; else the CPU device)."""
    dp = dpctl()
    if isinstance(spec, dp.SyclDevice):
        return spec
    devices = list_devices()
    if spec is None:
        for backend, kind in (("opencl", "gpu"), ("level_zero", "gpu"), ("opencl", "cpu")):
            for d in devices:
                if d.backend.name == backend and d.device_type.name == kind:
                    return d
        if devices:
            return devices[0]
        raise ConfigError(f"no SYCL device found: {why_no_devices()}")
    backend, kind, index = parse_device(spec)
    match = [d for d in devices if d.device_type.name == kind and (backend is None or d.backend.name == backend)]
    want = f"{backend + ':' if backend else ''}{kind}"
    if index is not None:
        if index < len(match):
            return match[index]
        looked = f"{want} number {index} (there are {len(match)} {want} devices)"
    elif match:
        return match[0]
    else:
        looked = f"device {want}"
    seen = ", ".join(describe(d) for d in devices) or "none"
    why = ""
    if not devices:
        why = f" ({why_no_devices()})"
    elif kind == "gpu" and not any(Path("/dev/dri").glob("renderD*")):
        why = " (no GPU render node in /dev/dri: no GPU driver visible, or the container lacks the device and its " \
              "render/video groups)"
    raise ConfigError(f"SYCL device {spec!r} not found: looked for {looked}; devices seen: {seen}{why}")


_queues: dict = {}
_partitions: list = []          # the sub-device lists made by sub_devices(), each kept so its members keep one identity


def sub_devices(device, n: int) -> list:
    """`device` cut into n sub-devices of equal compute units, the same objects on every call (dpctl makes new,
    unequal objects for each partition): how tests stand in for n cards, and a layer split's stages find theirs."""
    cu = device.max_compute_units
    if not 2 <= n <= cu:
        raise ConfigError(f"{describe(device)} can be cut into 2..{cu} sub-devices, not {n}")
    with _lock:                                 # one lookup-or-cut: two callers never cut two partitions
        for parent, subs in _partitions:
            if parent == device and len(subs) == n:
                return subs
        subs = list(device.create_sub_devices(partition=[cu // n + (i < cu % n) for i in range(n)]))
        _partitions.append((device, subs))
        return subs


def siblings(device) -> list:
    """The devices a layer split runs on beside `device`: its partition when it is a sub-device made by
    sub_devices(), else every root device of its backend and type (`device` among them)."""
    if device.parent_device is not None:
        with _lock:
            for _, subs in _partitions:
                if any(d is device for d in subs):
                    return subs
        raise ConfigError(f"{describe(device)} is a sub-device not made by strata's runtime.sub_devices: its "
                          f"siblings are unknown (make them with strata.sycl_backend.runtime.sub_devices)")
    return [d for d in list_devices() if d.backend == device.backend and d.device_type == device.device_type]


def queue_for(device):
    """THE queue of a device, the same object on every call, so every array and kernel of the device shares one
    queue (arrays of two queue objects cannot be mixed, and a kernel built in one context fails on another's queue).
    A root device gets dpctl's cached queue (the one dpnp uses by default); a sub-device, which dpctl does not
    cache, gets one made once and kept here."""
    dp = dpctl()
    with _lock:
        q = _queues.get(device)
        if q is None:
            q = _queues[device] = dp.get_device_cached_queue(device)
        return q
