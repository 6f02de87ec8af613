"""The scheduler on the demo model, without HTTP: continuous batching gives every request exactly what it gets alone."""
from __future__ import annotations

import logging

import anyio
import pytest

from strata import Engine
from strata.engine.runner import WindowRunner
from strata.sched.request import Delta, Failed, Finished, QueueFull, Request, SamplingParams
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


def _scheduler(engine, parallel, prefill, **kw):
    return Scheduler(WindowRunner(engine, parallel, prefill), tokenizer=engine.tokenizer,
                     eos_token_ids=engine.eos_token_ids, **kw)


def _run(engine, requests, parallel, prefill, concurrent=True, lookahead=True):
    """Serve `requests` (all at once, or one after another) -> {id: (text, final event)}."""
    sched = _scheduler(engine, parallel, prefill, max_context=2048, queue_limit=16, lookahead=lookahead)
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


@pytest.mark.parametrize("parallel,prefill", [(1, 64), (2, 16), (3, 64), (4, 16)])
def test_concurrent_equals_sequential(engine, parallel, prefill):
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


def test_stop_string_ends_the_request_without_showing_it(engine):
    prompt = _prompts(engine, 1)[0]
    full, _ = _run(engine, [Request(id="a", prompt_ids=prompt, max_tokens=24, stop_token_ids=())], 1, 64)
    text = full["a"][0]
    stop = text[5:8]
    assert len(stop) == 3
    cut, _ = _run(engine, [Request(id="a", prompt_ids=prompt, max_tokens=24, stop=(stop,), stop_token_ids=())], 1, 64)
    assert cut["a"][0] == text[:text.find(stop)]
    assert cut["a"][1].reason == "stop"


def test_queue_bound_and_log_lines(engine, caplog):
    caplog.set_level(logging.INFO, logger="strata.sched")
    prompt = _prompts(engine, 3)[2]                   # long enough for several parts of 16
    sched = _scheduler(engine, 1, 16, max_context=2048, queue_limit=1)
    out = {}

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(sched.run)
            a = sched.submit(Request(id="a", prompt_ids=prompt, max_tokens=4, stop_token_ids=()))
            with pytest.raises(QueueFull):
                sched.submit(Request(id="b", prompt_ids=prompt, max_tokens=4))
            out["a"] = await _collect(a)
            tg.cancel_scope.cancel()
    anyio.run(main)
    assert isinstance(out["a"][1], Finished)
    parts = -(-len(prompt) // 16)
    assert any(f"the prompt was read in {parts} parts, the slots decoding" in m for m in caplog.messages)
    assert any(m.startswith(f"strata serve: prompt {len(prompt)} tokens = 0 reused + {len(prompt)} read in ")
               and "4 generated in" in m for m in caplog.messages)


def test_cancel_frees_the_slot_and_ends_the_stream(engine):
    prompt = _prompts(engine, 1)[0]
    sched = _scheduler(engine, 2, 64, max_context=2048, queue_limit=4)
    out = {}

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(sched.run)
            recv = sched.submit(Request(id="a", prompt_ids=prompt, max_tokens=1000, stop_token_ids=()))
            other = sched.submit(Request(id="b", prompt_ids=prompt, max_tokens=8, stop_token_ids=()))
            async with recv:
                async for ev in recv:
                    if isinstance(ev, Delta):
                        sched.cancel("a")
                    elif isinstance(ev, (Finished, Failed)):
                        out["a"] = ev
            out["b"] = await _collect(other)
            out["slots"] = sched.slots()
            tg.cancel_scope.cancel()
    anyio.run(main)
    assert isinstance(out["a"], Failed) and "cancelled" in out["a"].message
    assert isinstance(out["b"][1], Finished) and out["b"][1].completion_tokens == 8
    assert all(s["state"] == "free" for s in out["slots"])


def test_submit_refuses_what_cannot_fit(engine):
    sched = _scheduler(engine, 1, 64, max_context=64, queue_limit=4)
    for prompt, max_tokens in (((), 4), ((1, 2), 0), (tuple(range(60)), 5)):
        with pytest.raises(ValueError, match="must fit max_context 64"):
            sched.submit(Request(id="x", prompt_ids=prompt, max_tokens=max_tokens))
    assert not sched.queue
