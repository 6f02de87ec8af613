"""The scheduler's behaviour against a FakeExecutor (tests/sched/fake_executor.py), in milliseconds: admission and
slot states, prompts read in parts beside decode rows, cancellation, stop strings and tokens, lengths, lookahead,
the queue bound, failure isolation, and that every request ends with exactly one Finished or Failed event. Expected
tokens come from the fake's formula (next_token); each id decodes to one printable character (text_of)."""
from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import replace

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from fake_executor import FakeExecutor, expected_tokens, text_of

from strata.demo_tokenizer import write_demo_tokenizer
from strata.sched.request import Delta, Failed, Finished, QueueFull, Request
from strata.sched.scheduler import Scheduler
from strata.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo_tokenizer")
    write_demo_tokenizer(d)
    return Tokenizer.from_dir(d)


def P(text: str) -> tuple[int, ...]:
    """A prompt of byte tokens (the demo tokenizer's ids 0..255 are the bytes)."""
    return tuple(text.encode())


def req(id, prompt, max_tokens, **kw) -> Request:
    return Request(id=id, prompt_ids=prompt, max_tokens=max_tokens, **kw)


def sched_over(fake, tokenizer, **kw) -> Scheduler:
    kw.setdefault("eos_token_ids", tokenizer.eos_token_ids)      # 256, 258: never sampled by the fake
    kw.setdefault("queue_limit", 16)
    return Scheduler(fake, tokenizer=tokenizer, **kw)


def ended(events) -> tuple[str, Finished | Failed]:
    """(streamed text, final event): exactly one Finished or Failed, and it came last."""
    finals = [i for i, e in enumerate(events) if isinstance(e, (Finished, Failed))]
    assert finals == [len(events) - 1], events
    assert all(isinstance(e, Delta) for e in events[:-1]), events
    return "".join(e.content + e.reasoning for e in events[:-1]), events[-1]


async def drain(receive, events: list, on_event=None) -> None:
    """Read a request's stream until the scheduler closes it."""
    async with receive:
        async for ev in receive:
            events.append(ev)
            if on_event is not None:
                on_event(ev)


def serve(sched, requests, on_event=None) -> dict:
    """Submit `requests` before the scheduler starts (so its windows are deterministic) and run it until every stream
    was closed -> {id: (text, final)}. on_event(id, event) is called as events arrive."""
    events = {r.id: [] for r in requests}

    async def main():
        with anyio.fail_after(10):
            streams = {r.id: sched.submit(r) for r in requests}
            async with anyio.create_task_group() as tg:
                await tg.start(sched.run)
                async with anyio.create_task_group() as clients:
                    for rid, stream in streams.items():
                        hook = None if on_event is None else (lambda ev, rid=rid: on_event(rid, ev))
                        clients.start_soon(drain, stream, events[rid], hook)
                tg.cancel_scope.cancel()
    anyio.run(main)
    return {rid: ended(evs) for rid, evs in events.items()}


def finished(text_tokens, reason, prompt, n) -> tuple:
    return text_of(text_tokens), ("Finished", reason, len(prompt), n)


def summary(outcome) -> tuple:
    text, final = outcome
    if isinstance(final, Finished):
        return text, ("Finished", final.reason, final.prompt_tokens, final.completion_tokens)
    return text, ("Failed", final.status, final.message)


def read_prompts(fake) -> list[tuple]:
    """The prompts the fake read, in the order they were started (a part at 0 starts one; the rest continue it)."""
    prompts, reading = [], {}
    for w in fake.windows:
        p = w.plan.part
        if p is not None:
            if p.start == 0:
                reading[p.slot] = len(prompts)
                prompts.append(())
            prompts[reading[p.slot]] += tuple(p.tokens.tolist())
    return prompts


def slot(id, state="free", request=None, prompt=0, read=0, generated=0) -> dict:
    return {"id": id, "state": state, "request": request, "prompt_tokens": prompt, "read": read,
            "generated": generated, "numerics": "default", "attempts": 0, "poisoned": False}


def slot_states(sched) -> list[dict]:
    """/slots without the prompt cache's fields (tests/sched/test_prompt_cache_fake.py checks those)."""
    return [{k: s[k] for k in slot(0)} for s in sched.slots()]


def test_admission_order_slot_states_and_windows(tokenizer):
    """Two slots, three requests: the first two are admitted in order, the earliest-admitted reading slot gets the
    part, a slot generates from its prompt's last part on, and the third request takes the first slot freed."""
    a, b, c = P("herons"), P("owl"), P("ox")
    seen = []
    fake = FakeExecutor(slots=2, part_size=4, chains=False, observe=lambda i, plan: seen.append(slot_states(sched)))
    sched = sched_over(fake, tokenizer)
    out = serve(sched, [req("A", a, 3), req("B", b, 2), req("C", c, 2)])
    ea, eb, ec = expected_tokens(a, 3), expected_tokens(b, 2), expected_tokens(c, 2)
    assert summary(out["A"]) == finished(ea, "length", a, 3)
    assert summary(out["B"]) == finished(eb, "length", b, 2)
    assert summary(out["C"]) == finished(ec, "length", c, 2)
    assert seen == [
        [slot(0, "reading", "A", 6), slot(1, "reading", "B", 3)],                                   # A's part 1
        [slot(0, "reading", "A", 6, read=4), slot(1, "reading", "B", 3)],                           # A's part 2
        [slot(0, "generating", "A", 6, 6, 1), slot(1, "reading", "B", 3)],                          # A + B's part
        [slot(0, "generating", "A", 6, 6, 2), slot(1, "generating", "B", 3, 3, 1)],                 # A + B
        [slot(0, "reading", "C", 2), slot(1)],                                                      # C's part
        [slot(0, "generating", "C", 2, 2, 1), slot(1)],                                             # C
    ]
    parts = [(w.plan.part.slot, w.plan.part.tokens.tolist(), w.plan.part.start, w.plan.part.last)
             if w.plan.part else None for w in fake.windows]
    assert parts == [(0, list(a[:4]), 0, False), (0, list(a[4:]), 4, True), (1, list(b), 0, True), None,
                     (0, list(c), 0, True), None]
    rows = [{int(s): (int(w.tokens[s]), int(w.plan.decode_pos[s])) for s in np.flatnonzero(w.plan.decode_active)}
            for w in fake.windows]
    assert rows == [{}, {}, {0: (ea[0], 6)}, {0: (ea[1], 7), 1: (eb[0], 3)}, {}, {0: (ec[0], 2)}]
    assert slot_states(sched) == [slot(0), slot(1)] and not sched.queue


def test_a_long_prompt_is_read_in_parts_while_the_others_decode(tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="strata.sched")
    a, b = P("hi"), P("heron waits")                     # B: 11 tokens, parts of 4, 4 and 3
    fake = FakeExecutor(slots=2, part_size=4)
    sched = sched_over(fake, tokenizer)
    out = serve(sched, [req("A", a, 8), req("B", b, 2)])
    assert summary(out["A"]) == finished(expected_tokens(a, 8), "length", a, 8)
    assert summary(out["B"]) == finished(expected_tokens(b, 2), "length", b, 2)
    w = fake.windows
    assert [x.plan.part.slot if x.plan.part else None for x in w[:4]] == [0, 1, 1, 1]
    assert [(x.plan.part.start, len(x.plan.part.tokens)) for x in w[1:4]] == [(0, 4), (4, 4), (8, 3)]
    assert all(x.plan.decode_active.tolist() == [True, False] for x in w[1:4])   # A decodes beside each part
    assert [x.plan.decode_pos[0] for x in w[1:4]] == [2, 3, 4]
    assert all(x.plan.part is None for x in w[4:])
    assert sum(m.startswith("strata batch: the prompt was read in 3 parts, the slots decoding ")
               for m in caplog.messages) == 1
    for n, p in ((8, a), (2, b)):
        assert any(m.startswith(f"strata serve: prompt {len(p)} tokens = 0 reused + {len(p)} read in ")
                   and f", {n} generated in " in m for m in caplog.messages), caplog.messages


def test_stop_strings_end_the_request_without_showing_any_of_it(tokenizer):
    prompt = P("the mill pond")
    want = text_of(expected_tokens(prompt, 30))
    stop = want[10:13]
    at = want.find(stop)
    never = "\x7f"                                     # the fake samples 32..126 only
    fake = FakeExecutor()
    out = serve(sched_over(fake, tokenizer), [
        req("cut", prompt, 30, stop=(stop,)),
        req("held", prompt, 30, stop=(want[-1] + never,)),   # its last character is held back, then flushed
        req("none", prompt, 30, stop=(never,))])
    assert summary(out["cut"]) == (want[:at], ("Finished", "stop", len(prompt), at + len(stop)))
    assert summary(out["held"]) == (want, ("Finished", "length", len(prompt), 30))
    assert summary(out["none"]) == (want, ("Finished", "length", len(prompt), 30))


def test_stop_tokens_the_requests_own_or_the_models(tokenizer):
    prompt = P("a kettle")
    ids = expected_tokens(prompt, 20)
    k = next(i for i in range(3, 20) if ids[i] not in ids[:i])
    out = serve(sched_over(FakeExecutor(slots=3), tokenizer, eos_token_ids=(ids[k],)), [
        req("own", prompt, 20, stop_token_ids=(ids[k], 1000)),
        req("model's", prompt, 20),                        # None: the scheduler's eos_token_ids
        req("none", prompt, 20, stop_token_ids=())])
    stopped = (text_of(ids[:k]), ("Finished", "stop", len(prompt), k + 1))   # the stop token shows no text
    assert summary(out["own"]) == stopped and summary(out["model's"]) == stopped
    assert summary(out["none"]) == finished(ids, "length", prompt, 20)


def test_lengths_and_what_cannot_fit(tokenizer):
    fake = FakeExecutor(slots=1, max_context=64)
    assert sched_over(fake, tokenizer).max_context == 64
    with pytest.raises(ValueError, match="max_context 65 exceeds the executor's 64"):
        sched_over(fake, tokenizer, max_context=65)
    sched = sched_over(fake, tokenizer, max_context=20)
    for prompt, max_tokens in (((), 4), ((1, 2), 0), (tuple(range(40, 52)), 9)):
        with pytest.raises(ValueError, match="must fit max_context 20"):
            sched.submit(req("x", prompt, max_tokens))
    assert not sched.queue
    prompt = tuple(range(40, 52))                     # 12 + 8 = max_context: it ends by length at both at once
    out = serve(sched, [req("full", prompt, 8), req("one", prompt, 1)])
    assert summary(out["full"]) == finished(expected_tokens(prompt, 8), "length", prompt, 8)
    assert summary(out["one"]) == finished(expected_tokens(prompt, 1), "length", prompt, 1)


def test_a_request_whose_images_the_executor_cannot_read_ends_with_a_400_and_the_next_is_served(tokenizer):
    """Executor.prompt_rows refuses it at admission (here: a model without images): a Failed 400 naming why, its slot
    never taken; the request behind it runs."""
    fake = FakeExecutor(slots=1)
    prompt = P("look")
    out = serve(sched_over(fake, tokenizer), [req("img", prompt, 4, images=("an image",)), req("text", prompt, 4)])
    assert summary(out["img"]) == ("", ("Failed", 400, "this fake executor's model takes no images"))
    assert out["img"][1].code == "invalid_image"
    assert summary(out["text"]) == finished(expected_tokens(prompt, 4), "length", prompt, 4)
    assert [w.plan.part.slot for w in fake.windows if w.plan.part is not None] == [0]


def _lookahead_case(tokenizer, lookahead, chains=True, **fake_kw):
    a, b = P("go on"), P("and on")
    ids_a = expected_tokens(a, 30)
    k = next(i for i in range(4, 30) if ids_a[i] not in ids_a[:i])
    fake = FakeExecutor(slots=2, chains=chains, **fake_kw)
    sched = sched_over(fake, tokenizer, lookahead=lookahead)
    out = serve(sched, [req("A", a, 30, stop_token_ids=(ids_a[k],)), req("B", b, 14, stop_token_ids=())])
    return out, fake, sched, (a, ids_a, k, b)


def test_lookahead_dispatches_ahead_and_changes_nothing_a_client_sees(tokenizer):
    """Steady decoding dispatches each window before the last one is read; A ends on a stop token that the window
    already dispatched after it feeds on: that row's token is computed and dropped, never sent."""
    on, fake, sched, (a, ids_a, k, b) = _lookahead_case(tokenizer, True)
    off, fake_off, sched_off, _ = _lookahead_case(tokenizer, False)
    assert {r: summary(x) for r, x in on.items()} == {r: summary(x) for r, x in off.items()}
    assert summary(on["A"]) == (text_of(ids_a[:k]), ("Finished", "stop", len(a), k + 1))
    assert summary(on["B"]) == finished(expected_tokens(b, 14), "length", b, 14)
    ahead = [w for w in fake.windows if w.ahead]
    assert ahead and sched.stats["windows_ahead"] == len(ahead) and sched_off.stats["windows_ahead"] == 0
    assert not any(w.ahead for w in fake_off.windows)
    stop_pos = len(a) + k                                          # where A's stop token is fed
    beyond = [w for w in fake.windows if w.plan.decode_active[0] and w.plan.decode_pos[0] == stop_pos]
    # computed one further (no more), and dropped: A's text above ends before the stop token
    assert len(beyond) == 1 and beyond[0].ahead and beyond[0].tokens[0] == ids_a[k]
    assert max(w.plan.decode_pos[0] for w in fake.windows if w.plan.decode_active[0]) == stop_pos
    assert not any(w.plan.decode_active[0] and w.plan.decode_pos[0] == stop_pos for w in fake_off.windows)
    assert all(s["state"] == "free" for s in sched.slots())


def test_lookahead_needs_an_executor_that_chains_and_survives_a_refused_dispatch(tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="strata.sched")
    off, *_ = _lookahead_case(tokenizer, False)
    flat, fake, sched, _ = _lookahead_case(tokenizer, True, chains=False)
    assert not sched.lookahead and sched.stats["windows_ahead"] == 0 and not any(w.ahead for w in fake.windows)
    refused, fake, sched, _ = _lookahead_case(tokenizer, True, refuse_ahead=[RuntimeError("no room")])
    assert any(m == "strata batch: a window could not be dispatched ahead (RuntimeError: no room); the next one is "
                    "planned after this one's tokens" for m in caplog.messages)
    assert sched.stats["windows_ahead"] > 0
    for out in (flat, refused):
        assert {r: summary(x) for r, x in out.items()} == {r: summary(x) for r, x in off.items()}


def test_a_layer_split_pipelines_decode_windows_between_two_groups_of_slots(tokenizer):
    """An executor of two stages (a layer split): once no prompt is being read, decode windows alternate between two
    groups of the generating slots, and each is dispatched before the last one is read without waiting on it (no
    after=: every token it feeds is known), so the first stage can run it while the last stage runs the one before.
    A single generating slot chains as usual. What clients see is what an unsplit executor gives."""
    def requests():
        return [req(x, P(p), 12, stop_token_ids=()) for x, p in (("A", "go on"), ("B", "and on"), ("C", "on on"))]
    piped = FakeExecutor(slots=3, stages=2)
    sched = sched_over(piped, tokenizer)
    out = serve(sched, requests())
    plain = serve(sched_over(FakeExecutor(slots=3), tokenizer), requests())
    assert {r: summary(x) for r, x in out.items()} == {r: summary(x) for r, x in plain.items()}
    decode = [w for w in piped.windows if w.plan.part is None]
    steady = [w for w in decode if w.plan.n_decode < 3]
    assert len(steady) >= 12 and not any(w.plan.decode_active.all() for w in decode)
    pairs = list(zip(decode, decode[1:]))
    disjoint = [a for a, b in pairs if not (a.plan.decode_active & b.plan.decode_active).any()]
    assert len(disjoint) >= 10 and sched.stats["windows_pipelined"] >= 10
    # pipelined windows are not chained to the window before (the fake records after= as ahead); only the last
    # slot left generating chains
    chained = [w for w in piped.windows if w.ahead]
    assert all(w.plan.n_decode == 1 for w in chained)
    assert sched.pipelined and not sched_over(FakeExecutor(slots=3), tokenizer).pipelined
    assert not sched_over(FakeExecutor(slots=3, stages=2), tokenizer, lookahead=False).pipelined


def test_cancelling_queued_and_running_requests(tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="strata.sched")
    a, b, c = P("first"), P("second"), P("third")
    fake = FakeExecutor(slots=2)
    sched = sched_over(fake, tokenizer)
    d = P("fourth")
    streams, events, asked = {}, {"A": [], "B": [], "C": [], "D": []}, []

    def on_event(rid, ev):
        if rid == "A" and isinstance(ev, Delta) and not asked:
            asked.append(True)
            sched.cancel("A")                                   # running: cancelled at its first text
            sched.cancel("D")                                   # queued behind B until A's slot is free

    async def main():
        with anyio.fail_after(10):
            for r in (req("A", a, 200), req("B", b, 40), req("C", c, 5), req("D", d, 5)):
                streams[r.id] = sched.submit(r)
            sched.cancel("C")                                   # queued behind A and B, before anything ran
            async with anyio.create_task_group() as tg:
                await tg.start(sched.run)
                async with anyio.create_task_group() as clients:
                    for rid, s in streams.items():
                        clients.start_soon(drain, s, events[rid], lambda ev, rid=rid: on_event(rid, ev))
                tg.cancel_scope.cancel()
    anyio.run(main)
    cancelled = ("Failed", 499, "cancelled by the client")
    assert summary(ended(events["C"])) == ("", cancelled)
    assert summary(ended(events["D"])) == ("", cancelled)
    text_a, final_a = summary(ended(events["A"]))
    assert final_a == cancelled and text_of(expected_tokens(a, 200)).startswith(text_a) and text_a
    assert summary(ended(events["B"])) == finished(expected_tokens(b, 40), "length", b, 40)
    assert read_prompts(fake) == [a, b]                          # neither C nor D was ever read
    assert sum(bool(w.plan.decode_active[0]) for w in fake.windows) < 50   # A stopped long before 200 tokens
    assert "strata serve: request A cancelled by its client; slot 0 is free" in caplog.messages
    assert all(s["state"] == "free" for s in sched.slots()) and not sched.queue


def test_the_queue_bound(tokenizer):
    a, b, c = P("one"), P("two"), P("three")
    fake = FakeExecutor(slots=1)
    sched = sched_over(fake, tokenizer, queue_limit=1)
    events = {"A": [], "B": []}
    refused = []

    async def main():
        with anyio.fail_after(10):
            first = sched.submit(req("A", a, 6))
            with pytest.raises(QueueFull, match="the server is busy: 1 requests are waiting") as e:
                sched.submit(req("B", b, 6))
            refused.append(e.value.depth)
            async with anyio.create_task_group() as tg:
                await tg.start(sched.run)
                async with anyio.create_task_group() as clients:
                    clients.start_soon(drain, first, events["A"])
                    while not events["A"]:                     # A admitted: the queue has room again
                        await anyio.lowlevel.checkpoint()
                    clients.start_soon(drain, sched.submit(req("B", b, 6)), events["B"])
                    with pytest.raises(QueueFull):              # B waits for A's slot: the queue is full again
                        sched.submit(req("C", c, 6))
                tg.cancel_scope.cancel()
    anyio.run(main)
    assert refused == [1]
    assert summary(ended(events["A"])) == finished(expected_tokens(a, 6), "length", a, 6)
    assert summary(ended(events["B"])) == finished(expected_tokens(b, 6), "length", b, 6)


def test_a_window_that_raises_fails_only_its_requests(tokenizer, caplog):
    """Three slots: window 1 holds A's decode row and B's first part; C (reading, not in it) and D (queued) finish
    as if nothing happened, in the slots A and B freed."""
    caplog.set_level(logging.INFO, logger="strata.sched")
    a, b, c, d = P("hi"), P("herons"), P("owl"), P("ox")
    fake = FakeExecutor(slots=3, part_size=4, raise_at={1: RuntimeError("device lost")})
    sched = sched_over(fake, tokenizer)
    out = serve(sched, [req("A", a, 6), req("B", b, 3), req("C", c, 2), req("D", d, 2)])
    failed = ("Failed", 500, "the engine failed in a window: RuntimeError: device lost")
    assert summary(out["A"]) == (text_of(expected_tokens(a, 1)), failed)     # its first token, from window 0
    assert summary(out["B"]) == ("", failed)
    assert summary(out["C"]) == finished(expected_tokens(c, 2), "length", c, 2)
    assert summary(out["D"]) == finished(expected_tokens(d, 2), "length", d, 2)
    assert fake.windows[1].plan.decode_active.tolist() == [True, False, False] and fake.windows[1].plan.part.slot == 1
    assert fake.windows[2].plan.part.slot == 2 and fake.windows[3].plan.part.slot == 0    # C, then D in A's slot
    assert "strata batch: a window failed (RuntimeError: device lost); ending its 2 requests" in caplog.messages
    assert sched.stats["requests_failed"] == 2 and sched.stats["requests_finished"] == 2


def test_a_non_finite_row_fails_only_its_request_naming_the_position(tokenizer):
    """Rows non-finite on every numerics path: each request is retried once on the guard's first rung, then ends with
    the explicit error naming the position and the attempts; the steady request beside them is untouched."""
    a, b, c = P("steady"), P("flaky"), P("a long prompt")
    bad = len(b) + 2                                  # B's third decode row
    fake = FakeExecutor(slots=3, part_size=4, nonfinite={(1, bad), (2, 5)})   # and C's second part (4..7)
    out = serve(sched_over(fake, tokenizer), [req("A", a, 12), req("B", b, 12), req("C", c, 12)])
    assert summary(out["A"]) == finished(expected_tokens(a, 12), "length", a, 12)
    assert summary(out["B"]) == (text_of(expected_tokens(b, 3)),                  # the row emits nothing
                                 ("Failed", 500, f"non-finite logits at position {bad} again at the same position "
                                                 f"after 2 attempts (default, reference_ops); resending the same "
                                                 f"request is likely to fail the same way"))
    assert summary(out["C"])[1][2].startswith("non-finite logits at position 7 again at the same position")


def test_every_request_ends_once_when_the_scheduler_stops(tokenizer):
    """Stopping the scheduler ends the running and the queued requests with one Failed each, and closes them."""
    fake = FakeExecutor(slots=1)
    sched = sched_over(fake, tokenizer)
    events = {"A": [], "B": []}

    async def main():
        with anyio.fail_after(10):
            streams = {"A": sched.submit(req("A", P("long"), 200)), "B": sched.submit(req("B", P("wait"), 5))}
            async with anyio.create_task_group() as clients:
                for rid, s in streams.items():
                    clients.start_soon(drain, s, events[rid])
                async with anyio.create_task_group() as tg:
                    await tg.start(sched.run)
                    while len(events["A"]) < 3:
                        await anyio.lowlevel.checkpoint()
                    tg.cancel_scope.cancel()
    anyio.run(main)
    stopping = ("Failed", 503, "the server is shutting down")
    text_a, final_a = summary(ended(events["A"]))
    assert final_a == stopping and text_of(expected_tokens(P("long"), 200)).startswith(text_a)
    assert summary(ended(events["B"])) == ("", stopping)


def test_warm_up_and_metrics_come_from_the_executor(tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="strata.sched")
    fake = FakeExecutor(slots=3, part_size=8)
    sched = sched_over(fake, tokenizer)
    serve(sched, [req("A", P("count"), 5)])
    assert fake.warmed == 1
    assert "strata batch: 3 slots, prompt parts of up to 8 tokens, compiled at warm-up in 0 ms" in caplog.messages
    bucketed = FakeExecutor(slots=3, part_size=8)
    bucketed.capacity = replace(bucketed.capacity, row_buckets=(1, 2))
    serve(sched_over(bucketed, tokenizer), [])
    assert ("strata batch: 3 slots, prompt parts of up to 8 tokens, decode windows of 1, 2 or 3 rows, compiled at "
            "warm-up in 0 ms") in caplog.messages
    m = sched.metrics()
    assert m["fake_windows"] == len(fake.windows) and m["windows"] == len(fake.collected)
    assert m["generated_tokens"] == 5 and m["prompt_tokens"] == 5 and m["requests_finished"] == 1


def test_without_warm_up_the_scheduler_serves_at_once_and_says_so(tokenizer, caplog):
    """warm_up off (tests, development): the executor's warm-up is never called, the requests are served all the
    same, and the start-up line says that shapes compile when first used."""
    caplog.set_level(logging.INFO, logger="strata.sched")
    fake = FakeExecutor(slots=2, part_size=8)
    out = serve(sched_over(fake, tokenizer, warm_up=False), [req("A", P("count"), 5)])
    assert fake.warmed == 0
    assert summary(out["A"]) == finished(expected_tokens(P("count"), 5), "length", P("count"), 5)
    assert ("strata batch: 2 slots, prompt parts of up to 8 tokens, no warm-up (warm_up off): each window shape "
            "compiles when first used") in caplog.messages


def test_the_scheduler_imports_nothing_below_the_plan():
    """strata/sched plans against the Executor protocol: importing it loads no engine, model code or backend."""
    code = ("import sys, strata.sched.scheduler; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('jax', 'dpnp', 'dpctl') or m.startswith(('strata.engine', 'strata.model', 'strata.jax_backend', "
            "'strata.sycl_backend', 'strata.experts'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
