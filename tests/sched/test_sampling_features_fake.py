"""What the scheduler plans and reports for the sampling features, against a FakeExecutor: n choices read their prompt
once and end one by one; grammar masks go only to the rows that have a grammar, which decode every other window while
the others keep lookahead (every window, their masks given after dispatch, with an executor that takes late masks);
penalties, bias and logprobs arrays appear only when some request uses them (a plain plan is the plain plan); each
token's logprob reaches its choice's events."""
from __future__ import annotations

import anyio
import numpy as np
import pytest
from fake_executor import FakeExecutor, expected_tokens, fake_logprobs, next_token, obey, text_of

from strata.demo_tokenizer import write_demo_tokenizer
from strata.engine.sampling import mask_words, pack_mask
from strata.sched.request import Delta, Failed, Finished, Request, SamplingParams
from strata.sched.scheduler import Scheduler, choice_seed
from strata.tokenizer import Tokenizer

VOCAB = 624
ALNUM = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo_tokenizer")
    write_demo_tokenizer(d)
    return Tokenizer.from_dir(d)


def P(text: str) -> tuple[int, ...]:
    return tuple(text.encode())


def run(sched, requests) -> dict:
    """Submit, run until every stream closed -> {id: [events]}."""
    events = {r.id: [] for r in requests}

    async def main():
        with anyio.fail_after(10):
            streams = {r.id: sched.submit(r) for r in requests}
            async with anyio.create_task_group() as tg:
                await tg.start(sched.run)
                async with anyio.create_task_group() as clients:
                    for rid, stream in streams.items():
                        async def drain(stream=stream, out=events[rid]):
                            async with stream:
                                async for ev in stream:
                                    out.append(ev)
                        clients.start_soon(drain)
                tg.cancel_scope.cancel()
    anyio.run(main)
    return events


def choices(events) -> dict:
    """{index: (text, Finished)} of a request whose every choice finished."""
    out = {}
    for ev in events:
        if isinstance(ev, Delta):
            text, fin = out.get(ev.index, ("", None))
            assert fin is None, "a choice's text came after its end"
            out[ev.index] = (text + ev.content, None)
        else:
            assert isinstance(ev, Finished), ev
            out[ev.index] = (out.get(ev.index, ("", None))[0], ev)
    return out


class Spell:
    """A matcher that allows exactly one token sequence, then nothing."""

    def __init__(self, tokens):
        self.tokens, self.i, self.bad = list(tokens), 0, None

    def mask(self):
        allowed = np.zeros((1, VOCAB), bool)
        if self.i < len(self.tokens):
            allowed[0, self.tokens[self.i]] = True
        return pack_mask(allowed)[0]

    def accept(self, token):
        ok = self.i < len(self.tokens) and token == self.tokens[self.i]
        self.bad = None if ok else f"token {token} is not {self.tokens[self.i]}"
        self.i += 1
        return ok

    def done(self):
        return self.i == len(self.tokens)

    def error(self):
        return self.bad or ""


class SpellConstraint:
    def __init__(self, tokens):
        self.tokens = tokens

    def matcher(self):
        return Spell(self.tokens)


def test_n_choices_read_the_prompt_once_and_each_finishes(tokenizer):
    fake = FakeExecutor(slots=3, part_size=4)
    sched = Scheduler(fake, tokenizer=tokenizer, eos_token_ids=tokenizer.eos_token_ids, queue_limit=4)
    prompt = P("hello world")
    ev = run(sched, [Request(id="A", prompt_ids=prompt, max_tokens=6, n=3)])["A"]
    got = choices(ev)
    want = text_of(expected_tokens(prompt, 6))
    assert sorted(got) == [0, 1, 2]
    assert all(text == want and fin.reason == "length" and fin.completion_tokens == 6 and fin.index == i
               for i, (text, fin) in got.items())
    parts = [w.plan.part for w in fake.windows if w.plan.part is not None]
    assert sum(len(p.tokens) for p in parts) == len(prompt), "the prompt is read once"
    assert [p.copies for p in parts if p.last] == [(1, 2)] and all(not p.copies for p in parts if not p.last)
    decode = [w.plan for w in fake.windows if w.plan.n_decode]
    assert all(p.decode_active.tolist() == [True] * 3 for p in decode)
    seeds = {tuple(p.seeds[i]) for p in decode for i in range(3)}
    assert len(seeds) == 3, "each choice samples with its own seed"
    assert all(s["state"] == "free" for s in sched.slots())


def test_n_waits_for_its_slots_and_more_than_the_slots_is_refused(tokenizer):
    fake = FakeExecutor(slots=2, part_size=4)
    sched = Scheduler(fake, tokenizer=tokenizer, eos_token_ids=tokenizer.eos_token_ids, queue_limit=4)
    with pytest.raises(ValueError, match="n = 3 choices; this server has 2 slots"):
        sched.submit(Request(id="X", prompt_ids=P("hi"), max_tokens=2, n=3))
    ev = run(sched, [Request(id="A", prompt_ids=P("abc"), max_tokens=5),
                     Request(id="B", prompt_ids=P("xyz"), max_tokens=3, n=2)])
    assert sorted(choices(ev["B"])) == [0, 1] and list(choices(ev["A"])) == [0]
    b_starts = min(i for i, w in enumerate(fake.windows) if w.plan.part is not None and w.plan.part.tokens[0] == 120)
    a_last = min(i for i, w in enumerate(fake.windows) if w.plan.decode_active[0] and w.plan.decode_pos[0] == 6)
    assert a_last < b_starts, "B waited until A's slot was free (A's last token is fed at position 3 + 4 - 1)"
    assert choice_seed(7, 0) == 7 and choice_seed(7, 1) != choice_seed(7, 2)


class Letters:
    """A matcher that allows n letters or digits, then nothing: which letter comes depends on the token and position
    a row is fed (the fake takes the first allowed at or after its own next token)."""

    def __init__(self, n):
        self.n, self.i = n, 0

    def mask(self):
        allowed = np.zeros((1, VOCAB), bool)
        if self.i < self.n:
            allowed[0, [ord(c) for c in ALNUM]] = True
        return pack_mask(allowed)[0]

    def accept(self, token):
        self.i += 1
        return chr(token) in ALNUM and self.i <= self.n

    def done(self):
        return self.i == self.n

    def error(self):
        return "not a letter or digit"


class LettersConstraint:
    def __init__(self, n):
        self.n = n

    def matcher(self):
        return Letters(self.n)


def letters(prompt, n) -> list[int]:
    """The tokens the fake gives a request under Letters(n)."""
    mask = Letters(n).mask()
    out, last, pos = [], prompt[-1], len(prompt) - 1
    for _ in range(n):
        last = obey(mask, next_token(last, pos))
        out.append(last)
        pos += 1
    return out


def _grammar_beside_plain(tokenizer, lookahead: bool, late_masks: bool = False):
    fake = FakeExecutor(slots=2, part_size=8, late_masks=late_masks)
    sched = Scheduler(fake, tokenizer=tokenizer, eos_token_ids=tokenizer.eos_token_ids, queue_limit=4,
                      lookahead=lookahead)
    ev = run(sched, [Request(id="G", prompt_ids=P("json:"), max_tokens=40, constraint=LettersConstraint(13)),
                     Request(id="F", prompt_ids=P("free"), max_tokens=40)])
    out = {k: [(text, fin.reason, fin.completion_tokens) for text, fin in choices(v).values()] for k, v in ev.items()}
    return out, fake, sched


def test_a_grammar_row_decodes_every_other_window_and_the_others_keep_lookahead(tokenizer):
    """A grammar's mask needs the token before it: while windows are dispatched ahead, the grammar row drops out of
    the window after each of its own and joins the next with its token, position and mask given by the host; the plain
    row is in every window, each dispatched ahead; what both clients get is what they get without lookahead."""
    on, fake, sched = _grammar_beside_plain(tokenizer, True)
    off, fake_off, _ = _grammar_beside_plain(tokenizer, False)
    assert on == off
    want = letters(P("json:"), 13)
    assert on["G"] == [(text_of(want), "stop", 13)] and len(set(want)) > 5
    assert on["F"] == [(text_of(expected_tokens(P("free"), 40)), "length", 40)]
    g_windows = [i for i, w in enumerate(fake.windows) if w.plan.decode_active[0]]
    first = min(i for i, w in enumerate(fake.windows) if w.plan.decode_active.all())   # both decode, planned afresh
    both = fake.windows[first:g_windows[-1] + 1]                                        # until G's last token
    assert [bool(w.plan.decode_active[0]) for w in both] == [i % 2 == 0 for i in range(len(both))]
    assert all(w.plan.decode_active[1] and w.plan.part is None for w in both)
    assert not both[0].ahead and all(w.ahead for w in both[1:]), "every window after the first dispatched ahead"
    joined = [w for w in both[1:] if w.plan.decode_active[0]]
    assert len(joined) == 13 - 3      # the 1st from G's part, the 2nd beside F's part, the 3rd in both[0]
    for w in joined:      # G's token from the host (the one it sampled two windows back), F's from the device
        assert w.plan.decode_tokens[0] >= 0 and w.plan.decode_tokens[1] == -1
        assert (w.plan.mask[1] == -1).all() and not (w.plan.mask[0] == -1).all()
    assert all(w.plan.mask is None for w in both if not w.plan.decode_active[0])
    assert sched.stats["windows_ahead"] == sum(w.ahead for w in fake.windows) >= len(both) - 1
    assert not any(w.ahead for w in fake_off.windows)
    assert any(w.ahead for w in fake.windows[g_windows[-1] + 1:]), "lookahead goes on once no row has a grammar"


def test_with_late_masks_a_grammar_row_decodes_every_window_its_mask_given_while_the_window_runs(tokenizer):
    """An executor that takes late masks: the grammar row continues on the device in every window dispatched ahead
    (token -1, mask_late), and each such window gets its masks (give_masks) once the window before is read, before it
    is continued or read; both clients get what they get without lookahead."""
    on, fake, sched = _grammar_beside_plain(tokenizer, True, late_masks=True)
    off, _, _ = _grammar_beside_plain(tokenizer, False)
    assert on == off
    assert on["G"] == [(text_of(letters(P("json:"), 13)), "stop", 13)]
    g_windows = [i for i, w in enumerate(fake.windows) if w.plan.decode_active[0]]
    first = min(i for i, w in enumerate(fake.windows) if w.plan.decode_active.all())
    both = fake.windows[first:g_windows[-1] + 1]
    # G's 1st token from its part, its 2nd beside F's part, one window for each other token, and one computed past
    # its last token (dropped: ahead, it was dispatched before that token was read)
    assert len(both) == 13 - 2 + 1 and all(w.plan.decode_active.all() for w in both)
    assert all(w.ahead for w in both[1:])
    for w in both[1:]:
        assert (w.plan.decode_tokens == -1).all() and w.plan.mask is None
        assert w.plan.mask_late.tolist() == [True, False]
    late = [i for i, w in enumerate(fake.windows) if w.plan.mask_late is not None]
    assert fake.given_masks == late and len(late) >= len(both) - 1
    assert sched.stats["windows_ahead"] == sum(w.ahead for w in fake.windows)


def test_with_late_masks_grammar_rows_alone_keep_lookahead(tokenizer):
    """Two grammar rows and no other: with late masks their windows are dispatched ahead too, the text unchanged."""
    fake = FakeExecutor(slots=2, part_size=8, late_masks=True)
    sched = Scheduler(fake, tokenizer=tokenizer, eos_token_ids=tokenizer.eos_token_ids, queue_limit=4)
    ev = run(sched, [Request(id=f"G{i}", prompt_ids=P(f"json{i}:"), max_tokens=40,
                             constraint=SpellConstraint(list(P('{"b": 2}')))) for i in range(2)])
    assert all(next(iter(choices(e).values()))[0] == '{"b": 2}' for e in ev.values())
    assert sched.stats["windows_ahead"] > 0 and fake.given_masks
    assert all(fake.windows[i].plan.mask_late.all() for i in fake.given_masks)


def test_grammar_rows_alone_get_no_lookahead(tokenizer):
    """With every generating row under a grammar a continuation would have no row: each window is planned after the
    last one's tokens, as without lookahead."""
    fake = FakeExecutor(slots=2, part_size=8)
    sched = Scheduler(fake, tokenizer=tokenizer, eos_token_ids=tokenizer.eos_token_ids, queue_limit=4)
    ev = run(sched, [Request(id=f"G{i}", prompt_ids=P(f"json{i}:"), max_tokens=40,
                             constraint=SpellConstraint(list(P('{"b": 2}')))) for i in range(2)])
    assert all(next(iter(choices(e).values()))[0] == '{"b": 2}' for e in ev.values())
    assert fake.windows and not any(w.ahead for w in fake.windows) and sched.stats["windows_ahead"] == 0


def test_a_token_the_grammar_rejects_fails_the_request(tokenizer):
    class Liar(SpellConstraint):
        def matcher(self):
            m = Spell(self.tokens)
            m.mask = lambda: np.full(mask_words(VOCAB), -1, np.int32)     # claims every token is allowed
            return m
    fake = FakeExecutor(slots=1, part_size=8)
    sched = Scheduler(fake, tokenizer=tokenizer, eos_token_ids=tokenizer.eos_token_ids, queue_limit=4)
    ev = run(sched, [Request(id="G", prompt_ids=P("x"), max_tokens=9, constraint=Liar([1, 2, 3]))])["G"]
    assert isinstance(ev[-1], Failed) and "broke the request's grammar at generated token 1" in ev[-1].message
    # a grammar this model cannot follow is the request's to change: a 4xx that says so, never a 500
    assert (ev[-1].status, ev[-1].code) == (422, "grammar_unfollowable")
    assert "is not 1;" in ev[-1].message and "cannot write a reply that follows the grammar" in ev[-1].message


def test_optional_arrays_only_when_a_request_uses_them(tokenizer):
    fake = FakeExecutor(slots=2, part_size=8)
    sched = Scheduler(fake, tokenizer=tokenizer, eos_token_ids=tokenizer.eos_token_ids, queue_limit=4)
    run(sched, [Request(id="A", prompt_ids=P("plain"), max_tokens=4)])
    assert all(w.plan.penalties is None and w.plan.bias_ids is None and w.plan.mask is None
               and w.plan.logprobs is None and not w.plan.shaped for w in fake.windows)
    fake = FakeExecutor(slots=2, part_size=8)
    sched = Scheduler(fake, tokenizer=tokenizer, eos_token_ids=tokenizer.eos_token_ids, queue_limit=4)
    sp = SamplingParams(frequency_penalty=0.5, logit_bias=((7, 3.0), (9, -1.0)))
    run(sched, [Request(id="A", prompt_ids=P("plain"), max_tokens=4),
                Request(id="B", prompt_ids=P("shaped"), max_tokens=4, sampling=sp, logprobs=2)])
    both = [w.plan for w in fake.windows if w.plan.decode_active.all()]
    assert both and all(p.shaped and p.mask is None for p in both)
    p = both[0]
    assert p.penalties.tolist() == [[0, 0, 1], [0, 0.5, 1]]
    assert p.bias_ids.tolist() == [[-1, -1], [7, 9]] and p.bias_values.tolist() == [[0, 0], [3, -1]]
    assert p.logprobs.tolist() == [-1, 2]


def test_logprobs_reach_each_tokens_choice(tokenizer):
    fake = FakeExecutor(slots=2, part_size=8)
    sched = Scheduler(fake, tokenizer=tokenizer, eos_token_ids=tokenizer.eos_token_ids, queue_limit=4)
    prompt = P("logprobs")
    ev = run(sched, [Request(id="A", prompt_ids=prompt, max_tokens=5, logprobs=3, n=2)])["A"]
    want = expected_tokens(prompt, 5)
    for index in (0, 1):
        lps = [lp for e in ev if isinstance(e, Delta) and e.index == index for lp in e.logprobs]
        assert [lp.token for lp in lps] == want
        ref = fake_logprobs(want)
        assert [lp.logprob for lp in lps] == pytest.approx(ref.sampled.tolist())
        assert all(len(lp.top) == 3 and lp.top[0] == (t, pytest.approx(lp.logprob)) for lp, t in zip(lps, want))
