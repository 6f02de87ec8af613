"""The field report's interleaving (../shared/seeds/000_*.txt), run by its own client (../shared/clients/two_clients.py)
against a real server: client A decodes while client B's long prompt is read in several parts. 20 runs in a row,
with every expert resident, and with a tiny expert cache: 8 of the demo's 64 experts in device slots, so B's prompt
parts borrow slots while A decodes (the report's failure: a decode window reading a slot on loan to a prompt part),
every slot any computation reads checked against the pack. (Both in one file: run one after the other, these CPU-heavy
runs do not overlap the timing-sensitive disconnect test on the other worker.)"""
from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from servers import running_server

from strata import Engine
from strata.experts.path import PathKind

pytestmark = pytest.mark.heavy      # minutes on 2 CPU cores: started first (tests/conftest.py)

RUNS = 20
STREAM_RUNS = 3
# B's prompt: 150 lines of the client's filler are ~6,800 tokens of the demo's byte-level tokenizer, 7 parts of 1024
# (the client's default 600 lines are ~27,000: the same interleaving at four times the CPU time)
CONTEXT, LINES = 16384, "150"
TWO_CLIENTS = Path(__file__).resolve().parents[2].parent / "shared" / "clients" / "two_clients.py"


@pytest.fixture(scope="module")
def engine():
    return Engine.load("demo", max_context=CONTEXT, prefill=1024)


def test_two_clients_twenty_times(engine, caplog):
    """The seed-000 interleaving: A decodes while B's long prompt is read in several parts; 20 runs in a row."""
    assert TWO_CLIENTS.exists(), f"{TWO_CLIENTS} is missing (../shared/clients beside the checkout)"
    caplog.set_level(logging.INFO, logger="strata.sched")
    with running_server(engine, parallel=2, prefill=1024, max_context=CONTEXT) as srv:
        for run in range(RUNS):
            # B sent after A's first token, and A's 400 tokens outlast B's admission on a loaded machine (with 200 and
            # B sent after A's tenth, A could finish before B's first part: the client's overlap held, the server's not)
            r = subprocess.run([sys.executable, str(TWO_CLIENTS), "--base", srv.url, "--tokens", "400", "--b-after",
                                "1", "--lines", LINES, "--stall", "120"], capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, f"run {run}: {r.stdout}{r.stderr}"
            assert all(s["state"] == "free" for s in httpx.get(srv.url + "/slots").json())
            srv.scheduler.cache.clear()      # B's prompt read whole every run (test_prompt_cache_server.py: cached)
        # A's tokens came in windows that also read B's parts (the overlap the client checks, seen by the server)
        metrics = httpx.get(srv.url + "/metrics").text
        beside = re.search(r'^strata_inter_token_seconds_count\{window="part"\} (\S+)', metrics, re.M)
        assert beside and float(beside.group(1)) >= RUNS
    parts = [m for m in caplog.messages if m.startswith("strata batch: the prompt was read in ")]
    assert len(parts) >= RUNS and all(int(m.split(" parts,")[0].rsplit(" ", 1)[1]) > 1 for m in parts)


@pytest.fixture(scope="module")
def tiny_cache_engine():
    # 2 slots per MoE layer (8 of the demo's 64 experts): every prompt part borrows (parts copy their misses, not
    # whole layers: the report's case), most decode rows miss
    return Engine.load("demo", max_context=CONTEXT, prefill=1024, expert_cache=8, debug_slots=True,
                       stream_parts=False, say=lambda line: None)


def _tiny_cache_runs(e, runs: int, counter: str, what: str) -> None:
    """The client `runs` times against a server over e (a tiny expert cache), B's prompt read whole every run: each
    run must leave every slot free and grow the cache's counter `counter` (else: `what` did not happen)."""
    with running_server(e, parallel=2, prefill=1024, max_context=CONTEXT) as srv:
        for run in range(runs):
            before = getattr(e.experts.cache.stats, counter)
            r = subprocess.run([sys.executable, str(TWO_CLIENTS), "--base", srv.url, "--tokens", "40",
                                "--lines", "100", "--delay", "0.5", "--stall", "120"], capture_output=True,
                               text=True, timeout=600)
            assert r.returncode == 0, f"run {run}: {r.stdout}{r.stderr}"
            assert all(s["state"] == "free" for s in httpx.get(srv.url + "/slots").json())
            srv.scheduler.cache.clear()
            assert getattr(e.experts.cache.stats, counter) > before, f"run {run}: {what}"


def test_two_clients_twenty_times_with_a_tiny_expert_cache(tiny_cache_engine, caplog):
    assert TWO_CLIENTS.exists(), f"{TWO_CLIENTS} is missing (../shared/clients beside the checkout)"
    e = tiny_cache_engine
    caplog.set_level(logging.INFO, logger="strata.sched")
    _tiny_cache_runs(e, RUNS, "loans", "B's prompt parts borrowed no slot")
    cache = e.experts.cache
    assert not any(cache.slot(i).state.name == "LOANED" for i in range(cache.n_slots))   # every loan came back
    assert cache.verify() == []                                                    # and every resident slot is intact
    assert e.experts.moe.uses_checked > 0 and e.path.kind is not PathKind.RESIDENT
    parts = [m for m in caplog.messages if m.startswith("strata batch: the prompt was read in ")]
    assert len(parts) >= RUNS and all(int(m.split(" parts,")[0].rsplit(" ", 1)[1]) > 1 for m in parts)


def test_two_clients_with_prompt_parts_streaming_whole_layers():
    """The same interleaving with B's parts streaming each layer's experts whole (stream_parts, the default where
    every expert is in pinned host memory; a part of fewer than 4 tokens still borrows): every expert any computation
    reads, the streamed copies' too, is checked against the pack, and every resident slot stays intact."""
    e = Engine.load("demo", max_context=CONTEXT, prefill=1024, expert_cache=8, debug_slots=True,
                    say=lambda line: None)
    assert e.path.streams_parts
    _tiny_cache_runs(e, STREAM_RUNS, "streamed_layers", "no prompt part streamed a layer")
    assert e.experts.cache.verify() == [] and e.experts.moe.uses_checked > 0
