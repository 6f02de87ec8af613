"""The core parity suite against transformers, with backend="sycl": the same tiny models (CONFIGS), the same
oracle and near-tie rejection, the same checks and tolerances as tests/model/test_parity.py, imported from it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))

import test_parity as jax_parity  # noqa: E402
from strata import Engine  # noqa: E402

# the checks themselves, collected here against this module's `case` fixture
from test_parity import (test_greedy_generation_identical, test_logits_match_transformers,  # noqa: E402,F401
                         test_parts_plus_decode_equal_one_pass)


class _SyclEngine:
    """Engine with backend="sycl" on the session's device, for the imported fixture's Engine.load."""

    def __init__(self, device):
        self.device = device

    def load(self, path, **options):
        return Engine.load(path, backend="sycl", device=self.device, **options)


@pytest.fixture(scope="module", params=sorted(jax_parity.CONFIGS))
def case(request, tmp_path_factory, sycl_device):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax_parity, "Engine", _SyclEngine(sycl_device))
        c = jax_parity.case.__wrapped__(request, tmp_path_factory)
    assert c["engine"].backend.name == "sycl"
    return c
