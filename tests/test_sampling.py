"""Sampling: JaxBackend.sample checked statistically against an independent numpy reference (thousands of keys on
one fixed 8-entry distribution), and Engine.generate on the demo model: greedy is argmax, seeded requests are
reproducible, bad arguments are named, stop tokens end a generation right after their first occurrence.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata import Engine
from strata.errors import StrataError
from strata.jax_backend.backend import JaxBackend

N = 4000            # keys per statistical check
SIGMAS = 5.0
# a fixed distribution, deliberately not sorted: descending order is ids 1, 4, 3, 6, 0, 7, 5, 2
PROBS = np.array([0.10, 0.25, 0.04, 0.15, 0.20, 0.06, 0.12, 0.08])
LOGITS = (np.log(PROBS) + 2.0).astype(np.float32)
PROMPT = [5, 70, 101, 33]


def _one(logits, temperature, top_k, top_p, min_p, key):
    return JaxBackend.sample(logits[None], temperature[None], top_k[None], top_p[None], min_p[None], key[None])[0]


_draw_many = jax.jit(jax.vmap(_one, in_axes=(None, None, None, None, None, 0)))


def draw(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, logits=LOGITS, n=N, seed=0) -> np.ndarray:
    keys = jax.random.split(jax.random.key(seed), n)
    out = _draw_many(jnp.asarray(logits), jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
                     jnp.float32(min_p), keys)
    return np.asarray(out)


def reference(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, logits=LOGITS) -> np.ndarray:
    """The distribution a sampler must draw from: softmax(logits / T), then the kept set is the intersection of
    top_k (k most probable), top_p (smallest prefix of the sorted probabilities whose mass reaches top_p) and
    min_p (probability >= min_p * max probability), renormalised."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.ones(len(p), bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    cum = np.cumsum(p[order])
    n_prefix = int(np.searchsorted(cum, top_p - 1e-12)) + 1          # first prefix with mass >= top_p
    keep[order[n_prefix:]] = False
    keep &= p >= min_p * p.max()
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def assert_matches(samples: np.ndarray, q: np.ndarray, what: str) -> None:
    n = len(samples)
    counts = np.bincount(samples, minlength=len(q))
    assert len(counts) == len(q), f"{what}: token id out of range: {samples.max()}"
    allowed = set(np.flatnonzero(q > 0).tolist())
    seen = set(np.flatnonzero(counts).tolist())
    assert seen <= allowed, f"{what}: drew {sorted(seen - allowed)}, allowed only {sorted(allowed)}"
    sigma = np.sqrt(n * q * (1 - q))
    dev = np.abs(counts - n * q)
    bad = np.flatnonzero(dev > SIGMAS * sigma + 1e-9)
    assert bad.size == 0, (f"{what}: counts {counts.tolist()} vs expected {np.round(n * q, 1).tolist()} "
                           f"(ids {bad.tolist()} beyond {SIGMAS} sigma)")


# --- the sampler itself


def test_reference_filters_are_what_the_test_means():
    # pin the reference to hand-worked sets, so the statistical tests below check the right thing
    kept = lambda **kw: set(np.flatnonzero(reference(**kw) > 0).tolist())  # noqa: E731
    assert kept(top_k=2) == {1, 4}
    assert kept(top_p=0.5) == {1, 4, 3}                  # 0.25 + 0.20 = 0.45 < 0.5 <= 0.60
    assert kept(min_p=0.2) == set(range(8)) - {2}        # 0.04 < 0.2 * 0.25
    assert kept(min_p=0.45) == {1, 4, 3, 6}              # threshold 0.1125
    assert np.allclose(reference(), PROBS)


def test_temperature_zero_is_argmax():
    for kw in ({}, dict(top_k=3), dict(top_p=0.3), dict(min_p=0.5)):
        out = draw(temperature=0.0, n=256, **kw)
        assert (out == int(np.argmax(LOGITS))).all()


def test_temperature_zero_row_in_a_mixed_batch_is_greedy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    t = jnp.array([0.0, 1.0, 0.0], jnp.float32)
    zeros, ones = jnp.zeros(3, jnp.int32), jnp.ones(3, jnp.float32)
    f = jax.jit(lambda k: JaxBackend.sample(jnp.asarray(logits), t, zeros, ones, jnp.zeros(3, jnp.float32),
                                             jax.random.split(k, 3)))
    outs = np.stack([np.asarray(f(k)) for k in jax.random.split(jax.random.key(1), 64)])
    greedy = logits.argmax(-1)
    assert (outs[:, 0] == greedy[0]).all() and (outs[:, 2] == greedy[2]).all()
    assert len(set(outs[:, 1].tolist())) > 5                # the sampled row really samples


def test_all_greedy_gives_the_general_paths_greedy_rows_without_sorting():
    """all_greedy (static, the runner's choice when every row has temperature 0): the same tokens as the general
    path's greedy rows, ties to the lower id as argmax's, and no sort in the compiled function."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 300)).astype(np.float32)
    logits[2, [7, 9]] = logits[2].max() + 1.0                               # a tie: the lower id wins
    args = (jnp.asarray(logits), jnp.zeros(4, jnp.float32), jnp.array([0, 3, 0, 1], jnp.int32),
            jnp.array([1.0, 0.5, 0.9, 1.0], jnp.float32), jnp.zeros(4, jnp.float32),
            jax.random.split(jax.random.key(0), 4))
    general = np.asarray(JaxBackend.sample(*args))
    fast = jax.jit(lambda *a: JaxBackend.sample(*a, all_greedy=True))
    assert np.array_equal(np.asarray(fast(*args)), general) and general[2] == 7
    assert "sort" not in fast.lower(*args).as_text()
    assert "sort" in jax.jit(JaxBackend.sample).lower(*args).as_text()


def test_no_filters_matches_softmax():
    assert_matches(draw(), reference(), "T=1")


def test_top_k_2_only_yields_the_top_two():
    out = draw(top_k=2)
    assert set(out.tolist()) == {1, 4}
    assert_matches(out, reference(top_k=2), "top_k=2")


def test_top_p_half_only_yields_the_smallest_prefix_reaching_half():
    out = draw(top_p=0.5)
    assert set(out.tolist()) == {1, 4, 3}
    assert_matches(out, reference(top_p=0.5), "top_p=0.5")


@pytest.mark.parametrize("min_p", [0.2, 0.45])
def test_min_p_excludes_tokens_below_fraction_of_max(min_p):
    out = draw(min_p=min_p)
    p = PROBS / PROBS.sum()
    assert (p[out] >= min_p * p.max()).all()
    assert_matches(out, reference(min_p=min_p), f"min_p={min_p}")


@pytest.mark.parametrize("filters,kept", [
    (dict(top_k=2, top_p=0.8, min_p=0.2), {1, 4}),           # top_k is the tightest
    (dict(top_k=5, top_p=0.7, min_p=0.2), {1, 4, 3, 6}),     # top_p is the tightest
    (dict(top_k=5, top_p=0.8, min_p=0.5), {1, 4, 3}),        # min_p is the tightest
])
def test_filters_combine_as_an_intersection(filters, kept):
    # each filter keeps a prefix of the sorted probabilities (here after temperature 0.8), so the tightest one wins
    q = reference(temperature=0.8, **filters)
    assert set(np.flatnonzero(q > 0).tolist()) == kept
    out = draw(temperature=0.8, **filters)
    assert set(out.tolist()) == kept
    assert_matches(out, q, f"T=0.8 {filters}")


def test_filters_always_keep_the_best_token():
    for kw in (dict(top_p=0.01), dict(min_p=1.0), dict(top_k=1)):
        assert (draw(n=256, **kw) == 1).all()


def test_temperature_half_sharpens():
    cold, warm = draw(temperature=0.5, seed=1), draw(temperature=1.0, seed=2)
    q = reference(temperature=0.5)
    assert np.allclose(q, PROBS ** 2 / (PROBS ** 2).sum())   # softmax(z / 0.5) is p^2, renormalised
    assert_matches(cold, q, "T=0.5")
    assert (cold == 1).mean() > (warm == 1).mean() + 0.08     # 0.39 vs 0.25 expected
    assert (cold == 2).mean() < (warm == 2).mean()


def test_high_temperature_flattens():
    out = draw(temperature=50.0)
    assert_matches(out, reference(temperature=50.0), "T=50")
    assert np.bincount(out, minlength=8).min() > N / 8 * 0.8


def test_draws_vary_with_the_key():
    a, b = draw(seed=10, n=64), draw(seed=11, n=64)
    assert not np.array_equal(a, b)
    assert np.array_equal(a, draw(seed=10, n=64))


# --- Engine.generate on the demo model


@pytest.fixture(scope="module")
def engine():
    return Engine.load("demo", max_context=128)


@pytest.fixture(scope="module")
def greedy(engine):
    out = engine.generate(PROMPT, 20, temperature=0.0, stop_token_ids=[])
    assert len(out) == 20
    return out


def test_greedy_generation_is_argmax_of_the_logits(engine, greedy):
    logits = engine.logits(PROMPT + greedy)[len(PROMPT) - 1:-1]
    assert (logits.argmax(-1) == np.array(greedy)).all()


def test_filters_that_keep_one_token_are_greedy(engine, greedy):
    assert engine.generate(PROMPT, 20, temperature=1.0, seed=5, top_k=1, stop_token_ids=[]) == greedy
    assert engine.generate(PROMPT, 20, temperature=1.5, seed=6, top_p=1e-6, stop_token_ids=[]) == greedy


def test_seeded_request_is_reproducible(engine, greedy):
    a = engine.generate(PROMPT, 20, temperature=1.0, seed=1234, stop_token_ids=[])
    b = engine.generate(PROMPT, 20, temperature=1.0, seed=1234, stop_token_ids=[])
    assert len(a) == 20 and a == b
    assert list(engine.stream(PROMPT, 20, temperature=1.0, seed=1234, stop_token_ids=[])) == a
    assert a != greedy                                      # it really sampled
    big = 2 ** 63 - 1                                       # the high word of the seed is used too
    assert engine.generate(PROMPT, 20, temperature=1.0, seed=big, stop_token_ids=[]) == \
        engine.generate(PROMPT, 20, temperature=1.0, seed=big, stop_token_ids=[])


def test_different_seeds_give_different_sequences(engine):
    runs = {tuple(engine.generate(PROMPT, 20, temperature=1.0, seed=s, stop_token_ids=[])) for s in range(5)}
    assert len(runs) > 1
    # seeds that differ only in the high 32-bit word are different streams as well
    hi = {tuple(engine.generate(PROMPT, 20, temperature=1.0, seed=s << 32, stop_token_ids=[])) for s in (1, 2, 3)}
    assert len(hi) > 1


@pytest.mark.parametrize("kwargs,name", [
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(min_p=2.0), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(seed=-1), "seed"), (dict(seed=2 ** 63), "seed"),
    (dict(seed=1.5), "seed"), (dict(max_tokens=-1), "max_tokens"), (dict(max_tokens=2.0), "max_tokens"),
])
def test_invalid_sampling_args_name_the_parameter(engine, kwargs, name):
    args = dict(max_tokens=4, temperature=1.0)
    args.update(kwargs)
    max_tokens = args.pop("max_tokens")
    with pytest.raises(StrataError) as ei:
        engine.generate(PROMPT, max_tokens, **args)
    assert str(ei.value).startswith(name + " "), str(ei.value)
    bad = kwargs[name]
    assert repr(bad) in str(ei.value) or str(bad) in str(ei.value)


def test_max_tokens_zero_generates_nothing(engine):
    assert engine.generate(PROMPT, 0) == []


def test_stop_token_truncates_right_after_its_first_occurrence(engine, greedy):
    # a token first generated at step k >= 2 (so the cut is neither at the start nor trivially the whole output)
    k = next(i for i in range(2, len(greedy) - 1) if greedy[i] not in greedy[:i])
    stop = greedy[k]
    assert engine.generate(PROMPT, 20, stop_token_ids=[stop]) == greedy[:k + 1]
    # several stop ids: the earliest one generated wins
    assert engine.generate(PROMPT, 20, stop_token_ids=[stop, greedy[1]]) == greedy[:2]
    # a stop id never generated changes nothing
    never = next(t for t in range(engine.cfg.vocab_size) if t not in greedy)
    assert engine.generate(PROMPT, 20, stop_token_ids=[never]) == greedy


def test_default_stop_is_the_eos_ids(engine):
    eos = set(engine.eos_token_ids)
    assert eos                                               # the demo tokenizer / config declares some
    # a one-token prompt from which the random demo model greedily reaches an eos id before the end
    for prompt in ([t] for t in range(64)):
        full = engine.generate(prompt, 24, stop_token_ids=[])
        first = next((i for i, t in enumerate(full) if t in eos), None)
        if first is not None and first < 23:
            break
    else:
        pytest.fail("no one-token prompt among the first 64 reaches an eos id within 23 tokens")
    assert engine.generate(prompt, 24) == full[:first + 1]
