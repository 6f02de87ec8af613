"""The layer split (strata/engine/stages.py) on three CPU devices (tests/conftest.py): greedy tokens identical and
logits equal to float-summation order between the unsplit engine and a split at every layer boundary of the demo
model, 2 and 3 stages, with every expert resident and with a small expert cache per stage (window fetch and layer by
layer), for a pack of every expert format; the runner's windows (decode rows, prompt parts, the prompt cache's
copies) through a real server; each stage's memory plan from its own device's numbers and its host mirror holding
its own experts only; the seed-000 interleaving against --layer-split 2 --parallel 2. Seeds:
../shared/seeds/002_*.txt, 004_*.txt."""
from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jax
import numpy as np
import openai
import pytest
from servers import running_server

from strata import Engine
from strata.engine.stages import split_points
from strata.errors import ConfigError
from strata.experts.pack import write_pack
from strata.experts.path import PathKind
from strata.jax_backend.backend import JaxBackend
from tests.experts.test_cache_equivalence import _compare

pytestmark = pytest.mark.heavy      # minutes on 2 CPU cores: started first (tests/conftest.py)

PROMPT_LEN, PART, GEN = 40, 16, 12
TWO_CLIENTS = Path(__file__).resolve().parents[2].parent / "shared" / "clients" / "two_clients.py"
QUIET = {"say": lambda line: None}


def _run(**options):
    e = Engine.load("demo", max_context=256, prefill=PART, debug_slots=True, **QUIET, **options)
    prompt = np.random.default_rng(3).integers(0, e.cfg.vocab_size, PROMPT_LEN).tolist()
    return e, e.logits(prompt, part_size=PART), e.generate(prompt, GEN)


@pytest.fixture(scope="module")
def unsplit():
    return _run()


def test_three_devices_are_visible():
    assert len(jax.devices("cpu")) >= 3, "tests/conftest.py asks XLA for three CPU devices"


@pytest.mark.parametrize("split", ["1", "2", "3", "1,3"])
def test_split_matches_unsplit(unsplit, split):
    """Every layer boundary of the demo model (2 stages), and 3 stages."""
    got = _run(layer_split=split)
    e = got[0]
    assert len(e.stages) == split.count(",") + 2
    assert [st.ops.device for st in e.stages] == jax.devices("cpu")[:len(e.stages)]
    # each stage's parameters live on its own device
    for st in e.stages:
        assert all(a.devices() == {st.ops.device} for a in jax.tree.leaves(st.params))
    _compare(unsplit, got, f"layer_split {split}")


def test_pipelined_windows_on_a_split_give_the_unsplit_tokens(unsplit):
    """Two requests generating on a split with nothing to read: the scheduler alternates its windows between them,
    each dispatched before the last one is read and without waiting on it, and each request's text is the unsplit
    engine's."""
    from strata.sched.request import Request
    from tests.sched.test_guard_engine import greedy_text, prompt_of, serve_all
    base = unsplit[0]
    e = Engine.load("demo", max_context=256, prefill=PART, layer_split="2", **QUIET)
    prompts = [prompt_of(e, text) for text in ("the heron waits", "by the mill pond at dusk")]
    out, sched = serve_all(e, [Request(f"R{i}", p, 40, stop_token_ids=()) for i, p in enumerate(prompts)])
    assert sched.pipelined and sched.stats["windows_pipelined"] >= 10
    for i, p in enumerate(prompts):
        assert out[f"R{i}"][0] == greedy_text(base, p, 40)


def test_the_hand_off_keeps_its_address_window_to_window():
    """A split's decode windows write the hidden rows into a hand-off buffer that each window donates back, so
    every stage's compiled window sees the same addresses window to window (a command buffer whose addresses move
    is recorded again); the tokens stay those of the unsplit engine (test_split_matches_unsplit, the server test)."""
    from dataclasses import replace

    from strata.engine.runner import WindowRunner
    from strata.plan import idle_plan
    e = Engine.load("demo", max_context=256, prefill=PART, layer_split="2", **QUIET)
    runner = WindowRunner(e, 2, 16)
    plan = replace(idle_plan(2), decode_active=np.ones(2, bool), decode_tokens=np.array([3, 4], np.int32))
    runner.run(plan)                                                    # compiles
    first = runner.rows._handoff[0]
    where = first.unsafe_buffer_pointer()
    for i in range(1, 4):
        runner.run(replace(plan, decode_pos=plan.decode_pos + i, steps=plan.steps + i))
        buf = runner.rows._handoff[0]
        assert buf.unsafe_buffer_pointer() == where and buf.dtype == e.dtype and buf.devices() == {jax.devices()[0]}
    assert first.is_deleted()                                           # donated, not copied


def test_auto_balances_by_bytes_and_free_memory():
    cfg = Engine.load("demo", max_context=256, prefill=PART, **QUIET).cfg          # 4 layers
    assert split_points("auto", cfg, 2) == [2] and split_points("auto", cfg, 3) == [1, 3]
    assert split_points("auto", cfg, 2, layer_bytes=[1, 1, 1, 5]) == [3]
    assert split_points("auto", cfg, 2, free=[300, 100]) == [3]          # the larger device takes more layers
    assert split_points("auto", cfg, 2, free=[100, 300]) == [1]
    assert split_points(None, cfg, 3) == [] and split_points("1,3", cfg, 3) == [1, 3]


@pytest.mark.parametrize("split", ["1", "2,3"])
@pytest.mark.parametrize("cache", [dict(expert_cache=4), dict(expert_cache=4, window_fetch=False)])
def test_split_with_a_small_expert_cache_per_stage(unsplit, split, cache):
    got = _run(layer_split=split, **cache)
    kinds = {st.path.kind for st in got[0].stages if st.experts is not None}
    assert kinds and PathKind.RESIDENT not in kinds
    _compare(unsplit, got, f"layer_split {split}, {cache}")


def test_each_stage_plans_from_its_own_device(monkeypatch):
    """Devices reporting different free memory: each stage's cache is sized from its own device's number, and its
    host mirror holds its own layers' experts only (../shared/seeds/002_*.txt, parts 1 and 2)."""
    free = {0: 900_000, 1: 300 << 20}        # device 0: room for about a dozen of the demo's 36 KB experts
    monkeypatch.setattr(JaxBackend, "free_memory_bytes", lambda self, driver=None: free[self.device.id])
    lines: list[str] = []
    e = Engine.load("demo", max_context=256, prefill=PART, layer_split="2", say=lines.append)
    st0, st1 = e.stages
    assert [st.experts.plan.free_bytes for st in e.stages] == [free[0], free[1]]
    assert any(ln.startswith(f"strata plan: {st0.ops.device}: ") for ln in lines)
    assert any(ln.startswith(f"strata plan: {st1.ops.device}: ") for ln in lines)
    # each stage's state counted for its own layers: the attention layer's KV is on stage 1 only
    assert st0.experts.plan.state_bytes < st1.experts.plan.state_bytes
    own = st0.experts.cache.n_layers * st0.experts.cache.n_experts
    assert 0 < st0.experts.cache.n_slots < own and st1.experts.cache.all_resident()
    # the host mirror of stage 0 (whose cache is partial): its own MoE layers only, never stage 1's
    slot = st0.experts.layout.nbytes
    mirror = st0.experts.mirror
    assert mirror is not None and mirror.n_layers == 2 and mirror.nbytes == own * slot
    assert st1.experts.mirror is None


def test_server_on_a_split(unsplit):
    """The runner's windows across stages through a real server: prompts read in parts while another slot decodes,
    the same answers as the unsplit engine, also with two slots decoding at once; a repeated prompt through the
    prompt cache (snapshots and restores on every stage); /metrics and /props per stage; then
    ../shared/clients/two_clients.py 20 times against --layer-split 2 --parallel 2 (two CPU devices)."""
    assert TWO_CLIENTS.exists(), f"{TWO_CLIENTS} is missing (../shared/clients beside the checkout)"
    base = unsplit[0]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, base.cfg.vocab_size, n).tolist() for n in (5, 70, 150)]
    want = [base.tokenizer.decode(base.generate(p, 16, stop_token_ids=[]), skip_special_tokens=True) for p in prompts]
    e = Engine.load("demo", max_context=8192, prefill=256, layer_split="2", **QUIET)
    with running_server(e, parallel=2, prefill=256, max_context=8192) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)

        def ask(p, n=16):
            return client.completions.create(model="demo", prompt=p, max_tokens=n, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(ask, prompts))
        assert together == want
        # two slots decoding at once (whether their windows alternate depends on when the requests arrive: the
        # scheduler's own test below checks that)
        long = [base.tokenizer.decode(base.generate(p, 48, stop_token_ids=[]), skip_special_tokens=True)
                for p in prompts[:2]]
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(lambda p: ask(p, 48), prompts[:2])) == long
        assert srv.scheduler.pipelined
        assert [ask(p) for p in prompts] == want                       # again: prompt-cache hits
        metrics = httpx.get(srv.url + "/metrics").text
        for stage, layers in (("0", "0-1"), ("1", "2-3")):
            assert re.search(rf'^strata_stage_expert_hits_total{{device="cpu:{stage}",layers="{layers}",'
                             rf'stage="{stage}"}} [1-9]', metrics, re.M), metrics
        assert re.search(r'^strata_stage_handoff_seconds_total{device="cpu:1",layers="2-3",stage="1"} ', metrics,
                         re.M)
        stages = httpx.get(srv.url + "/props").json()["stages"]
        assert [(st["stage"], st["device"], st["layers"]) for st in stages] == [(0, "cpu:0", "0-1"),
                                                                                (1, "cpu:1", "2-3")]
        assert all(st["expert_hits"] > 0 for st in stages) and stages[1]["handoff_seconds"] > 0
        srv.scheduler.cache.clear()
        for run in range(20):
            r = subprocess.run([sys.executable, str(TWO_CLIENTS), "--base", srv.url, "--tokens", "60",
                                "--lines", "40", "--stall", "120"], capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, f"run {run}: {r.stdout}{r.stderr}"
            srv.scheduler.cache.clear()


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("split-packs")
    return {fmt: write_pack("demo", root / fmt, fmt) for fmt in ("int4", "nvfp4")}


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "int4", "nvfp4"])
def test_split_matches_unsplit_in_every_expert_format(packs, tmp_path, fmt):
    """A pack of each expert format (strata.weights.quant.FORMATS): split at 2 with a small cache on the first
    stage equals the unsplit engine on the same pack."""
    pack = packs[fmt] if fmt in packs else write_pack("demo", tmp_path / fmt, fmt)

    def run(**options):
        e = Engine.load(pack, max_context=256, prefill=PART, debug_slots=True, **QUIET, **options)
        prompt = np.random.default_rng(3).integers(0, e.cfg.vocab_size, PROMPT_LEN).tolist()
        return e, e.logits(prompt, part_size=PART), e.generate(prompt, GEN)
    got = run(layer_split="2", expert_cache=6)
    assert got[0].stages[0].experts.layout.fmt == fmt
    _compare(run(), got, f"{fmt} pack, layer_split 2")


@pytest.mark.parametrize("fmt, cache", [("int4", dict(expert_cache=6)), ("nvfp4", {})])
def test_prefill_help_matches_no_help(packs, fmt, cache):
    """../shared/seeds/004_*.txt: prompts of 1024..3276 tokens read in one part, the second device computing a share
    of the first stage's experts (its format's scales through the same expert op), give what they give unhelped."""
    options = dict(max_context=4096, prefill=4096, layer_split="2", debug_slots=True, **cache, **QUIET)
    off = Engine.load(packs[fmt], **options)
    on = Engine.load(packs[fmt], prefill_help=True, **options)
    assert on.stages[0].path.helped and not on.stages[0].path.compiled_parts
    rng = np.random.default_rng(7)
    for n in (1024, 3276):            # the seed's range's ends: one part each (buckets 1024 and 4096)
        prompt = rng.integers(0, off.cfg.vocab_size, n).tolist()
        tokens = n == 1024                # greedy tokens too (generate reads the prompt again)
        ref = (off, off.logits(prompt)[-8:], off.generate(prompt, 3) if tokens else None)
        got = (on, on.logits(prompt)[-8:], on.generate(prompt, 3) if tokens else None)
        _compare(ref, got, f"{fmt} {cache} prompt of {n} tokens, help on vs off")
    st = on.stages[0].experts.cache.stats
    assert st.peer_routes > 0 and off.stages[0].experts.cache.stats.peer_routes == 0


def test_prefill_help_needs_a_split():
    with pytest.raises(ConfigError, match="prefill_help needs layer_split"):
        Engine.load("demo", max_context=256, prefill=PART, prefill_help=True, **QUIET)


@pytest.mark.parametrize("value, words", [
    ("0", "increasing layers in 1..3"), ("4", "increasing layers in 1..3"), ("2,1", "increasing layers"),
    ("1,2,3", "makes 4 stages but the backend sees 3"), ("x", "must be auto, or the first layer")])
def test_bad_splits_are_refused_by_name(value, words):
    with pytest.raises(ConfigError, match=words):
        Engine.load("demo", max_context=256, prefill=PART, layer_split=value, **QUIET)


def test_the_guard_on_a_split(tmp_path):
    """The numerics guard across stages: a corrupt slot of the first stage is found and rewritten and the request
    returns the clean engine's tokens; a deterministic non-finite value in the second stage's layer 3 (the fault names
    the whole model's layers) ends its request with the explicit error after its retry on cpu_experts, sparing the
    other slot."""
    from strata.config import Settings
    from strata.sched.request import Failed, Finished, Request
    from tests.sched.test_guard_engine import SHAPE, greedy_text, prompt_of, serve_all
    pack = write_pack("demo", tmp_path / "pack", "f32")
    clean = Engine.load(pack, **SHAPE, **QUIET)

    def faulty(**faults):
        return Engine.load(pack, settings=Settings.build(allow_faults=True, model=str(pack), layer_split="2",
                                                         **SHAPE, **faults), **QUIET)
    a, short = prompt_of(clean, "the heron waits by the mill pond"), prompt_of(clean, "hi")
    clean.record_routing = True
    clean.logits(a)                                  # which experts the prompt reads: corrupt one of them
    clean.record_routing = False
    p, x = 1, int(np.argmax(clean.experts.cache.routed[1]))          # MoE layer 1: the first stage's
    e = faulty(fault_corrupt_slot=clean.experts.cache.slot_of(p, x))
    cache = e.stages[0].experts.cache
    assert cache.content_matches(cache.pool, [cache.slot_of(p, x)], [(p, x)]) is False
    out, sched = serve_all(e, [Request("A", a, 8, stop_token_ids=())])
    assert out["A"][0] == greedy_text(clean, a, 8) and isinstance(out["A"][1], Finished)
    assert all(st.experts.cache.verify() == [] for st in e.stages)
    assert sched.stats["guard_retries"] >= 1 and sched.stats["expert_slots_repaired"] == 1

    e = faulty(fault_nonfinite=(3, 20))
    out, sched = serve_all(e, [Request("L", a, 4), Request("S", short, 4, stop_token_ids=())])
    text, final = out["L"]
    assert text == "" and isinstance(final, Failed) and final.code == "non_finite"
    assert [t["numerics"] for t in dict(final.detail)["attempts"]][1] == "cpu_experts"
    assert out["S"][0] == greedy_text(clean, short, 4) and isinstance(out["S"][1], Finished)
