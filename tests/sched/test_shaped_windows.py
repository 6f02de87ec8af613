"""Shaped windows on the demo model (WindowRunner, on each expert path): rows without features sample bit for bit
what plain windows do; logprobs are the log-softmax of the engine's logits at the sampled token; a +100 bias forces a
token and -100 bans one; penalties match a numpy reference on captured logits; a part's copies (n > 1) continue its
state; chained windows keep the counts on the device; after warm-up nothing compiles."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from strata import Engine
from strata.engine.runner import WindowRunner
from strata.engine.sampling import logprobs_reference, pack_mask, shape_logits_reference
from strata.plan import PromptPart, idle_plan

S = 3
PROMPT = np.array([5, 70, 101, 33, 9, 44, 70, 101], np.int32)


# every expert resident (compiled rows and parts); half of them with window fetch (compiled rows that fetch); half
# of them layer by layer (host rows and parts)
PATHS = {"resident": {}, "window fetch": dict(expert_cache=32), "layer by layer": dict(expert_cache=32,
                                                                                       window_fetch=False)}


@pytest.fixture(scope="module", params=list(PATHS))
def engine(request):
    return Engine.load("demo", max_context=256, prefill=16, say=lambda line: None, **PATHS[request.param])


@pytest.fixture(scope="module")
def runner(engine):
    r = WindowRunner(engine, S, 16)
    r.warm_up()
    return r


def generate(runner, n, features=None, rows=(1,), temperature=None, chained=False):
    """Prompt PROMPT read into rows[0] (copied to the other rows), then n - 1 decode windows: -> ({row: tokens},
    [WindowResult]). features(tokens so far) -> the plan's optional arrays; temperature [S] (default greedy)."""
    features = features or (lambda toks: {})
    temp = np.zeros(S, np.float32) if temperature is None else np.asarray(temperature, np.float32)
    seeds = np.arange(2 * S, dtype=np.uint32).reshape(S, 2) + 7
    base = replace(idle_plan(S), temperature=temp, seeds=seeds)
    part = PromptPart(slot=rows[0], tokens=PROMPT, start=0, last=True, copies=tuple(rows[1:]))
    res = runner.run(replace(base, part=part, **features({})))
    toks = {rows[0]: [res.part_next]}
    for j, c in enumerate(rows[1:]):
        toks[c] = [int(res.copies_next[j])]
    results = [res]
    active = np.zeros(S, bool)
    active[list(rows)] = True
    plan = replace(base, decode_active=active, decode_tokens=np.array([toks.get(i, [0])[-1] for i in range(S)],
                                                                       np.int32),
                   decode_pos=np.where(active, len(PROMPT), 0).astype(np.int32), steps=active.astype(np.int32),
                   **features(toks))
    if chained:            # every window after the first dispatched before its predecessor is read
        w = runner.dispatch(plan)
        for i in range(n - 1):
            nxt = plan.continued()
            w_next = runner.dispatch(nxt, after=w) if i < n - 2 else None
            res = runner.collect(w)
            results.append(res)
            for r in rows:
                toks[r].append(int(res.decode_next[r]))
            w, plan = w_next, nxt
        return toks, results
    for _ in range(n - 1):
        res = runner.run(plan)
        results.append(res)
        for r in rows:
            toks[r].append(int(res.decode_next[r]))
        plan = replace(plan, decode_tokens=np.where(active, res.decode_next, 0).astype(np.int32),
                       decode_pos=np.where(active, plan.decode_pos + 1, 0).astype(np.int32),
                       steps=np.where(active, plan.steps + 1, 0).astype(np.int32), **features(toks))
    return toks, results


def lp_only(row):
    def f(toks):
        lp = np.full(S, -1, np.int32)
        lp[row] = 5
        return {"logprobs": lp}
    return f


@pytest.mark.parametrize("temperature", [None, [0.0, 0.9, 0.0]])
def test_rows_without_features_sample_what_plain_windows_do(runner, temperature):
    plain, _ = generate(runner, 8, rows=(1,), temperature=temperature)
    beside, results = generate(runner, 8, features=lp_only(2), rows=(1, 2), temperature=temperature)
    assert beside[1] == plain[1]
    assert all(r.decode_logprobs is not None for r in results[1:])


@pytest.mark.parametrize("temperature", [None, [0.0, 1.0, 0.0]])
def test_logprobs_are_the_log_softmax_of_the_engines_logits(runner, engine, temperature):
    toks, results = generate(runner, 8, features=lp_only(1), temperature=temperature)
    ref = logprobs_reference(engine.logits(np.concatenate([PROMPT, toks[1][:-1]])))[len(PROMPT) - 1:]
    lps = [results[0].part_logprobs] + [r.decode_logprobs for r in results[1:]]
    for i, (lp, tok) in enumerate(zip(lps, toks[1])):
        row = 0 if i == 0 else 1
        assert lp.sampled[row] == pytest.approx(ref[i, tok], abs=2e-5)
        want = np.argsort(-ref[i], kind="stable")[:20]
        assert set(lp.top_ids[row][:10].tolist()) == set(want[:10].tolist())
        np.testing.assert_allclose(lp.top[row], ref[i, lp.top_ids[row]], atol=2e-5)


def test_a_bias_of_plus_100_forces_a_token_and_minus_100_bans_one(runner):
    plain, _ = generate(runner, 6, rows=(1,))

    def bias(token, value):
        ids, values = np.full((S, 1), -1, np.int32), np.zeros((S, 1), np.float32)
        ids[1], values[1] = token, value
        return lambda toks: {"bias_ids": ids, "bias_values": values}
    forced, _ = generate(runner, 6, features=bias(77, 100.0), rows=(1,), temperature=[0.0, 1.0, 0.0])
    assert forced[1] == [77] * 6
    banned, _ = generate(runner, 6, features=bias(plain[1][0], -100.0), rows=(1,))
    assert plain[1][0] not in banned[1]


def test_penalties_match_a_numpy_reference_on_captured_logits(runner, engine):
    """A +6 bias on token 77 makes the demo repeat it (its text never repeats by itself), so the counts matter."""
    ids, values = np.full((S, 1), -1, np.int32), np.zeros((S, 1), np.float32)
    ids[1], values[1] = 77, 6.0
    pen = np.array([[0, 0, 1], [0.6, 0.9, 1.4], [0, 0, 1]], np.float32)
    biased, _ = generate(runner, 14, features=lambda t: {"bias_ids": ids, "bias_values": values}, rows=(1,))
    toks, _ = generate(runner, 14, features=lambda t: {"penalties": pen, "bias_ids": ids, "bias_values": values},
                       rows=(1,))
    assert biased[1] == [77] * 14 and toks[1].count(77) > 1 and toks[1] != biased[1]
    vocab = engine.cfg.vocab_size
    seen = np.zeros((1, vocab), np.int32)
    seen[0, PROMPT] = 1
    bias = np.zeros((1, vocab), np.float32)
    bias[0, 77] = 6.0
    for i, tok in enumerate(toks[1]):
        captured = engine.logits(np.concatenate([PROMPT, toks[1][:i]]).astype(np.int32))[-1:]
        counts = np.bincount(toks[1][:i], minlength=vocab)[None].astype(np.int32)
        want = shape_logits_reference(captured, pen[1:2], counts, seen, bias, np.ones_like(captured, bool))
        assert tok == int(want.argmax()), f"token {i}"


def test_a_mask_allows_only_its_tokens(runner, engine):
    allowed = np.ones((S, engine.cfg.vocab_size), bool)
    allowed[1] = False
    allowed[1, [40, 41, 300]] = True
    toks, _ = generate(runner, 6, features=lambda t: {"mask": pack_mask(allowed)}, rows=(1,),
                       temperature=[0.0, 1.5, 0.0])
    assert set(toks[1]) <= {40, 41, 300}


def test_copies_continue_the_parts_state(runner):
    single, _ = generate(runner, 6, rows=(0,))
    three, _ = generate(runner, 6, rows=(2, 0, 1))
    assert three[0] == three[1] == three[2] == single[0], "under greedy every choice is the same"
    hot, _ = generate(runner, 6, rows=(2, 0, 1), temperature=[1.5] * S)
    assert len({tuple(t) for t in hot.values()}) > 1, "sampled choices draw with their own seeds"


def test_chained_windows_keep_the_counts_on_the_device(runner):
    if not runner.chains:
        pytest.skip("this path does not chain windows (layer by layer)")
    pen = np.array([[0, 0, 1], [0.6, 0.9, 1.4], [0, 0, 1]], np.float32)
    f = lambda t: {"penalties": pen, "logprobs": np.array([-1, 3, -1], np.int32)}  # noqa: E731
    one_by_one, _ = generate(runner, 10, features=f, rows=(1,))
    chained, results = generate(runner, 10, features=f, rows=(1,), chained=True)
    assert chained == one_by_one
    assert all(r.decode_logprobs is not None for r in results[1:])


def test_shaped_windows_compile_nothing_after_warm_up(runner):
    import jax
    lowered = []

    def listen(name, secs, **kw):
        # (layer by layer, the expert cache's writes of misses compile per count of experts written: not sampling)
        if name.endswith("jaxpr_to_mlir_module_duration") and "pool_write" not in kw.get("fun_name", ""):
            lowered.append(kw.get("fun_name", name))
    pen = np.array([[0, 0, 1], [0.6, 0.9, 1.4], [0, 0, 1]], np.float32)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        generate(runner, 3, features=lambda t: {"penalties": pen}, rows=(1, 2), temperature=[0.0, 0.5, 0.0])
        generate(runner, 3, features=lp_only(0), rows=(0, 1, 2))
        generate(runner, 3, features=lambda t: {"penalties": pen}, rows=(1,), chained=runner.chains)
        if runner.chains:     # a continuing window that a row drops out of and another joins (merge_rows)
            for extra in ({}, {"penalties": pen}):
                plan = replace(idle_plan(S), decode_active=np.array([True, True, False]),
                               decode_tokens=np.array([5, 6, 0], np.int32), **extra)
                w = runner.dispatch(plan)
                w_next = runner.dispatch(replace(plan.continued(), decode_active=np.array([True, False, True]),
                                                 decode_tokens=np.array([-1, 0, 7], np.int32)), after=w)
                runner.collect(w)
                runner.collect(w_next)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert lowered == [], f"compiled under load, after warm-up: {lowered}"
