"""Shaped sampling on the SYCL backend: the sampler against its numpy references (tests/test_shaped_sampling.py's
cases) and shaped windows of a WindowRunner on the demo model (tests/sched/test_shaped_windows.py's tests but the
chained windows, which an eager backend does not run, and the JAX compilation count)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sched"))

from strata import Engine  # noqa: E402
from strata.engine.runner import WindowRunner  # noqa: E402
from strata.engine.sampling import logprobs_reference, pack_mask, sample_shaped, shape_logits_reference  # noqa: E402
from test_shaped_windows import (S, test_a_bias_of_plus_100_forces_a_token_and_minus_100_bans_one,  # noqa: E402,F401
                                 test_a_mask_allows_only_its_tokens, test_copies_continue_the_parts_state,
                                 test_logprobs_are_the_log_softmax_of_the_engines_logits,
                                 test_penalties_match_a_numpy_reference_on_captured_logits,
                                 test_rows_without_features_sample_what_plain_windows_do)

from tests.test_shaped_sampling import case  # noqa: E402


@pytest.fixture(scope="module")
def engine(sycl_device):
    return Engine.load("demo", backend="sycl", device=sycl_device, max_context=256, prefill=16)


@pytest.fixture(scope="module")
def runner(engine):
    return WindowRunner(engine, S, 16)


@pytest.mark.parametrize("greedy", [True, False])
def test_sample_shaped_matches_the_references(ops, greedy):
    logits, penalties, counts, seen, bias, allowed = case(3)
    s = len(logits)
    active, reset = np.array([1, 1, 0, 1], np.int32), np.array([0, 0, 0, 1], np.int32)
    temperature = np.zeros(s, np.float32) if greedy else np.full(s, 0.7, np.float32)
    args = (logits, active, temperature, np.zeros(s, np.int32), np.ones(s, np.float32), np.zeros(s, np.float32),
            np.arange(2 * s, dtype=np.uint32).reshape(s, 2), np.zeros(s, np.int32), penalties, counts, seen, bias,
            pack_mask(allowed), reset)
    nxt, finite, new_counts, (lp, ids, top) = sample_shaped(ops, *(ops.to_device(np.asarray(a)) for a in args),
                                                            greedy=greedy)
    nxt, new_counts = np.asarray(ops.to_host(nxt)), np.asarray(ops.to_host(new_counts))
    base = np.where(reset[:, None] > 0, 0, counts)
    shaped = shape_logits_reference(logits, penalties, base, seen, bias, allowed)
    assert allowed[np.arange(s), nxt].all()
    if greedy:
        assert nxt.tolist() == shaped.argmax(-1).tolist()
    want = base.copy()
    want[np.flatnonzero(active), nxt[active > 0]] += 1
    assert np.array_equal(new_counts, want) and np.asarray(ops.to_host(finite)).all()
    ref = logprobs_reference(logits)
    np.testing.assert_allclose(np.asarray(ops.to_host(lp)), ref[np.arange(s), nxt], atol=1e-5)
    ids = np.asarray(ops.to_host(ids))
    assert np.array_equal(ids, np.argsort(-ref, axis=-1, kind="stable")[:, :20])
    np.testing.assert_allclose(np.asarray(ops.to_host(top)), np.take_along_axis(ref, ids, -1), atol=1e-5)
