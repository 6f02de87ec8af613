"""RoPE scaling (YaRN x2 and x4, linear, dynamic NTK) against transformers with backend="sycl": the same tiny models,
oracle and tolerance as tests/model/test_rope_scaling.py, whose fixture and check are imported."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))

from test_rope_scaling import case, check_scaled  # noqa: E402,F401


def test_scaled_rope_matches_transformers_sycl(case, sycl_device):
    check_scaled(case, backend="sycl", device=sycl_device)
