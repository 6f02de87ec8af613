"""Steady decoding dispatches the next window before the last one is read (the tokens stay on the device): the
runner's dispatch/collect with `after`, and the scheduler's lookahead, which must change nothing a client sees."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from strata import Engine
from strata.engine.runner import ROWS, WindowRunner
from strata.plan import idle_plan
from strata.plan import PromptPart
from strata.sched.request import Finished, Request, SamplingParams
from tests.sched.test_scheduler import _prompts, _run


@pytest.fixture(scope="module")
def engine():
    return Engine.load("demo", max_context=2048, prefill=64)


def _steady(plan, res=None):
    """The plan after `plan` in steady decoding (WindowPlan.continued): each active row's token from res, or -1 (on
    the device), its position and step one on."""
    nxt = plan.continued()
    if res is None:
        return nxt
    return replace(nxt, decode_tokens=np.where(plan.decode_active, res.decode_next, 0).astype(np.int32))


def test_windows_dispatched_ahead_give_the_tokens_of_windows_run_one_by_one(engine):
    first = replace(idle_plan(3), decode_active=np.array([True, False, True]),
                    decode_tokens=np.array([11, 0, 12], np.int32), decode_pos=np.array([0, 0, 0], np.int32),
                    temperature=np.array([0.0, 0.0, 0.9], np.float32),
                    seeds=np.array([[1, 2], [0, 0], [3, 4]], np.uint32))
    one_by_one = WindowRunner(engine, 3, 16)
    want, plan = [], first
    for _ in range(6):
        res = one_by_one.run(plan)
        want.append(res.decode_next[[0, 2]].tolist())
        plan = _steady(plan, res)
    ahead = WindowRunner(engine, 3, 16)
    got, plan = [], first
    w = ahead.dispatch(plan)
    for i in range(6):
        nxt = _steady(plan)
        w_next = ahead.dispatch(nxt, after=w) if i < 5 else None         # before w is read
        res = ahead.collect(w)
        got.append(res.decode_next[[0, 2]].tolist())
        assert res.decode_finite.all()
        w, plan = w_next, nxt
    assert got == want


def test_only_a_steady_plan_continues_a_window(engine):
    runner = WindowRunner(engine, 2, 16)
    plan = replace(idle_plan(2), decode_active=np.array([True, False]), decode_tokens=np.array([5, 0], np.int32))
    w = runner.dispatch(plan)
    with pytest.raises(ValueError, match="same rows"):
        runner.dispatch(replace(_steady(plan), decode_active=np.array([True, True])), after=w)
    with pytest.raises(ValueError, match="one position and one step"):
        runner.dispatch(replace(_steady(plan), decode_pos=np.array([5, 0], np.int32)), after=w)
    w2 = runner.dispatch(_steady(plan), after=w)
    with pytest.raises(ValueError, match="once"):
        runner.dispatch(_steady(plan), after=w)                      # w's rows went to w2
    with pytest.raises(RuntimeError, match="before the window it continues"):
        runner.collect(w2)
    assert runner.collect(w).decode_finite[0] and runner.collect(w2).decode_finite[0]
    with_part = runner.dispatch(replace(plan, part=PromptPart(slot=1, tokens=np.arange(3, dtype=np.int32), start=0,
                                                              last=True)))
    with pytest.raises(ValueError, match="decode-only"):                  # a window with a prompt part
        runner.dispatch(_steady(plan), after=with_part)
    runner.collect(with_part)


def test_lookahead_changes_nothing_a_client_sees(engine):
    """Lengths, stop tokens, stop strings, greedy and sampled rows, more requests than slots: the same text, finish
    reasons and token counts with the lookahead on and off, and the lookahead did dispatch windows ahead. (Windows
    dispatched ahead over a partial cache: tests/experts/test_window_fetch.py; the scheduler's lookahead itself:
    test_scheduler_fake.py.)"""
    prompts = _prompts(engine, 5)
    ids = engine.generate(list(prompts[1]), 20, stop_token_ids=[])
    text = engine.tokenizer.decode(ids, skip_special_tokens=True)
    reqs = [Request(id="len", prompt_ids=prompts[0], max_tokens=17, stop_token_ids=()),
            Request(id="stop-token", prompt_ids=prompts[1], max_tokens=20, stop_token_ids=(ids[6],)),
            Request(id="stop-string", prompt_ids=prompts[1], max_tokens=20, stop=(text[8:11],), stop_token_ids=()),
            Request(id="sampled", prompt_ids=prompts[3], max_tokens=9, stop_token_ids=(),
                    sampling=SamplingParams(temperature=0.9, seed=7)),
            Request(id="short", prompt_ids=prompts[4], max_tokens=1, stop_token_ids=())]
    on, sched_on = _run(engine, reqs, 2, 64, lookahead=True)
    off, sched_off = _run(engine, reqs, 2, 64, lookahead=False)
    assert sched_on.stats["windows_ahead"] > 0 and sched_off.stats["windows_ahead"] == 0
    st = sched_on.stats          # a window dispatched ahead is timed from its collect: no time is counted twice
    assert 0 <= st["device_seconds_sum"] <= st["window_seconds_sum"] and st["handoff_seconds_sum"] >= 0
    for r in reqs:
        (t_on, f_on), (t_off, f_off) = on[r.id], off[r.id]
        assert isinstance(f_on, Finished) and isinstance(f_off, Finished), r.id
        assert (t_on, f_on.reason, f_on.completion_tokens) == (t_off, f_off.reason, f_off.completion_tokens), r.id
    assert on["stop-token"][1].reason == "stop" and on["stop-token"][1].completion_tokens == ids.index(ids[6]) + 1
    assert on["stop-string"][1].reason == "stop" and on["len"][1].completion_tokens == 17
    assert all(s["state"] == "free" for s in sched_on.slots())


def test_a_compiled_windows_outputs_are_its_donated_inputs(engine):
    """Every output of the compiled decode window is written over a donated input (the slot states, the rows with
    the results in them), so its buffers keep their addresses from window to window: XLA re-records a command
    buffer (CUDA graph) whose outputs move. The result the host reads is a copy peeled off by a second call."""
    import jax
    runner = WindowRunner(engine, 2, 16)
    plan = replace(idle_plan(2), decode_active=np.array([True, True]), decode_tokens=np.array([5, 6], np.int32))
    runner.run(plan)                                                      # compiles
    ops = engine.backend
    stable = runner.window_args(plan)
    # rows XLA allocated: on the CPU a 64-byte-aligned numpy array is put on the device without a copy, and a
    # buffer that aliases numpy memory cannot be donated (the output then moves, which the GPU never sees)
    rows = ops.to_device(jax.numpy.zeros((ROWS, 2), np.int32))
    before = [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves((runner.states, rows))]
    states, rows_out = runner.rows._decode(engine.params, engine.path.args(), runner.states, rows, *stable, greedy=True)
    after = [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves((states, rows_out))]
    assert after == before
    runner.states = states
    result = runner.rows._peel(rows_out)
    assert result.shape == (2, 2) and result.unsafe_buffer_pointer() != rows_out.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(result), np.asarray(rows_out)[3:])
