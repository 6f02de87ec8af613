"""The field report's interleaving (../shared/seeds/000_*.txt), run by its own client (../shared/clients/two_clients.py)
against a real server: client A decodes while client B's long prompt is read in several parts. 20 runs in a row,
with every expert resident (test_two_clients_tiny_cache.py repeats it with a tiny expert cache)."""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from servers import running_server

from strata import Engine

RUNS = 20
TWO_CLIENTS = Path(__file__).resolve().parents[2].parent / "shared" / "clients" / "two_clients.py"


@pytest.fixture(scope="module")
def engine():
    return Engine.load("demo", max_context=65536, prefill=1024)


def test_two_clients_twenty_times(engine, caplog):
    """The seed-000 interleaving: A decodes while B's long prompt is read in several parts; 20 runs in a row."""
    assert TWO_CLIENTS.exists(), f"{TWO_CLIENTS} is missing (../shared/clients beside the checkout)"
    caplog.set_level(logging.INFO, logger="strata.sched")
    with running_server(engine, parallel=2, prefill=1024, max_context=65536) as srv:
        for run in range(RUNS):
            r = subprocess.run([sys.executable, str(TWO_CLIENTS), "--base", srv.url, "--tokens", "200",
                                "--lines", "600", "--stall", "120"], capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, f"run {run}: {r.stdout}{r.stderr}"
            assert all(s["state"] == "free" for s in httpx.get(srv.url + "/slots").json())
    parts = [m for m in caplog.messages if m.startswith("strata batch: the prompt was read in ")]
    assert len(parts) >= RUNS and all(int(m.split(" parts,")[0].rsplit(" ", 1)[1]) > 1 for m in parts)

