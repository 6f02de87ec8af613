"""A compiled decode window updates the slots' KV caches in place: its temporary memory (XLA's memory_analysis of the
compiled function) does not grow by anything like a cache when max_context grows, and every state it returns reuses
a donated input's buffer. A copy of the caches (a converted or transposed cache read by the attention, a lost
donation) would grow it by a whole cache per attention layer; a prompt part may copy the one slot it reads, no more."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from strata import Engine
from strata.engine.runner import WindowRunner, _sampling_of, _with_result_rows
from strata.model.config import LINEAR
from strata.plan import PromptPart, idle_plan

S = 8
CONTEXTS = (8192, 32768)   # large enough that the caches, not the fixed temporaries, decide the peak
PART = 16


def _compiled(ctx: int):
    """(decode window, prompt part) compiled for the demo model at max_context ctx; the engine."""
    e = Engine.load("demo", max_context=ctx, prefill=PART, kernels="xla", say=lambda line: None)
    r = WindowRunner(e, S, PART)
    st = r.rows.last
    plan = replace(idle_plan(S), decode_active=np.ones(S, bool))
    pos, _ = r.decode_rows(plan)
    rows = _with_result_rows(np.stack([np.zeros(S, np.int32), pos, np.zeros(S, np.int32)]))
    stable = r.window_args(plan)
    decode = r.rows._decode.lower(st.params, st.path.args(), r.states, rows, stable[0], *stable[1:], x=None,
                                  greedy=True).compile()
    tokens = np.zeros(PART, np.int32)
    part = r.part._part.lower(st.params, st.path.args(), r.states, np.int32(0), tokens, np.int32(0),
                              np.int32(PART), *_sampling_of(plan, 0), plan.seeds[0], plan.steps[0],
                              x=None).compile()
    return decode, part, e, r


@pytest.fixture(scope="module")
def windows():
    return {ctx: _compiled(ctx) for ctx in CONTEXTS}


def _attention_kv(e, r):
    """Bytes of one attention layer's K cache over the bank, and the bank's whole state."""
    kinds = e.cfg.layer_types
    k = [layer["k"].nbytes for kind, layer in zip(kinds, r.states) if kind != LINEAR]
    return k[0], sum(v.nbytes for layer in r.states for v in layer.values()), len(k)


def test_decode_window_updates_the_caches_in_place(windows):
    small, large = (windows[c] for c in CONTEXTS)
    (d1, _, e1, r1), (d2, _, e2, r2) = small, large
    k1, state1, _ = _attention_kv(e1, r1)
    k2, state2, _ = _attention_kv(e2, r2)
    m1, m2 = d1.memory_analysis(), d2.memory_analysis()
    assert m1 is not None and m2 is not None
    # the one-pass attention's scores grow with the capacity ([S, Hq, Cap] float32, a fraction of a K cache); a
    # copy of any cache would grow it by at least one K cache's growth
    growth = m2.temp_size_in_bytes - m1.temp_size_in_bytes
    assert growth < (k2 - k1) / 2, (m1.temp_size_in_bytes, m2.temp_size_in_bytes, k1, k2)
    # every state returned reuses its donated input's buffer (a lost donation would leave outputs unaliased)
    assert m1.alias_size_in_bytes >= state1 and m2.alias_size_in_bytes >= state2


def test_prompt_part_copies_at_most_its_slot(windows):
    (_, p1, e1, r1), (_, p2, e2, r2) = (windows[c] for c in CONTEXTS)
    k1, state1, n_attn = _attention_kv(e1, r1)
    k2, state2, _ = _attention_kv(e2, r2)
    m1, m2 = p1.memory_analysis(), p2.memory_analysis()
    # one slot's K and V per attention layer at most (the slot the part reads, taken out of the bank)
    slot_kv_growth = n_attn * 2 * (k2 - k1) / S
    assert m2.temp_size_in_bytes - m1.temp_size_in_bytes <= slot_kv_growth, (m1.temp_size_in_bytes,
                                                                               m2.temp_size_in_bytes)
    assert m1.alias_size_in_bytes >= state1 and m2.alias_size_in_bytes >= state2
