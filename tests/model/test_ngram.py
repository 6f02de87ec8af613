"""PLE n-gram ids (strata/model/ngram.py) against transformers' qwen4_exp.

The spec's constants against transformers' helpers and a constructed Qwen4ExpTextNGramEmbedding (small tables; the
release's multipliers and primes through the helpers, without its 320M-row table). The int64 reference against the
ids that module looks up (a pre-hook on its nn.Embedding), in one call and in parts carried by a DynamicCache. The
32-bit `ngram_ids`, with numpy and jitted with x64 off, against the reference: parts with carried context, resets
(start == 0), padding rows, and tokens over the whole vocabulary.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, Qwen4ExpTextConfig
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

from strata.errors import ConfigError
from strata.ngram import NgramSpec, ngram_ids, ngram_ids_reference, ngram_spec

RELEASE = dict(vocab_size=248320, ngram_size=3, heads_per_ngram=8, vocab_size_base=20_000_000, divisible_by=128,
               seed=1234)
RELEASE_EOS = 248044
NEAR_INT32 = 2**31 - 5000   # a base whose primes make 2r + 1 reach close to 2^32 in the remainder

# (vocab, ngram_size, heads_per_ngram, base, divisible_by, seed, ple_layer_index, eos): small tables for a module
HF_CASES = {
    "small": (1000, 3, 4, 1000, 128, 1234, 0, 999),
    "eos-list-layer2": (1000, 3, 4, 1000, 128, 7, 2, [5, 6]),
    "release-vocab-4gram": (248320, 4, 2, 1000, 64, 1234, 1, RELEASE_EOS),
    "tiny-primes": (50, 3, 3, 2, 1, 0, 0, 0),
}
PART_T = 16    # the jitted parts' static length


def _spec(case) -> NgramSpec:
    vocab, n, hpn, base, div, seed, layer, eos = case
    return ngram_spec(vocab, n, hpn, base, div, seed, layer, eos)


def _hf_module(case):
    """transformers' n-gram embedding for `case` (as PLE layer `layer`, cache layer 0), the ids its table was given
    (appended per call), and its config."""
    vocab, n, hpn, base, div, seed, layer, eos = case
    heads = (n - 1) * hpn
    config = Qwen4ExpTextConfig(
        vocab_size=vocab, hidden_size=2 * heads, ple_embed_dim=2 * heads, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2, hc_lowrank=4,
        layer_types=["linear_attention"], ple_layer_ids=[1], eos_token_id=eos, ngram_size=n, heads_per_ngram=hpn,
        ngram_vocab_size_base=base, make_ngram_vocab_size_divisible_by=div, seed=seed)
    module = hf.Qwen4ExpTextNGramEmbedding(config, config.ple_embed_dim, layer_idx=0, ple_layer_index=layer)
    seen = []
    module.ngram_embedding.register_forward_pre_hook(lambda _m, args: seen.append(args[0].clone()))
    return module, seen, config


def _tokens(rng, spec: NgramSpec, n: int) -> np.ndarray:
    """n tokens over the whole vocabulary, a third of them EOS or at the vocabulary's ends."""
    v = spec.vocab_size
    special = np.array([spec.eos_token_id, 0, v - 1, v - 2, spec.eos_token_id])
    return np.where(rng.random(n) < 0.35, rng.choice(special, n), rng.integers(0, v, n))


@pytest.mark.parametrize("case", HF_CASES.values(), ids=HF_CASES.keys())
def test_spec_matches_transformers_module(case):
    spec = _spec(case)
    module, _, _ = _hf_module(case)
    assert spec.multipliers == tuple(module.layer_multipliers.tolist())
    assert spec.head_sizes == tuple(module.ngram_heads_vocab_sizes.tolist())
    assert spec.head_offsets == tuple(module.ngram_heads_offsets.tolist())
    assert spec.table_rows == module.ngram_embedding.num_embeddings
    assert (spec.heads, spec.context_len, spec.eos_token_id) == (module.ngram_heads, module.context_len,
                                                                 module.eos_token_id)


@pytest.mark.parametrize("layer", [0, 1])
def test_spec_release_values(layer):
    spec = ngram_spec(**RELEASE, ple_layer_index=layer, eos_token_id=RELEASE_EOS)
    v, base = RELEASE["vocab_size"], RELEASE["vocab_size_base"]
    assert spec.multipliers == tuple(hf._build_layer_multipliers(v, 3, layer, RELEASE["seed"]).tolist())
    assert spec.heads == 16 and spec.context_len == 2
    assert spec.head_sizes == tuple(hf._find_nth_prime_after(base - 1, 16 * layer + h + 1) for h in range(16))
    assert spec.head_offsets == tuple(sum(spec.head_sizes[:h]) for h in range(16))
    assert spec.table_rows == math.ceil(sum(spec.head_sizes) / 128) * 128 < 2**31
    assert all((v - 1) * m < 2**63 for m in spec.multipliers) and spec.hash_bits <= 63


def test_spec_primes_near_int32_limit_and_limits():
    for layer in (0, 1):
        spec = ngram_spec(1000, 2, 1, NEAR_INT32, 128, 1234, layer, 3)
        assert spec.head_sizes == (hf._find_nth_prime_after(NEAR_INT32 - 1, layer + 1),)
        assert spec.head_sizes[0] > 2**31 - 5000 and spec.table_rows < 2**31
    with pytest.raises(ConfigError, match="int32"):
        ngram_spec(1000, 2, 2, NEAR_INT32, 128, 1234, 0, 3)      # two such primes: more rows than int32 indexes
    with pytest.raises(ConfigError, match="eos_token_id"):
        ngram_spec(1000, 3, 2, 1000, 128, 1234, 0, 1000)


@pytest.mark.parametrize("case", HF_CASES.values(), ids=HF_CASES.keys())
def test_reference_matches_transformers(case):
    """One call over two sequences with EOS inside, then the same in parts (the first shorter than the context)
    with a DynamicCache carrying the context: each part's ids and the cached context against the reference."""
    spec = _spec(case)
    module, seen, config = _hf_module(case)
    eos, n_ctx = spec.eos_token_id, spec.context_len
    rng = np.random.default_rng(sum(spec.multipliers) % 2**32)
    rows = _tokens(rng, spec, 2 * 48).reshape(2, 48)
    rows[0, :2] = eos                       # a sequence opening with EOS
    rows[:, 7:9] = eos                      # two EOS in a row
    rows[1, 20] = spec.vocab_size - 1
    with torch.no_grad():
        module(torch.from_numpy(rows), cache=None)
    whole = seen[-1].numpy()
    assert whole.shape == (2, 48, spec.heads)
    refs = [ngram_ids_reference(spec, [eos] * n_ctx, row) for row in rows]
    for b, (ids, context) in enumerate(refs):
        np.testing.assert_array_equal(whole[b], ids)
        np.testing.assert_array_equal(context, rows[b, -n_ctx:])

    cache = DynamicCache(config=config)
    contexts = [np.full(n_ctx, eos)] * 2
    bounds = [0, 1, 2, 6, 7, 15, 16, 30, 48]
    for lo, hi in zip(bounds, bounds[1:]):
        with torch.no_grad():
            module(torch.from_numpy(rows[:, lo:hi]), cache=cache)
        for b in range(2):
            ids, contexts[b] = ngram_ids_reference(spec, contexts[b], rows[b, lo:hi])
            np.testing.assert_array_equal(seen[-1][b].numpy(), ids)
            np.testing.assert_array_equal(whole[b, lo:hi], ids)
        np.testing.assert_array_equal(cache.get_conv_state(0, state_idx=2).numpy(), np.stack(contexts))


# the 32-bit path's specs: the release's two PLE layers, small ones, primes from 2 up, primes just under 2^31
DEVICE_SPECS = {
    "release-layer0": ngram_spec(**RELEASE, ple_layer_index=0, eos_token_id=RELEASE_EOS),
    "release-layer1": ngram_spec(**RELEASE, ple_layer_index=1, eos_token_id=RELEASE_EOS),
    "small-4gram": _spec((1000, 4, 2, 1000, 64, 99, 1, 17)),
    "tiny-primes": _spec(HF_CASES["tiny-primes"]),
    "near-int32": ngram_spec(RELEASE["vocab_size"], 2, 1, NEAR_INT32, 128, 1234, 1, 0),
}


@functools.lru_cache(maxsize=None)
def _jitted(spec: NgramSpec):
    return jax.jit(functools.partial(ngram_ids, jnp, spec))


def _run_numpy(spec, context, tokens, start, n_valid):
    ids, context = ngram_ids(np, spec, np.asarray(context, np.int32), np.asarray(tokens, np.int32), np.int32(start),
                             np.int32(n_valid))
    assert ids.dtype == np.int32 and context.dtype == np.int32
    return ids, context


def _run_jax(spec, context, tokens, start, n_valid):
    assert not jax.config.jax_enable_x64
    ids, context = _jitted(spec)(jnp.asarray(context, jnp.int32), jnp.asarray(tokens, jnp.int32), jnp.int32(start),
                                 jnp.int32(n_valid))
    assert ids.dtype == jnp.int32 and context.dtype == jnp.int32
    return np.asarray(ids), np.asarray(context)


RUNS = {"numpy": _run_numpy, "jit": _run_jax}


def _check_stream(run, spec: NgramSpec, parts, rng):
    """Feeds `parts` — (real tokens, new sequence?) — as PART_T-row parts to `run`, padding with tokens outside
    the vocabulary and passing junk as the context of a new sequence; checks every part against the reference."""
    eos, n_ctx = spec.eos_token_id, spec.context_len
    context = ref_context = np.full(n_ctx, eos)
    start = 0
    for real, new_sequence in parts:
        if new_sequence:
            start, ref_context = 0, np.full(n_ctx, eos)
            context = rng.integers(0, spec.vocab_size, n_ctx)          # must be ignored: start == 0
        tokens = np.concatenate([real, rng.choice([-1, spec.vocab_size, 2**31 - 1], PART_T - len(real))])
        ids, context = run(spec, context, tokens, start, len(real))
        ref_ids, ref_context = ngram_ids_reference(spec, ref_context, real)
        np.testing.assert_array_equal(ids[:len(real)], ref_ids)
        np.testing.assert_array_equal(context, ref_context)
        assert ids.shape == (PART_T, spec.heads) and ids.min() >= 0 and ids.max() < spec.table_rows
        start += len(real)


@pytest.mark.parametrize("run", RUNS.values(), ids=RUNS.keys())
@pytest.mark.parametrize("spec", DEVICE_SPECS.values(), ids=DEVICE_SPECS.keys())
def test_ngram_ids_matches_reference(spec, run):
    """Full parts, one-token parts (shorter than the context), empty parts, a reset mid-stream, padding rows."""
    rng = np.random.default_rng(spec.table_rows % 2**32)
    lengths = [(PART_T, True), (1, False), (0, False), (5, False), (PART_T, False), (0, True), (1, False),
               (1, False), (PART_T, False), (3, True), (PART_T, False), (2, False)]
    _check_stream(run, spec, [(_tokens(rng, spec, n), new) for n, new in lengths], rng)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_ngram_ids_property(data):
    spec = data.draw(st.sampled_from(list(DEVICE_SPECS.values())))
    v, eos = spec.vocab_size, spec.eos_token_id
    token = st.one_of(st.sampled_from([eos, 0, v - 1]), st.integers(0, v - 1))
    parts = data.draw(st.lists(st.tuples(st.lists(token, max_size=PART_T), st.booleans()), min_size=1, max_size=6))
    parts = [(np.array(real, np.int64), new or i == 0) for i, (real, new) in enumerate(parts)]
    seed = data.draw(st.integers(0, 2**32 - 1))
    for run in RUNS.values():
        _check_stream(run, spec, parts, np.random.default_rng(seed))
