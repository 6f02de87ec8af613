"""Fixtures of the expert tests: a tiny Qwen3-Next checkpoint with 64 experts per layer."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    from oracle import build_hf_model, save_hf_model
    d = tmp_path_factory.mktemp("tiny64")
    model = build_hf_model("qwen3_next", 5, num_experts=64, num_experts_per_tok=4, hidden_size=64,
                           moe_intermediate_size=32)
    return save_hf_model(model, d / "hf")
