"""The scheduler and WindowRunner on the SYCL backend: continuous batching gives every request what it gets alone
(greedy and seeded sampling rows), and the scheduler's output equals Engine.generate. Helpers come from
tests/sched/test_scheduler.py."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sched"))

from strata import Engine  # noqa: E402
from strata.engine.runner import WindowRunner  # noqa: E402
from strata.plan import idle_plan
from strata.sched.request import Finished, Request, SamplingParams  # noqa: E402
from test_scheduler import _prompts, _run  # noqa: E402


@pytest.fixture(scope="module")
def engine(sycl_device):
    return Engine.load("demo", backend="sycl", device=sycl_device, max_context=2048, prefill=64)


def test_concurrent_equals_sequential_parallel_2(engine):
    prompts = [p[:150] for p in _prompts(engine, 3)]
    reqs = [Request(id=f"r{i}", prompt_ids=p, max_tokens=8 + 3 * i,
                    sampling=SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=i),
                    stop_token_ids=()) for i, p in enumerate(prompts)]
    together, sched = _run(engine, reqs, 2, 16, concurrent=True)
    alone, _ = _run(engine, reqs, 2, 16, concurrent=False)
    for r in reqs:
        assert isinstance(together[r.id][1], Finished) and together[r.id][1].reason == "length"
        assert together[r.id][1].completion_tokens == r.max_tokens
        assert together[r.id][0] == alone[r.id][0], r.id
    assert all(s["state"] == "free" for s in sched.slots())


def test_scheduler_equals_engine_generate(engine):
    prompt = _prompts(engine, 1)[0]
    want = engine.generate(list(prompt), 10, stop_token_ids=[])
    got, _ = _run(engine, [Request(id="a", prompt_ids=prompt, max_tokens=10, stop_token_ids=())], 2, 16)
    assert got["a"][0] == engine.tokenizer.decode(want, skip_special_tokens=True)


def test_window_runner_decode_rows_keep_the_slot_bank_in_place(engine):
    """Decode rows update each slot's KV and recurrent state in place in the [S, ...] bank (vmap returns the input
    array, no per-window copy), and an inactive row leaves its slot's recurrent state untouched."""
    runner = WindowRunner(engine, 2, 16)
    ops = engine.backend
    from dataclasses import replace

    from strata.plan import PromptPart
    plan = idle_plan(2)
    runner.run(replace(plan, part=PromptPart(slot=0, tokens=np.arange(3, 12, dtype=np.int32), start=0, last=True)))
    bank = [dict(layer) for layer in runner.states]
    ssm_slot1 = [ops.to_host(layer["ssm"][1]) for layer in runner.states if "ssm" in layer]
    step = replace(plan, decode_active=np.array([True, False]), decode_tokens=np.array([7, 0], np.int32),
                   decode_pos=np.array([9, 0], np.int32))
    res = runner.run(step)
    assert res.decode_finite.all()
    for before, after in zip(bank, runner.states):
        for name in ("k", "v", "ssm"):
            if name in before:
                assert after[name] is before[name], name
    assert all(np.array_equal(a, ops.to_host(layer["ssm"][1]))
               for a, layer in zip(ssm_slot1, [layer for layer in runner.states if "ssm" in layer]))


def test_a_window_of_four_rows_costs_the_launches_of_one(engine):
    """The rows mode's point on an eager backend: a decode window's projections, routing and experts run over all
    its rows at once and each state op is one kernel over every row, so 4 rows take the launches 1 row takes. (At
    f64e597 the window's active mask reached the ops as a device array, which sent attention and the delta rule down
    the per-row composition: 210 launches for 1 row, 646 for 4, where 60 are needed.)"""
    from dataclasses import replace
    ops = engine.backend
    counts = {}
    for s in (1, 4):
        runner = WindowRunner(engine, s, 16)
        plan = replace(idle_plan(s), decode_active=np.ones(s, bool), decode_tokens=np.full(s, 7, np.int32),
                       decode_pos=np.arange(8, 8 + s, dtype=np.int32))
        runner.run(plan)                                                   # first use: kernels built, constants
        with ops.count_launches() as c:
            runner.run(replace(plan, decode_pos=plan.decode_pos + 1))
        counts[s] = c.device_launches
    layers = len(engine.cfg.layer_types)
    assert counts[4] == counts[1], counts
    assert counts[1] <= 16 * layers + 8, f"{counts[1]} launches for a window of {layers} layers"


def test_a_parked_kv_loads_back_into_another_slot_exactly(engine):
    """save_kv / load_kv (parking a conversation) on the SYCL backend: a large block (the whole 2112-row cache) does
    not fit in n, so blocks of 256 copy the first n rows, and they land in the other slot as they were."""
    from dataclasses import replace
    from strata.plan import PromptPart
    r = WindowRunner(engine, 2, 64)
    assert r.copies.sizes == (2112, 256) and engine.capacity == 2112
    toks = (np.arange(2048) * 37 % 600).astype(np.int32)
    for start in range(0, len(toks), 64):
        r.run(replace(idle_plan(2), part=PromptPart(slot=0, tokens=toks[start:start + 64], start=start, last=True)))
    for n in (300, 2000):
        saved = r.save_kv(0, n)
        assert [a for a, _ in saved.data] == list(range(0, n, 256))
        r.load_kv(1, saved)
        for layer in (layer for layer in r.states if "k" in layer):
            for k, v in layer.items():
                a = np.asarray(engine.backend.to_host(v))
                assert np.array_equal(a[1, :n], a[0, :n]), (n, k)
