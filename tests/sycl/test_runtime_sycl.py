"""Device selection, runtime set-up and their messages: a bad device string or a missing runtime names what was
looked for and what exists; `auto` picks the backend; `strata doctor` lists what it sees."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from strata import Engine
from strata.errors import ConfigError
from strata.sycl_backend import runtime


@pytest.mark.parametrize("spec,says", [
    ("opencl:tpu", "not a device string"),
    ("vulkan:gpu", "not a device string"),
    ("opencl:cpu:x", "not a non-negative integer"),
    ("opencl:cpu:0:1", "not a device string"),
    ("opencl:cpu:7", "looked for opencl:cpu number 7 (there are 1 opencl:cpu devices)"),
    ("level_zero:gpu:0", "looked for level_zero:gpu number 0"),
    ("opencl:accelerator", "looked for device opencl:accelerator"),
])
def test_bad_device_strings_name_what_was_looked_for(sycl_device, spec, says):
    with pytest.raises(ConfigError) as ei:
        Engine.load("demo", backend="sycl", device=spec)
    msg = str(ei.value)
    assert repr(spec) in msg and says in msg, msg
    if "looked for" in says:
        assert "devices seen: " + runtime.filter_string(sycl_device) in msg        # and what exists
    else:
        assert "'opencl:cpu'" in msg and "level_zero" in msg                     # and what is allowed


def test_jax_kernel_choices_are_refused_on_sycl(sycl_device):
    with pytest.raises(ConfigError, match="kernels 'pallas' applies to the jax backend"):
        Engine.load("demo", backend="sycl", device=sycl_device, kernels="pallas")


def test_device_strings_parse():
    assert runtime.parse_device("opencl:cpu") == ("opencl", "cpu", None)
    assert runtime.parse_device("Level_Zero:GPU:1") == ("level_zero", "gpu", 1)
    assert runtime.parse_device("gpu:0") == (None, "gpu", 0)
    assert runtime.parse_device("cpu") == (None, "cpu", None)


def test_missing_opencl_cpu_runtime_is_named(tmp_path):
    """No intel-opencl-rt (simulated: its distribution is not found) and no OCL_ICD_FILENAMES: the CPU
    device is absent and the error says what was looked for, in a fresh process (the runtime reads the
    environment once, at its first device query)."""
    code = textwrap.dedent("""
        import importlib.metadata as md
        real = md.files
        def files(name):
            if name == "intel-opencl-rt":
                raise md.PackageNotFoundError(name)
            return real(name)
        md.files = files
        from strata import Engine
        from strata.errors import ConfigError
        try:
            Engine.load("demo", backend="sycl", device="opencl:cpu")
        except ConfigError as exc:
            print("CONFIGERROR", exc)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("OCL_ICD_FILENAMES", "ONEAPI_DEVICE_SELECTOR")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("CONFIGERROR")), None)
    assert line is not None, out.stdout + out.stderr
    assert "SYCL device 'opencl:cpu' not found" in line
    assert "libintelocl.so" in line and "intel-opencl-rt is not installed" in line, line
    assert "devices seen: none" in line


def test_missing_dpctl_is_named(monkeypatch):
    monkeypatch.setattr(runtime, "dpctl_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"needs dpctl and dpnp, which are not installed: pip install "
                                          r"'strata\[sycl\]'"):
        runtime.select_device("opencl:cpu")
    assert "dpctl is not installed" in runtime.why_no_devices()


def test_auto_picks_sycl_only_for_a_sycl_gpu_without_an_nvidia_gpu(monkeypatch):
    from strata import backend
    monkeypatch.setattr(runtime, "has_sycl_gpu", lambda: False)
    assert backend._auto() == "jax"
    monkeypatch.setattr(runtime, "has_sycl_gpu", lambda: True)
    assert backend._auto() == "sycl"                  # this machine's JAX sees no GPU
    assert runtime.has_sycl_gpu.__call__() is True


def test_one_queue_per_device(sycl_device):
    from strata.sycl_backend.backend import SyclBackend
    a, b = SyclBackend(sycl_device), SyclBackend(runtime.filter_string(sycl_device))
    assert a.queue is b.queue is runtime.queue_for(sycl_device)
    assert a.kernels is b.kernels                     # the program is built once per queue


def test_doctor_lists_devices(sycl_device):
    from strata.doctor import doctor
    text = doctor()
    assert "jax device 0: cpu" in text
    assert f"sycl device {runtime.filter_string(sycl_device)}" in text
    assert "OpenCL CPU runtime: " in text and "libintelocl.so" in text
    assert "backend auto: " in text


def test_zeros_like_makes_the_state_on_the_queue(ops):
    """A fresh sequence state is made on the device (Backend.zeros_like), not copied from the host: same tree,
    shapes and dtypes (bfloat16 as Bf16 bits), every value 0, on the backend's queue."""
    import dpnp
    import ml_dtypes
    import numpy as np

    from strata.sycl_backend.backend import Bf16
    host = [{"ssm": np.zeros((2, 3, 4), np.float32), "conv": np.zeros((3, 5), ml_dtypes.bfloat16)},
            {"k": np.zeros((6, 2, 8), np.int8), "k_scale": np.zeros((6, 2), np.float32)}]
    dev = ops.zeros_like(host)
    assert isinstance(dev, list) and [sorted(d) for d in dev] == [sorted(h) for h in host]
    assert isinstance(dev[0]["conv"], Bf16) and dev[0]["conv"].bits.sycl_queue is ops.queue
    for d, h in zip(dev, host):
        for name, a in h.items():
            got = ops.to_host(d[name])
            assert got.shape == a.shape and got.dtype == a.dtype and not np.any(got.astype(np.float32)), name
            if name != "conv":
                assert isinstance(d[name], dpnp.ndarray) and d[name].sycl_queue is ops.queue
