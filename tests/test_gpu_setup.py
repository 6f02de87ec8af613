"""The GPU set-up that runs before JAX makes its client, checked on the CPU: the command-buffer update flag
(strata/jax_backend/xla_flags.py) against stubs of the jaxlib check and a real child process, and the free-memory
query under an allocator that says nothing (strata/jax_backend/cuda_memory.py) against a stub of the CUDA driver."""
from __future__ import annotations

import ctypes

import pytest

from strata.backend import get_backend
from strata.jax_backend import cuda_memory
from strata.jax_backend.xla_flags import FLAG, SET_BY_STRATA, accepts, command_buffer_update, pinned_host_usable


def test_the_flag_is_the_first_mode_name_the_jaxlib_accepts():
    tried = []

    def newer_jaxlib(flag):
        tried.append(flag)
        return flag.endswith("=TEMP_NEVER_UPDATE")
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    line = command_buffer_update("skip_temp", env, newer_jaxlib, gpu=True)
    assert tried == [f"{FLAG}=SKIP_TEMP", f"{FLAG}=TEMP_NEVER_UPDATE"]
    assert env["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {FLAG}=TEMP_NEVER_UPDATE" and "TEMP_NEVER_UPDATE" in line
    assert env[SET_BY_STRATA] == f"{FLAG}=TEMP_NEVER_UPDATE"


@pytest.mark.parametrize("case", ["off", "given", "no gpu", "unknown names"])
def test_the_flag_is_left_alone(case):
    env = {"XLA_FLAGS": f"{FLAG}=ALWAYS_UPDATE"} if case == "given" else {}
    before = dict(env)
    mode = "xla_default" if case == "off" else "skip_temp"
    line = command_buffer_update(mode, env, lambda flag: case not in ("unknown names",), gpu=case != "no gpu")
    assert env == before
    assert {"off": "xla_default", "given": "left as given", "no gpu": "no NVIDIA driver",
            "unknown names": "knows none of SKIP_TEMP, TEMP_NEVER_UPDATE"}[case] in line


def test_no_pinned_host_memory_under_a_command_buffer_mode_on_a_gpu(monkeypatch):
    """Any update mode in XLA_FLAGS makes XLA's GPU client use its VMM allocator, under which an array put in pinned
    host memory kills the process (seen on the H200, bench/results/overlap_probe_h200_skip_temp_segfault.log): the
    backend then offers no HostFetch, so host mirrors stay in pageable memory and window fetch is off."""
    assert not pinned_host_usable("gpu", f"--xla_dump_to=/tmp/x {FLAG}=SKIP_TEMP")
    assert pinned_host_usable("gpu", "--xla_dump_to=/tmp/x") and pinned_host_usable("cpu", f"{FLAG}=SKIP_TEMP")
    cpu = get_backend("jax", device="cpu")
    assert cpu.host_fetch is cpu                      # the CPU's pinned host memory is usable under any flags
    assert "XLA's VMM allocator then leaves no pinned host memory" in command_buffer_update(
        "skip_temp", {}, lambda flag: True, gpu=True)


def test_the_jaxlib_check_runs_a_child_that_an_unknown_value_aborts():
    assert accepts("--xla_dump_hlo_as_text")
    assert not accepts(f"{FLAG}=NOT_A_MODE")


class Driver:
    """The five CUDA driver calls free_total makes, writing through ctypes pointers as libcuda does; `fail` names
    one that returns an error."""

    def __init__(self, free, total, fail=None):
        self.free, self.total, self.fail, self.calls = free, total, fail, []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            if name == self.fail:
                return 1
            if name == "cuMemGetInfo_v2":
                args[0]._obj.value, args[1]._obj.value = self.free, self.total
            elif name == "cuDevicePrimaryCtxRetain":
                args[0]._obj.value = 0x1234
            return 0
        return call


def test_free_memory_from_the_driver():
    d = Driver(3 << 30, 141 << 30)
    assert cuda_memory.free_total(0, d) == (3 << 30, 141 << 30)
    assert d.calls == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent_v2", "cuMemGetInfo_v2",
                       "cuCtxPopCurrent_v2", "cuDevicePrimaryCtxRelease_v2"]
    for fail, last in (("cuInit", "cuInit"), ("cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain"),
                       ("cuCtxPushCurrent_v2", "cuDevicePrimaryCtxRelease_v2"),
                       ("cuMemGetInfo_v2", "cuDevicePrimaryCtxRelease_v2")):
        d = Driver(1, 2, fail)                        # a retained context is always released, a pushed one popped
        assert cuda_memory.free_total(0, d) is None and d.calls[-1] == last
        assert ("cuCtxPopCurrent_v2" in d.calls) == (fail == "cuMemGetInfo_v2")


def test_no_driver_library_is_none():
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert cuda_memory.free_total(0) is None
    else:
        pytest.skip("this machine has a CUDA driver")


class SilentGpu:
    """A GPU device whose allocator reports nothing (XLA's VMM allocator)."""
    platform, local_hardware_id = "gpu", 0

    def memory_stats(self):
        return None


def test_the_planner_gets_the_drivers_free_memory_when_the_allocator_says_nothing():
    ops = get_backend("jax", kernels="xla")
    assert ops.free_memory_bytes() is None                 # the CPU says nothing
    ops.device = SilentGpu()
    assert ops.free_memory_bytes(driver=Driver(7 << 30, 141 << 30)) == 7 << 30


def test_the_kv_host_tier_runs_xlas_default_command_buffer_mode():
    """kv_resident needs pinned host memory, which skip_temp's allocator leaves none of: the server sets XLA's default
    mode for it and says why; without it the configured mode stands."""
    from strata.config import Settings
    from strata.serve.server import command_buffer_mode
    assert command_buffer_mode(Settings.build()) == ("skip_temp", "")
    assert command_buffer_mode(Settings.build(kv_resident=4096)) == ("xla_default",
                                                                     " (kv_resident needs pinned host memory)")
    assert command_buffer_mode(Settings.build(kv_resident=4096, command_buffer_update="xla_default")) == \
        ("xla_default", "")
