"""The KV's host tier through a real server (loopback, --kv-resident 128 on the demo model): the field report's two
clients (../shared/clients/two_clients.py) pass again and again while slots spill to host RAM, a long chat through the
openai client gets the text of the same engine with every position on the device, and /slots, /metrics and the log
say where each slot's KV is."""
from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from servers import running_server

from strata import Engine

CONTEXT, PREFILL, RESIDENT = 2048, 32, 128
TWO_CLIENTS = Path(__file__).resolve().parents[2].parent / "shared" / "clients" / "two_clients.py"
WORDS = "the heron waits by the mill pond while a fox counts the reeds and seven geese argue".split()


@pytest.fixture(scope="module")
def server():
    engine = Engine.load("demo", max_context=CONTEXT, prefill=PREFILL, kv_resident=RESIDENT)
    with running_server(engine, parallel=2, prefill=PREFILL, max_context=CONTEXT, kv_resident=RESIDENT,
                        checkpoint_every=64) as srv:
        yield srv, engine


def test_two_clients_and_a_long_chat_over_the_host_tier(server, caplog):
    srv, engine = server
    caplog.set_level(logging.INFO, logger="strata")
    assert TWO_CLIENTS.exists(), f"{TWO_CLIENTS} is missing (../shared/clients beside the checkout)"
    for run in range(3):
        r = subprocess.run([sys.executable, str(TWO_CLIENTS), "--base", srv.url, "--tokens", "40",
                            "--lines", str(16 + 4 * run), "--stall", "120"], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, f"run {run}: {r.stdout}{r.stderr}"
    messages = [{"role": "user", "content": " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(400))}]
    client = OpenAI(base_url=srv.url + "/v1", api_key="none")
    got = client.chat.completions.create(model="demo", messages=messages, max_tokens=24, temperature=0)
    _, ids = engine.tokenizer.encode_chat(messages, add_generation_prompt=True)
    assert got.usage.prompt_tokens == len(ids) > 2 * RESIDENT
    want = engine.generate(ids, max_tokens=24)        # an Engine sequence: every position on the device
    want = [t for t in want if t not in engine.eos_token_ids]
    assert got.choices[0].message.content == engine.tokenizer.decode(want)
    slots = httpx.get(srv.url + "/slots").json()
    assert all(s["kv_device_tokens"] + s["kv_host_tokens"] == s["conversation_tokens"] for s in slots)
    assert max(s["kv_host_tokens"] for s in slots) > len(ids) - RESIDENT
    metrics = httpx.get(srv.url + "/metrics").text
    spills = re.search(r"^strata_kv_spills_total (\S+)", metrics, re.M)
    assert spills and float(spills.group(1)) > 0 and re.search(r"^strata_kv_host_positions \d", metrics, re.M)
    assert re.search(r"^strata_kv_rows_free \d", metrics, re.M)               # parked rows: auto, one a slot
    assert re.search(r"^strata_kv_parks_by_reference_total \d", metrics, re.M)
    assert any(re.match(r"strata kv: slot \d moved positions \d+\.\.\d+ to host RAM", m) for m in caplog.messages)
