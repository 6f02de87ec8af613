"""Free and total memory of an NVIDIA GPU from the CUDA driver (cuMemGetInfo in the device's primary context), for
when JAX's memory_stats() says nothing (under XLA's VMM allocator, which the command-buffer mode brings). The driver
library is given (a stub in tests) or loaded as libcuda.so.1; any failure is None, never an exception."""
from __future__ import annotations

import ctypes


def free_total(ordinal: int, lib=None) -> tuple[int, int] | None:
    """(free, total) bytes of CUDA device `ordinal`, or None when the driver cannot say."""
    try:
        lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, ctx, old = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        return None
    if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
        return None
    try:
        if lib.cuCtxPushCurrent_v2(ctx) != 0:
            return None
        try:
            if lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != 0:
                return None
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(old))
    finally:
        lib.cuDevicePrimaryCtxRelease_v2(dev)
    return int(free.value), int(total.value)
