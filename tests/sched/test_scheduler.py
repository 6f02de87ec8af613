"""The scheduler over the demo engine's WindowRunner, without HTTP: continuous batching gives every request exactly
what it gets alone, and what Engine.generate gives. The scheduler's behaviour (admission, parts, cancellation, stops,
lookahead, failures) is tested against a FakeExecutor in test_scheduler_fake.py; these hold it to the real engine."""
from __future__ import annotations

import anyio
import pytest

from strata import Engine
from strata.engine.runner import WindowRunner
from strata.sched.request import Delta, Finished, Request, SamplingParams
from strata.sched.scheduler import Scheduler


@pytest.fixture(scope="module")
def engine():
    return Engine.load("demo", max_context=2048, prefill=64)


def _prompts(engine, n):
    tok = engine.tokenizer
    texts = [f"request {i}: " + "the heron waits by the mill pond. " * (i * 5 + 1) for i in range(n)]
    return [tuple(tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))) for t in texts]


async def _collect(receive):
    text, final = "", None
    async with receive:
        async for ev in receive:
            if isinstance(ev, Delta):
                text += ev.content + ev.reasoning
            else:
                final = ev
    return text, final


def _run(engine, requests, parallel, prefill, concurrent=True, lookahead=True, window_tokens=None, prompt_share=1.0,
         observe: list | None = None):
    """Serve `requests` (all at once, or one after another) -> {id: (text, final event)}; observe: a list that gets
    (plan, whether dispatched ahead) of every window."""
    runner = WindowRunner(engine, parallel, prefill)
    if observe is not None:
        dispatch = runner.dispatch
        runner.dispatch = lambda plan, after=None: observe.append((plan, after is not None)) or dispatch(plan, after)
    sched = Scheduler(runner, tokenizer=engine.tokenizer,
                      eos_token_ids=engine.eos_token_ids, max_context=2048, queue_limit=16, lookahead=lookahead,
                      window_tokens=window_tokens, prompt_share=prompt_share)
    results = {}

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(sched.run)

            async def one(req):
                results[req.id] = await _collect(sched.submit(req))
            if concurrent:
                async with anyio.create_task_group() as inner:
                    for r in requests:
                        inner.start_soon(one, r)
            else:
                for r in requests:
                    await one(r)
            tg.cancel_scope.cancel()
    anyio.run(main)
    return results, sched


def test_concurrent_equals_sequential(engine):
    """Four requests on two slots (queued, then in freed slots), prompts read in parts of 16 beside decode rows,
    greedy and seeded sampling rows: each gets what it gets alone."""
    parallel, prefill = 2, 16
    prompts = _prompts(engine, 4)
    reqs = [Request(id=f"r{i}", prompt_ids=p, max_tokens=12 + 3 * i,
                    sampling=SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=i),
                    stop_token_ids=()) for i, p in enumerate(prompts)]
    together, sched = _run(engine, reqs, parallel, prefill, concurrent=True)
    alone, _ = _run(engine, reqs, parallel, prefill, concurrent=False)
    for r in reqs:
        assert isinstance(together[r.id][1], Finished) and together[r.id][1].reason == "length"
        assert together[r.id][1].completion_tokens == r.max_tokens
        assert together[r.id] [0] == alone[r.id][0], r.id
    assert all(s["state"] == "free" for s in sched.slots())


def test_engine_generate_equals_the_scheduler(engine):
    prompt = _prompts(engine, 1)[0]
    want = engine.generate(list(prompt), 10, stop_token_ids=[])
    got, _ = _run(engine, [Request(id="a", prompt_ids=prompt, max_tokens=10, stop_token_ids=())], 2, 16)
    assert got["a"][0] == engine.tokenizer.decode(want, skip_special_tokens=True)


def test_a_window_budget_changes_no_token(engine):
    """Prompts read beside decoding rows in parts of a window budget of 8 (7 tokens beside one row, padded to 8;
    alone, parts of 64), in every window or paced to a third of the device time (by the measured times, so how many
    parts go beside the rows varies): every request gets what it gets with no budget (parts of 64 beside the rows
    too)."""
    reqs = [Request(id=f"r{i}", prompt_ids=p, max_tokens=(120, 30, 20)[i],
                    sampling=SamplingParams(temperature=0.0 if i != 1 else 0.8, seed=i), stop_token_ids=())
            for i, p in enumerate(_prompts(engine, 3))]
    plain, _ = _run(engine, reqs, 2, 64)
    for share, beside in ((1.0, 20), (0.33, 1)):
        budget, sched = _run(engine, reqs, 2, 64, window_tokens=8, prompt_share=share)
        assert sched.window_part == 8 and sched.metrics()["inter_tokens_beside_parts"] >= beside, share
        assert {k: v[0] for k, v in budget.items()} == {k: v[0] for k, v in plain.items()}, share
        assert all(isinstance(v[1], Finished) and v[1].reason == "length" for v in budget.values())
