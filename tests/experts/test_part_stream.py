"""A prompt part that streams whole layers of experts (strata/experts/stream.py): the order of its copies and waits
against a recording HostFetch (its own unit test), and on the demo engine that a corrupted copy is caught under
--debug-slots, that small parts keep borrowing slots, and that the routing counts reach the cache."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from strata import Engine
from strata.engine.runner import WindowRunner
from strata.experts.cache import CacheStats
from strata.experts.moe import SlotMismatch
from strata.experts.stream import AHEAD, PartStream
from strata.plan import PromptPart, idle_plan

LAYERS = 5


class _Cache:
    def __init__(self, resident: set):
        self.stats, self.pool = CacheStats(), "pool"
        self._table = np.full((LAYERS, 3), -1, np.int32)
        for p in resident:
            self._table[p] = np.arange(3)

    def table(self):
        return self._table.copy()

    def table_row(self, p):
        return self._table[p].copy()


class _Recorder:
    """HostFetch's stage_layer and wait, and the MoeRunner parts a PartStream uses, writing down what happens."""

    def __init__(self, resident=()):
        self.events = []
        self.host_fetch, self.ops = self, self
        self.layout = type("Layout", (), {"nbytes": 4})()
        self.cache = _Cache(set(resident))
        self.check_uses, self.pending_counts = False, []

    def stage_layer(self, chunks):
        p = int(chunks[0][0, 0])              # each layer's one chunk holds its layer's number
        self.events.append(("copy", p))
        return p

    def wait(self, y):
        self.events.append(("wait", y))

    def streamed_op(self, h, idx, w, n_valid, pool, table):
        self.events.append(("experts", pool))
        return pool, "counts"


def test_copies_run_ahead_and_at_most_ahead_plus_one_layers_are_held():
    rec = _Recorder()
    stream = PartStream(rec, [[np.full((1, 4), p, np.uint8)] for p in range(LAYERS)], np.ones(8, bool))
    assert AHEAD == 2 and rec.events == [("copy", 0), ("copy", 1)]       # before any layer runs
    for p in range(LAYERS):
        assert stream(p, None, None, None) == p
        assert len(stream.staged) <= AHEAD + 1, stream.staged
    want = [("copy", 0), ("copy", 1), ("copy", 2), ("experts", 0)]
    for p in range(1, LAYERS):
        # layer p - 1's experts are waited on before layer p + 2's copy is issued (its memory is then free)
        want += [("wait", p - 1)] + ([("copy", p + 2)] if p + 2 < LAYERS else []) + [("experts", p)]
    assert rec.events == want
    assert rec.cache.stats.streamed_layers == LAYERS and rec.cache.stats.bytes_copied == LAYERS * 4
    assert [p for p, _ in rec.pending_counts] == list(range(LAYERS))


def test_a_layer_whose_experts_are_all_resident_is_read_from_the_pool_uncopied():
    rec = _Recorder(resident={2})
    stream = PartStream(rec, [[np.full((1, 4), p, np.uint8)] for p in range(LAYERS)], np.ones(8, bool))
    for p in range(LAYERS):
        stream(p, None, None, None)
        assert len(stream.staged) <= AHEAD + 1, stream.staged
    assert rec.events == [("copy", 0), ("copy", 1), ("copy", 3), ("experts", 0),
                          ("wait", 0), ("copy", 4), ("experts", 1),
                          ("experts", "pool"),
                          ("wait", 1), ("experts", 3),
                          ("wait", 3), ("experts", 4)]
    assert rec.cache.stats.streamed_layers == LAYERS - 1


def _part(e, n):
    runner = WindowRunner(e, 1, 16)
    tokens = (np.arange(n, dtype=np.int32) * 7) % e.cfg.vocab_size
    return runner, runner.run(replace(idle_plan(1), part=PromptPart(slot=0, tokens=tokens, start=0, last=True)))


def test_a_corrupted_layer_copy_is_caught_under_debug_slots(monkeypatch):
    e = Engine.load("demo", max_context=64, prefill=16, expert_cache=8, debug_slots=True, say=lambda line: None)
    assert e.path.streams_parts
    ops = e.path.ops.host_fetch
    real = ops.stage_layer

    def corrupted(chunks):
        staged = real(chunks)
        return staged.at[:, 100].set(staged[:, 100] ^ 1)
    monkeypatch.setattr(ops, "stage_layer", corrupted)
    with pytest.raises(SlotMismatch, match="do not match the pack"):
        _part(e, 16)


def test_streamed_counts_reach_the_cache_and_small_parts_borrow():
    e = Engine.load("demo", max_context=64, prefill=16, expert_cache=8, say=lambda line: None)
    cache, k, n_experts = e.experts.cache, e.cfg.num_experts_per_tok, e.cfg.num_experts
    small = max(1, (n_experts - 1) // k)              # its routes do not outnumber a layer's experts
    assert small * k < n_experts
    runner, _ = _part(e, small)
    assert cache.stats.streamed_layers == 0 and cache.stats.loans > 0
    routed = cache.routed.sum()
    runner.metrics()                                  # settles what streamed parts counted
    _, _ = _part(e, 16)
    e.experts.moe.settle()
    assert cache.stats.streamed_layers == cache.n_layers
    assert cache.routed.sum() - routed == 16 * k * cache.n_layers     # every real row's routes, counted once


def test_a_part_over_resident_and_streamed_layers_gives_the_all_resident_logits():
    """expert_cache 20 in (layer, expert) order: MoE layer 0 all resident (read from the pool), layers 1-3 streamed;
    every route reads its expert's bytes through the same op as the all-resident compiled part."""
    ref = Engine.load("demo", max_context=64, prefill=16, say=lambda line: None)
    e = Engine.load("demo", max_context=64, prefill=16, expert_cache=20, debug_slots=True, say=lambda line: None)
    tokens = ((np.arange(16) * 5) % e.cfg.vocab_size).tolist()
    want, got = ref.logits(tokens, part_size=16), e.logits(tokens, part_size=16)
    assert e.experts.cache.stats.streamed_layers == e.experts.cache.n_layers - 1
    assert e.experts.moe.uses_checked > 0
    np.testing.assert_array_equal(got, want)       # the same op over the same bytes: bit for bit, on the CPU
