"""The shaped sampler (strata/engine/sampling.py) on the JAX backend against its numpy references, on random logits:
penalties, bias and masks as their definitions read, neutral settings exact bit for bit, counts advanced by the
sampled tokens of active rows only, logprobs the log-softmax of the raw logits."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from strata.engine.sampling import (logprobs_reference, pack_mask, sample_shaped, shape_logits,
                                    shape_logits_reference, unpack_mask)
from strata.jax_backend.backend import JaxBackend

S, V = 4, 77
ops = JaxBackend(device="cpu", kernels="xla")


def case(seed=0):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((S, V)) * 3).astype(np.float32)
    penalties = np.array([[0.0, 0.0, 1.0], [0.7, 0.0, 1.0], [0.0, 0.4, 1.0], [0.3, 0.2, 1.6]], np.float32)
    counts = rng.integers(0, 4, (S, V)).astype(np.int32) * (rng.random((S, V)) < 0.2)
    seen = (rng.random((S, V)) < 0.2).astype(np.int32)
    bias = np.where(rng.random((S, V)) < 0.1, rng.uniform(-5, 5, (S, V)), 0).astype(np.float32)
    allowed = rng.random((S, V)) < 0.6
    allowed[:, 0] = True
    return logits, penalties, counts.astype(np.int32), seen, bias, allowed


def test_masks_round_trip_through_the_device_layout():
    allowed = np.random.default_rng(1).random((S, V)) < 0.5
    packed = pack_mask(allowed)
    assert packed.dtype == np.int32 and packed.shape == (S, 3)
    assert np.array_equal(np.asarray(unpack_mask(ops.xp, jax.numpy.asarray(packed), V)), allowed)


def test_shape_logits_is_the_definitions():
    logits, penalties, counts, seen, bias, allowed = case()
    got = np.asarray(jax.jit(lambda *a: shape_logits(ops.xp, *a))(logits, penalties, counts, seen, bias, allowed))
    want = shape_logits_reference(logits, penalties, counts, seen, bias, allowed)
    assert np.array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[~np.isinf(got)], want[~np.isinf(want)], rtol=1e-6, atol=1e-5)


def test_neutral_settings_leave_the_logits_bit_for_bit():
    logits, _, counts, seen, _, _ = case(2)
    neutral = np.tile(np.array([0.0, 0.0, 1.0], np.float32), (S, 1))
    got = np.asarray(shape_logits(ops.xp, logits, neutral, counts, seen, np.zeros((S, V), np.float32),
                                  np.ones((S, V), bool)))
    assert np.array_equal(got.view(np.int32), logits.view(np.int32))


@pytest.mark.parametrize("greedy", [True, False])
def test_sample_shaped_draws_from_the_shaped_logits_and_counts_active_rows(greedy):
    logits, penalties, counts, seen, bias, allowed = case(3)
    active = np.array([1, 1, 0, 1], np.int32)
    reset = np.array([0, 0, 0, 1], np.int32)
    temperature = np.zeros(S, np.float32) if greedy else np.full(S, 0.7, np.float32)
    args = (logits, active, temperature, np.zeros(S, np.int32), np.ones(S, np.float32), np.zeros(S, np.float32),
            np.arange(2 * S, dtype=np.uint32).reshape(S, 2), np.zeros(S, np.int32), penalties, counts, seen, bias,
            pack_mask(allowed), reset)
    nxt, finite, new_counts, (lp, top_ids, top) = jax.jit(
        lambda *a: sample_shaped(ops, *a, greedy=greedy))(*args)
    nxt, new_counts = np.asarray(nxt), np.asarray(new_counts)
    base = np.where(reset[:, None] > 0, 0, counts)
    shaped = shape_logits_reference(logits, penalties, base, seen, bias, allowed)
    assert allowed[np.arange(S), nxt].all(), "a masked token was sampled"
    if greedy:
        assert nxt.tolist() == shaped.argmax(-1).tolist()
    want = base.copy()
    want[np.flatnonzero(active), nxt[active > 0]] += 1
    assert np.array_equal(new_counts, want) and np.asarray(finite).all()
    ref = logprobs_reference(logits)
    np.testing.assert_allclose(np.asarray(lp), ref[np.arange(S), nxt], atol=1e-5)
    top_ids = np.asarray(top_ids)
    assert top_ids.shape == (S, 20)
    assert np.array_equal(top_ids, np.argsort(-ref, axis=-1, kind="stable")[:, :20])
    np.testing.assert_allclose(np.asarray(top), np.take_along_axis(ref, top_ids, -1), atol=1e-5)


def test_a_bias_of_plus_100_forces_and_minus_100_bans():
    logits, *_ = case(4)
    neutral = np.tile(np.array([0.0, 0.0, 1.0], np.float32), (S, 1))
    zeros = np.zeros((S, V), np.int32)
    bias = np.zeros((S, V), np.float32)
    bias[0, 13] = 100.0
    best = logits.argmax(-1)
    bias[1, best[1]] = -100.0
    nxt, *_ = sample_shaped(ops, logits, np.ones(S, np.int32), np.full(S, 1.0, np.float32), np.zeros(S, np.int32),
                            np.ones(S, np.float32), np.zeros(S, np.float32), np.zeros((S, 2), np.uint32),
                            np.zeros(S, np.int32), neutral, zeros, zeros, bias, pack_mask(np.ones((S, V), bool)),
                            np.zeros(S, np.int32))
    nxt = np.asarray(nxt)
    assert nxt[0] == 13 and nxt[1] != best[1]
