"""Fair streams against a FakeExecutor: beside decode rows a window carries at most `window_tokens` tokens (the decode
rows first, then a prompt part of the rest, padded to a declared part size within the budget), alone a part of the
part size; every generating slot decodes in every window; parts take at most `prompt_share` of the device time while
slots decode; a prompt split into budgeted, paced parts gives the same tokens; the gaps between a stream's tokens are
counted apart for windows with a part."""
from __future__ import annotations

import pytest
from fake_executor import FakeExecutor, expected_tokens
from test_scheduler_fake import P, finished, read_prompts, req, sched_over, serve, summary, tokenizer  # noqa: F401

from strata.plan import Capacity
from strata.sched.scheduler import window_part

SIZES = (1, 2, 4, 8, 16)


def run_checked(fake, tokenizer, requests, window_tokens, prompt_share=1.0):
    """Serve requests with a budget, checking every window as it is dispatched: every generating slot has its
    decode row, and a part beside decode rows fits the budget (its padded size too); -> (outcomes, sched)."""
    def observe(i, plan):
        states = {s["id"]: s["state"] for s in sched.slots()}
        generating = {i for i, st in states.items() if st == "generating"}
        assert {int(s) for s in plan.decode_active.nonzero()[0]} == generating, (i, states)
        if plan.part is not None and plan.n_decode:
            n = len(plan.part.tokens)
            budget = sched.window_tokens
            assert plan.tokens <= budget or n == max(1, sched.window_part // 4), (i, plan.n_decode, n)
            assert fake.capacity.padded(n) <= budget, (i, n)
        elif plan.part is not None:
            prompt = sched.slots_[plan.part.slot].req.prompt_ids
            assert len(plan.part.tokens) == min(fake.part_size, len(prompt) - plan.part.start), i
    fake.observe = observe
    sched = sched_over(fake, tokenizer, window_tokens=window_tokens, prompt_share=prompt_share)
    return serve(sched, requests), sched


def test_the_window_part_is_the_largest_compiled_size_within_the_budget():
    cap = Capacity(slots=2, part_size=16, max_context=256, part_sizes=SIZES)
    assert [window_part(cap, w) for w in (1, 2, 3, 7, 8, 12, 16, 17, 100)] == [1, 2, 2, 4, 8, 8, 16, 16, 16]
    # a part of up to 12 tokens is padded to 16: within a budget of 16, not of 14
    cap = Capacity(slots=2, part_size=12, max_context=256, part_sizes=SIZES)
    assert [window_part(cap, w) for w in (14, 16, 40)] == [8, 12, 12]
    any_size = Capacity(slots=2, part_size=16, max_context=256)          # nothing padded
    assert [window_part(any_size, w) for w in (3, 7, 16, 40)] == [3, 7, 16, 16]


def test_a_long_prompt_is_read_in_budgeted_parts_beside_decode_rows_and_at_full_size_alone(tokenizer):
    a, b = P("hi"), P("a grey heron waits by the mill pond")           # B: 35 tokens
    fake = FakeExecutor(slots=2, part_size=16, part_sizes=SIZES)
    out, sched = run_checked(fake, tokenizer, [req("A", a, 20), req("B", b, 3)], window_tokens=8)
    assert summary(out["A"]) == finished(expected_tokens(a, 20), "length", a, 20)
    assert summary(out["B"]) == finished(expected_tokens(b, 3), "length", b, 3)
    parts = [(len(w.plan.part.tokens), w.plan.n_decode) for w in fake.windows if w.plan.part is not None]
    # A's prompt alone at the part size; B's beside A's row: 7 tokens (8 less the row), padded to 8
    assert parts == [(2, 0)] + [(7, 1)] * 5
    assert read_prompts(fake) == [a, b]
    # a budget of 6 holds no part of 5: parts of 4, the largest compiled size within it
    fake = FakeExecutor(slots=2, part_size=16, part_sizes=SIZES)
    out6, _ = run_checked(fake, tokenizer, [req("A", a, 20), req("B", b, 3)], window_tokens=6)
    assert {k: summary(v) for k, v in out6.items()} == {k: summary(v) for k, v in out.items()}
    assert [len(w.plan.part.tokens) for w in fake.windows if w.plan.part is not None] == [2] + [4] * 8 + [3]


def test_with_nothing_decoding_a_prompt_is_read_in_parts_of_the_part_size(tokenizer):
    b = P("a grey heron waits by the mill pond")
    fake = FakeExecutor(slots=2, part_size=16, part_sizes=SIZES)
    out, _ = run_checked(fake, tokenizer, [req("B", b, 2)], window_tokens=4)
    assert summary(out["B"]) == finished(expected_tokens(b, 2), "length", b, 2)
    assert [len(w.plan.part.tokens) for w in fake.windows if w.plan.part is not None] == [16, 16, 3]


@pytest.mark.parametrize("window_tokens", [None, 16, 9, 5, 1])
def test_any_budget_gives_every_request_the_same_tokens_and_never_starves_a_row(tokenizer, window_tokens):
    """Six slots, five short requests and one long prompt admitted last: whatever the budget, each request gets
    exactly its tokens, every generating slot decodes in every window, and the long prompt is read to its end (with
    five rows decoding, a budget of 5 or 1 still leaves it a quarter of the window part)."""
    prompts = [P(f"{i}" * (i + 1)) for i in range(5)] + [P("the barge drifts past the lock " * 3)]
    reqs = [req(f"r{i}", p, 120 if i < 5 else 4) for i, p in enumerate(prompts)]
    fake = FakeExecutor(slots=6, part_size=16, max_context=256, part_sizes=SIZES)
    out, sched = run_checked(fake, tokenizer, reqs, window_tokens)
    for r in reqs:
        assert summary(out[r.id]) == finished(expected_tokens(r.prompt_ids, r.max_tokens), "length", r.prompt_ids,
                                              r.max_tokens)
    assert read_prompts(fake) == prompts
    long_parts = [len(w.plan.part.tokens) for w in fake.windows if w.plan.part and w.plan.part.slot == 5]
    want = {None: 16, 16: 11, 9: 4, 5: 1, 1: 1}[window_tokens]            # beside 5 rows: the rest, or the floor
    assert long_parts[:-1] == [want] * (len(long_parts) - 1)


def test_inter_token_gaps_are_counted_apart_beside_prompt_parts(tokenizer):
    a, b = P("hi"), P("a grey heron waits by the mill pond")
    fake = FakeExecutor(slots=2, part_size=16, part_sizes=SIZES)
    out, sched = run_checked(fake, tokenizer, [req("A", a, 20), req("B", b, 3)], window_tokens=8)
    m = sched.metrics()
    # every token after a request's first has a gap: A's 19, B's 2; A's first 5 decoded beside B's parts
    assert (m["inter_tokens"], m["inter_tokens_beside_parts"]) == (19 + 2 - 5, 5)
    assert m["inter_token_seconds_sum"] >= 0 and m["inter_token_seconds_beside_parts_sum"] >= 0


def test_parts_take_at_most_the_prompt_share_of_the_device_time_while_slots_decode(tokenizer):
    """Decode rows report 1 s, a part of 8 (padded) 2 s. At a share of 1/4 a part window owes the stream
    2 - (1 + 2) / 4 = 1.25 s, paid back by five windows of decode rows alone (1/4 s each): parts in every sixth
    window while A decodes; A's and B's tokens are unchanged."""
    a, b = P("hi"), P("a grey heron waits by the mill pond")           # B: 35 tokens, 5 parts of 7 beside A's row
    fake = FakeExecutor(slots=2, part_size=16, part_sizes=SIZES, decode_s=1.0, part_s_per_token=0.25)
    out, sched = run_checked(fake, tokenizer, [req("A", a, 40), req("B", b, 3)], window_tokens=8, prompt_share=0.25)
    assert summary(out["A"]) == finished(expected_tokens(a, 40), "length", a, 40)
    assert summary(out["B"]) == finished(expected_tokens(b, 3), "length", b, 3)
    assert read_prompts(fake) == [a, b]
    beside = [w.plan.part is not None for w in fake.windows[1:]]        # from A's first decode row on
    assert beside[:25] == [True, False, False, False, False, False] * 4 + [True] and not any(beside[25:])
    part_s = sum(fake.part_s_per_token * fake.capacity.padded(len(w.plan.part.tokens))
                 for w in fake.windows[1:25] if w.plan.part is not None)
    assert part_s / (part_s + 24 * fake.decode_s) == 0.25
    # a share of 1: a part beside every window's rows
    fake = FakeExecutor(slots=2, part_size=16, part_sizes=SIZES, decode_s=1.0, part_s_per_token=0.25)
    run_checked(fake, tokenizer, [req("A", a, 40), req("B", b, 3)], window_tokens=8)
    assert [w.plan.part is not None for w in fake.windows[1:7]] == [True] * 5 + [False]


def test_one_slow_part_does_not_hold_the_prompt_back(tokenizer):
    """Parts are charged the median of the last few: a part that took 50 times its usual time (the host was busy
    elsewhere) leaves the pattern of the test above as it was."""
    a, b = P("hi"), P("a grey heron waits by the mill pond")
    fake = FakeExecutor(slots=2, part_size=16, part_sizes=SIZES, decode_s=1.0, part_s_per_token=0.25,
                        part_s_at={13: 100.0})                          # B's third part
    run_checked(fake, tokenizer, [req("A", a, 40), req("B", b, 3)], window_tokens=8, prompt_share=0.25)
    assert fake.windows[13].plan.part is not None
    pattern = [w.plan.part is not None for w in fake.windows[1:26]]
    assert pattern == [True, False, False, False, False, False] * 4 + [True]


def test_a_prompt_share_outside_zero_to_one_is_refused(tokenizer):
    for share in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match="prompt_share must be in"):
            sched_over(FakeExecutor(), tokenizer, prompt_share=share)
