"""Decode windows of fewer rows than slots (row_buckets): a compiled window runs the smallest bucket (1, 2, 4, ...)
holding its active rows, on their bank rows (WindowRunner.row_slots). It must change nothing: every row's tokens
(greedy and sampled, one by one and dispatched ahead with rows dropping out) equal those of windows over all slots,
with float and int8 KV, the KV host tier, the layer split and shaped sampling (penalties, logprobs); and the slots
a window does not compute keep their states bit for bit (but the scratch row, which no query reads)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from strata import Engine
from strata.engine.runner import WindowRunner
from strata.model.config import LINEAR
from strata.plan import PromptPart, idle_plan

pytestmark = pytest.mark.heavy

S, PART = 5, 32
LENGTHS = [70, 9, 41, 100, 23]           # prompt lengths per slot (past a 64-row KV window on three of them)
VARIANTS = {"float KV": {}, "int8 KV": dict(kv="int8"), "KV host tier": dict(kv_resident=64),
            "layer split": dict(layer_split="2"), "shaped sampling": {}}
# a shaped window's rows: penalties on two rows (one with a repetition penalty, which reads the prompt's tokens) and
# logprobs on all
SHAPED = dict(penalties=np.array([[0, 0, 1], [0.5, 0.2, 1], [0, 0, 1], [0, 0, 1.3], [0, 0, 1]], np.float32),
              logprobs=np.full(S, 3, np.int32))


def engine(buckets: bool, **kw):
    return Engine.load("demo", max_context=512, prefill=PART, row_buckets=buckets, **kw)


def test_windows_take_the_smallest_bucket_holding_their_rows():
    r = WindowRunner(engine(True), S, PART)
    assert r.capacity.row_buckets == (1, 2, 4)
    plan = idle_plan(S)
    for on, want in (([3], [3]), ([0, 4], [0, 4]), ([1, 2, 4], [0, 1, 2, 4]), ([4, 1, 0, 3], [0, 1, 3, 4]),
                     ([0, 1, 2, 3, 4], None)):
        got = r.row_slots(replace(plan, decode_active=np.isin(np.arange(S), on)))
        assert (got is None and want is None) or got.tolist() == want
    assert WindowRunner(engine(False), S, PART).capacity.row_buckets == ()
    assert WindowRunner(engine(True), 1, PART).capacity.row_buckets == ()


def read_prompts(r: WindowRunner, shaped: dict) -> list[int]:
    """Each slot's prompt read in parts -> each slot's first token."""
    first = []
    for slot, n in enumerate(LENGTHS):
        toks = (np.arange(n) * 7 + slot) % 500 + 3
        for at in range(0, n, PART):
            res = r.run(replace(idle_plan(S), **shaped,
                                part=PromptPart(slot=slot, tokens=toks[at:at + PART].astype(np.int32), start=at,
                                                last=at + PART >= n)))
        first.append(res.part_next)
    return first


def drive(r: WindowRunner, check_idle=None, shaped: dict | None = None) -> tuple[list, list]:
    """Windows of 5, 1, 2, 3 and 4 active rows one by one, then a chain dispatched ahead from which rows drop out;
    -> (every window's tokens of its active rows and a shaped window's top ids, a shaped window's logprobs).
    check_idle(runner, before, after, idle): called around the window of three rows, whose bucket of four pads with
    slot 0 and leaves slot 3 out. shaped: the plans' penalties and logprobs (SHAPED)."""
    shaped = shaped or {}
    toks = np.array(read_prompts(r, shaped), np.int32)
    pos = np.array(LENGTHS, np.int32)
    steps = np.zeros(S, np.int32)
    base = replace(idle_plan(S), temperature=np.array([0, 0.9, 0, 0.7, 0], np.float32),
                   seeds=np.arange(2 * S, dtype=np.uint32).reshape(S, 2), **shaped)
    seen, values = [], []
    for on in ([0, 1, 2, 3, 4], [3], [0, 4], [1, 2, 4], [0, 1, 3, 4], [2]):
        active = np.isin(np.arange(S), on)
        plan = replace(base, decode_active=active, decode_tokens=toks, decode_pos=pos, steps=steps)
        before = _host_states(r) if check_idle and len(on) == 3 else None
        res = r.run(plan)
        if before is not None:
            check_idle(r, before, _host_states(r), [0, 3])
        seen.append(res.decode_next[active].tolist())
        if shaped:
            lp = res.decode_logprobs
            seen.append(lp.top_ids[active].tolist())
            values.append(np.concatenate([lp.sampled[active], lp.top[active].ravel()]))
        toks = np.where(active, res.decode_next, toks).astype(np.int32)
        pos, steps = pos + active, steps + active
    plan = replace(base, decode_active=np.isin(np.arange(S), [0, 1, 2, 4]), decode_tokens=toks, decode_pos=pos,
                   steps=steps)
    w = r.dispatch(plan)
    for drop in (None, 4, 1, None):            # 4 rows, then 3 (bucket 4), 2 and 2
        nxt = plan.continued()
        if drop is not None:
            nxt = replace(nxt, decode_active=nxt.decode_active & (np.arange(S) != drop))
        w_next = r.dispatch(nxt, after=w)
        res = r.collect(w)
        seen.append(res.decode_next[plan.decode_active].tolist())
        w, plan = w_next, nxt
    seen.append(r.collect(w).decode_next[plan.decode_active].tolist())
    return seen, values


def _host_states(r: WindowRunner) -> list:
    return [{k: np.asarray(r.engine.backend.to_host(v)).copy() for k, v in layer.items()} for layer in r.states]


def _unchanged(r, before, after, idle):
    """The idle slots' recurrent states and every key and value but the scratch row are as before the window."""
    for i, (kind, b, a) in enumerate(zip(r.engine.cfg.layer_types, before, after)):
        for name in b:
            if b[name].ndim == 0 or b[name].shape[0] != S:         # host banks and per-slot scalars: as they were
                assert np.array_equal(b[name], a[name], equal_nan=True), (i, name)
                continue
            x, y = b[name][idx := np.array(idle)], a[name][idx]
            if kind != LINEAR and x.ndim >= 2:
                x, y = x[:, :-1], y[:, :-1]                        # the scratch row (a padding row's key) aside
            assert np.array_equal(x, y, equal_nan=True), f"layer {i} {name} of idle slots {idle} changed"


@pytest.mark.parametrize("variant", VARIANTS)
def test_fewer_rows_give_the_tokens_of_windows_over_every_slot(variant):
    e = engine(True, **VARIANTS[variant])
    shaped = SHAPED if variant == "shaped sampling" else None
    every = WindowRunner(e, S, PART)
    every.capacity = replace(every.capacity, row_buckets=())   # as row_buckets = false, sharing the compilations
    bucketed = WindowRunner(e, S, PART)
    assert bucketed.capacity.row_buckets == (1, 2, 4)
    sizes, row_slots = [], bucketed.row_slots
    bucketed.row_slots = lambda plan: sizes.append(row_slots(plan)) or sizes[-1]
    (got, got_lp), (want, want_lp) = drive(bucketed, _unchanged, shaped), drive(every, shaped=shaped)
    assert got == want
    # XLA's CPU matmul of one row (a bucket of 1: the head's gemv) sums in another order than of several (gemm), so
    # a lone row's logits may differ from the same row's among others in their last bits (as between runners of 1
    # and 5 slots): ~1e-6 here
    assert len(got_lp) == len(want_lp) and all(np.abs(a - b).max() <= 1e-5 for a, b in zip(got_lp, want_lp))
    assert sorted({len(x) for x in sizes if x is not None}) == [1, 2, 4] and sum(x is None for x in sizes) == 1
