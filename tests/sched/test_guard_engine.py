"""The numerics guard on the demo model served from a pack (every expert in a device slot, the pack and its host tier
behind them), with the test-only faults: a corrupt device slot is found, repaired from the host tier and named in
the log, and the request returns a clean engine's greedy output (resumed from a prompt-cache checkpoint before the
failing part when there is one); a deterministic non-finite value ends its request with the explicit error after two
attempts while a request on the other slot completes exactly; through a live server the error reaches clients
streamed (finish_reason "error" + the error object) and as an HTTP 500 body."""
from __future__ import annotations

import json
import logging
import re
from dataclasses import replace

import anyio
import httpx
import numpy as np
import pytest
from servers import running_server

from strata import Engine
from strata.config import Settings, load_settings
from strata.errors import ConfigError
from strata.engine.runner import WindowRunner
from strata.experts.pack import write_pack
from strata.plan import DEFAULT, PromptPart, idle_plan
from strata.sched.request import Delta, Failed, Finished, Request
from strata.sched.scheduler import Scheduler

SHAPE = dict(max_context=128, prefill=8, parallel=2)
FAULT_AT = (1, 20)                       # layer 1's output at position 20


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    return write_pack("demo", tmp_path_factory.mktemp("guard") / "pack", "f32")


@pytest.fixture(scope="module")
def clean(pack):
    return Engine.load(pack, **SHAPE)


def prompt_of(engine, text: str) -> tuple[int, ...]:
    tok = engine.tokenizer
    return tuple(tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])))


def greedy_text(engine, prompt, n) -> str:
    return engine.tokenizer.decode(engine.generate(list(prompt), n, stop_token_ids=[]), skip_special_tokens=True)


def faulty(pack, **faults) -> Engine:
    return Engine.load(pack, settings=Settings.build(allow_faults=True, model=str(pack), **SHAPE, **faults))


def serve_all(engine, requests, part: int = 8, later=(), **kw):
    """The requests on one scheduler over the engine (kw: the Scheduler's), then the `later` ones once those ended
    -> ({id: (text, final event)}, scheduler)."""
    sched = Scheduler(WindowRunner(engine, 2, part), tokenizer=engine.tokenizer, eos_token_ids=engine.eos_token_ids,
                      queue_limit=4, **kw)
    out = {}

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(sched.run)

            async def one(r):
                text, final = "", None
                async with sched.submit(r) as receive:
                    async for ev in receive:
                        if isinstance(ev, Delta):
                            text += ev.content + ev.reasoning
                        else:
                            final = ev
                out[r.id] = (text, final)
            for batch in (requests, later):
                async with anyio.create_task_group() as clients:
                    for r in batch:
                        clients.start_soon(one, r)
            tg.cancel_scope.cancel()
    anyio.run(main)
    return out, sched


def test_fault_keys_are_refused_without_the_test_flag(pack, tmp_path):
    with pytest.raises(ConfigError, match="test-only fault injection"):
        Engine.load(pack, fault_corrupt_slot=3, **SHAPE)
    (tmp_path / "c.toml").write_text("fault_nonfinite = [1, 20]\n")
    with pytest.raises(ConfigError, match="fault_nonfinite is a test-only fault injection"):
        load_settings(tmp_path / "c.toml")
    with pytest.raises(ConfigError, match="fault_corrupt_slot"):
        Settings.build(allow_faults=True, fault_corrupt_slot=-1)


def test_the_ladder_is_checked_at_config_time_and_stripped_at_load(tmp_path, caplog):
    (tmp_path / "c.toml").write_text('guard_ladder = ["cpu_experts", "float16"]\n')
    with pytest.raises(ConfigError, match="guard_ladder must be distinct names among reference_ops, float32, "
                                          "cpu_experts"):
        load_settings(tmp_path / "c.toml")
    assert load_settings(None, env={"STRATA_DBG_NAN": "1"}).backend.debug_nan is True
    with caplog.at_level(logging.INFO, "strata"):
        r = WindowRunner(Engine.load("demo", **SHAPE), 2, 8)         # XLA on a CPU: reference_ops is the default
    assert r.numerics == ("cpu_experts",)
    assert any("left out: reference_ops (the jax backend runs no kernel of its own here), float32 (the engine "
               "computes in float32 already)" in m for m in caplog.messages)


def test_the_reference_ops_path_computes_a_clean_engines_tokens(pack):
    """With the Pallas kernels (interpreted on a CPU), a slot on reference_ops gets its part and decode rows from
    XLA's ops: a different computation, the same greedy tokens."""
    r = WindowRunner(Engine.load(pack, kernels="pallas", **SHAPE), 2, 8)
    assert r.numerics == ("reference_ops", "cpu_experts")
    toks = np.arange(40, 48, dtype=np.int32)
    got = {}
    for numerics in (None, ("reference_ops", DEFAULT)):
        res = r.run(replace(idle_plan(2), part=PromptPart(slot=0, tokens=toks, start=0, last=True),
                            numerics=numerics))
        seq = [res.part_next]
        for i in range(3):
            res = r.run(replace(idle_plan(2), decode_active=np.array([True, False]), numerics=numerics,
                                decode_tokens=np.array([seq[-1], 0], np.int32),
                                decode_pos=np.array([len(toks) + i, 0], np.int32)))
            assert res.decode_finite[0]
            seq.append(int(res.decode_next[0]))
        got[numerics] = seq
    assert got[None] == got[("reference_ops", DEFAULT)]


def test_a_corrupt_slot_is_repaired_and_the_request_returns_a_clean_engines_output(pack, clean, caplog):
    a = prompt_of(clean, "the heron waits by the mill pond")
    clean.record_routing = True
    clean.logits(a)                                  # which experts the prompt reads: corrupt one of them
    clean.record_routing = False
    routed = clean.experts.cache.routed
    p, e = 1, int(np.argmax(routed[1]))
    engine = faulty(pack, fault_corrupt_slot=clean.experts.cache.slot_of(p, e))
    slot = engine.experts.cache.slot_of(p, e)
    assert engine.experts.cache.content_matches(engine.experts.cache.pool, [slot], [(p, e)]) is False
    b = prompt_of(clean, "owls")
    with caplog.at_level(logging.INFO):
        out, sched = serve_all(engine, [Request("A", a, 12, stop_token_ids=()), Request("B", b, 12,
                                                                                       stop_token_ids=())])
    assert out["A"] == (greedy_text(clean, a, 12), out["A"][1]) and isinstance(out["A"][1], Finished)
    assert out["B"] == (greedy_text(clean, b, 12), out["B"][1]) and isinstance(out["B"][1], Finished)
    assert engine.experts.cache.verify() == []                          # repaired: every slot matches the pack
    assert any(f"slot {slot} (layer {p}, expert {e})" in m and "rewritten from the host tier" in m
               for m in caplog.messages), caplog.messages
    assert sched.stats["guard_retries"] >= 1 and sched.stats["expert_slots_repaired"] == 1


@pytest.fixture(scope="module")
def deterministic(pack):
    return faulty(pack, fault_nonfinite=FAULT_AT)


def test_a_deterministic_non_finite_ends_with_the_explicit_error_and_spares_the_other_slot(deterministic, clean):
    long = prompt_of(clean, "a prompt long enough to reach the fault")          # past position 20
    short = prompt_of(clean, "hi")
    assert len(long) > FAULT_AT[1] + 1 and len(short) + 4 <= FAULT_AT[1]
    out, sched = serve_all(deterministic, [Request("L", long, 4), Request("S", short, 4, stop_token_ids=())])
    text, final = out["L"]
    assert text == "" and isinstance(final, Failed) and final.code == "non_finite" and final.status == 500
    detail = dict(final.detail)
    assert len(detail["attempts"]) == 2 and detail["attempts"][1]["numerics"] == "cpu_experts"
    assert detail["attempts"][0]["position"] == detail["attempts"][1]["position"] == detail["position"]
    assert out["S"] == (greedy_text(clean, short, 4), out["S"][1]) and isinstance(out["S"][1], Finished)
    assert sched.stats["guard_failed"] == 1


def test_debug_nan_names_the_first_layer_that_went_non_finite(pack, clean, caplog):
    engine = Engine.load(pack, settings=Settings.build(allow_faults=True, model=str(pack), debug_nan=True,
                                                       fault_nonfinite=FAULT_AT, **SHAPE))
    with caplog.at_level(logging.WARNING, "strata"):
        engine.logits(prompt_of(clean, "a prompt long enough to reach the fault"))
    assert any("the first non-finite value of a pass came from layer 1 output" in m for m in caplog.messages)


def test_a_live_server_reports_it_streamed_and_as_http_500(deterministic):
    """Streamed: the fault is reached while decoding, after some text was sent; the stream ends with a chunk whose
    finish_reason is "error", then the error object. A request that fails before its first text (streamed or not)
    gets HTTP 500 with that object as its body."""
    short = [{"role": "user", "content": "hi"}]
    long = [{"role": "user", "content": "a prompt long enough to reach the fault"}]
    with running_server(deterministic, **SHAPE, window_tokens=8) as s:
        with httpx.Client(base_url=s.url, timeout=120) as h:
            with h.stream("POST", "/v1/chat/completions",
                          json={"messages": short, "stream": True, "max_tokens": 30}) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            whole = h.post("/v1/chat/completions", json={"messages": long, "max_tokens": 4})
            early = h.post("/v1/chat/completions", json={"messages": long, "max_tokens": 4, "stream": True})
            metrics = h.get("/metrics").text
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    assert any(c["choices"][0]["delta"].get("content") for c in chunks[:-2])        # text came first
    assert chunks[-2]["choices"][0]["finish_reason"] == "error"
    err = chunks[-1]["error"]
    assert err["code"] == "non_finite" and err["position"] == FAULT_AT[1]
    assert [a["numerics"] for a in err["attempts"]] == ["default", "cpu_experts"]
    for r in (whole, early):
        assert r.status_code == 500
        body = r.json()["error"]
        assert body["code"] == "non_finite" and body["position"] >= FAULT_AT[1]
        assert [a["numerics"] for a in body["attempts"]] == ["default", "cpu_experts"]
    assert re.search(r"^strata_guard_failed_total 3", metrics, re.M)
    assert re.search(r"^strata_guard_retries_total 3", metrics, re.M)


def test_a_retry_resumes_from_the_last_checkpoint_before_the_fault_and_returns_a_clean_engines_output(pack, clean,
                                                                                                       caplog):
    """A long prompt read in parts of 8 with a checkpoint every 8 tokens; a device expert slot that the prompt first
    routes to after its first checkpoint is corrupt, so the part that first reads it goes non-finite. The retry
    (cpu_experts) restores the checkpoint at that part's start and reads only the rest; its tokens are a clean
    engine's. The conversation it leaves in the cache is clean: the same prompt again continues from a checkpoint
    and gives the same tokens."""
    every = 8
    a = prompt_of(clean, "the heron waits by the mill pond while the miller counts his sacks of grain, slowly")
    assert len(a) > 4 * every
    clean.record_routing = True
    before = clean.experts.cache.routed.copy()
    clean.logits(a[:every])
    early = clean.experts.cache.routed - before
    clean.logits(a)
    whole = clean.experts.cache.routed - before - early
    clean.record_routing = False
    late = np.argwhere((early == 0) & (whole > 0))            # (MoE layer, expert) first routed after token 8
    assert len(late), "the prompt routes to no expert only after its first checkpoint: pick another prompt"
    p, e = (int(x) for x in late[0])
    engine = faulty(pack, fault_corrupt_slot=clean.experts.cache.slot_of(p, e))
    want = greedy_text(clean, a, 6)
    with caplog.at_level(logging.INFO):
        out, sched = serve_all(engine, [Request("A", a, 6, stop_token_ids=())], checkpoint_every=every,
                               checkpoint_ram_gib=0.01, later=[Request("B", a, 6, stop_token_ids=())])
    assert out["A"][0] == want and isinstance(out["A"][1], Finished)
    failed = [m for m in caplog.messages if "strata guard: non-finite at the prompt part" in m]
    assert len(failed) == 1
    start = int(re.search(r"prompt part (\d+)\.\.", failed[0]).group(1))
    assert start >= every and start % every == 0
    assert f"reads its prompt again from its checkpoint at token {start} ({len(a) - start} of its {len(a)}" in failed[0]
    assert out["A"][1].timings["reused"] == start and sched.stats["guard_tokens_resumed"] == start
    assert any(f"prompt {len(a)} tokens = {start} reused + {len(a) - start} read" in m and "attempt 2 on cpu_experts"
               in m for m in caplog.messages), caplog.messages
    assert sched.stats["guard_retries"] == 1 and sched.stats["expert_slots_repaired"] == 1
    assert out["B"][0] == want and out["B"][1].timings["reused"] == start        # continued from A's clean cache
