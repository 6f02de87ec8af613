"""Property test of the expert slots (ARCHITECTURE.md, "Expert slots"): random interleavings of decode windows from
several sequences, prompt parts that borrow slots (or use staging slots), adaptive swaps, refills and evictions.

Every expert computation checks, in the very pool value it computes with, that each slot it reads holds exactly
the (layer, expert) it claims (MoeRunner.check_uses raises SlotMismatch otherwise: the seed-000 failure); and every
output is compared with the numpy reference computed from the true experts. After every step the slot table, the
slot states and the resident slots' bytes are checked against the pack's checksums.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.experts.cache import ExpertCache, SlotState
from strata.experts.moe import MoeRunner, SlotMismatch
from strata.experts.tiers import HostMirror, MemoryStore
from strata.jax_backend.backend import JaxBackend
from strata.weights import quant

H, I, LAYERS, E, K = 32, 16, 3, 8, 2
ROWS, PART = 4, 40            # decode windows of up to 4 sequences; prompt parts of up to 40 tokens

OPS = JaxBackend()
rng0 = np.random.default_rng(0)
LAYOUT = quant.layout("f32", H, I)
WEIGHTS = [(rng0.standard_normal((E, I, H)).astype(np.float32) / 4, rng0.standard_normal((E, I, H)).astype(np.float32) / 4,
            rng0.standard_normal((E, H, I)).astype(np.float32) / 4) for _ in range(LAYERS)]
STORE = MemoryStore(LAYOUT, WEIGHTS)
# the pinned host copy a window-fetch decode copies its misses from: chunks of 3 experts, so a layer spans three
MIRROR = HostMirror(STORE, LAYERS * E * LAYOUT.nbytes, chunk_bytes=3 * LAYOUT.nbytes, device=OPS)
WINDOW_CHUNKS = MIRROR.window_chunks()
COMPILED: dict = {}


def _compiled(name, make):
    if name not in COMPILED:
        COMPILED[name] = make()
    return COMPILED[name]


def _reference(p, x, ids, w):
    """y[t] = sum_j w[t, j] * expert(ids[t, j])(x[t]) in float64, from the true weights."""
    g, u, d = WEIGHTS[p]
    y = np.zeros((x.shape[0], H))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if e < 0:
                continue
            a, b = g[e] @ x[t], u[e] @ x[t]
            y[t] += w[t, j] * (d[e] @ (a / (1 + np.exp(-a)) * b))
    return y


def _check_invariants(cache: ExpertCache, staging: set[int]):
    table = cache.table()
    for i in range(cache.n_slots):
        s = cache.slot(i)
        if s.state is SlotState.RESIDENT:
            assert table[s.layer, s.expert] == i
        elif s.state is SlotState.LOANED:
            assert i in staging, f"slot {i} is still on loan to {s.owner} after the computation returned"
            assert i not in table
        else:
            assert s.state is SlotState.FREE and i not in table
    assert (table >= 0).sum() == sum(cache.slot(i).state is SlotState.RESIDENT for i in range(cache.n_slots))
    assert cache.verify() == [], "a resident slot's bytes are not its expert's"


def _window_fetch(p, x, ids, w, valid, pool, table):
    chunks, starts = WINDOW_CHUNKS[p]
    f = _compiled(("window", starts), lambda: OPS.compile(
        lambda x, ids, w, valid, pool, row, chunks: OPS.experts_fetch(x, ids, w, valid, pool, row, chunks, starts,
                                                                      LAYOUT)))
    return f(x, ids, w, valid, pool, table[p], chunks)


step = st.one_of(
    st.tuples(st.just("decode"), st.integers(0, LAYERS - 1), st.integers(1, ROWS)),
    st.tuples(st.just("window"), st.integers(0, LAYERS - 1), st.integers(1, ROWS)),
    st.tuples(st.just("part"), st.integers(0, LAYERS - 1), st.integers(1, PART)),
    st.tuples(st.just("adapt"), st.integers(0, 6), st.just(0)),
    st.tuples(st.just("refill"), st.just(0), st.just(0)),
    st.tuples(st.just("evict"), st.integers(0, 63), st.just(0)),
    st.tuples(st.just("end_window"), st.just(0), st.just(0)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_slots=st.integers(K, 20), borrow=st.booleans(), policy=st.sampled_from(["fetch", "cpu"]),
       steps=st.lists(step, min_size=1, max_size=14), seed=st.integers(0, 2 ** 16))
def test_every_computation_reads_the_experts_it_claims(n_slots, borrow, policy, steps, seed):
    rng = np.random.default_rng(seed)
    staging_n = 0 if borrow else min(3, n_slots - 1)
    cache = ExpertCache(OPS, STORE, n_slots + staging_n, LAYERS, E)
    moe = MoeRunner(OPS, cache, STORE, LAYOUT, E, _compiled, miss_policy=policy, cpu_ops=OPS, borrow=borrow,
                    staging=staging_n, check_uses=True)
    staging = set(moe.staging)
    cache.place(rng.random((LAYERS, E)))
    _check_invariants(cache, staging)
    for kind, a, b in steps:
        if kind == "window":            # a window-fetch decode layer: the table by value, misses from host chunks
            x = rng.standard_normal((ROWS, H)).astype(np.float32)
            ids = np.stack([rng.choice(E, K, replace=False) for _ in range(ROWS)]).astype(np.int32)
            w = rng.random((ROWS, K)).astype(np.float32)
            valid = np.arange(ROWS) < b
            table = cache.table()
            y, copied = _window_fetch(a, x, ids, w, valid, cache.pool, table)
            routed = np.where(valid[:, None], ids, -1)
            want = _reference(a, x, routed, w)
            assert np.abs(np.asarray(y) - want).max() <= 1e-5 * max(np.abs(want).max(), 1e-3)
            missing = {int(e) for e in routed[routed >= 0] if table[a, e] < 0}
            assert int(copied) == len(missing)
        elif kind in ("decode", "part"):
            rows = ROWS if kind == "decode" else PART
            x = rng.standard_normal((rows, H)).astype(np.float32)
            ids = np.stack([rng.choice(E, K, replace=False) for _ in range(rows)]).astype(np.int32)
            w = rng.random((rows, K)).astype(np.float32)
            valid = np.arange(rows) < b
            y = moe.compute(a, OPS.to_device(x), OPS.to_device(w), ids, valid, part=kind == "part")
            want = _reference(a, x, np.where(valid[:, None], ids, -1), w)
            assert np.abs(np.asarray(y) - want).max() <= 1e-5 * max(np.abs(want).max(), 1e-3)
        elif kind == "adapt":
            cache.adapt(a)
        elif kind == "refill":
            cache.refill()
        elif kind == "evict":
            i = a % cache.n_slots
            if cache.slot(i).state is SlotState.RESIDENT:
                cache.evict(i)
        else:
            cache.end_window()
        _check_invariants(cache, staging)


def test_the_check_catches_a_window_reading_a_slot_on_loan():
    """The detector is not vacuous: a window that took the table, then read a slot after it was lent to a prompt
    part and overwritten (what seed 000 describes), is caught before it computes."""
    cache = ExpertCache(OPS, STORE, 6, LAYERS, E)
    moe = MoeRunner(OPS, cache, STORE, LAYOUT, E, _compiled, check_uses=True)
    cache.place()
    stale = cache.table()                                      # a decode window's view, taken first
    victim = int(stale[0, 0])
    lent = cache.loan(6, "prompt part")                       # the part borrows every slot
    assert victim in lent and cache.table()[0, 0] == -1      # the loan took it out of the table first
    cache.write_loaned([victim], [(1, 5)], "prompt part")     # and wrote another expert into it
    slots = np.full((ROWS, K), -1, np.int32)
    slots[0, 0] = stale[0, 0]                                  # read as expert (0, 0), as the stale table says
    ids = np.zeros((ROWS, K), np.int32)
    with pytest.raises(SlotMismatch):
        moe._run(OPS.to_device(np.ones((ROWS, H), np.float32)), slots, OPS.to_device(np.ones((ROWS, K), np.float32)),
                 0, ids)


def test_decode_misses_beyond_the_usable_slots_run_in_passes_beside_staging_slots():
    """Borrowing off: the reserved staging slots are not reusable, so a decode window whose misses outnumber the
    other slots computes them in passes of the slots that are (found by reading the fetch path, kept as a case)."""
    cache = ExpertCache(OPS, STORE, 4, LAYERS, E)
    moe = MoeRunner(OPS, cache, STORE, LAYOUT, E, _compiled, borrow=False, staging=2, check_uses=True)
    cache.place()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((ROWS, H)).astype(np.float32)
    ids = np.array([[0, 1], [2, 3], [4, 5], [6, 7]], np.int32)            # 8 distinct experts, 2 reusable slots
    w = rng.random((ROWS, K)).astype(np.float32)
    y = moe.compute(1, OPS.to_device(x), OPS.to_device(w), ids, np.ones(ROWS, bool), part=False)
    want = _reference(1, x, ids, w)
    assert np.abs(np.asarray(y) - want).max() <= 1e-5 * np.abs(want).max()
    _check_invariants(cache, set(moe.staging))


def test_adapt_swaps_in_a_clearly_busier_expert_and_does_not_churn_on_near_ties():
    """Adaptive swaps follow decayed routing counts and need the newcomer's count above the evicted one's by more
    than SWAP_MARGIN + SWAP_Z * sqrt(both counts) (cache.py): an expert routed far more than a resident one replaces
    it; a count just at that threshold swaps nothing."""
    from strata.experts.cache import SWAP_MARGIN, SWAP_Z
    cache = ExpertCache(OPS, STORE, 4, LAYERS, E)
    cache.place()                                        # in order: layer 0, experts 0..3
    assert sorted(int(e) for e in np.flatnonzero(cache.table()[0] >= 0)) == [0, 1, 2, 3]
    # the threshold over residents with count 0: s = margin + z * sqrt(s), s = ((z + sqrt(z^2 + 4 margin)) / 2)^2
    at = ((SWAP_Z + np.sqrt(SWAP_Z ** 2 + 4 * SWAP_MARGIN)) / 2) ** 2
    near = np.zeros(E)
    near[5] = 0.999 * at                                 # better than the residents (0), but within the threshold
    cache.observe(0, near)
    assert cache.adapt(4) == 0 and cache.stats.swaps == 0
    busy = np.zeros(E)
    busy[6] = 3 * at
    cache.observe(0, busy)
    assert cache.adapt(4) == 1 and cache.table()[0, 6] >= 0
    assert cache.verify() == []


def test_mirror_reads_blobs_in_bulk_and_singly_alike():
    """HostMirror.blobs (pinned chunks read with one device call each, the CPU miss path) equals blob() and the
    store, for mirrored and unmirrored experts alike."""
    half = HostMirror(STORE, (LAYERS * E // 2) * LAYOUT.nbytes, chunk_bytes=3 * LAYOUT.nbytes, device=OPS)
    for mirror in (MIRROR, half):
        for p in range(LAYERS):
            experts = np.array([5, 0, 7], np.int32)          # not a power of two: the device call pads its rows
            got = mirror.blobs(p, experts)
            assert got.shape == (3, LAYOUT.nbytes)
            for row, e in zip(got, experts):
                assert np.array_equal(row, STORE.blob(p, int(e))) and np.array_equal(row, mirror.blob(p, int(e)))
