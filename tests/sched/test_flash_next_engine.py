"""Qwen3.8-Flash-Next (qwen4_exp) through the engine's features, on the built-in demo-flash model (hyper-connection
streams, a PLE layer, QSA past 64 tokens): a slot's PLE n-gram context and conv state and its QSA index keys travel
with it. The prompt cache's turns, interleaved conversations on three slots (row buckets) and parked conversations
give the cold engine's greedy text; concurrent requests through a real server give what each got alone, with
prompt parts of 16 and 64 tokens; a table in host RAM gives the device table's text; the layer split gives the unsplit engine's logits and text; speculative decoding with its MTP head gives the
plain text; the seed-000 interleaving (../shared/clients/two_clients.py) with a small expert
cache; the expert paths and a pack equal the all-resident engine."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from servers import alone_then_together, running_server
from test_prompt_cache import converse

from strata import Engine

pytestmark = pytest.mark.heavy      # minutes on 2 CPU cores: started first (tests/conftest.py)

TWO_CLIENTS = Path(__file__).resolve().parents[2].parent / "shared" / "clients" / "two_clients.py"


@pytest.fixture(scope="module")
def engine():
    return Engine.load("demo-flash", max_context=4096, prefill=64)


def test_the_state_holds_the_ple_context_and_conv_and_the_qsa_keys(engine):
    state = engine.init_state()
    ple = engine.cfg.ple.layers[0]
    assert set(state[ple]) == {"conv", "ssm", "ple_ctx", "ple_conv"}
    attention = engine.cfg.layer_types.index("full_attention")
    assert state[attention]["ik"].shape == (engine.capacity, engine.cfg.qsa.head_dim)


def test_turns_give_the_cold_engines_text(engine):
    sched, rows = converse(engine, 1, 4, parallel=1)
    assert all(reused > 0 for _, reused, _ in rows[1:])
    assert max(len(prompt) for prompt, _, _ in rows) > engine.cfg.qsa.budget     # the selection ran
    assert sched.metrics()["prompt_cache_hits"] == 3


def test_three_interleaved_conversations_on_three_slots(engine):
    sched, _ = converse(engine, 3, 3, parallel=3)
    assert sched.metrics()["prompt_cache_hits"] == 6


def test_a_table_in_host_ram_gives_the_device_tables_text_on_three_slots(engine):
    # decode rows gather their table rows on the host together (host_call under the rows' vmap), parts and
    # checkpoints as on the device
    host = Engine.load("demo-flash", max_context=4096, prefill=64, ple_table="host")
    assert type(host.params["layers"][engine.cfg.ple.layers[0]]["ple_table"]).__name__ == "HostRows"
    sched, _ = converse(engine, 3, 2, parallel=3, cached_engine=host)
    assert sched.metrics()["prompt_cache_hits"] == 3


@pytest.mark.parametrize("split", ["1", "2", "3", "1,3"])
def test_the_layer_split_gives_the_unsplit_logits_and_text(engine, split):
    """The streams [T, hc x H] handed between stages; the final mixer and head on the last stage."""
    prompt = list(np.random.default_rng(3).integers(0, engine.cfg.vocab_size, 100))
    staged = Engine.load("demo-flash", max_context=4096, prefill=64, layer_split=split)
    assert len(staged.stages) == split.count(",") + 2 and "hcf_down" in staged.stages[-1].params
    assert np.array_equal(staged.logits(prompt, part_size=16), engine.logits(prompt, part_size=16))
    assert staged.generate(prompt, 10) == engine.generate(prompt, 10)


def test_two_stages_with_the_table_in_host_ram_give_the_device_tables_text(engine):
    staged = Engine.load("demo-flash", max_context=4096, prefill=64, layer_split="2", ple_table="host")
    sched, _ = converse(engine, 2, 2, parallel=2, cached_engine=staged)
    assert sched.metrics()["prompt_cache_hits"] == 2


@pytest.fixture(scope="module")
def spec_pair():
    from tests.sched.test_spec import CTX, PART
    return (Engine.load("demo-flash", max_context=CTX, prefill=PART),
            Engine.load("demo-flash", max_context=CTX, prefill=PART, spec=4, mtp=True))


def test_speculative_decoding_with_its_mtp_head_gives_the_plain_text(spec_pair):
    """--spec 4 --mtp on demo-flash: four requests on three slots, rows verifying 4, 2 and 3 of the head's own
    drafts (its QSA layer and the streams through verify windows and rollback): the spec-off greedy text."""
    from tests.sched.test_spec import Lengths, _requests, _serve
    plain, spec = spec_pair
    want, _ = _serve(plain, _requests(plain), 3)
    got, sched = _serve(spec, _requests(spec), 3, Lengths([4, 2, 3]))
    assert {r: v[0] for r, v in got.items()} == {r: v[0] for r, v in want.items()}
    assert sched.metrics()["drafts_verified"] > 0


@pytest.mark.parametrize("right", [3, 1])
def test_accepted_drafts_roll_the_ple_state_back_to_the_last_accepted_position(spec_pair, right):
    """Drafts injected from the model's own greedy continuation, the first `right` of 3 right: each window accepts
    them and rolls back to that position (a PLE layer's n-gram context and conv rows included); the text is the
    spec-off text."""
    from tests.sched.test_spec import DraftPolicy, _reference_ids, _requests, _serve, reference_drafts
    plain, spec = spec_pair
    k, n = 3, 20
    req = _requests(spec, 1, max_tokens=n)[0]
    ref = list(req.prompt_ids) + _reference_ids(plain, req.prompt_ids, n + k)
    wrap = reference_drafts(ref, k, right, spec.cfg.vocab_size)
    got, sched = _serve(spec, [req], 3, DraftPolicy(k, adaptive=False), wrap)
    text, final = got[req.id]
    assert final.completion_tokens == n and text == spec.tokenizer.decode(ref[len(req.prompt_ids):][:n])
    assert sched.metrics()["drafts_accepted"] >= 3 * right


def test_conversations_parked_and_resumed(engine):
    sched, _ = converse(engine, 2, 3, parallel=1, together=False)
    m = sched.metrics()
    assert m["conversations_parked"] == 5 and m["conversations_resumed"] == 4


def _ask(url, prompt):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=16, temperature=0)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens


@pytest.mark.parametrize("prefill", [16, 64])
def test_concurrent_requests_equal_alone(engine, prefill):
    prompts = [f"note {n}: " + "the kettle is on and the window is open. " * n for n in (1, 5, 14)]
    with running_server(engine, parallel=3, prefill=prefill, max_context=4096) as srv:
        alone, together = alone_then_together(lambda p: _ask(srv.url, p), prompts, 300)
    assert together == alone
    assert all(n > 0 for _, _, n in alone)


def test_expert_paths_and_a_pack_give_the_resident_engines_tokens(tmp_path):
    """A small expert cache (misses copied in the window, run layer by layer, or computed on the CPU) and a pack of
    its experts (f32, so bit-equal values) give the all-resident engine's logits and greedy tokens."""
    from strata.experts.pack import write_pack
    prompt = [5, 80, 256, 17, 300, 42, 42, 9] * 11                      # 88 tokens: past QSA's 64
    full = Engine.load("demo-flash", max_context=512)
    want, want_gen = full.logits(prompt), full.generate(prompt, 8, temperature=0.0)
    span = float(want.max() - want.min())
    pack = write_pack("demo-flash", tmp_path / "pack", "f32")
    for model, kw in (("demo-flash", dict(expert_cache=24)), ("demo-flash", dict(expert_cache=24, window_fetch=False)),
                      ("demo-flash", dict(expert_cache=24, miss_policy="cpu")), (pack, dict(expert_cache=24))):
        e = Engine.load(model, max_context=512, **kw)
        got = e.logits(prompt)
        assert float(abs(got - want).max()) <= 1e-5 * span, kw
        assert e.generate(prompt, 8, temperature=0.0) == want_gen, kw


def test_the_seed_000_interleaving_with_a_small_expert_cache():
    """Client A decodes while client B's long prompt (past QSA's budget, several parts) is read, on 8 of the 64
    expert slots (parts borrow slots while A decodes; every slot read is checked against its source): twice, each
    run leaving every slot free."""
    assert TWO_CLIENTS.exists(), f"{TWO_CLIENTS} is missing (../shared/clients beside the checkout)"
    e = Engine.load("demo-flash", max_context=16384, prefill=1024, expert_cache=8, debug_slots=True,
                    stream_parts=False, say=lambda line: None)
    with running_server(e, parallel=2, prefill=1024, max_context=16384) as srv:
        for run in range(2):
            r = subprocess.run([sys.executable, str(TWO_CLIENTS), "--base", srv.url, "--tokens", "40", "--lines", "100",
                                "--delay", "0.5", "--stall", "120"], capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, f"run {run}: {r.stdout}{r.stderr}"
            assert all(s["state"] == "free" for s in httpx.get(srv.url + "/slots").json())
            srv.scheduler.cache.clear()
