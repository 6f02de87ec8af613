"""The prompt cache's policy against the FakeExecutor, whose slots model what their KV and recurrent state hold (a
restore of a checkpoint whose KV the slot lacks, or a part that does not continue the recurrent state, raises; each
last part records the tokens its state read): a conversation's next turn reads only what it does not share (plus at
most checkpoint_every), checkpoints never hold a token a window ahead fed, conversations are parked and resumed when
their slot is needed, the RAM budget evicts least recently used first, the request fields opt out, and a failed
request leaves nothing behind. Random conversation trees (hypothesis) hold all of it at once."""
from __future__ import annotations

import anyio
from fake_executor import FakeExecutor, expected_tokens, text_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_fake import P, drain, ended, sched_over, tokenizer  # noqa: F401 - the fixture

import pytest
from strata.sched.guard import Guard
from strata.sched.prompt_cache import common_prefix
from strata.sched.request import Failed, Finished, Request, SamplingParams

HEADER = P("<A>")              # stands for the assistant header that ends every chat prompt


def serve_rounds(sched, rounds) -> list[dict]:
    """Serve rounds of requests (a round's together, rounds one after another) -> per round {id: (text, final)}."""
    out = []

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(sched.run)
            for round_ in rounds:
                events = {r.id: [] for r in round_}
                streams = {r.id: sched.submit(r) for r in round_}
                async with anyio.create_task_group() as clients:
                    for rid, stream in streams.items():
                        clients.start_soon(drain, stream, events[rid])
                out.append({rid: ended(evs) for rid, evs in events.items()})
            tg.cancel_scope.cancel()
    anyio.run(main)
    return out


def turn(id, prompt, reply_len, stop=True, **kw) -> Request:
    """A chat turn of reply_len tokens: its prompt ends with HEADER (a checkpoint at its start); it ends on a stop
    token (its reply's last, when that is new to the reply: a window ahead may have fed it), else by length."""
    reply = expected_tokens(prompt, reply_len + 4)
    stops = (reply[reply_len - 1],) if stop and reply[reply_len - 1] not in reply[:reply_len - 1] else ()
    return Request(id=id, prompt_ids=tuple(prompt), max_tokens=reply_len + 4 if stops else reply_len,
                   stop_token_ids=stops, turn_at=len(prompt) - len(HEADER), **kw)


def reply_of(r: Request) -> list:
    """The tokens a turn() generates."""
    out = expected_tokens(r.prompt_ids, r.max_tokens)
    return out[:out.index(r.stop_token_ids[0]) + 1] if r.stop_token_ids else out


def check_exact(fake, sched, requests, results, every) -> None:
    """Each request got the fake's tokens for its prompt, its state had read exactly its prompt when it sampled, and
    it read at most what it did not share with what came before it plus checkpoint_every."""
    by_id = {rid: res for round_ in results for rid, res in round_.items()}
    for r in requests:
        text, final = by_id[r.id]
        reply = reply_of(r)
        assert isinstance(final, Finished), (r.id, final)
        assert final.completion_tokens == len(reply)
        assert text == text_of(reply[:-1] if r.stop_token_ids else reply)
    read_prompts = [rec for _, rec in fake.prompts]
    assert sorted(read_prompts) == sorted(tuple(r.prompt_ids) for r in requests)
    # every snapshot holds what its slot's request had fed while it was live: never a token a window ahead fed
    # after it ended (a snapshot's request: the one its slot held at the last dispatch before it, see watch())
    owners, n = {}, 0
    for name, slot, tokens in fake.calls:
        if name == "owners":
            owners = tokens
        if name == "snapshot":
            r = owners[slot]
            live = tuple(r.prompt_ids) + tuple(reply_of(r))[:-1]
            assert len(tokens) <= len(live) and live[:len(tokens)] == tokens, (r.id, len(tokens), len(live))
            n += 1
    assert n > 0


def watch(fake, sched) -> None:
    """Record, at each dispatch, the request each slot holds (check_exact attributes snapshots with it)."""
    before = fake.observe

    def observe(i, plan):
        fake.calls.append(("owners", None, {s.id: s.req for s in sched.slots_}))
        if before is not None:
            before(i, plan)
    fake.observe = observe


def bound(history: tuple, prompt: tuple, every: int) -> int:
    """The most a prompt may read after `history` was served in its slot: what it does not share, plus every."""
    return len(prompt) - common_prefix(history, prompt) + every


@pytest.mark.parametrize("lookahead", [False, True])
def test_each_turn_reads_its_new_tokens(tokenizer, lookahead):
    every = 8
    fake = FakeExecutor(slots=2, part_size=8, max_context=4096, chains=lookahead)
    sched = sched_over(fake, tokenizer, checkpoint_every=every, checkpoint_ram_gib=1.0, lookahead=lookahead)
    history, reqs, before = (), [], []
    for k in range(8):
        prompt = history + P(f"user {k}: " + "x" * (9 + 5 * k)) + HEADER
        reqs.append(turn(f"t{k}", prompt, 6 + 3 * k))
        before.append(history)
        history = prompt + tuple(reply_of(reqs[-1]))
    watch(fake, sched)
    results = serve_rounds(sched, [[r] for r in reqs])
    for k, (r, res, history) in enumerate(zip(reqs, results, before)):
        reused = res[r.id][1].timings["reused"]
        assert len(r.prompt_ids) - reused <= bound(history, r.prompt_ids, every), k
        if k:
            assert reused > 0
            if not lookahead:          # the end of the reply was a checkpoint: only the new tokens are read
                assert reused == len(history) - 1
    check_exact(fake, sched, reqs, results, every)
    assert sched.metrics()["prompt_cache_hits"] == 7
    if lookahead:
        assert sched.stats["windows_ahead"] > 0


def test_three_interleaved_conversations_on_three_slots(tokenizer):
    every = 8
    fake = FakeExecutor(slots=3, part_size=8, max_context=4096, chains=True)
    sched = sched_over(fake, tokenizer, checkpoint_every=every, checkpoint_ram_gib=1.0)
    hist = {c: () for c in "abc"}
    rounds, before = [], {}
    for k in range(5):
        round_ = []
        for c in "abc":
            prompt = hist[c] + P(f"{c} {k}: " + c * (7 + 4 * k)) + HEADER
            round_.append(turn(f"{c}{k}", prompt, 5 + 2 * k + "abc".index(c)))
            before[round_[-1].id] = hist[c]
            hist[c] = prompt + tuple(reply_of(round_[-1]))
        rounds.append(round_)
    watch(fake, sched)
    results = serve_rounds(sched, rounds)
    for round_, res in zip(rounds, results):
        for r in round_:
            reused = res[r.id][1].timings["reused"]
            assert len(r.prompt_ids) - reused <= bound(before[r.id], r.prompt_ids, every), r.id
    check_exact(fake, sched, [r for round_ in rounds for r in round_], results, every)
    assert sched.metrics()["prompt_cache_hits"] == 12 and sched.metrics()["conversations_parked"] == 0


@pytest.mark.parametrize("parked_rows", [0, 1])
def test_a_conversation_is_parked_when_its_slot_is_needed_and_resumed_without_rereading(tokenizer, parked_rows):
    """(parked_rows 1: one parked KV at a time is kept by reference, the others copied.)"""
    every = 8
    fake = FakeExecutor(slots=2, part_size=8, max_context=4096, chains=True, parked_rows=parked_rows)
    sched = sched_over(fake, tokenizer, checkpoint_every=every, checkpoint_ram_gib=1.0)
    hist = {c: () for c in "abc"}
    reqs, before = [], {}
    for k in range(4):
        for c in "abc":                # three conversations, one after another, on two slots
            prompt = hist[c] + P(f"{c} {k}: " + c * (7 + 4 * k)) + HEADER
            reqs.append(turn(f"{c}{k}", prompt, 5 + 2 * k))
            before[reqs[-1].id] = hist[c]
            hist[c] = prompt + tuple(reply_of(reqs[-1]))
    watch(fake, sched)
    results = serve_rounds(sched, [[r] for r in reqs])
    for r, res in zip(reqs, results):
        if before[r.id]:
            assert res[r.id][1].timings["reused"] >= len(before[r.id]) - every, r.id
    check_exact(fake, sched, reqs, results, every)
    m = sched.metrics()
    assert m["conversations_parked"] >= 9 and m["conversations_resumed"] >= 8 and m["prompt_cache_hits"] == 9
    assert m["checkpoint_ram_bytes"] > 0 and [c[0] for c in fake.calls].count("load_kv") == m["conversations_resumed"]
    assert m["conversations_parked"] > fake.ref_saves >= 2 * parked_rows


@pytest.mark.parametrize("parked_rows", [0, 1])
def test_the_ram_budget_evicts_least_recently_used_first(tokenizer, parked_rows):
    """A budget for a few checkpoints (the fake's are 100 bytes, its KV 10 bytes a token): older checkpoints go
    first, parked conversations that do not fit are dropped (a by-reference KV's row given back: parked_rows 1),
    and every reply is still exact."""
    every, budget = 4, 1000
    fake = FakeExecutor(slots=2, part_size=8, max_context=4096, chains=True, parked_rows=parked_rows)
    sched = sched_over(fake, tokenizer, checkpoint_every=every, checkpoint_ram_gib=budget / (1 << 30))
    hist = {c: () for c in "abc"}
    reqs = []
    for k in range(3):
        for c in "abc":
            prompt = hist[c] + P(f"{c} {k}: " + c * 20) + HEADER
            reqs.append(turn(f"{c}{k}", prompt, 6))
            hist[c] = prompt + tuple(reply_of(reqs[-1]))
    fake.observe = lambda i, plan: budgets.append(sched.cache.ram_bytes())
    budgets: list = []
    watch(fake, sched)
    results = serve_rounds(sched, [[r] for r in reqs])
    assert max(budgets) <= budget
    check_exact(fake, sched, reqs, results, every)
    m = sched.metrics()
    assert m["checkpoints_evicted"] > 0 and m["conversations_dropped"] > 0
    newest = [c for c in sched.cache.live if c is not None]
    assert all(not ck.saved.on_host for conv in newest for ck in conv.checkpoints[-1:])   # each slot's newest
    held = [c.kv.data[2] for c in sched.cache.parked if c.kv.data[0] == "ref"]
    dropped_refs = [c for c in fake.calls if c[0] == "drop_kv"]
    assert sorted(held + fake.free_rows) == list(range(parked_rows)) and (fake.ref_saves > 0) == (parked_rows > 0)
    assert len(dropped_refs) > 0 or not parked_rows


def test_cache_prompt_false_reads_all_and_strata_checkpoint_false_takes_none(tokenizer):
    fake = FakeExecutor(slots=1, part_size=8, max_context=4096)
    sched = sched_over(fake, tokenizer, checkpoint_every=8, checkpoint_ram_gib=1.0)
    prompt = P("the same prompt, twice over") + HEADER
    a, b = turn("a", prompt, 4), turn("b", prompt, 4, cache_prompt=False)
    c = turn("c", prompt + P("more") + HEADER, 4, checkpoints=False)
    taken = []
    fake.observe = lambda i, plan: taken.append(sched.metrics()["checkpoints_taken"])
    watch(fake, sched)
    results = serve_rounds(sched, [[a], [b], [c]])
    assert results[1]["b"][1].timings["reused"] == 0
    assert results[2]["c"][1].timings["reused"] == len(prompt) - len(HEADER)    # b's header checkpoint
    c_windows = 1 + 4                                       # c's one part and its decode rows
    assert taken[-c_windows] == sched.metrics()["checkpoints_taken"]
    check_exact(fake, sched, [a, b, c], results, 8)


def test_a_failed_request_leaves_nothing_in_the_cache(tokenizer):
    fake = FakeExecutor(slots=1, part_size=8, max_context=4096)
    sched = sched_over(fake, tokenizer, checkpoint_every=8, checkpoint_ram_gib=1.0)
    first = P("a first turn of the conversation") + HEADER
    a = turn("a", first, 5)
    second = first + tuple(reply_of(a)) + P("next") + HEADER
    fake.nonfinite.add((0, len(second) + 1))             # the second turn's second decode row
    b = turn("b", second, 5)
    c = turn("c", first + P("other") + HEADER, 5)          # shares a's prompt, which b continued
    watch(fake, sched)
    results = serve_rounds(sched, [[a], [b], [c]])
    assert isinstance(results[1]["b"][1], Failed)
    assert results[2]["c"][1].timings["reused"] == 0        # b's slot kept nothing: read from token 0
    assert sched.metrics()["conversations_dropped"] == 1
    assert fake.prompts[-1] == (0, c.prompt_ids)


# --- the tree: conversations that share a prefix
@pytest.mark.parametrize("slots", [1, 2])
def test_a_new_conversation_branches_and_never_takes_anothers_history(tokenizer, slots):
    """B shares A's long system prompt and nothing else: it copies the prefix's KV (from A's slot, or from A parked)
    and reads only its own tokens, and A's next turn still reuses all of A (the issue's 3,584 of 8,050)."""
    every = 8
    fake = FakeExecutor(slots=slots, part_size=16, max_context=4096, chains=False)   # (an exact end-of-reply)
    sched = sched_over(fake, tokenizer, checkpoint_every=every, checkpoint_ram_gib=1.0, lookahead=False)
    system = P("system: " + "s" * 120)
    a1 = turn("a1", system + P("user a: " + "a" * 60) + HEADER, 20)
    b1 = turn("b1", system + P("user b: " + "b" * 30) + HEADER, 10)
    a_hist = a1.prompt_ids + tuple(reply_of(a1))
    a2 = turn("a2", a_hist + P("next: " + "n" * 9) + HEADER, 5)
    watch(fake, sched)
    results = serve_rounds(sched, [[a1], [b1], [a2]])
    reused = {r.id: results[i][r.id][1].timings["reused"] for i, r in enumerate([a1, b1, a2])}
    assert len(system) - every <= reused["b1"] <= len(system)
    assert reused["a2"] == len(a_hist) - 1               # a's end-of-reply checkpoint: nothing of a re-read
    check_exact(fake, sched, [a1, b1, a2], results, every)
    m = sched.metrics()
    assert m["prompt_cache_branches"] == 1 and m["prompt_cache_hits"] == 2
    copies = [c for c in fake.calls if c[0] == "copy_kv"]
    assert len(copies) == 1 and copies[0][2] == system[:reused["b1"]]
    if slots == 1:                                        # a parked for b, then resumed; b parked for a2
        assert m["conversations_parked"] == 2 and m["conversations_resumed"] == 1


def test_a_turn_whose_reply_is_rendered_anew_continues_its_conversation_and_another_does_not(tokenizer):
    """a's next turn holds a's prompt whole but renders its reply otherwise (a chat template's re-rendering): it
    continues a in its slot, nothing copied. b shares only the system prompt with a, and a loses fewer than
    checkpoint_every tokens if b took it over: b branches all the same (from a, parked for it), and a's next turn
    resumes a whole."""
    every = 40
    fake = FakeExecutor(slots=1, part_size=16, max_context=4096, chains=False)
    sched = sched_over(fake, tokenizer, checkpoint_every=every, checkpoint_ram_gib=1.0, lookahead=False)
    system = P("system: " + "s" * 40)
    a1 = turn("a1", system + P("user a") + HEADER, 8)
    a2 = turn("a2", a1.prompt_ids + P("the reply, rendered anew") + P("more") + HEADER, 4)
    b1 = turn("b1", system + P("user b") + HEADER, 4)
    a3 = turn("a3", a2.prompt_ids + tuple(reply_of(a2)) + P("again") + HEADER, 4)
    assert len(a2.prompt_ids) + len(reply_of(a2)) - 1 - common_prefix(a2.prompt_ids, b1.prompt_ids) < every
    results = serve_rounds(sched, [[a1], [a2], [b1], [a3]])
    reused = [results[i][r.id][1].timings["reused"] for i, r in enumerate([a1, a2, b1, a3])]
    assert reused == [0, len(a1.prompt_ids) - len(HEADER), every, len(a2.prompt_ids) + len(reply_of(a2)) - 1]
    m = sched.metrics()
    assert m["prompt_cache_branches"] == 1 and m["conversations_parked"] == 2 and m["conversations_resumed"] == 1


def test_agents_sharing_a_system_prompt_on_fewer_slots(tokenizer):
    """Six agents share a system prompt on two slots, three turns each, round robin: every first turn reuses the
    shared prompt (to within a checkpoint's spacing), every later turn its whole history; the shared checkpoints
    are stored once."""
    every = 8
    fake = FakeExecutor(slots=2, part_size=16, max_context=4096, chains=True)
    sched = sched_over(fake, tokenizer, checkpoint_every=every, checkpoint_ram_gib=1.0)
    system = P("tools and rules: " + "t" * 100)
    hist = {c: system for c in "abcdef"}
    reqs, before = [], {}
    for k in range(3):
        for c in "abcdef":
            prompt = hist[c] + P(f"{c} {k}: " + c * (5 + 3 * k)) + HEADER
            reqs.append(turn(f"{c}{k}", prompt, 6))
            before[reqs[-1].id] = hist[c] if k else system
            hist[c] = prompt + tuple(reply_of(reqs[-1]))
    watch(fake, sched)
    results = serve_rounds(sched, [[r] for r in reqs])
    for r, res in zip(reqs, results):
        reused = res[r.id][1].timings["reused"]
        if r.id != "a0":
            assert reused >= len(before[r.id]) - every, (r.id, reused, len(before[r.id]))
    check_exact(fake, sched, reqs, results, every)
    on_system = [n for n in sched.cache._nodes() if n.pos <= len(system)]
    assert len(on_system) == len({n.pos for n in on_system})     # one node per position of the shared prefix
    assert sched.metrics()["prompt_cache_branches"] >= 5


def test_agents_sent_together_read_their_shared_prompt_once(tokenizer):
    """Three agents with one long system prompt sent at once on four slots: one reads it, the others wait for its
    checkpoints and then read only their own tokens (plus at most checkpoint_every); a request beside them that shares
    nothing starts at once."""
    every = 8
    fake = FakeExecutor(slots=4, part_size=16, max_context=4096, chains=True)
    sched = sched_over(fake, tokenizer, checkpoint_every=every, checkpoint_ram_gib=1.0)
    system = P("system: " + "s" * 150)
    agents = [turn(f"a{i}", system + P(f"agent {i}") + HEADER, 6) for i in range(3)]
    other = turn("u", P("unrelated " * 3) + HEADER, 6)
    watch(fake, sched)
    results = serve_rounds(sched, [agents + [other]])[0]
    reused = {r.id: results[r.id][1].timings["reused"] for r in agents + [other]}
    parts = [(i, w.plan.part) for i, w in enumerate(fake.windows) if w.plan.part is not None]

    def first(r):
        return next(i for i, p in parts if p.start == reused[r.id]
                    and tuple(p.tokens) == r.prompt_ids[p.start:p.start + len(p.tokens)])
    assert first(other) < first(agents[1])        # the unrelated request did not wait behind the agents
    assert reused["a0"] == 0 and reused["u"] == 0
    assert all(len(system) - every <= reused[f"a{i}"] <= len(system) + len("agent ") for i in (1, 2)), reused
    check_exact(fake, sched, agents + [other], [results], every)
    read = sum(len(r.prompt_ids) - reused[r.id] for r in agents)
    assert read <= len(agents[0].prompt_ids) + 2 * (len("agent 1") + len(HEADER) + every)


def test_cache_keys_share_nothing(tokenizer):
    """Equal tokens under another cache_key (a control vector's scale) read from token 0."""
    fake = FakeExecutor(slots=2, part_size=16, max_context=4096, chains=True)
    sched = sched_over(fake, tokenizer, checkpoint_every=8, checkpoint_ram_gib=1.0)
    prompt = P("the same words " * 4) + HEADER
    a, b, c = turn("a", prompt, 4), turn("b", prompt, 4, cache_key=(0.5,)), turn("c", prompt, 4, cache_key=(0.5,))
    results = serve_rounds(sched, [[a], [b], [c]])
    assert [results[i][r.id][1].timings["reused"] for i, r in enumerate([a, b, c])] == [0, 0, len(prompt) - len(HEADER)]


def test_a_repetition_penalty_reuses_the_prompt_and_keeps_its_whole_prompt_set(tokenizer):
    """A row with a repetition penalty reuses the cache; its first part names the reused tokens, which join the
    prompt set the penalty reads."""
    fake = FakeExecutor(slots=1, part_size=16, max_context=4096, chains=True)
    sched = sched_over(fake, tokenizer, checkpoint_every=8, checkpoint_ram_gib=1.0)
    a = turn("a", P("a first prompt, long enough") + HEADER, 5)
    b = turn("b", a.prompt_ids + tuple(reply_of(a)) + P("again") + HEADER, 5,
             sampling=SamplingParams(repetition_penalty=1.3))
    results = serve_rounds(sched, [[a], [b]])
    reused = results[1]["b"][1].timings["reused"]
    assert reused > len(a.prompt_ids)
    parts = [w.plan.part for w in fake.windows if w.plan.part is not None and w.plan.part.start >= reused]
    assert tuple(parts[0].reused) == b.prompt_ids[:reused] and all(p.reused is None for p in parts[1:])


# --- random conversation trees
ops = st.lists(st.tuples(st.sampled_from(["new", "extend", "edit", "regenerate", "truncate"]),
                         st.integers(0, 1 << 16), st.integers(1, 12)), min_size=2, max_size=10)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, every=st.integers(2, 16), slots=st.integers(1, 3), lookahead=st.booleans(),
       budget=st.sampled_from([0, 600, 1 << 20]), together=st.booleans(), parked_rows=st.integers(0, 2))
def test_random_conversation_trees(tokenizer, ops, every, slots, lookahead, budget, together, parked_rows):
    """New conversations, turns extending any earlier one, edits (an earlier prompt cut at a random point and
    continued otherwise), regenerations (a prompt sent again) and truncations, served one by one or in rounds of
    `slots`, with any budget and parked KVs kept by reference while rows last: each gets its exact tokens from a
    state that read exactly its prompt, and every by-reference KV is held by a parked conversation or given back
    once."""
    fake = FakeExecutor(slots=slots, part_size=8, max_context=4096, chains=lookahead, parked_rows=parked_rows)
    sched = sched_over(fake, tokenizer, checkpoint_every=every, checkpoint_ram_gib=budget / (1 << 30),
                       lookahead=lookahead)
    done: list[tuple] = []             # every prompt + reply served so far
    reqs = []
    for i, (op, pick, size) in enumerate(ops):
        base = done[pick % len(done)] if done else ()
        if op == "new" or not done:
            prompt = P(f"conversation {i} " + "n" * size)
        elif op == "extend":
            prompt = base + P(f"turn {i} " + "e" * size)
        elif op == "edit":
            prompt = base[:pick % len(base)] + P(f"edited {i} " + "d" * size)
        elif op == "regenerate":
            prompt = reqs[pick % len(reqs)].prompt_ids
        else:
            prompt = base[:max(1, pick % len(base))]
        prompt = prompt if prompt[-len(HEADER):] == HEADER else prompt + HEADER
        reqs.append(turn(f"r{i}", prompt, size))
        done.append(prompt + tuple(reply_of(reqs[-1])))
    rounds = [reqs[i:i + slots] for i in range(0, len(reqs), slots)] if together else [[r] for r in reqs]
    watch(fake, sched)
    results = serve_rounds(sched, rounds)
    check_exact(fake, sched, reqs, results, every)
    assert sched.cache.ram_bytes() <= budget
    held = [c.kv.data[2] for c in sched.cache.parked if c.kv.data[0] == "ref"]
    assert sorted(held + fake.free_rows) == list(range(parked_rows))


# --- the numerics guard
def snapshots(fake) -> list[tuple[str, int, bool]]:
    """(request, position, after a repair) of each snapshot (watch() records the owners, noting() the repairs)."""
    owners, repaired, out = {}, False, []
    for name, slot, x in fake.calls:
        owners = x if name == "owners" else owners
        repaired = repaired or name == "repair"
        if name == "snapshot":
            out.append((owners[slot].id, len(x), repaired))
    return out


def noting(fake) -> None:
    repair = fake.repair

    def noted(slots, rebuild=False, keep=None):
        fake.calls.append(("repair", None, None))
        return repair(slots, rebuild, keep)
    fake.repair = noted


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_guard_retry_resumes_from_a_clean_checkpoint_and_caches_nothing_of_its_path(tokenizer, lookahead):
    """b continues a's conversation and goes non-finite (a corrupt expert slot) just before a checkpoint position:
    its slot is never snapshotted while poisoned (the fake refuses), the repair keeps the KV below b's last
    checkpoint (48) and the retry resumes there on reference_ops (the fake checks the KV and the restored state
    agree) and takes no checkpoint; c, continuing b, resumes from that clean checkpoint and gets a cold read's
    tokens."""
    every = 8
    fake = FakeExecutor(slots=1, part_size=8, max_context=4096, chains=lookahead)
    sched = sched_over(fake, tokenizer, checkpoint_every=every, checkpoint_ram_gib=1.0, lookahead=lookahead)
    a = turn("a", P("a first turn of the conversation") + HEADER, 5)
    second = tuple(a.prompt_ids) + tuple(reply_of(a)) + P("next one") + HEADER
    bad = (len(second) // every + 1) * every - 1               # its state after this row is a checkpoint's
    last = bad + 1 - every                                     # b's last checkpoint before it
    fake.corrupt[(0, bad)] = (7, 1, 3)                        # non-finite until the repair
    b = turn("b", second, bad - len(second) + 6)
    c = turn("c", second + tuple(reply_of(b)) + P("and on") + HEADER, 4)
    noting(fake)
    watch(fake, sched)
    results = serve_rounds(sched, [[a], [b], [c]])
    b_final = results[1]["b"][1]
    assert isinstance(b_final, Finished) and b_final.timings["reused"] == last
    assert results[1]["b"][0] == text_of(reply_of(b)[:-1])
    assert sched.stats["guard_retries"] == 1 and fake.repairs == [((0,), False)] and fake.kept == [(last,)]
    assert sched.stats["guard_tokens_resumed"] == last
    snaps = {(r, after) for r, _, after in snapshots(fake)}
    assert ("b", False) in snaps and ("b", True) not in snaps and ("c", True) in snaps
    assert [p for _, p, path in fake.paths if path != "default"][0] == last
    assert results[2]["c"][1].timings["reused"] == last and results[2]["c"][0] == text_of(reply_of(c)[:-1])
    assert sched.metrics()["conversations_dropped"] == 0
    sent = bad - len(second) + 1                               # b's tokens sent before the failure
    assert [rec for _, rec in fake.prompts] == [a.prompt_ids, second, second + tuple(reply_of(b)[:sent]), c.prompt_ids]


def test_a_retry_after_a_storm_reads_from_the_start(tokenizer):
    """A storm's repair rebuilds everything: no device state is trusted, so the retry reads from token 0 and the
    repair keeps no KV."""
    fake = FakeExecutor(slots=1, part_size=8, max_context=4096, corrupt={(0, 20): (7, 1, 3)})
    sched = sched_over(fake, tokenizer, checkpoint_every=8, checkpoint_ram_gib=1.0)
    sched.guard = Guard(fake.numerics, storm=1)
    a = turn("a", P("a prompt longer than two parts") + HEADER, 5)
    results = serve_rounds(sched, [[a]])
    assert results[0]["a"][0] == text_of(reply_of(a)[:-1]) and results[0]["a"][1].timings["reused"] == 0
    assert fake.repairs == [((0,), True)] and fake.kept == [(0,)] and sched.stats["guard_tokens_resumed"] == 0


def test_a_part_that_goes_non_finite_at_a_checkpoint_position_is_not_snapshotted(tokenizer):
    """The part that ends at a checkpoint position is non-finite: no snapshot of the poisoned slot (the fake
    refuses one), the retry resumes from the checkpoint before the part on reference_ops without taking any, and
    the next turn continues from that checkpoint."""
    fake = FakeExecutor(slots=1, part_size=8, max_context=4096, corrupt={(0, 15): (7, 1, 3)})
    sched = sched_over(fake, tokenizer, checkpoint_every=8, checkpoint_ram_gib=1.0)
    a = turn("a", P("a prompt longer than two parts") + HEADER, 5)
    b = turn("b", tuple(a.prompt_ids) + tuple(reply_of(a)) + P("more") + HEADER, 4)
    noting(fake)
    watch(fake, sched)
    results = serve_rounds(sched, [[a], [b]])
    assert results[0]["a"][0] == text_of(reply_of(a)[:-1])
    assert sched.metrics()["checkpoints_taken"] == len([1 for n, _, _ in fake.calls if n == "snapshot"])
    assert [(p, after) for r, p, after in snapshots(fake) if r == "a"] == [(8, False)]   # none at 16, none after
    assert results[1]["b"][1].timings["reused"] == 8 and results[1]["b"][0] == text_of(reply_of(b)[:-1])
    assert results[0]["a"][1].timings["reused"] == 8 and fake.kept == [(8,)]
    assert [rec for _, rec in fake.prompts] == [a.prompt_ids, b.prompt_ids] and sched.stats["guard_retries"] == 1
