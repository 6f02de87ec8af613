"""The numerics guard: its policy (strata/sched/guard.py) on plain data, and the scheduler acting on it against the
FakeExecutor (tests/sched/fake_executor.py): a corrupt expert slot is repaired and the request completes with the
exact tokens, a path-dependent failure recovers on the next rung, a deterministic one ends with the explicit error
after two attempts, other slots are untouched, and a storm of failures asks for one rebuild."""
from __future__ import annotations

import logging

import pytest
from fake_executor import FakeExecutor, expected_tokens, text_of
from test_scheduler_fake import P, req, sched_over, serve

from strata.demo_tokenizer import write_demo_tokenizer
from strata.plan import DEFAULT
from strata.sched.guard import Attempt, GiveUp, Guard, Retry
from strata.sched.request import Failed, Finished
from strata.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo_tokenizer")
    write_demo_tokenizer(d)
    return Tokenizer.from_dir(d)


# --- the policy alone

def test_a_first_failure_retries_on_the_first_rung():
    g = Guard(("reference_ops", "cpu_experts"))
    assert g.failed("r", (Attempt(DEFAULT, 40, 40),), now=0.0) == Retry("reference_ops", rebuild=False)


def test_a_failure_at_an_earlier_attempts_position_gives_up():
    g = Guard(("reference_ops", "cpu_experts"))
    tried = (Attempt(DEFAULT, 0, 63), Attempt("reference_ops", 16, 31))      # a part that overlaps the first's
    d = g.failed("r", tried, now=0.0)
    assert isinstance(d, GiveUp) and d.position == 31 and not d.rebuild
    assert d.message() == ("non-finite logits at position 31 again at the same position after 2 attempts (default, "
                           "reference_ops); resending the same request is likely to fail the same way")
    assert dict(d.detail()) == {"position": 31, "attempts": [{"numerics": "default", "position": 63},
                                                             {"numerics": "reference_ops", "position": 31}]}


def test_failures_at_new_positions_climb_the_ladder_then_give_up():
    g = Guard(("reference_ops", "cpu_experts"))
    a = (Attempt(DEFAULT, 5, 5),)
    assert g.failed("r", a, 0.0) == Retry("reference_ops", False)
    a += (Attempt("reference_ops", 9, 9),)
    assert g.failed("r", a, 0.0) == Retry("cpu_experts", False)
    a += (Attempt("cpu_experts", 12, 12),)
    d = g.failed("r", a, 0.0)
    assert isinstance(d, GiveUp) and d.why == "with no numerics path left to try"


def test_an_empty_ladder_gives_up_at_once():
    d = Guard(()).failed("r", (Attempt(DEFAULT, 3, 3),), 0.0)
    assert isinstance(d, GiveUp) and len(d.attempts) == 1


def test_a_storm_of_different_requests_asks_for_one_rebuild():
    g = Guard(("cpu_experts",), storm=3, window_s=60.0)
    one = (Attempt(DEFAULT, 1, 1),)
    assert [g.failed(r, one, t).rebuild for r, t in (("a", 0.0), ("a", 1.0), ("b", 2.0))] == [False] * 3
    assert g.failed("c", one, 3.0).rebuild                       # a third request within the window
    assert not g.failed("d", one, 4.0).rebuild                   # a new storm starts counting afresh
    assert not g.failed("e", one, 100.0).rebuild and g.recent(100.0) == 1     # "d" is out of the window


@pytest.mark.parametrize("ladder", [("cpu_experts", "cpu_experts"), (DEFAULT,)])
def test_a_ladder_names_distinct_paths_other_than_the_default(ladder):
    with pytest.raises(ValueError, match="distinct paths"):
        Guard(ladder)


# --- the scheduler acting on it

def test_a_corrupt_expert_slot_is_repaired_and_the_request_completes_exactly(tokenizer, caplog):
    """A's second prompt part reads a corrupt expert slot: nothing of it is sent, the executor repairs the slot
    (the log names it), A reads its prompt again from 0 on the first rung and its tokens are exactly a clean run's;
    B, on the other slot, never notices."""
    a, b = P("a prompt of four parts"), P("bee")
    fake = FakeExecutor(slots=2, part_size=8, corrupt={(0, 12): (7, 1, 3)})
    sched = sched_over(fake, tokenizer)
    with caplog.at_level(logging.INFO, "strata.sched"):
        out = serve(sched, [req("A", a, 6), req("B", b, 6)])
    assert out["A"] == (text_of(expected_tokens(a, 6)), out["A"][-1])
    assert out["A"][-1] == Finished("length", len(a), 6, out["A"][-1].timings)
    assert out["B"][0] == text_of(expected_tokens(b, 6))
    assert fake.repairs == [((0,), False)]
    retry = [(pos, path) for slot, pos, path in fake.paths if slot == 0 and path != DEFAULT]
    assert retry[0] == (0, "reference_ops") and len(retry) == len(a) + 6 - 1   # the whole prompt, then decoding
    assert any("slot 7 (layer 1, expert 3)" in m and "rewritten from the host tier" in m for m in caplog.messages)
    assert sched.stats["guard_retries"] == 1 and sched.stats["expert_slots_repaired"] == 1


def test_a_decode_failure_rereads_the_sent_tokens_and_sends_nothing_twice(tokenizer):
    """B fails on its fourth decode row on the default path only: it re-reads its prompt and the 3 tokens it sent,
    on reference_ops, and continues from there; the client's text is exactly a clean run's."""
    b = P("flaky")
    bad = len(b) + 3 - 1
    fake = FakeExecutor(slots=2, part_size=4, nonfinite_default={(1, bad)})
    out = serve(sched_over(fake, tokenizer), [req("A", P("steady"), 10), req("B", b, 10)])
    assert out["B"][0] == text_of(expected_tokens(b, 10))
    assert isinstance(out["B"][-1], Finished) and out["B"][-1].completion_tokens == 10
    reread = [w.plan.part for w in fake.windows if w.plan.part is not None and w.plan.part.slot == 1][-2:]
    assert sum(len(p.tokens) for p in reread) == len(b) + 3 and reread[0].start == 0      # prompt + 3 sent
    assert out["A"][0] == text_of(expected_tokens(P("steady"), 10))


def test_a_deterministic_failure_ends_with_the_explicit_error_after_two_attempts(tokenizer):
    c = P("a deterministic fault")
    fake = FakeExecutor(slots=2, part_size=8, nonfinite={(0, 10)})
    out = serve(sched_over(fake, tokenizer), [req("C", c, 8), req("D", P("other"), 8)])
    text, final = out["C"]
    assert text == "" and isinstance(final, Failed) and final.status == 500 and final.code == "non_finite"
    assert dict(final.detail) == {"position": 15, "attempts": [{"numerics": "default", "position": 15},
                                                               {"numerics": "reference_ops", "position": 15}]}
    assert len([1 for s, p, path in fake.paths if s == 0 and p == 0]) == 2           # two attempts read it
    assert out["D"] == (text_of(expected_tokens(P("other"), 8)), out["D"][-1])
    assert len(fake.repairs) == 2 and all(r == ((0,), False) for r in fake.repairs)


def test_a_failure_while_a_window_runs_ahead_drops_that_windows_row(tokenizer):
    """Steady decoding with lookahead: B's row fails in a window already continued on the device; the continued
    row's result is dropped, nothing is dispatched ahead until B is repaired, and B's text is exactly a clean run's."""
    b = P("ahead")
    bad = len(b) + 5
    fake = FakeExecutor(slots=2, part_size=8, nonfinite_default={(1, bad)})
    out = serve(sched_over(fake, tokenizer), [req("A", P("steady"), 16), req("B", b, 16)])
    assert any(w.ahead for w in fake.windows)
    assert out["B"][0] == text_of(expected_tokens(b, 16))
    assert out["A"][0] == text_of(expected_tokens(P("steady"), 16))


def test_a_storm_of_failures_rebuilds_once(tokenizer, caplog):
    fake = FakeExecutor(slots=3, part_size=8, nonfinite_default={(0, 2), (1, 2), (2, 2)})
    sched = sched_over(fake, tokenizer)
    sched.guard = Guard(fake.numerics, storm=3, window_s=600.0)
    with caplog.at_level(logging.INFO, "strata.sched"):
        out = serve(sched, [req(r, P(r * 4), 4) for r in "xyz"])
    assert all(out[r][0] == text_of(expected_tokens(P(r * 4), 4)) for r in "xyz")
    assert fake.repairs == [((0,), False), ((1,), False), ((2,), True)] and sched.stats["guard_rebuilds"] == 1
    assert any("3 different requests went non-finite within 600 s" in m for m in caplog.messages)


def test_the_guard_ladder_must_be_paths_the_executor_runs(tokenizer):
    with pytest.raises(ValueError, match="does not run"):
        sched_over(FakeExecutor(numerics=("cpu_experts",)), tokenizer, guard=Guard(("float32",)))
