"""The prompt cache through a real server (loopback): the field report's two clients (../shared/clients/two_clients.py)
run 20 times against --parallel 2 --checkpoint-every 32, B's long prompt two lines longer each run and back to
the shortest every ten (so it shares all but its new lines with an earlier run's and still reads them in parts while A
decodes): every run passes,
the slots end free, later runs reuse what earlier ones stored, and /slots, /metrics and the log say so. A chat's
follow-up turn through the openai client gets the text a cold server gives."""
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

RUNS = 20          # about 1 s a run on the demo model (2 shared CPU cores), after a 25 s warm-up
CONTEXT = 2048
TWO_CLIENTS = Path(__file__).resolve().parents[2].parent / "shared" / "clients" / "two_clients.py"


@pytest.fixture(scope="module")
def server():
    engine = Engine.load("demo", max_context=CONTEXT, prefill=64)
    with running_server(engine, parallel=2, prefill=64, max_context=CONTEXT, checkpoint_every=32) as srv:
        yield srv


def test_two_clients_again_and_again_with_the_prompt_cache(server, caplog):
    assert TWO_CLIENTS.exists(), f"{TWO_CLIENTS} is missing (../shared/clients beside the checkout)"
    caplog.set_level(logging.INFO, logger="strata.sched")
    srv = server
    for run in range(RUNS):
        r = subprocess.run([sys.executable, str(TWO_CLIENTS), "--base", srv.url, "--tokens", "40",
                            "--lines", str(12 + 2 * (run % 10)), "--stall", "120"], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, f"run {run}: {r.stdout}{r.stderr}"
        slots = httpx.get(srv.url + "/slots").json()
        assert all(s["state"] == "free" for s in slots)
        assert all({"reused", "read", "checkpoints", "conversation_tokens"} <= set(s) for s in slots)
    metrics = httpx.get(srv.url + "/metrics").text
    hits = re.search(r"^strata_prompt_cache_hits_total (\S+)", metrics, re.M)
    reused = re.search(r"^strata_prompt_cache_tokens_reused_total (\S+)", metrics, re.M)
    ram = re.search(r"^strata_checkpoint_ram_bytes (\S+)", metrics, re.M)
    assert hits and float(hits.group(1)) >= 2 * (RUNS - 1)               # A and B of every run after the first
    assert reused and float(reused.group(1)) > 0 and ram is not None
    lines = [m for m in caplog.messages if re.match(r"strata serve: prompt \d+ tokens = \d+ reused \+ \d+ read", m)]
    assert len(lines) == 2 * RUNS and all(" checkpoints, finish " in m for m in lines)
    later = [int(m.split(" reused")[0].rsplit(" ", 1)[1]) for m in lines[2:]]
    assert all(n > 0 for n in later)


def test_a_follow_up_turn_equals_a_cold_servers(server):
    history = [{"role": "user", "content": "Name three birds that wade in ponds."}]
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    first = client.chat.completions.create(model="demo", messages=history, max_tokens=16, temperature=0)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And three that do not."}]
    hits = server.scheduler.metrics()["prompt_cache_hits"]
    warm = client.chat.completions.create(model="demo", messages=history, max_tokens=16, temperature=0)
    assert server.scheduler.metrics()["prompt_cache_hits"] == hits + 1
    cold = client.chat.completions.create(model="demo", messages=history, max_tokens=16, temperature=0,
                                          extra_body={"cache_prompt": False, "strata_checkpoint": False})
    assert server.scheduler.metrics()["prompt_cache_hits"] == hits + 1
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert warm.usage.prompt_tokens == cold.usage.prompt_tokens
    assert 0 < warm.usage.prompt_tokens_details.cached_tokens <= warm.usage.prompt_tokens
    assert cold.usage.prompt_tokens_details.cached_tokens == 0


def test_conversations_sharing_a_system_prompt_branch_and_keep_their_histories(server):
    """The issue's case through the openai client on two slots: B and C share A's long system prompt; each reuses it
    (copied from A's slot), A's next turn reuses all of A's history (before the tree, B took A over and cut it), and
    a reply after a branch is a cold server's."""
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    system = {"role": "system", "content": "You review code. " + "Read the file, then the tests, then answer. " * 40}

    def ask(messages, **kw):
        return client.chat.completions.create(model="demo", messages=messages, max_tokens=12, temperature=0, **kw)
    a = [system, {"role": "user", "content": "What does module a do?"}]
    first = ask(a)
    branches = server.scheduler.metrics()["prompt_cache_branches"]
    others = [ask([system, {"role": "user", "content": f"What does module {m} do?"}]) for m in "bc"]
    assert server.scheduler.metrics()["prompt_cache_branches"] >= branches + 2
    shared = first.usage.prompt_tokens - 16                  # the system prompt and the chat markers before "What"
    for r in others:
        assert shared - 32 <= r.usage.prompt_tokens_details.cached_tokens <= r.usage.prompt_tokens - 1
    a += [{"role": "assistant", "content": first.choices[0].message.content},
          {"role": "user", "content": "And module b?"}]
    again = ask(a)
    cold = ask(a, extra_body={"cache_prompt": False, "strata_checkpoint": False})
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 3 - 32
    assert again.choices[0].message.content == cold.choices[0].message.content
