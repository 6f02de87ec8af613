"""DraftPolicy (strata/sched/drafts.py): a slot whose drafts are rejected drafts less; verify windows while their
measured tokens a second beat plain windows' at that batch, the slower kind tried again every EXPLORE windows."""
from __future__ import annotations

from strata.sched.drafts import EXPLORE, DraftPolicy


def test_a_slot_whose_drafts_are_rejected_drafts_less_and_recovers():
    p = DraftPolicy(4)
    p.reset(0)
    assert p.length(0) == 4
    lengths = []
    for _ in range(10):
        p.record(0, p.length(0), 0)              # every first draft rejected
        lengths.append(p.length(0))
    assert lengths == sorted(lengths, reverse=True) and lengths[-1] == 1   # never below one: it keeps measuring
    for _ in range(30):
        p.record(0, p.length(0), p.length(0))    # everything accepted
    assert p.length(0) == 4
    p.reset(0)
    assert p.length(0) == 4


def test_the_faster_kind_wins_by_measured_rates_and_the_slower_is_retried():
    p = DraftPolicy(4)
    assert not p.on(2)                           # nothing measured: a plain window first
    p.window(2, False, 2, 0.010)                 # 200 tok/s
    assert p.on(2)                               # then a verify window
    p.window(2, True, 5, 0.020)                  # 250 tok/s
    kinds = []
    for _ in range(2 * EXPLORE):
        kinds.append(p.on(2))
        p.window(2, kinds[-1], 5 if kinds[-1] else 2, 0.020 if kinds[-1] else 0.010)
    assert kinds.count(False) == 2               # the slower kind once every EXPLORE windows
    for _ in range(8):                           # verifying gets slow at this batch (8 windows: the average turns)
        p.window(2, True, 2, 0.030)
    assert not p.on(2)
    assert p.on(1) is False and DraftPolicy(4, adaptive=False).on(16)   # batches are measured apart; fixed: always
