import os
import tempfile
import sys

# test utilities (oracle.py, gguf_writer.py) live beside the tests
sys.path.insert(0, os.path.dirname(__file__))
# STRATA_TEST_DEVICE=gpu runs the kernel tests on the GPU (compiled, not interpreted); the default is the CPU
ON_GPU = os.environ.get("STRATA_TEST_DEVICE", "cpu") == "gpu"
if not ON_GPU:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # three CPU devices, for the layer split's stages (tests/e2e/test_layer_split.py); one-device code is unchanged
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=3").strip()
# JAX's persistent compilation cache: many tests build engines of the same shapes, and an engine's functions are
# compiled per engine; with the cache the second engine of a shape loads its executables instead of recompiling.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "strata-test-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


import pytest  # noqa: E402


@pytest.fixture
def interpret() -> bool:
    """Whether Pallas kernels run in interpret mode: on the CPU (make test) yes, with STRATA_TEST_DEVICE=gpu no."""
    return not ON_GPU


def pytest_collection_modifyitems(items):
    """Files marked `heavy` (module-level pytestmark) go first: with --dist loadfile a worker takes whole files in
    collection order (pyproject's --no-loadscope-reorder), and a long file taken last keeps one worker busy alone."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
