"""Speculative decoding with the MTP head (strata/engine/spec.py, strata/sched/drafts.py) on real engines: greedy
tokens equal spec off whatever the drafts offered (1..4 a row), slots, parts and expert cache; a non-finite verify
row goes to the numerics guard and its retry does not verify; the head's drafts on the device are its argmax over
the sequence as read; acceptance counts in constructed cases; sampled rows keep the target's distribution
(chi-square). Engines are shared by the module and windows compile at first use (no warm-up): compiling is most of
the cost, so one K = 4 engine verifies every length up to 4 (a row offers fewer drafts than K)."""
from __future__ import annotations

import logging
from dataclasses import replace

import anyio
import numpy as np
import pytest

from strata import Engine
from strata.config import Settings
from strata.engine.runner import WindowRunner
from strata.engine.spec import sequence_draft_logits
from strata.plan import DEFAULT, PromptPart, idle_plan
from strata.sched.drafts import DraftPolicy
from strata.sched.request import Failed, Finished, Request, SamplingParams
from strata.sched.scheduler import Scheduler
from tests.sched.test_scheduler import _collect

CTX, PART = 128, 8
FAULT = (1, 96)            # the K = 1 engine's layer 1 output is NaN at position 96: beyond every request but one


def _quiet(line):
    pass


@pytest.fixture(scope="module")
def plain():
    return Engine.load("demo", max_context=CTX, prefill=PART, say=_quiet)


@pytest.fixture(scope="module")
def spec4():
    return Engine.load("demo", max_context=CTX, prefill=PART, spec=4, mtp=True, say=_quiet)


@pytest.fixture(scope="module")
def spec4_split():
    """K = 4 on a layer split of three stages (tests/conftest.py's three CPU devices): the head on the last."""
    return Engine.load("demo", max_context=CTX, prefill=PART, spec=4, mtp=True, layer_split="1,3", say=_quiet)


@pytest.fixture(scope="module")
def spec2_split():
    """K = 2 on a split of two stages, each with 16 of its layers' experts on the device (window fetch)."""
    return Engine.load("demo", max_context=CTX, prefill=PART, spec=2, mtp=True, layer_split="2", expert_cache=16,
                       say=_quiet)


@pytest.fixture(scope="module")
def spec1():
    """K = 1, 32 of the 64 experts on the device (window fetch), and the test-only fault FAULT."""
    return Engine.load(settings=Settings.build(allow_faults=True, model="demo", max_context=CTX, prefill=PART, spec=1,
                                               mtp=True, expert_cache=32, fault_nonfinite=FAULT), say=_quiet)


class Lengths(DraftPolicy):
    """Every window verifies; slot i offers lengths[i] drafts (rows of one window verify different lengths)."""

    def __init__(self, lengths):
        super().__init__(max(lengths), adaptive=False)
        self.lengths = lengths

    def length(self, slot: int) -> int:
        return self.lengths[slot]


def _serve(engine, requests, parallel, drafts=None, wrap=None):
    """Serve requests at once (parts of PART beside the decoding rows, lookahead on) -> ({id: (text, final)},
    scheduler); wrap(runner) may patch the runner. No warm-up: each shape compiles when first used."""
    runner = WindowRunner(engine, parallel, PART)
    runner.warm_up = lambda: 0.0
    if wrap is not None:
        wrap(runner)
    sched = Scheduler(runner, tokenizer=engine.tokenizer, eos_token_ids=engine.eos_token_ids, max_context=CTX,
                      queue_limit=16, drafts=drafts)
    results = {}

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(sched.run)

            async def one(req):
                results[req.id] = await _collect(sched.submit(req))
            async with anyio.create_task_group() as inner:
                for r in requests:
                    inner.start_soon(one, r)
            tg.cancel_scope.cancel()
    anyio.run(main)
    return results, sched


def _prompt(engine, i: int, repeat: int) -> tuple[int, ...]:
    tok = engine.tokenizer
    text = f"request {i}: " + "the heron waits by the mill pond. " * repeat
    return tuple(tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])))


def _requests(engine, n=4, max_tokens=16):
    """n greedy requests of different prompt lengths and max_tokens (every position they reach is below FAULT's)."""
    return [Request(id=f"r{i}", prompt_ids=_prompt(engine, i, 1 + i % 2), max_tokens=max_tokens + 4 * i,
                    stop_token_ids=(), sampling=SamplingParams(temperature=0.0)) for i in range(n)]


@pytest.fixture(scope="module")
def want(plain):
    """The spec-off replies to _requests, three slots."""
    reqs = _requests(plain)
    assert max(len(r.prompt_ids) + r.max_tokens for r in reqs) < FAULT[1]
    got, _ = _serve(plain, reqs, 3)
    return {r: v[0] for r, v in got.items()}


def _reference_ids(engine, prompt, n: int) -> list[int]:
    """n greedy tokens after prompt, spec off: the prompt in parts of PART on slot 0 of three, then decode rows."""
    runner = WindowRunner(engine, 3, PART)
    plan = idle_plan(3)
    for a in range(0, len(prompt), PART):
        chunk = np.asarray(prompt[a:a + PART], np.int32)
        res = runner.run(replace(plan, part=PromptPart(slot=0, tokens=chunk, start=a, last=a + PART >= len(prompt))))
    out = [int(res.part_next)]
    while len(out) < n:
        res = runner.run(replace(plan, decode_active=np.arange(3) == 0, decode_tokens=np.array([out[-1], 0, 0]),
                                 decode_pos=np.array([len(prompt) + len(out) - 1, 0, 0])))
        out.append(int(res.decode_next[0]))
    return out


@pytest.mark.parametrize("engine, parallel, policy", [("spec4", 3, "lengths 4, 2, 3"), ("spec4", 3, "adaptive"),
                                                      ("spec1", 2, "fixed"), ("spec4_split", 3, "lengths 4, 2, 3"),
                                                      ("spec2_split", 2, "lengths 2, 1")])
def test_greedy_tokens_equal_spec_off(request, want, engine, parallel, policy):
    """Four requests on fewer slots: prompts read in parts beside the decoding rows; every window verifies with
    rows of different lengths, or the adaptive policy (plain windows chain ahead, lookahead); K = 1 with half the
    experts on the device (window fetch); on a layer split of three stages, and of two with window fetch on each."""
    e = request.getfixturevalue(engine)
    k = e.settings.sched.spec
    drafts = {"lengths 4, 2, 3": Lengths([4, 2, 3]), "adaptive": DraftPolicy(k), "fixed": DraftPolicy(k, False),
              "lengths 2, 1": Lengths([2, 1])}
    got, sched = _serve(e, _requests(e), parallel, drafts[policy])
    assert {r: v[0] for r, v in got.items()} == want
    assert all(isinstance(v[1], Finished) and v[1].reason == "length" for v in got.values())
    m = sched.metrics()
    assert m["windows_verifying"] > 0 and m["drafts_verified"] > 0
    if policy != "adaptive":
        assert m["windows_ahead"] == 0          # every decode window verifies: none is dispatched ahead


def test_a_nonfinite_verify_row_goes_to_the_guard(spec1, want, caplog):
    """A request whose verify window reaches FAULT's position: nothing of that row is sent, it is retried on the
    guard's next numerics path, where its slot does not verify, fails there again and ends with non_finite; the
    request on the other slot returns spec off's reply."""
    bad = Request(id="bad", prompt_ids=_prompt(spec1, 9, 4), max_tokens=40, stop_token_ids=(),
                  sampling=SamplingParams(temperature=0.0))
    assert len(bad.prompt_ids) < FAULT[1] < len(bad.prompt_ids) + bad.max_tokens <= CTX
    good = _requests(spec1)[3]
    plans = []

    def wrap(runner):
        assert runner.numerics                 # a path to retry on
        dispatch = runner.dispatch
        runner.dispatch = lambda plan, after=None: (plans.append(plan), dispatch(plan, after))[1]
    with caplog.at_level(logging.WARNING, logger="strata"):
        got, sched = _serve(spec1, [bad, good], 2, DraftPolicy(1, adaptive=False), wrap)
    assert got["r3"][0] == want["r3"] and isinstance(got["r3"][1], Finished)
    final = got["bad"][1]
    assert isinstance(final, Failed) and final.code == "non_finite", final
    attempts = dict(final.detail)["attempts"]
    assert [a["numerics"] for a in attempts] == [DEFAULT, _retry_path(plans)]
    assert any("non-finite at the verify row" in m for m in caplog.messages), caplog.messages
    retried = [p for p in plans if p.numerics is not None]
    assert retried and all(p.draft_len is None or not p.draft_len[np.asarray(p.numerics) != DEFAULT].any()
                           for p in retried)
    assert sched.stats["guard_retries"] == 1 and sched.stats["guard_failed"] == 1


def _retry_path(plans) -> str:
    """The one numerics path other than DEFAULT that the plans name."""
    names = {n for p in plans if p.numerics is not None for n in p.numerics} - {DEFAULT}
    assert len(names) == 1, names
    return names.pop()


def _inject(runner, drafts: np.ndarray) -> None:
    """Put drafts [n, S] (all offered) on the device in place of the head's; n <= K."""
    s = runner.spec
    k, n = s.geo.k, drafts.shape[0]
    full = np.zeros((k + 1, drafts.shape[1]), np.int64)
    full[:n], full[k] = drafts, n
    s.bank = {**s.bank, "drafted": runner.engine.backend.to_device(full.astype(np.int32))}
    s.fresh[:] = True


def reference_drafts(ref: list, k: int, right: int, vocab: int):
    """A _serve wrap that offers, before each verify window, k drafts per row from the greedy sequence ref (the
    row's next tokens), the first `right` of them right and the rest off by one id."""
    def wrap(runner):
        dispatch = runner.spec.dispatch

        def patched(plan):
            drafts = np.zeros((k, runner.n_slots), np.int64)
            for s in np.flatnonzero(plan.decode_active):
                pos = int(plan.decode_pos[s])
                assert ref[pos] == plan.decode_tokens[s]
                nxt = np.array(ref[pos + 1:pos + 1 + k])
                drafts[:, s] = np.where(np.arange(k) < right, nxt, (nxt + 1) % vocab)
            _inject(runner, drafts)
            return dispatch(plan)
        runner.spec.dispatch = patched
    return wrap


@pytest.mark.parametrize("engine, right", [("spec4", True), ("spec4", False), ("spec4_split", True),
                                           ("spec4_split", False)])
def test_acceptance_counts_by_hand(request, plain, engine, right):
    """Drafts that are the model's own greedy continuation are all accepted; drafts that never are cost each window
    one verify position per draft and accept nothing. One request, 20 tokens, 3 drafts offered while they fit;
    unsplit and on a split of three stages (whose first two take their rollback from the last's counts)."""
    spec4 = request.getfixturevalue(engine)
    k, n = 3, 20
    req = _requests(spec4, 1, max_tokens=n)[0]
    ref = list(req.prompt_ids) + _reference_ids(plain, req.prompt_ids, n + k)
    wrap = reference_drafts(ref, k, k if right else 0, spec4.cfg.vocab_size)
    got, sched = _serve(spec4, [req], 3, DraftPolicy(k, adaptive=False), wrap)
    text, final = got[req.id]
    assert final.completion_tokens == n and text == spec4.tokenizer.decode(ref[len(req.prompt_ids):][:n])
    m = sched.metrics()
    # offered each window: min(3, 20 - generated - 1); right: generated 1, 5, 9, 13, 17 -> 3+3+3+3+2 in 5 windows;
    # wrong: generated 1..19, one a window -> 16 x 3 + 2 + 1 + 0 in 19 windows
    windows, offered, accepted = (5, 14, 14) if right else (19, 51, 0)
    assert (m["windows_verifying"], m["drafts_verified"], m["drafts_accepted"]) == (windows, offered, accepted)
    assert (final.timings["drafts"], final.timings["drafts_accepted"]) == (offered, accepted)


@pytest.mark.parametrize("inside", [True, False])
def test_a_reply_ending_inside_a_verify_window_takes_no_checkpoint_there(plain, spec4, inside):
    """Drafts that are all accepted (3 a window), and a stop token inside the first verify window's accepted tokens
    (the device fed tokens past it) or as its last token (it fed none): the end-of-reply checkpoint is taken only in
    the second case, so no checkpoint holds a state past the stored conversation's end."""
    k = 3
    req = _requests(spec4, 1, max_tokens=12)[0]
    n = len(req.prompt_ids)
    ref = list(req.prompt_ids) + _reference_ids(plain, req.prompt_ids, 12)
    gen = ref[n:]
    # generated token 0 comes from the prompt's last part; the first verify window emits tokens 1..4
    at = next(i for i in ((1, 2, 3) if inside else (4,)) if gen[i] not in gen[:i])
    req = replace(req, stop_token_ids=(gen[at],))

    def wrap(runner):
        dispatch = runner.spec.dispatch

        def patched(plan):
            drafts = np.zeros((k, runner.n_slots), np.int64)
            for s in np.flatnonzero(plan.decode_active):
                pos = int(plan.decode_pos[s])
                drafts[:, s] = ref[pos + 1:pos + 1 + k]
            _inject(runner, drafts)
            return dispatch(plan)
        runner.spec.dispatch = patched

    got, sched = _serve(spec4, [req], 3, DraftPolicy(k, adaptive=False), wrap)
    final = got[req.id][1]
    assert isinstance(final, Finished) and final.reason == "stop" and final.completion_tokens == at + 1
    conv = next(c for c in sched.cache.live if c is not None)
    end = n + at                                     # tokens fed once the reply's last token is applied
    assert all(c.pos <= end for c in conv.checkpoints)
    assert (end in [c.pos for c in conv.checkpoints]) is not inside


def test_the_heads_drafts_follow_the_sequence(plain, spec4):
    """Before each verify window, the first draft on the device is the head's argmax after the sequence so far (the
    oracle: its uncompiled sequence form over the whole text), so its cache was filled right across prompt parts and
    verify windows."""
    req = _requests(spec4, 2, max_tokens=8)[1]
    tokens = list(req.prompt_ids) + _reference_ids(plain, req.prompt_ids, req.max_tokens)
    seen = []

    def wrap(runner):
        dispatch = runner.spec.dispatch

        def record(plan):
            drafted = np.asarray(spec4.backend.to_host(runner.spec.bank["drafted"]))
            seen.append((int(plan.decode_pos[0]), int(plan.decode_tokens[0]), int(drafted[0, 0]),
                         bool(runner.spec.fresh[0])))
            return dispatch(plan)
        runner.spec.dispatch = record
    _serve(spec4, [req], 3, DraftPolicy(2, adaptive=False), wrap)
    assert len(seen) >= 3
    heads = sequence_draft_logits(spec4, tokens[:seen[2][0] + 1])     # row i: after tokens[:i + 2]
    for pos, token, draft, fresh in seen[:3]:
        assert fresh and tokens[pos] == token
        ref = heads[pos - 1]
        assert ref[draft] >= ref.max() - 1e-4 * (ref.max() - ref.min()), (pos, draft, int(ref.argmax()))


def _offered_after_prompt(engine, prompt) -> tuple[int, int]:
    """Read prompt in parts on slot 0 of one -> (its first token, the drafts the head left on the device to offer)."""
    runner = WindowRunner(engine, 1, PART)
    for a in range(0, len(prompt), PART):
        chunk = np.asarray(prompt[a:a + PART], np.int32)
        res = runner.run(replace(idle_plan(1), part=PromptPart(slot=0, tokens=chunk, start=a,
                                                               last=a + PART >= len(prompt))))
    drafted = np.asarray(engine.backend.to_host(runner.spec.bank["drafted"]))
    return int(res.part_next), int(drafted[engine.settings.sched.spec, 0])


def test_spec_min_p_stops_drafting_at_an_unlikely_draft(spec4):
    """The first draft's probability under the head (its sequence form: softmax of the draft logits after the prompt
    and the first token) decides: spec_min_p just below it offers drafts, just above it offers none."""
    req = _requests(spec4, 1)[0]
    first, offered = _offered_after_prompt(spec4, req.prompt_ids)
    assert offered == 4                                        # spec_min_p 0: every draft
    logits = sequence_draft_logits(spec4, list(req.prompt_ids) + [first])[-1].astype(np.float64)
    p1 = float(np.max(np.exp(logits - logits.max())) / np.exp(logits - logits.max()).sum())
    for min_p, drafts in ((p1 * 0.99, lambda n: n >= 1), (p1 * 1.01, lambda n: n == 0)):
        e = Engine.load("demo", max_context=CTX, prefill=PART, spec=4, mtp=True, spec_min_p=min_p, say=_quiet)
        got_first, n = _offered_after_prompt(e, req.prompt_ids)
        assert got_first == first and drafts(n), (min_p, p1, n)


def test_sampled_rows_keep_the_targets_distribution(tmp_path):
    """Over a vocabulary of 12, the first token a verify window emits (an accepted draft or the residual draw) is
    distributed as the model's own next token (transformers' probabilities): 2400 draws (16 slots a window, seeded
    per trial), the most likely token drafted (accepted often, rejected often enough), a chi-square goodness-of-fit
    at p = 0.001 (bins with expected count >= 5, the rest pooled). Each trial reads the prompt afresh."""
    torch = pytest.importorskip("torch")
    from scipy.stats import chi2
    from oracle import build_hf_model, build_mtp_head, save_mtp_head
    model = build_hf_model("qwen3_next", 1, vocab_size=12, num_hidden_layers=2,
                           layer_types=["linear_attention", "full_attention"])
    model.save_pretrained(tmp_path)
    save_mtp_head(build_mtp_head(model, 1), tmp_path)
    prompt, t0, temp = np.array([3, 1, 4, 1, 5, 9], np.int32), 2, 1.3
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + [t0]])).logits[0, -1].double().numpy() / temp
    p = np.exp(logits - logits.max())
    p /= p.sum()
    best = int(p.argmax())
    e = Engine.load(tmp_path, max_context=16, prefill=8, say=_quiet, spec=1, mtp=True)
    S, trials = 16, 150
    runner = WindowRunner(e, S, 8)
    counts = np.zeros(12, int)
    accepted = 0
    for t in range(trials):
        seeds = np.stack([np.arange(S) + S * t, np.full(S, 7)], axis=1).astype(np.uint32)
        base = replace(idle_plan(S), temperature=np.full(S, temp, np.float32), seeds=seeds)
        runner.run(replace(base, part=PromptPart(slot=0, tokens=prompt, start=0, last=True, copies=tuple(range(1, S)))))
        _inject(runner, np.full((1, S), best))
        res = runner.run(replace(base, decode_active=np.ones(S, bool), decode_tokens=np.full(S, t0, np.int32),
                                 decode_pos=np.full(S, len(prompt), np.int32), steps=np.ones(S, np.int32),
                                 draft_len=np.ones(S, np.int32)))
        np.add.at(counts, np.where(res.decode_n_accepted > 0, res.decode_accepted[:, 0], res.decode_next), 1)
        accepted += int((res.decode_n_accepted > 0).sum())
    n = S * trials
    assert 0.1 * n < accepted < 0.9 * n          # both the accept and the residual draw are exercised
    expected = p * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    limit = chi2.ppf(0.999, keep.sum() - 1)
    assert stat < limit, (stat, limit, counts.tolist(), expected.round(1).tolist())
