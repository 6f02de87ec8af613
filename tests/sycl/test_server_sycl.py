"""The server over backend="sycl": a real server on loopback, concurrent requests equal sequential ones, and the
field report's two-client interleaving (../shared/clients/two_clients.py) completes."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest
from servers import running_server

from strata import Engine

TWO_CLIENTS = Path(__file__).resolve().parents[2].parent / "shared" / "clients" / "two_clients.py"


@pytest.fixture(scope="module")
def engine(sycl_device):
    e = Engine.load("demo", backend="sycl", device=sycl_device, max_context=16384, prefill=1024)
    assert e.backend.name == "sycl"
    return e


def _ask(url, prompt):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=16, temperature=0)
    return r.choices[0].message.content, r.choices[0].finish_reason


def test_concurrent_requests_equal_sequential_on_sycl(engine):
    prompts = ["hi"] + ["\n".join(f"note {i}: the kettle is on" for i in range(n)) for n in (8, 30)]
    with running_server(engine, parallel=3, prefill=64, max_context=16384) as srv:
        alone = [_ask(srv.url, p) for p in prompts]
        together: list = [None] * len(prompts)
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, _ask(srv.url, prompts[i])))
                   for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert together == alone


def test_two_clients_on_sycl(engine):
    assert TWO_CLIENTS.exists(), f"{TWO_CLIENTS} is missing (../shared/clients beside the checkout)"
    with running_server(engine, parallel=2, prefill=1024, max_context=16384) as srv:
        r = subprocess.run([sys.executable, str(TWO_CLIENTS), "--base", srv.url, "--tokens", "200", "--lines", "150",
                            "--stall", "300"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
