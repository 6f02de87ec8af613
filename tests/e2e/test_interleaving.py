"""Black-box tests of a real server on loopback: concurrency changes nothing a client sees, and a client that goes away
frees its slot without disturbing the others."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from servers import alone_then_together, running_server

from strata import Engine

pytestmark = pytest.mark.heavy      # minutes on 2 CPU cores: started first (tests/conftest.py)



@pytest.fixture(scope="module")
def engine():
    # one engine for every server in this module, so compilations are shared
    return Engine.load("demo", max_context=65536, prefill=1024)


def _prompts():
    base = "Summarise the notes below in one line.\n"
    return [base + "\n".join(f"note {i}: the kettle is on and the window is open" for i in range(n))
            for n in (1, 6, 20, 45)]


def _ask(url, prompt, max_tokens):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens


def _concurrent_equals_sequential(engine, parallel, prefill, max_context):
    """Each prompt asked alone, then all at once: every client gets what it got alone."""
    prompts = _prompts()
    with running_server(engine, parallel=parallel, prefill=prefill, max_context=max_context) as srv:
        alone, together = alone_then_together(lambda p: _ask(srv.url, p, 24), prompts, 120)
    assert together == alone
    assert any(n > 0 for _, _, n in alone)


@pytest.mark.parametrize("parallel", [1, 2, 3, 4])
@pytest.mark.parametrize("prefill", [16, 64])
def test_concurrent_requests_equal_sequential(engine, parallel, prefill):
    _concurrent_equals_sequential(engine, parallel, prefill, 65536)


def test_int8_kv_concurrent_requests_equal_sequential():
    """The int8 KV cache through the runner's bank (decode rows and prompt parts on slots): concurrency changes
    nothing, as with the float cache."""
    _concurrent_equals_sequential(Engine.load("demo", max_context=4096, prefill=64, kv="int8"), 3, 16, 4096)


def test_disconnect_frees_the_slot_and_spares_the_others(engine):
    prompt = _prompts()[1]
    with running_server(engine, parallel=2, prefill=64, max_context=65536) as srv:
        solo = _ask(srv.url, prompt, 40)
        other: dict = {}

        def steady():
            other["result"] = _ask(srv.url, prompt, 40)
        # ignore_eos: the random demo model would otherwise end on an end-of-sequence token at a random moment.
        # max_tokens near the context: the engine does not wait for the client (its event buffer is unbounded), so on a
        # fast machine 5000 tokens could all be generated before this thread looked at /slots; 60000 cannot
        body = {"model": "demo", "stream": True, "max_tokens": 60000, "temperature": 0.7, "seed": 1,
                "ignore_eos": True, "messages": [{"role": "user", "content": "go on forever"}]}
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json=body) as resp:
                got, request_id = 0, None
                # hold the line iterator: a `for` over a bare iter_lines() closes it at `break`, and closing it closes
                # the connection, so the server could free the slot before the /slots check below
                lines = resp.iter_lines()
                for line in lines:
                    if line.startswith("data:") and "content" in line:
                        request_id = json.loads(line[5:])["id"]
                        got += 1
                    if got == 3:
                        break
                t = threading.Thread(target=steady)
                t.start()
                assert request_id in [s["request"] for s in c.get("/slots").json()]
            gone = time.monotonic()                       # the response is closed: the client went away
            while request_id in [s["request"] for s in c.get("/slots").json()]:
                assert time.monotonic() - gone < 1.0, c.get("/slots").json()
                time.sleep(0.01)
            freed = time.monotonic() - gone
        t.join(120)
    assert freed < 1.0
    assert other["result"] == solo
