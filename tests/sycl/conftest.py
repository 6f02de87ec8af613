"""The SYCL backend's tests: one session queue on STRATA_SYCL_DEVICE (default "opencl:cpu").

The environment (OCL_ICD_FILENAMES for the intel-opencl-rt wheel's CPU runtime) is prepared here, before anything
imports dpctl. Without dpnp installed the directory is skipped; with dpnp installed and no matching device every test
FAILS, naming what was looked for: a CI machine that silently ran none of these tests would hide a broken runtime.
"""
from __future__ import annotations

import importlib.util
import os
import zlib

import numpy as np
import pytest

from strata.sycl_backend import runtime

runtime.prepare_environment()                # before any dpctl import

DEVICE = os.environ.get("STRATA_SYCL_DEVICE", "opencl:cpu")
HAVE_DPNP = importlib.util.find_spec("dpnp") is not None and importlib.util.find_spec("dpctl") is not None

if not HAVE_DPNP:
    collect_ignore_glob = ["test_*.py"]


def _device_line() -> str:
    if not HAVE_DPNP:
        return "sycl: dpnp is not installed (pip install 'strata[sycl]'): tests/sycl skipped"
    try:
        return f"sycl device: {runtime.describe(runtime.select_device(DEVICE))} (STRATA_SYCL_DEVICE={DEVICE})"
    except Exception as exc:                 # noqa: BLE001 - the header reports, the fixture fails
        return f"sycl device: NONE for STRATA_SYCL_DEVICE={DEVICE}: {exc}"


def pytest_report_header(config):
    return _device_line()


def pytest_collection_modifyitems(config, items):
    if not HAVE_DPNP:
        return
    # the header hook only runs when tests/sycl is on the command line; put the device in every run's summary too
    config._strata_sycl_line = _device_line()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    line = getattr(config, "_strata_sycl_line", None)
    if line:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def sycl_device():
    """The session's SYCL device (its queue is runtime.queue_for(device): one per device, shared by everything)."""
    try:
        return runtime.select_device(DEVICE)
    except Exception as exc:                 # noqa: BLE001
        pytest.fail(f"dpnp is installed but no SYCL device matches STRATA_SYCL_DEVICE={DEVICE!r}: {exc}",
                    pytrace=False)


@pytest.fixture(scope="session")
def sycl_queue(sycl_device):
    return runtime.queue_for(sycl_device)


@pytest.fixture(scope="session")
def ops(sycl_device):
    from strata.sycl_backend.backend import SyclBackend
    return SyclBackend(sycl_device)


@pytest.fixture
def rng(request):
    """Fresh inputs per test, the same in every run: seeded by a checksum of the test's name (Python's str hash is
    salted per process, so a failing draw could not be replayed)."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))
