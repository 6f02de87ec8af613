"""The attention KV's host tier (kv_resident) on the demo engine: conversations of about 2K tokens give the text of a
cold engine that keeps every position on the device (unlimited, with the prompt cache: test_prompt_cache.py), with
the device window at 64 and 256, on 1-3 parallel slots with prompt parts interleaved and lookahead on, the prompt
cache resuming spilled conversations (on their slot and parked), with int8 KV, the Pallas kernels, speculative
decoding and the layer split; a 64K prompt keeps the state's device bytes within the window; bad settings are
refused naming what is allowed."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from lowerings import lowered
from test_prompt_cache import converse

from strata import Engine
from strata.backend import HOST
from strata.config import Settings
from strata.engine.core import _kv_window, device_bytes
from strata.engine.runner import HostPart, WindowRunner, _host_rows
from strata.engine.slot_copies import ParkedRow
from strata.errors import ConfigError
from strata.plan import PromptPart, idle_plan
from strata.sched.drafts import DraftPolicy

pytestmark = pytest.mark.heavy

CONTEXT, PREFILL = 4096, 32


@pytest.fixture(scope="module")
def cold():
    return Engine.load("demo", max_context=CONTEXT, prefill=PREFILL)


def tiered(resident, **kw):
    return Engine.load("demo", max_context=CONTEXT, prefill=PREFILL, kv_resident=resident, **kw)


@pytest.mark.parametrize("resident,parallel,together,convs,turns", [(64, 1, False, 3, 3), (256, 3, True, 2, 4)])
def test_conversations_match_the_cold_engine(cold, resident, parallel, together, convs, turns):
    """Conversations of about 2K tokens by their last turn: three of 3 turns one after another on one slot (each
    turn parks the last conversation and resumes its own; with one parked row, some park in place and the others
    are copied while the row is taken), or two of 4 turns together on 3 slots."""
    e = tiered(resident, kv_parked=1)
    sched, rows = converse(cold, convs, turns, parallel, user_words=230, max_tokens=24, together=together,
                           cached_engine=e)
    assert len(rows[-1][0]) > 1400, len(rows[-1][0])
    m = sched.metrics()
    assert m["prompt_cache_hits"] == 6
    by_ref = [c for c in sched.cache.parked if isinstance(c.kv.data, ParkedRow)]
    assert m["kv_rows_free"] + len(by_ref) == 1                 # every parked row held or free: none lost
    if resident:
        assert m["kv_spills"] > 0 and m["kv_positions_spilled"] > 0
        slots = sched.slots()
        assert all(s["kv_device_tokens"] + s["kv_host_tokens"] == s["conversation_tokens"] for s in slots)
        assert any(s["kv_host_tokens"] > 0 for s in slots)
    if not together:
        assert m["conversations_parked"] > m["kv_parks_by_reference"] > 0 and m["conversations_resumed"] > 0


def test_branches_copy_the_shared_prefix_across_the_tiers(cold):
    """Three conversations sharing a long system prompt with a 64-row device window and one parked row, on one slot
    (the prefix's KV copied from a conversation parked by reference to make room: host row to host row) and on two
    (slot to slot): every reply is the cold engine's."""
    for parallel in (1, 2):
        sched, rows = converse(cold, 3, 2, parallel, user_words=40, max_tokens=16, together=False,
                               system_words=200, cached_engine=tiered(64, kv_parked=1))
        m = sched.metrics()
        assert m["prompt_cache_branches"] >= 2 and m["kv_spills"] > 0 and m["kv_parks_by_reference"] > 0
        by_ref = [c for c in sched.cache.parked if isinstance(c.kv.data, ParkedRow)]
        assert m["kv_rows_free"] + len(by_ref) == 1


@pytest.mark.parametrize("kw", [dict(kv="int8"), dict(kernels="pallas")], ids=["int8", "pallas"])
def test_int8_and_the_kernels(kw):
    """int8 KV (its scales spill with it), and the Pallas kernels (interpreted: decode rows read the host part
    through the tiered decode kernel), two conversations on one slot: parked in place, so the slot's host row is
    another bank row than its index once the first is parked."""
    cold = Engine.load("demo", max_context=CONTEXT, prefill=PREFILL, **kw)
    sched, rows = converse(cold, 2, 2, 1, user_words=120, max_tokens=16, together=False,
                           cached_engine=tiered(64, **kw))
    m = sched.metrics()
    assert m["kv_spills"] > 0 and m["kv_parks_by_reference"] > 0 and m["conversations_resumed"] > 0


def test_speculative_decoding_verifies_across_the_tiers(cold):
    """spec 2 with drafts offered in every window (the demo head's drafts are mostly rejected: rollbacks): verify
    windows write 3 positions a row into the window, conversations parked and resumed on one slot."""
    spec = tiered(64, spec=2, mtp=True)
    sched, rows = converse(cold, 2, 3, 1, user_words=120, max_tokens=24, together=False, cached_engine=spec,
                           drafts=DraftPolicy(2, adaptive=False))
    m = sched.metrics()
    assert m["windows_verifying"] > 20 and m["kv_spills"] > 0 and m["conversations_resumed"] > 0


def test_a_guard_repair_keeps_positions_below_the_window():
    """repair(keep=n) with n below the slot's host part: the window is read back first, and a part continued from n
    gives the logits of the prompt read whole."""
    e = tiered(64)
    r = WindowRunner(e, 2, PREFILL)
    toks = (np.arange(300) * 37 % 600).astype(np.int32)
    whole = read(r, 0, 0, toks).part_logprobs
    read(r, 1, 0, toks)
    assert r.tiers.base[1] > 100
    snap = r.snapshot(1)
    r.repair((1,), keep=(100,))
    assert r.tiers.base[1] <= 100
    r.restore(1, snap)           # (the snapshot is of position 300; only the KV before 100 is asked for below)
    read(r, 1, 0, toks[:100])    # the recurrent state rebuilt, then the rest continued from the kept KV
    again = read(r, 1, 100, toks[100:]).part_logprobs
    np.testing.assert_array_equal(again.top_ids, whole.top_ids)
    np.testing.assert_allclose(again.top, whole.top, rtol=1e-5, atol=1e-5)


def read(r, slot: int, start: int, tokens, copies: tuple = ()):
    """tokens read into a runner's slot from position start, in parts of its part size (the last part copied to
    `copies`) -> the last part's WindowResult (with logprobs)."""
    size = r.part_size
    for a in range(0, len(tokens), size):
        last = a + size >= len(tokens)
        res = r.run(replace(idle_plan(r.n_slots), logprobs=np.zeros(r.n_slots, np.int32), part=PromptPart(
            slot=slot, tokens=np.asarray(tokens[a:a + size], np.int32), start=start + a, last=True,
            copies=copies if last else ())))
    return res


def generate(e, prompt, steps: int) -> tuple[list[int], WindowRunner]:
    """prompt read in parts of the engine's prefill on slot 0 of a one-slot runner, then `steps` greedy tokens."""
    r = WindowRunner(e, 1, e.settings.sched.prefill)
    tokens = [read(r, 0, 0, prompt).part_next]
    for i in range(steps):
        plan = replace(idle_plan(1), decode_active=np.ones(1, bool), decode_tokens=np.array(tokens[-1:], np.int32),
                       decode_pos=np.array([len(prompt) + i], np.int32), steps=np.array([i], np.int32))
        tokens.append(int(r.run(plan).decode_next[0]))
    return tokens, r


def test_a_long_conversation_keeps_the_device_bytes_within_the_window():
    """A 64K-token prompt with kv_resident 4096: the runner's device state is that of a 4096-row window per slot
    (the host arrays, in host memory, hold the rest), and the reply's tokens are the one-tier engine's."""
    n, resident = 65536, 4096
    kw = dict(max_context=n + 64, prefill=2048)
    prompt = (np.arange(n) * 7919 % 600).astype(np.int32)
    e = Engine.load("demo", kv_resident=resident, **kw)
    got, r = generate(e, prompt, 8)
    attn = [layer for layer in r.states if "base" in layer]
    kv_device = sum(a.nbytes for layer in attn for k, a in layer.items() if not k.endswith(HOST))
    row = sum(a.nbytes // a.shape[1] for layer in attn for k, a in layer.items() if a.ndim > 1 and not k.endswith(HOST))
    assert kv_device <= resident * row + 8 * len(attn)          # the window's rows (+ the int32 bases and rows)
    assert all(a.sharding.memory_kind == "pinned_host" for layer in attn for k, a in layer.items() if k.endswith(HOST))
    assert r.tiers.base[0] >= n - resident
    assert device_bytes(e.init_state(tiers=True)) < device_bytes(e.init_state()) / 8
    assert got == generate(Engine.load("demo", **kw), prompt, 8)[0]


def test_a_parts_copies_take_its_tiers():
    """A prompt whose last part is copied to a second slot (n = 2): both slots decode the one-tier engine's tokens
    from the copied window and host rows."""
    def run(e):
        r = WindowRunner(e, 2, PREFILL)
        toks = (np.arange(200) * 37 % 600).astype(np.int32)
        res = read(r, 0, 0, toks, copies=(1,))
        rows, out = [res.part_next, int(res.copies_next[0])], []
        for i in range(24):
            plan = replace(idle_plan(2), decode_active=np.ones(2, bool), decode_tokens=np.array(rows, np.int32),
                           decode_pos=np.full(2, len(toks) + i, np.int32), steps=np.full(2, i + 1, np.int32))
            rows = r.run(plan).decode_next.tolist()
            out.append(rows)
        return out, r
    got, r = run(tiered(64))
    assert r.tiers.base[1] == r.tiers.base[0] > 0
    assert got == run(Engine.load("demo", max_context=CONTEXT, prefill=PREFILL))[0]


def test_the_layer_split_keeps_each_stages_tiers():
    """Two stages on two CPU devices, each holding its own layers' windows and host arrays."""
    prompt = (np.arange(400) * 31 % 600).astype(np.int32)
    e = tiered(64, layer_split="2", say=lambda line: None)
    assert e.split
    got, r = generate(e, prompt, 24)
    assert r.tiers.spills > 0
    assert got == generate(Engine.load("demo", max_context=CONTEXT, prefill=PREFILL), prompt, 24)[0]


@pytest.mark.parametrize("kw", [{}, dict(layer_split="2"), dict(expert_cache=16, window_fetch=False)],
                         ids=["one_stage", "split", "layer_by_layer"])
def test_a_conversation_parked_in_place_continues_exactly(cold, kw):
    """A conversation parked in place (its host row kept, the slot given the free one) while another prompt spills
    through the slot, then resumed (its row back, its checkpoint restored): it decodes the one-tier engine's tokens;
    on a layer split every stage moves its own rows; with an expert cache the windows run layer by layer."""
    e = tiered(64, kv_parked=1, say=lambda line: None, **kw)
    prompt = (np.arange(400) * 31 % 600).astype(np.int32)
    r = WindowRunner(e, 1, PREFILL)
    assert kw.get("window_fetch", True) or isinstance(r.part, HostPart)
    tokens = [read(r, 0, 0, prompt).part_next]
    ck, saved = r.snapshot(0), r.save_kv(0, len(prompt))
    assert isinstance(saved.data, ParkedRow) and saved.nbytes == 0 and r.tiers.row[0] != saved.data.row
    other = (np.arange(300) * 7 % 600).astype(np.int32)              # another conversation, spilled, in the slot
    one_tier = WindowRunner(cold, 1, PREFILL)
    a, b = read(r, 0, 0, other).part_logprobs, read(one_tier, 0, 0, other).part_logprobs
    np.testing.assert_array_equal(a.top_ids, b.top_ids)               # it attended its own row's host part
    np.testing.assert_allclose(a.top, b.top, rtol=1e-5, atol=1e-5)
    assert r.tiers.base[0] > 0 and r.metrics()["kv_rows_free"] == 0
    r.load_kv(0, saved)
    r.restore(0, ck)
    got = decode(r, tokens[0], len(prompt), 16)
    assert r.tiers.row[0] == saved.data.row and r.metrics()["kv_rows_free"] == 1
    want = decode(one_tier, read(one_tier, 0, 0, prompt).part_next, len(prompt), 16)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):             # every key the one-tier engine attends: the logits agree
        np.testing.assert_array_equal(a.top_ids, b.top_ids)
        np.testing.assert_allclose(a.top, b.top, rtol=1e-5, atol=1e-5)


def decode(r, token: int, pos: int, steps: int) -> list:
    """steps greedy tokens of slot 0 (the runner's other slots idle) from token at pos -> [(token, its row's
    Logprobs)]."""
    out, n = [], r.n_slots
    for i in range(steps):
        one = lambda v: np.array([v] + [0] * (n - 1), np.int32)          # noqa: E731
        plan = replace(idle_plan(n), decode_active=np.arange(n) == 0, decode_tokens=one(token),
                       decode_pos=one(pos + i), steps=one(i), logprobs=np.full(n, 20, np.int32))
        res = r.run(plan)
        token = int(res.decode_next[0])
        out.append((token, res.decode_logprobs))
    return out


def test_nothing_compiles_after_warm_up():
    """After warm-up a tiered runner's parts with spills, decode rows, checkpoints (on the device, their copy under
    way, read into host memory), parks in place and by copy, and resumes compile nothing."""
    r = WindowRunner(tiered(64, kv_parked=1), 2, PREFILL)
    r.warm_up()
    with lowered() as compiled:
        tokens = [read(r, 0, 0, (np.arange(200) * 37 % 600).astype(np.int32)).part_next]
        ck = r.to_host(r.snapshot(0))
        r.to_host(r.snapshot(1))                                     # reads ck into host memory
        in_place = r.save_kv(0, 200)
        spare, r.tiers.free = r.tiers.free, []
        copied = r.save_kv(1, 100)
        r.tiers.free = spare
        r.load_kv(1, copied)
        r.load_kv(0, in_place)
        r.restore(0, ck)
        decode(r, tokens[0], 200, 2)
    assert isinstance(in_place.data, ParkedRow) and not isinstance(copied.data, ParkedRow)
    assert compiled == [], f"{len(compiled)} functions were compiled after warm-up"


def test_bad_settings_are_refused():
    def window(**flat):
        return _kv_window(Settings.build(**flat), Engine.load("demo", max_context=512, prefill=32).backend)
    assert window(max_context=512, prefill=32) == 0
    assert window(max_context=512, prefill=32, kv_resident=100) == 128
    with pytest.raises(ConfigError, match="larger than max_context 512"):
        window(max_context=512, prefill=32, kv_resident=1024)
    with pytest.raises(ConfigError, match="smaller than a prompt part.*at least 65"):
        window(max_context=512, prefill=64, kv_resident=64)
    with pytest.raises(ConfigError, match="kv_resident .* is not allowed"):
        Settings.build(kv_resident=-1)
    with pytest.raises(ConfigError, match="rope_scale .* is not allowed"):
        Settings.build(rope_scale=0.5)
    with pytest.raises(ConfigError, match="needs 3.00 GiB, but only 2.00 GiB of RAM is available: lower max_con"):
        _host_rows(1 << 30, 64, 2, 1, free=2 << 30)
    with pytest.raises(ConfigError, match="kv_parked .* is not allowed"):
        Settings.build(kv_parked=-1)
    # auto: a row a slot, within half of what the slots' rows leave
    assert _host_rows(1 << 30, 64, 2, "auto", free=4 << 30) == 1
    assert _host_rows(1 << 30, 64, 2, "auto", free=9 << 30) == 2
    assert _host_rows(1 << 30, 64, 2, "auto", free=3 << 30) == 0
    assert _host_rows(1 << 20, 64, 2, 2) == 2          # this machine's MemAvailable: 4 MiB fit
    no_pinned = SimpleNamespace(name="jax", host_kv=None)          # jax under skip_temp on a GPU
    with pytest.raises(ConfigError, match="skip_temp leaves no pinned host memory: set command_buffer_update = xla_de"):
        _kv_window(Settings.build(max_context=512, prefill=32, kv_resident=128), no_pinned)
