"""The engine on the SYCL backend: JAX vs SYCL greedy tokens on the demo model, bfloat16 storage, a PLE table in host RAM, sampling
(statistics against the reference distribution, reproducibility, batch invariance), and two sub-devices of the CPU
device standing in for two cards."""
from __future__ import annotations

import numpy as np
import pytest

from strata import Engine

PROMPT = [5, 70, 101, 33]
GEN = 24


@pytest.fixture(scope="module")
def sycl_engine(sycl_device):
    return Engine.load("demo", backend="sycl", device=sycl_device, max_context=128)


@pytest.fixture(scope="module")
def jax_engine():
    return Engine.load("demo", backend="jax", max_context=128)


@pytest.fixture(scope="module")
def greedy(jax_engine):
    return jax_engine.generate(PROMPT, GEN, stop_token_ids=[])


def test_jax_and_sycl_greedy_tokens_identical(sycl_engine, jax_engine, greedy):
    assert sycl_engine.backend.name == "sycl" and sycl_engine.params["embed"].sycl_queue is sycl_engine.backend.queue
    assert sycl_engine.generate(PROMPT, GEN, stop_token_ids=[]) == greedy
    # a longer prompt read in parts (the blocked expert op, the delta rule over a part) then decode
    prompt = list(range(3, 90))
    assert sycl_engine.generate(prompt, 8, stop_token_ids=[]) == jax_engine.generate(prompt, 8, stop_token_ids=[])
    ours, ref = sycl_engine.logits(prompt), jax_engine.logits(prompt)
    assert np.abs(ours - ref).max() <= 1e-4 * (ref.max() - ref.min())


def test_int8_kv_jax_and_sycl_greedy_tokens_identical(sycl_device):
    """The int8 KV cache (codes + a float32 scale per token and head) on both backends: the same tokens, and logits
    as close as the float32 caches' (the same quantiser; a code can differ by one step at a rounding boundary)."""
    sycl = Engine.load("demo", backend="sycl", device=sycl_device, max_context=128, kv="int8")
    jax_ = Engine.load("demo", backend="jax", max_context=128, kv="int8")
    assert sycl.kv_dtype == jax_.kv_dtype == np.int8
    prompt = list(range(3, 90))
    assert sycl.generate(prompt, 12, stop_token_ids=[]) == jax_.generate(prompt, 12, stop_token_ids=[])
    ours, ref = sycl.logits(prompt), jax_.logits(prompt)
    assert np.abs(ours - ref).max() <= 1e-4 * (ref.max() - ref.min())


@pytest.mark.parametrize("fmt", ["auto", "int8"])
def test_a_ple_table_in_host_ram_gives_the_device_tables_logits(sycl_device, fmt):
    """demo-flash's PLE table gathered on the host (host_call) equals the table on the device, in its own format
    and converted to int8."""
    prompt = [5, 80, 256, 17, 300, 42, 42, 9, 256, 256, 12, 99] * 3
    runs = [Engine.load("demo-flash", backend="sycl", device=sycl_device, max_context=128, ple_table=place,
                        ple_format=fmt) for place in ("device", "host")]
    (a, b), (ta, tb) = ([e.logits(prompt) for e in runs], [e.generate(prompt[:9], 8) for e in runs])
    assert np.isfinite(a).all() and np.array_equal(a, b) and ta == tb


def test_bf16_weights_stored_as_uint16_compute_as_their_fp32_values(sycl_device, sycl_engine, monkeypatch):
    """dtype=bfloat16: weights live as uint16 bits (half the memory) and every op widens them, so the logits are
    those of the fp32 model whose weights are the bfloat16-rounded ones."""
    import ml_dtypes

    from strata.model.forward import forward, init_state
    from strata.sycl_backend import backend
    from strata.sycl_backend.backend import Bf16
    monkeypatch.setattr(backend, "BF16_WIDEN_ELEMENTS", 5000)        # matmuls widen the weights block by block
    e16 = Engine.load("demo", backend="sycl", device=sycl_device, max_context=128, dtype="bfloat16")
    assert isinstance(e16.params["layers"][0]["router"], Bf16)           # projections kept apart on SYCL
    assert e16.params["layers"][0]["router"].bits.dtype == np.uint16
    assert e16.layout.fmt == "bf16"                                   # the experts: bf16 blobs in the slot pool
    ops = e16.backend
    host = ops.to_host(e16.params)
    as32 = _tree(lambda a: a.astype(np.float32) if a.dtype == ml_dtypes.bfloat16 else a, host)
    p32 = ops.to_device(as32)
    tokens = np.array(list(range(3, 40)), np.int32)
    outs = []
    for params in (e16.params, p32):
        state = ops.to_device(init_state(e16.cfg, e16.capacity, np.float32))
        n = np.int32(len(tokens))
        experts = e16.path.traced(e16.layout, e16.path.args(), n)
        logits, _ = forward(ops, e16.cfg, params, state, tokens, np.int32(0), n, experts, all_logits=True)
        outs.append(ops.to_host(logits))
    assert np.abs(outs[0] - outs[1]).max() <= 1e-5 * np.ptp(outs[1])
    # and decode (the gathered expert op and the row kernels read the uint16 bits directly)
    assert e16.generate(PROMPT, 6, stop_token_ids=[]) == e16.generate(PROMPT, 6, stop_token_ids=[])


def _tree(f, t):
    if isinstance(t, dict):
        return {k: _tree(f, v) for k, v in t.items()}
    if isinstance(t, list):
        return [_tree(f, v) for v in t]
    return f(t)


# --- sampling


def test_sampler_matches_the_reference_distribution(ops):
    """The on-device sampler against tests/test_sampling.py's reference and statistical check, one row per key."""
    from test_sampling import LOGITS, assert_matches, reference
    n = 4000
    seeds = np.stack([np.arange(n, dtype=np.uint32), np.full(n, 9, np.uint32)], axis=-1)
    keys = ops.prng_keys(seeds, np.zeros(n, np.int32))
    logits = np.broadcast_to(LOGITS, (n, len(LOGITS)))
    for kw in (dict(), dict(temperature=0.8, top_k=5, top_p=0.7, min_p=0.2), dict(top_p=0.5), dict(min_p=0.45),
               dict(temperature=0.5)):
        t = kw.get("temperature", 1.0)
        out = ops.to_host(ops.sample(logits, np.full(n, t, np.float32), np.full(n, kw.get("top_k", 0), np.int32),
                                     np.full(n, kw.get("top_p", 1.0), np.float32),
                                     np.full(n, kw.get("min_p", 0.0), np.float32), keys))
        assert_matches(out, reference(**kw), f"sycl {kw}")


def test_a_rows_draw_depends_on_its_own_key_only(ops):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((6, 300)).astype(np.float32)
    seeds = rng.integers(0, 2 ** 31, (6, 2)).astype(np.uint32)
    steps = np.arange(6, dtype=np.int32)
    t = np.array([1.0, 0.0, 0.7, 1.5, 1.0, 0.0], np.float32)
    args = (np.zeros(6, np.int32), np.ones(6, np.float32), np.zeros(6, np.float32))
    batch = ops.to_host(ops.sample(logits, t, *args[:1], *args[1:], ops.prng_keys(seeds, steps)))
    for i in range(6):
        one = ops.to_host(ops.sample(logits[i:i + 1], t[i:i + 1], args[0][:1], args[1][:1], args[2][:1],
                                     ops.prng_keys(seeds[i:i + 1], steps[i:i + 1])))
        assert one[0] == batch[i]
    assert batch[1] == logits[1].argmax() and batch[5] == logits[5].argmax()       # temperature 0: greedy


def test_seeded_generation_is_reproducible_and_seeds_differ(sycl_engine, greedy):
    a = sycl_engine.generate(PROMPT, 16, temperature=1.0, seed=1234, stop_token_ids=[])
    assert a == sycl_engine.generate(PROMPT, 16, temperature=1.0, seed=1234, stop_token_ids=[])
    assert a != greedy[:16]
    runs = {tuple(sycl_engine.generate(PROMPT, 8, temperature=1.0, seed=s << 32, stop_token_ids=[]))
            for s in (1, 2, 3)}
    assert len(runs) > 1                                   # the seed's high word matters
    assert sycl_engine.generate(PROMPT, 16, temperature=1.0, seed=5, top_k=1, stop_token_ids=[]) == greedy[:16]


# --- two devices


def test_two_sub_devices_each_with_its_own_queue_give_identical_tokens(sycl_device, greedy):
    """The CPU device split in two (dpctl create_sub_devices) stands in for two cards: each gets its own queue and
    context, runs the demo model to the same greedy tokens, and an array cannot cross to the other unless moved."""
    from strata.sycl_backend import runtime
    n = sycl_device.max_compute_units
    if n < 2:
        pytest.skip(f"{runtime.describe(sycl_device)} has {n} compute unit: nothing to split")
    subs = sycl_device.create_sub_devices(partition=[n // 2, n - n // 2])
    assert len(subs) == 2
    engines = [Engine.load("demo", backend="sycl", device=d, max_context=128) for d in subs]
    q0, q1 = (e.backend.queue for e in engines)
    assert q0 is not q1 and q0.sycl_context != q1.sycl_context
    assert q0 is runtime.queue_for(subs[0]) and q1 is runtime.queue_for(subs[1])        # one queue per device
    assert engines[0].params["lm_head"].sycl_queue is q0 and engines[1].params["lm_head"].sycl_queue is q1
    for e in engines:
        assert e.generate(PROMPT, GEN, stop_token_ids=[]) == greedy
    # cross-device: refused when implicit, done through the host when asked for
    a0 = engines[0].params["norm"]
    with pytest.raises(ValueError, match="another queue"):
        engines[1].backend.rms_norm(a0, engines[1].params["norm"], 1e-6)
    moved = engines[1].backend.to_device(a0)
    assert moved.sycl_queue is q1 and np.array_equal(engines[1].backend.to_host(moved), engines[0].backend.to_host(a0))
