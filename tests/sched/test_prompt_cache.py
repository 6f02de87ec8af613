"""The prompt cache over the demo engine: a conversation's turns, rendered by the chat template, give the same greedy
text with the prompt cache as on a cold engine (the same scheduler and runner, every prompt read from token 0 with
no checkpoints), and each turn reads only the tokens it does not share with the stored conversation plus at most
checkpoint_every. Also with three interleaved conversations on three slots (lookahead on), with conversations parked
and resumed, with speculative decoding, on the SYCL backend's eager path, with a partial expert cache, for random
conversation trees (hypothesis), and at the issue's size (12 turns growing past 8K tokens, about a minute). The
policy itself is tested against the fake in test_prompt_cache_fake.py."""
from __future__ import annotations

import time
from dataclasses import replace

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowerings import lowered
from strata import Engine
from strata.engine.runner import WindowRunner
from strata.engine.slot_copies import KV_BLOCK_MAX
from strata.sched.prompt_cache import common_prefix
from strata.sched.request import Delta, Finished, Request
from strata.sched.scheduler import Scheduler
from strata.serve.app import _turn_at

pytestmark = pytest.mark.heavy      # minutes on 2 CPU cores: started first (tests/conftest.py)

WORDS = ("the heron waits by the mill pond while a fox counts the reeds; an owl asks the miller for bread "
         "and seven geese argue about the weather. ").split()


@pytest.fixture(scope="module")
def engine():
    return Engine.load("demo", max_context=4096, prefill=64)


def scheduler(engine, parallel, every=64, lookahead=True, ram_gib=1.0, drafts=None):
    return Scheduler(WindowRunner(engine, parallel, engine.settings.sched.prefill), tokenizer=engine.tokenizer,
                     eos_token_ids=engine.eos_token_ids, max_context=engine.settings.model.max_context,
                     queue_limit=16, lookahead=lookahead, checkpoint_every=every, checkpoint_ram_gib=ram_gib,
                     drafts=drafts)


def text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] for i in range(words))


def render(engine, messages) -> tuple[tuple, int | None]:
    tok = engine.tokenizer
    txt, ids = tok.encode_chat(messages, add_generation_prompt=True)
    return tuple(ids), _turn_at(tok, messages, None, txt, ids, {})


async def ask(sched, req) -> tuple[str, Finished]:
    out, final = "", None
    async with sched.submit(req) as receive:
        async for ev in receive:
            if isinstance(ev, Delta):
                out += ev.content + ev.reasoning
            else:
                final = ev
    assert isinstance(final, Finished), final
    return out, final


def stored(sched, prompt) -> tuple:
    """The stored conversation that starts with `prompt` (the one its request left)."""
    convs = [c for c in sched.cache.live if c is not None] + sched.cache.parked
    return max((tuple(c.tokens) for c in convs), key=lambda t: common_prefix(t, prompt))


def converse(engine, n_convs, turns, parallel, *, every=64, user_words=40, max_tokens=24, lookahead=True,
             together=True, ram_gib=1.0, cached_engine=None, drafts=None, system_words=0):
    """n_convs conversations of `turns` turns each, turns of the conversations sent together (or one after
    another) -> (the cached scheduler, [(prompt, reused, tokens the conversation shared before)]). cached_engine:
    the cached scheduler's engine (default engine, the cold one's); drafts: its DraftPolicy (spec); system_words:
    a system message every conversation starts with (they branch from the first one's checkpoints)."""
    cached = scheduler(cached_engine or engine, parallel, every, lookahead, ram_gib, drafts)
    cold = scheduler(engine, parallel, every, lookahead)
    rows = []

    async def cached_turn(c, k, messages, before, got):
        messages.append({"role": "user", "content": f"conversation {c}, turn {k}: " + text(7 * c + k, user_words)})
        prompt, turn_at = render(engine, messages)
        req = Request(id=f"c{c}t{k}", prompt_ids=prompt, max_tokens=max_tokens, turn_at=turn_at)
        got[c] = req, *await ask(cached, req)
        shared = max([common_prefix(before[c], prompt)] + [common_prefix(b, prompt) for b in before if system_words])
        rows.append((prompt, got[c][2].timings["reused"], shared))
        before[c] = stored(cached, prompt)

    async def cold_turn(c, messages, got):
        req, text_, _ = got[c]
        want, _ = await ask(cold, replace(req, id=req.id + "-cold", cache_prompt=False, checkpoints=False))
        assert text_ == want, (req.id, text_, want)
        messages.append({"role": "assistant", "content": text_})

    async def main():
        # (the two schedulers never run windows at once: two runners over one engine are not run concurrently)
        async with anyio.create_task_group() as tg:
            await tg.start(cached.run)
            await tg.start(cold.run)
            system = [{"role": "system", "content": text(99, system_words)}] if system_words else []
            convs, before = [list(system) for _ in range(n_convs)], [() for _ in range(n_convs)]
            for k in range(turns):
                got = {}
                for step in (lambda c: cached_turn(c, k, convs[c], before, got), lambda c: cold_turn(c, convs[c], got)):
                    if together:
                        async with anyio.create_task_group() as each:
                            for c in range(n_convs):
                                each.start_soon(step, c)
                    else:
                        for c in range(n_convs):
                            await step(c)
            tg.cancel_scope.cancel()
    anyio.run(main)
    for prompt, reused, shared in rows:
        assert len(prompt) - reused <= len(prompt) - shared + every, (len(prompt), reused, shared)
    return cached, rows


def test_turns_give_the_cold_engines_text_and_read_their_new_tokens(engine):
    sched, rows = converse(engine, 1, 6, parallel=1)
    assert all(reused > 0 for _, reused, _ in rows[1:])
    assert sched.metrics()["prompt_cache_hits"] == 5 and sched.stats["windows_ahead"] > 0


def test_three_interleaved_conversations_on_three_slots(engine):
    sched, rows = converse(engine, 3, 4, parallel=3)
    assert sched.metrics()["prompt_cache_hits"] == 9


def test_conversations_parked_and_resumed(engine):
    """Two conversations one after another on one slot: each turn parks the other one and resumes its own."""
    sched, rows = converse(engine, 2, 3, parallel=1, together=False)
    m = sched.metrics()
    assert m["conversations_parked"] == 5 and m["conversations_resumed"] == 4 and m["prompt_cache_hits"] == 4


def test_conversations_sharing_a_system_prompt_branch_from_each_other(engine):
    """Three conversations that start with one system message, one after another on two slots: each first turn
    copies the system prompt's KV from the slot or parked conversation that holds it (the copies are exact: the
    cold engine's text), and no conversation takes another's history."""
    sched, rows = converse(engine, 3, 2, 2, together=False, system_words=150)
    m = sched.metrics()
    assert m["prompt_cache_branches"] >= 2 and m["prompt_cache_hits"] == 5


def test_turns_with_speculative_decoding(engine):
    """With spec 2 on the cached side (verify windows, the head's cache restored with nothing of its own): the same
    text as the cold engine without spec, conversations parked and resumed on one slot."""
    spec = Engine.load("demo", max_context=4096, prefill=64, spec=2, mtp=True)
    sched, rows = converse(engine, 2, 3, parallel=1, together=False, cached_engine=spec)
    m = sched.metrics()
    assert m["prompt_cache_hits"] == 4 and m["conversations_resumed"] == 4 and m["windows_verifying"] > 0


def test_snapshots_restore_exactly_on_both_backends():
    """The runner's copies on the JAX and the SYCL backend (numpy on a CPU): a prompt continued from a restored
    checkpoint, and from a parked KV loaded into another slot, gives the logits of the prompt read whole; the
    checkpoint restores while its copy to the host is under way (to_host waits for nothing) and once the next
    to_host has read it into host memory."""
    import numpy as np
    from strata.plan import PromptPart, idle_plan
    for backend in ("jax", "sycl"):
        e = Engine.load("demo", max_context=512, prefill=64, backend=backend)
        r = WindowRunner(e, 2, 64)
        toks = (np.arange(100) * 37 % 600).astype(np.int32)

        def part(slot, start, tk):
            plan = replace(idle_plan(2), logprobs=np.zeros(2, np.int32),
                           part=PromptPart(slot=slot, tokens=np.asarray(tk, np.int32), start=start, last=True))
            return r.run(plan).part_logprobs
        whole = part(0, 0, toks)
        part(1, 0, toks[:40])
        snap = r.to_host(r.snapshot(1))
        assert not any(isinstance(v, np.ndarray) for layer in snap.data for v in layer.values())   # under way
        part(1, 40, toks[40:70])                        # the slot's state moves on past the checkpoint
        r.restore(1, snap)
        again = part(1, 40, toks[40:])
        r.to_host(r.snapshot(0))                        # reads snap's copy into host memory
        assert snap.on_host and all(isinstance(v, np.ndarray) for layer in snap.data for v in layer.values())
        kv = r.save_kv(1, 40)
        part(0, 0, toks[::-1])                          # slot 0 holds something else
        r.load_kv(0, kv)
        r.restore(0, snap)
        resumed = part(0, 40, toks[40:])
        for got in (again, resumed):
            np.testing.assert_array_equal(got.top_ids, whole.top_ids)
            np.testing.assert_allclose(got.top, whole.top, rtol=1e-5, atol=1e-5)


def test_the_mtp_heads_state_travels_with_checkpoints_and_kv_copies():
    """With spec on, a checkpoint holds the MTP head's hidden state and a KV copy (parked, loaded, or slot to slot)
    the head's KV too: a prompt continued in another slot leaves the head's state as the prompt read whole leaves
    it, so drafting after a cache hit is what it would be cold; the logits are the whole read's."""
    import numpy as np
    from strata.plan import PromptPart, idle_plan
    e = Engine.load("demo", max_context=512, prefill=64, spec=2, mtp=True)
    r = WindowRunner(e, 3, 64)
    toks = (np.arange(100) * 37 % 600).astype(np.int32)

    def part(slot, start, tk):
        plan = replace(idle_plan(3), logprobs=np.zeros(3, np.int32),
                       part=PromptPart(slot=slot, tokens=np.asarray(tk, np.int32), start=start, last=True))
        return r.run(plan).part_logprobs

    def head(slot):
        bank = r.spec.bank
        return {k: np.asarray(v[slot][:len(toks)]) for k, v in bank["kv"].items()}, np.asarray(bank["h"][slot])
    whole = part(0, 0, toks)
    part(1, 0, toks[:40])
    snap, kv = r.to_host(r.snapshot(1)), r.save_kv(1, 40)
    part(2, 0, toks[::-1])                              # slot 2 holds something else, its head too
    r.load_kv(2, kv)
    r.restore(2, snap)
    from_parked = part(2, 40, toks[40:])
    part(1, 0, toks[::-1])
    r.copy_kv(1, 40, 2)                                 # a branch: slot 2's prefix into slot 1
    r.restore(1, snap)
    from_slot = part(1, 40, toks[40:])
    want_kv, want_h = head(0)
    for slot, got in ((2, from_parked), (1, from_slot)):
        np.testing.assert_array_equal(got.top_ids, whole.top_ids)
        got_kv, got_h = head(slot)
        np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-5)
        for k in want_kv:
            np.testing.assert_allclose(got_kv[k], want_kv[k], rtol=1e-5, atol=1e-5, err_msg=f"slot {slot} {k}")


@pytest.mark.parametrize("backend", ["sycl"])
def test_turns_on_the_eager_backend(backend):
    e = Engine.load("demo", max_context=2048, prefill=64, backend=backend)
    sched, rows = converse(e, 1, 3, parallel=2, user_words=20, max_tokens=12)
    assert sched.metrics()["prompt_cache_hits"] == 2


def test_turns_with_a_partial_expert_cache():
    """8 of the demo's 64 experts in device slots: parts layer by layer (borrowing slots), decode by window fetch."""
    e = Engine.load("demo", max_context=2048, prefill=64, expert_cache=8, say=lambda line: None)
    sched, rows = converse(e, 1, 3, parallel=1, user_words=20, max_tokens=12)
    assert sched.metrics()["prompt_cache_hits"] == 2


trees = st.lists(st.tuples(st.sampled_from(["new", "extend", "edit", "regenerate", "truncate"]),
                           st.integers(0, 1 << 16), st.integers(2, 30)), min_size=2, max_size=5)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=trees, every=st.sampled_from([16, 32, 64]))
def test_random_conversation_trees_against_a_cold_engine(engine, ops, every):
    """Chats built from earlier ones (extended with a turn, an earlier user message edited, a prompt sent again, the
    history cut after a turn), on two slots: each reply is the cold engine's."""
    cached, cold = scheduler(engine, 2, every), scheduler(engine, 2, every)
    chats: list[list] = []

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(cached.run)
            await tg.start(cold.run)
            for i, (op, pick, words) in enumerate(ops):
                base = chats[pick % len(chats)] if chats else []
                if op == "new" or not base:
                    msgs = [{"role": "user", "content": text(pick, words)}]
                elif op == "extend":
                    msgs = base + [{"role": "user", "content": text(pick, words)}]
                elif op == "edit":
                    users = [j for j, m in enumerate(base) if m["role"] == "user"]
                    j = users[pick % len(users)]
                    msgs = base[:j] + [{"role": "user", "content": text(pick + 1, words)}]
                elif op == "regenerate":
                    msgs = base[:-1] if base[-1]["role"] == "assistant" else base
                else:
                    msgs = base[:max(1, pick % len(base))]
                    msgs = msgs if msgs[-1]["role"] == "user" else msgs[:-1]
                prompt, turn_at = render(engine, msgs)
                req = Request(id=f"r{i}", prompt_ids=prompt, max_tokens=8, turn_at=turn_at)
                got, _ = await ask(cached, req)
                want, _ = await ask(cold, replace(req, cache_prompt=False, checkpoints=False))
                assert got == want, (i, op)
                chats.append(msgs + [{"role": "assistant", "content": got}])
            tg.cancel_scope.cancel()
    anyio.run(main)


def test_twelve_turns_past_8k_tokens():
    """The issue's size: 12 turns growing past 8K tokens, checkpoint_every 256, lookahead on."""
    e = Engine.load("demo", max_context=10240, prefill=512)
    t = time.perf_counter()
    sched, rows = converse(e, 1, 12, parallel=1, every=256, user_words=300, max_tokens=32)
    assert len(rows[-1][0]) > 8192, len(rows[-1][0])
    assert sched.metrics()["prompt_cache_hits"] == 11
    print(f"12 turns to {len(rows[-1][0])} tokens in {time.perf_counter() - t:.0f} s")


def test_the_copies_compile_nothing_after_warm_up(engine):
    import numpy as np
    r = WindowRunner(engine, 2, 64)
    r.warm_up()
    with lowered() as compiled:
        snap = r.snapshot(1)
        r.restore(0, snap)
        r.restore(1, r.to_host(snap))
        r.load_kv(1, r.save_kv(0, KV_BLOCK_MAX + 5))     # a large block, then a small one
    assert compiled == [], f"{len(compiled)} functions were compiled after warm-up"
    assert isinstance(snap.nbytes, int) and snap.nbytes == sum(np.asarray(v).nbytes for layer in snap.data
                                                              for v in layer.values())


@pytest.mark.parametrize("n,blocks", [(470, [(0, 120), (120, 120), (240, 120), (360, 100), (460, 100)]),
                                      (500, [(0, 120), (120, 120), (240, 120), (360, 120), (480, 100)])])
def test_a_parked_kv_of_many_blocks_loads_back_exactly(monkeypatch, n, blocks):
    """save_kv over more blocks than it keeps in flight (slot_copies.KV_BLOCKS_IN_FLIGHT), of sizes that do not
    divide the cache's 576 rows (large blocks of 120 while they fit in n, then small ones of 100; at n = 500 the last
    one would run past the cache and is read and written at 476): loaded into another slot, every attention layer's
    first n rows equal the original's, in order."""
    import numpy as np
    from strata.engine import slot_copies
    from strata.plan import PromptPart, idle_plan
    monkeypatch.setattr(slot_copies, "KV_BLOCK_MAX", 120)
    monkeypatch.setattr(slot_copies, "KV_BLOCK_MIN", 100)
    e = Engine.load("demo", max_context=512, prefill=64)
    r = WindowRunner(e, 2, 64)
    assert r.copies.sizes == (120, 100) and e.capacity == 576
    toks = (np.arange(512) * 37 % 600).astype(np.int32)
    for start in range(0, len(toks), 64):
        r.run(replace(idle_plan(2), part=PromptPart(slot=0, tokens=toks[start:start + 64], start=start, last=True)))
    saved = r.save_kv(0, n)
    assert [(a, next(iter(rows[0].values())).shape[0]) for a, rows in saved.data] == blocks
    assert len(blocks) > slot_copies.KV_BLOCKS_IN_FLIGHT
    r.load_kv(1, saved)
    full = [i for i, layer in enumerate(r.states) if "k" in layer]
    for i in full:
        for k in r.states[i]:
            a = np.asarray(r.states[i][k])
            assert np.array_equal(a[1, :n], a[0, :n]), (i, k)
