"""Window fetch through the WindowRunner, as the server runs it: decode windows over a partial cache are one compiled
function that copies its misses from pinned host chunks, interleaved with prompt parts that borrow cache slots and
with the cache's swaps between windows. The tokens equal those of the all-resident runner, and after warm-up nothing
is compiled (ARCHITECTURE.md, "Bounded shapes": compilations happen at warm-up, not under load)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lowerings import lowered
from strata import Engine
from strata.engine.runner import WindowRunner
from strata.plan import idle_plan
from strata.plan import PromptPart
from strata.experts.path import PathKind

SLOTS, PART = 2, 16


def _drive(runner: WindowRunner, vocab: int) -> list[np.ndarray]:
    """Prompt parts on both slots (the second slot's prompt read in several parts while the first decodes), then
    decode windows; -> the tokens every window produced."""
    rng = np.random.default_rng(0)
    base = idle_plan(SLOTS)
    pos = np.zeros(SLOTS, np.int32)
    nxt = np.zeros(SLOTS, np.int32)
    out = []
    r = runner.run(replace(base, part=PromptPart(slot=0, tokens=rng.integers(0, vocab, PART).astype(np.int32),
                                                 start=0, last=True)))
    pos[0], nxt[0] = PART, r.part_next
    for i in range(8):
        part = None
        if i < 3:                    # slot 1's prompt, 3 parts of 5 tokens, beside slot 0's decoding
            part = PromptPart(slot=1, tokens=rng.integers(0, vocab, 5).astype(np.int32), start=int(pos[1]),
                              last=i == 2)
        active = np.array([True, i >= 3])
        r = runner.run(replace(base, decode_active=active, decode_tokens=nxt, decode_pos=pos, part=part))
        out.append(np.where(active, r.decode_next, -1))
        nxt = np.where(active, r.decode_next, nxt).astype(np.int32)
        pos = pos + active
        if part is not None:
            pos[1] += len(part.tokens)
            if part.last:
                nxt[1] = r.part_next
                out.append(np.array([r.part_next]))
    return out


@pytest.mark.parametrize("stream_parts", [True, False])
def test_runner_tokens_equal_all_resident_and_nothing_compiles_under_load(stream_parts):
    """Prompt parts stream whole layers (stream_parts), or borrow slots for their misses: the same tokens."""
    ref = Engine.load("demo", max_context=256, prefill=PART, say=lambda line: None)
    e = Engine.load("demo", max_context=256, prefill=PART, expert_cache=8, debug_slots=True,
                    stream_parts=stream_parts, say=lambda line: None)
    assert ref.path.kind is PathKind.RESIDENT and e.path.kind is PathKind.WINDOW_FETCH
    assert e.path.streams_parts is stream_parts
    want = _drive(WindowRunner(ref, SLOTS, PART), ref.cfg.vocab_size)

    runner = WindowRunner(e, SLOTS, PART)
    runner.warm_up()
    with lowered() as compiled:
        got = _drive(runner, e.cfg.vocab_size)
    assert compiled == [], f"{len(compiled)} functions were compiled under load, after warm-up"
    assert all(np.array_equal(a, b) for a, b in zip(got, want)) and len(got) == len(want), "tokens differ"
    e.experts.moe.settle()
    st = e.experts.cache.stats
    assert st.window_copies > 0, st.as_dict()
    # every part's routes outnumber the demo's experts: streamed, the cache lends no slot; else parts borrow
    assert (st.streamed_layers > 0 and st.loans == 0) if stream_parts else (st.loans > 0 and st.streamed_layers == 0)
    assert e.experts.moe.uses_checked > 0 and e.experts.cache.verify() == []


def test_between_window_work_runs_in_the_next_run_after_its_decode_is_dispatched():
    """Slots a prompt part borrowed come back FREE and stay so until the next run, whose decode window is dispatched
    first (with the table as it was: those slots out of it) and whose host work between windows (refill, swaps)
    then overlaps it on the device; afterwards the slots are refilled and every slot still holds what it claims.
    (Parts borrow slots when they do not stream whole layers.)"""
    e = Engine.load("demo", max_context=256, prefill=PART, expert_cache=8, debug_slots=True, stream_parts=False,
                    say=lambda line: None)
    runner = WindowRunner(e, SLOTS, PART)
    base = idle_plan(SLOTS)
    tokens = np.arange(PART, dtype=np.int32) % e.cfg.vocab_size
    r = runner.run(replace(base, part=PromptPart(slot=0, tokens=tokens, start=0, last=True)))
    cache = e.experts.cache
    returned = cache.free_slots()
    assert cache.stats.loans > 0, "the part borrowed no slots: the test needs it to"
    assert returned, "the part's slots were refilled in its own run, not deferred to the next"
    table_before = cache.table().copy()
    fills = cache.stats.fills
    runner.run(replace(base, decode_active=np.array([True, False]), decode_tokens=np.array([r.part_next, 0], np.int32),
                       decode_pos=np.array([PART, 0], np.int32)))
    assert cache.free_slots() == [] and cache.stats.fills > fills, "the deferred refill did not run"
    assert not np.isin(returned, table_before).any(), "a FREE slot was in the table a window received"
    assert cache.verify() == []


def test_windows_dispatched_ahead_over_a_partial_cache_give_the_tokens_of_windows_run_one_by_one():
    """Each window dispatched before its predecessor is read (the scheduler's lookahead), with the cache's swaps
    between windows (adapt_every=1) then running while two windows are queued: the same tokens as one by one,
    every window's routes counted once (recorded when it is read), and every slot still holding what it claims."""
    e = Engine.load("demo", max_context=256, prefill=PART, expert_cache=8, debug_slots=True, adapt_every=1,
                    say=lambda line: None)
    first = replace(idle_plan(SLOTS), decode_active=np.array([True, True]), decode_tokens=np.array([3, 9], np.int32),
                    temperature=np.array([0.0, 0.8], np.float32), seeds=np.array([[0, 0], [5, 6]], np.uint32))
    windows, routes_per_window = 10, SLOTS * e.cfg.num_experts_per_tok * e.experts.cache.n_layers

    def routes():
        st = e.experts.cache.stats
        return st.hits + st.misses

    one_by_one = WindowRunner(e, SLOTS, PART)
    want, plan, r0 = [], first, routes()
    for _ in range(windows):
        res = one_by_one.run(plan)
        want.append(res.decode_next.tolist())
        plan = replace(plan.continued(), decode_tokens=res.decode_next.astype(np.int32))
    assert routes() - r0 == windows * routes_per_window

    ahead = WindowRunner(e, SLOTS, PART)
    assert ahead.chains
    got, plan, r0, swaps = [], first, routes(), e.experts.cache.stats.swaps
    w = ahead.dispatch(plan)
    for i in range(windows):
        nxt = plan.continued()
        w_next = ahead.dispatch(nxt, after=w) if i < windows - 1 else None     # before w is read
        res = ahead.collect(w)
        got.append(res.decode_next.tolist())
        w, plan = w_next, nxt
    assert got == want
    assert routes() - r0 == windows * routes_per_window
    assert e.experts.cache.stats.swaps > swaps, "no swap ran between windows: the test needs them"
    assert e.experts.moe.uses_checked > 0 and e.experts.cache.verify() == []
