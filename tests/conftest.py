import json
import os
import sys
from pathlib import Path

# test utilities (oracle.py, gguf_writer.py) live beside the tests
sys.path.insert(0, os.path.dirname(__file__))
# STRATA_TEST_DEVICE=gpu runs the kernel tests on the GPU (compiled, not interpreted); the default is the CPU
ON_GPU = os.environ.get("STRATA_TEST_DEVICE", "cpu") == "gpu"
if not ON_GPU:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # three CPU devices, for the layer split's stages (tests/e2e/test_layer_split.py); one-device code is unchanged
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=3").strip()
# JAX's persistent compilation cache, in a fixed place that outlives the clone: most of a cold run is XLA compiling
# (tests/compile_report.py says so per file), and a second run on the same machine loads those executables instead.
CACHE_HOME = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(CACHE_HOME, "strata", "jax-test-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


import pytest  # noqa: E402

# STRATA_TEST_COMPILE_REPORT=FILE: per-test wall, trace, lowering and compile seconds (tests/compile_report.py)
pytest_plugins = ("compile_report",)

# seconds each test file took in a measured run (one worker's time, cold compile cache): python
# tests/compile_report.py FILE --write refreshes it. Files run longest first; `--quick` keeps the files under QUICK_S.
FILE_SECONDS = json.loads((Path(__file__).parent / "file_seconds.json").read_text())
QUICK_S = 10.0


@pytest.fixture
def interpret() -> bool:
    """Whether Pallas kernels run in interpret mode: on the CPU (make test) yes, with STRATA_TEST_DEVICE=gpu no."""
    return not ON_GPU


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help=f"only the test files that took under {QUICK_S:g} s in the measured run "
                          "(tests/file_seconds.json) and are not marked heavy: make check")


def file_seconds(item) -> float:
    """The file's measured seconds; a file not measured yet counts as long if marked heavy, else as short."""
    path = item.nodeid.split("::")[0]
    if path in FILE_SECONDS:
        return FILE_SECONDS[path]
    return float("inf") if item.get_closest_marker("heavy") else 0.0


def pytest_collection_modifyitems(config, items):
    """Longest files first: with --dist loadfile a worker takes whole files in collection order (pyproject's
    --no-loadscope-reorder), and a long file taken last would keep one worker busy alone at the end."""
    if config.getoption("--quick"):
        quick = [file_seconds(i) < QUICK_S and not i.get_closest_marker("heavy") for i in items]
        config.hook.pytest_deselected(items=[i for i, q in zip(items, quick) if not q])
        items[:] = [i for i, q in zip(items, quick) if q]
    items.sort(key=lambda item: -file_seconds(item))


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, but a worker gets its next file only when it is on its current file's last test: xdist's own
    hands one over at 2 tests left, so two long files of few tests each could queue behind one worker."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFirst(LoadFileScheduling):
        def _reschedule(self, node):
            if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    return LongestFirst(config, log)
