"""Fixtures shared by the kernel tests."""
from __future__ import annotations

import pytest

from strata.jax_backend.kernels import expert_decode, expert_grouped


@pytest.fixture
def fresh_jit():
    """The expert kernels read the pool limit when they are traced: drop their compiled versions before and after a
    test that monkeypatches the limit, so that neither that test nor the next sees the other's."""
    kernels = (expert_grouped.experts_grouped, expert_decode.experts_decode)
    for k in kernels:
        k.clear_cache()
    yield
    for k in kernels:
        k.clear_cache()
