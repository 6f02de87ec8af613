"""Steady decoding dispatches the next window before the last one is read (the tokens stay on the device): the
runner's dispatch/collect with `after`, and the scheduler's lookahead, which must change nothing a client sees."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from strata import Engine
from strata.engine.runner import ROWS, WindowRunner, _rows_after
from strata.engine.sampling import mask_words, pack_mask
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


def test_only_a_continuing_plan_continues_a_window(engine):
    runner = WindowRunner(engine, 3, 16)
    plan = replace(idle_plan(3), decode_active=np.array([True, False, False]),
                   decode_tokens=np.array([5, 0, 0], np.int32))
    w = runner.dispatch(plan)
    steady = _steady(plan)
    masked = np.full((3, mask_words(engine.cfg.vocab_size)), -1, np.int32)
    masked[0, 0] = 0
    for bad, why in ((replace(steady, decode_active=np.array([True, True, False]),
                              decode_tokens=np.array([-1, -1, 0], np.int32)), "inactive in the window it continues"),
                     (replace(steady, decode_tokens=np.array([7, 0, 0], np.int32)), "in the window it continues"),
                     (replace(steady, decode_pos=np.array([5, 0, 0], np.int32)), "one position and one step"),
                     (replace(steady, mask=masked), "masks only on rows that join"),
                     (replace(steady, decode_active=np.zeros(3, bool)), "by a decode-only plan")):
        with pytest.raises(ValueError, match=why):
            runner.dispatch(bad, after=w)
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


def _alternating(runner, n: int, shaped: bool, chained: bool):
    """n windows over 3 rows: rows 0 (greedy) and 1 (sampled) in every one, row 2 (as a grammar row: a mask, a
    frequency penalty) in every other one from the second, its token given by the host; every row with logprobs when
    shaped. chained: each window dispatched before the last one is read (rows 0 and 1 continued on the device, row 2
    joining and dropping out), and the host's copy of the last window's rows is what the device holds. -> ({row:
    tokens}, {row: logprobs of the sampled tokens})."""
    vocab = runner.engine.cfg.vocab_size
    allowed = np.zeros((1, vocab), bool)
    allowed[0, ::3] = True                          # row 2's "grammar": every third token
    mask = np.full((3, mask_words(vocab)), -1, np.int32)
    mask[2] = pack_mask(allowed)[0]
    base = replace(idle_plan(3), temperature=np.array([0.0, 0.9, 0.7], np.float32),
                   seeds=np.array([[1, 2], [3, 4], [5, 6]], np.uint32))
    if shaped:
        base = replace(base, logprobs=np.full(3, 2, np.int32),
                       penalties=np.array([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.8, 1.3]], np.float32))
    toks, lps = {0: [11], 1: [12], 2: [13]}, {0: [], 1: [], 2: []}

    def plan_of(i: int, continuing: bool):
        g = i % 2 == 1                             # row 2 in this window
        active = np.array([True, True, g])
        tokens = np.array([-1 if continuing else toks[0][-1], -1 if continuing else toks[1][-1],
                           toks[2][-1] if g else 0], np.int32)
        pos = np.array([i, i, i // 2], np.int32)
        return replace(base, decode_active=active, decode_tokens=tokens, decode_pos=pos, steps=pos,
                       mask=mask if g and shaped else None)

    def read(plan, res):
        for r in np.flatnonzero(plan.decode_active):
            toks[r].append(int(res.decode_next[r]))
            if shaped:
                lps[r].append(float(res.decode_logprobs.sampled[r]))
            assert res.decode_finite[r]
    if not chained:
        for i in range(n):
            plan = plan_of(i, False)
            read(plan, runner.run(plan))
        return toks, lps
    plan = plan_of(0, False)
    w = runner.dispatch(plan)
    for i in range(n):
        nxt = plan_of(i + 1, True) if i < n - 1 else None
        w_next = runner.dispatch(nxt, after=w) if nxt is not None else None         # before w is read
        res = runner.collect(w)
        read(plan, res)
        if w_next is None:      # (its rows for a successor: a dropped row's from the host, at the scratch row)
            d = w.decode
            held = np.asarray(d.rows_next)[:3]
            np.testing.assert_array_equal(held, _rows_after(np, d.rows, res.decode_next, d.active))
            assert held[1, 2] == runner.scratch_pos
        w, plan = w_next, nxt
    return toks, lps


@pytest.fixture(scope="module")
def fetching():
    """The demo model with half its experts in device slots: windows fetch their misses (and still chain)."""
    return Engine.load("demo", max_context=256, prefill=16, say=lambda line: None, expert_cache=32)


@pytest.mark.parametrize("shaped", [False, True], ids=["plain", "shaped"])
@pytest.mark.parametrize("path", ["engine", "fetching"], ids=["resident", "window fetch"])
def test_rows_that_drop_out_and_join_give_the_tokens_of_windows_run_one_by_one(request, path, shaped):
    """A row that drops out of a continuing window goes to the scratch row (its state untouched) and one that joins
    feeds the token the host gives, merged into the rows on the device: every row's tokens (and logprobs, penalty
    counts kept on the device through the windows a row sits out) are those of windows run one by one."""
    e = request.getfixturevalue(path)
    want = _alternating(WindowRunner(e, 3, 16), 9, shaped, chained=False)
    got = _alternating(WindowRunner(e, 3, 16), 9, shaped, chained=True)
    assert got == want
    assert len(want[0][2]) == 1 + 4 and (not shaped or all(t % 3 == 0 for t in want[0][2][1:]))


@pytest.mark.parametrize("features", ["greedy", "sampled"])
def test_a_grammar_request_beside_a_plain_one_changes_nothing_with_lookahead(engine, features):
    """A json_schema request (its matcher from strata/serve/grammar.py; greedy, or sampled with a frequency penalty
    and logprobs, so its penalty counts must survive the windows it sits out) beside a plain greedy one: both get
    exactly what they get with lookahead off, the JSON validates, and windows were dispatched ahead while the grammar
    request ran, its row continuing on the device in each, its mask given after dispatch (mask_late)."""
    from strata.serve.grammar import Grammars
    grammars = Grammars(engine.tokenizer, engine.cfg.vocab_size, engine.eos_token_ids)
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 4, "maxLength": 12},
                                               "n": {"type": "integer"}}, "required": ["name", "n"]}
    sampled = {"sampling": SamplingParams(temperature=0.8, seed=3, frequency_penalty=1.5), "logprobs": 2}
    prompts = _prompts(engine, 2)
    reqs = [Request(id="json", prompt_ids=prompts[0], max_tokens=80, stop_token_ids=(),
                    constraint=grammars.json(schema), **(sampled if features == "sampled" else {})),
            Request(id="plain", prompt_ids=prompts[1], max_tokens=40, stop_token_ids=())]
    seen = []
    on, sched_on = _run(engine, reqs, 2, 64, lookahead=True, observe=seen)
    off, sched_off = _run(engine, reqs, 2, 64, lookahead=False)
    for r in reqs:
        (t_on, f_on), (t_off, f_off) = on[r.id], off[r.id]
        assert isinstance(f_on, Finished) and isinstance(f_off, Finished), r.id
        assert (t_on, f_on.reason, f_on.completion_tokens) == (t_off, f_off.reason, f_off.completion_tokens), r.id
    assert on["json"][1].reason == "stop" and on["plain"][1].completion_tokens == 40
    value = json.loads(on["json"][0])
    assert set(value) == {"name", "n"} and 4 <= len(value["name"]) <= 12 and isinstance(value["n"], int)
    late = [plan for plan, ahead in seen if ahead and plan.mask_late is not None]
    for plan in late:       # both rows' tokens from the device, the grammar row's mask given later
        assert plan.decode_active.all() and (plan.decode_tokens == -1).all() and plan.mask_late.sum() == 1
    assert len(late) >= on["json"][1].completion_tokens - 3
    assert sched_on.stats["windows_ahead"] >= len(late) and sched_off.stats["windows_ahead"] == 0


def _late_masked(runner, n: int, chained: bool):
    """n windows over 2 rows, both in every one: row 0 plain (sampled), row 1 a grammar row (every third token, a
    frequency penalty, logprobs). chained: each window dispatched before the last one is read, row 1 continuing with
    mask_late and its mask given (give_masks) once the window before is read; else each run alone, its mask given at
    dispatch. -> (tokens per row, row 1's logprobs)."""
    vocab = runner.engine.cfg.vocab_size
    allowed = np.zeros((1, vocab), bool)
    allowed[0, ::3] = True
    mask = np.full((2, mask_words(vocab)), -1, np.int32)
    mask[1] = pack_mask(allowed)[0]
    base = replace(idle_plan(2), temperature=np.array([0.9, 0.7], np.float32),
                   seeds=np.array([[1, 2], [5, 6]], np.uint32),
                   penalties=np.array([[0.0, 0.0, 1.0], [0.0, 0.8, 1.3]], np.float32), logprobs=np.full(2, 2, np.int32))
    toks, lps = {0: [11], 1: [12]}, []

    def plan_of(i: int, continuing: bool):
        tokens = np.array([-1, -1] if continuing else [toks[0][-1], toks[1][-1]], np.int32)
        pos = np.full(2, i, np.int32)
        return replace(base, decode_active=np.ones(2, bool), decode_tokens=tokens, decode_pos=pos, steps=pos,
                       mask=None if continuing else mask, mask_late=np.array([False, True]) if continuing else None)

    def read(res):
        for r in (0, 1):
            toks[r].append(int(res.decode_next[r]))
        lps.append(float(res.decode_logprobs.sampled[1]))
    if not chained:
        for i in range(n):
            read(runner.run(plan_of(i, False)))
        return toks, lps
    w = runner.dispatch(plan_of(0, False))
    for i in range(n):
        w_next = runner.dispatch(plan_of(i + 1, True), after=w) if i < n - 1 else None
        if w_next is not None:
            with pytest.raises(ValueError, match="give_masks"):        # continued before its masks
                runner.dispatch(plan_of(i + 2, True), after=w_next)
        read(runner.collect(w))
        if w_next is not None:
            with pytest.raises(RuntimeError, match="give_masks"):      # read before its masks
                runner.collect(w_next)
            runner.give_masks(w_next, mask)
        w = w_next
    return toks, lps


def test_masks_given_after_dispatch_give_the_tokens_of_masks_given_with_it(engine):
    """A grammar row continuing on the device whose mask comes after its window was dispatched (give_masks, as the
    scheduler gives it once the window before is read) samples what it samples with the mask given at dispatch: the
    same tokens, logprobs and penalty counts, every one allowed by the mask."""
    want = _late_masked(WindowRunner(engine, 2, 16), 8, chained=False)
    got = _late_masked(WindowRunner(engine, 2, 16), 8, chained=True)
    assert got == want
    assert all(t % 3 == 0 for t in want[0][1][1:])


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
