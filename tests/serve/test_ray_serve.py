"""Strata on Ray Serve (serve/ray_app.py): one local Ray instance on the CPU for the module, two engine replicas of
the demo model behind the ingress, the official openai client and raw SSE on loopback. The server's API (streaming,
a malformed body, stop strings, a client that goes away), conversation affinity (three conversations of six turns,
interleaved: each stays on one replica and reuses its prompt tokens; round-robin does not), balance (eight
independent requests spread over both replicas) and a replica killed mid-stream (an explicit error and [DONE];
the next request succeeds; Serve brings the replica back). Ray is required: without it this module fails."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import ray
from ray import serve

from strata.config import Settings
from strata.serve.ray_app import HEADER, application

pytestmark = pytest.mark.heavy      # minutes on 2 CPU cores: started first (tests/conftest.py)

# the module's replicas start without warm-up: each compiles (or loads from the shared cache) the shapes its requests
# use; `strata serve --replicas` below keeps the default warm-up
SETTINGS = dict(parallel=2, prefill=32, max_context=512, queue_limit=8, cpus_per_replica=0.5,
                affinity_block=16, affinity_min_tokens=32, checkpoint_every=64, warm_up=False)
HI = [{"role": "user", "content": "Say hi."}]
# A follow-up turn on the replica holding its conversation resumes from a checkpoint near the end of the previous
# turn's prompt: it reads the generation prompt and the last few tokens again, and nothing earlier.
NEAR = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deploy(**kw):
    serve.run(application(Settings.build(**{**SETTINGS, **kw})), name="strata", route_prefix="/")



@pytest.fixture(scope="module")
def jax_cache():
    """One JAX compile cache for every Ray instance of the module: replicas after the first load their windows. It is
    the test session's cache (tests/conftest.py), so a later run of the suite loads them too."""
    return os.environ["JAX_COMPILATION_CACHE_DIR"]


# --- `strata serve --replicas N`: its own local Ray instance (this test runs before the module's instance starts) ----

def test_strata_serve_replicas_serves_and_stops_on_sigint(jax_cache, tmp_path):
    """max_context left at its default, "auto": the ingress takes the number the replica's memory plan made of it."""
    port = _free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "strata.cli", "serve", "--model", "tiny", "--replicas", "1", "--cpus-per-replica",
           "0.5", "--gpus-per-replica", "0", "--port", str(port), "--parallel", "2", "--prefill", "32",
           "--compile-cache", jax_cache]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    base = f"http://127.0.0.1:{port}"

    def up():
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(base + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False
    try:
        _wait(up, 400, "strata serve --replicas 1 to become healthy")
        r = httpx.post(base + "/v1/chat/completions", json={"messages": HI, "max_tokens": 4}, timeout=120)
        assert r.status_code == 200 and r.headers[HEADER] and r.json()["usage"]["completion_tokens"] >= 1
        # tiny's 4096 positions fit a CPU's memory: auto is all of them, and the ingress counts with that
        assert httpx.get(base + "/v1/models").json()["data"][0]["max_context"] == 4096
        r = httpx.post(base + "/v1/chat/completions", json={"messages": HI, "max_tokens": 4096}, timeout=120)
        assert r.status_code == 400 and "exceed max_context 4096" in r.json()["error"]["message"]
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(120)
    assert code == 0, log.read_text()[-3000:]
    assert "through Ray Serve: 1 engine replicas" in log.read_text()


@pytest.fixture(scope="module")
def url(jax_cache):
    cache = SETTINGS["compile_cache"] = jax_cache
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 << 20, log_to_driver=False,
             runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}})
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # one replica first, then the second: both compile into (and load from) the one cache
        _deploy(replicas=1)
        _deploy(replicas=2)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def _chat(client, messages, **kw):
    raw = client.chat.completions.with_raw_response.create(model="demo", messages=messages, temperature=0, **kw)
    return raw.headers.get(HEADER), raw.parse()


def _sse(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def _metric(url, name, **labels) -> float:
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{name}{{{sel}}} (\S+)$" if sel else rf"^{name} (\S+)$"
    m = re.search(pattern, httpx.get(url + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def _wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.2)


# --- the server's API through the ingress -----------------------------------------------------------------------------

def test_streamed_text_equals_whole_text_and_names_the_replica(client, url):
    name, whole = _chat(client, HI, max_tokens=12)
    assert name and whole.choices[0].finish_reason in ("stop", "length") and whole.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model="demo", messages=HI, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "abc", "max_tokens": 4, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers[HEADER]
        events = _sse(r.iter_lines())
    assert events[-1] == "[DONE]" and all("choices" in json.loads(e) for e in events[:-1])


def test_malformed_bodies_get_400_naming_the_field(url):
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": HI, "temperature": "hot"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 600})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_stop_string_ends_the_text_before_it(client):
    for i in range(10):
        messages = [{"role": "user", "content": f"Say something, number {i}."}]
        text = _chat(client, messages, max_tokens=16)[1].choices[0].message.content
        candidates = [c for c in dict.fromkeys(text[2:]) if c != "\ufffd"]
        if len(text) >= 4 and candidates:
            break
    else:
        pytest.fail("none of 10 prompts gave a greedy text of 4+ characters to pick a stop string from")
    r = _chat(client, messages, max_tokens=16, stop=[candidates[0]])[1]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:text.index(candidates[0])]


def test_a_client_that_goes_away_frees_its_slot_on_the_replica(url, client):
    prompt = [{"role": "user", "content": "Count the stars one by one, slowly. " * 6}]
    cancelled = _metric(url, "strata_requests_cancelled_total")
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                      json={"messages": prompt, "stream": True, "max_tokens": 400, "ignore_eos": True}) as r:
        name = r.headers[HEADER]
        lines = r.iter_lines()
        assert json.loads(_sse([next(lines)])[0])["choices"][0]["delta"]["role"] == "assistant"
    _wait(lambda: _metric(url, "strata_requests_cancelled_total") == cancelled + 1, 30, "the ingress to cancel")

    def replica_idle():          # a one-token request of the same prompt lands on that replica (affinity) and
        got, _ = _chat(client, prompt, max_tokens=1)       # its replica reports its slots as the request starts
        slots = [s for s in httpx.get(url + "/slots").json() if s["replica"] == name]
        return got == name and slots and all(s["state"] == "free" for s in slots)
    _wait(replica_idle, 30, f"replica {name}'s slots to be free")


# --- routing ------------------------------------------------------------------------------------------------------------

def _conversations(client, tag: str, turns: int = 6):
    """Three conversations of `turns` turns, interleaved turn by turn: -> per conversation, per turn,
    (replica, prompt tokens, tokens reused)."""
    histories = [[{"role": "user", "content": f"{tag} conversation {c}: tell me about rivers and lakes, the long "
                                              f"ones first, then the deep ones, in as many words as you like."}]
                 for c in range(3)]
    seen: list[list] = [[] for _ in histories]
    for turn in range(turns):
        for c, h in enumerate(histories):
            name, r = _chat(client, h, max_tokens=12)
            seen[c].append((name, r.usage.prompt_tokens, r.model_extra["timings"]["reused"]))
            h += [{"role": "assistant", "content": r.choices[0].message.content},
                  {"role": "user", "content": f"Turn {turn + 1}: and then what about the mountains near them?"}]
    return seen


def test_affinity_keeps_each_conversation_on_one_replica_and_reuses_its_prompt(client, url):
    hits = _metric(url, "strata_ray_routes_total", kind="hit")
    seen = _conversations(client, "affinity")
    for turns in seen:
        assert len({name for name, _, _ in turns}) == 1, turns
        for (_, before, _), (_, _, reused) in zip(turns, turns[1:]):
            assert reused >= before - NEAR, turns
    assert len({turns[0][0] for turns in seen}) == 2        # the three first turns went to both replicas
    assert _metric(url, "strata_ray_routes_total", kind="hit") == hits + 15


def test_eight_independent_requests_spread_over_both_replicas(client):
    with ThreadPoolExecutor(8) as pool:
        names = list(pool.map(lambda i: _chat(client, [{"role": "user", "content": f"Question {i}?"}],
                                              max_tokens=24)[0], range(8)))
    assert len(set(names)) == 2 and min(names.count(n) for n in set(names)) >= 3, names


# --- a replica that dies ------------------------------------------------------------------------------------------------

def test_a_replica_killed_mid_stream_ends_it_with_an_error_and_comes_back(client, url):
    before = {s["replica"]: s["pid"] for s in httpx.get(url + "/slots").json()}
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                      json={"messages": HI, "stream": True, "max_tokens": 400, "ignore_eos": True}) as r:
        name = r.headers[HEADER]
        lines = r.iter_lines()
        first = _sse([next(lines), next(lines)])
        assert first, "no chunk before the kill"
        pid = {s["replica"]: s["pid"] for s in httpx.get(url + "/slots").json()}[name]
        os.kill(pid, signal.SIGKILL)
        events = _sse(lines)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "replica_died" and name in error["message"]
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "error"
    # the next request succeeds (on the other replica, or retried there)
    other, r = _chat(client, HI, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length") and other != name
    # Serve starts a new replica in its place; independent requests reach it again
    names: list = []

    def replaced():
        names.append(_chat(client, [{"role": "user", "content": f"After the fault {len(names)}."}], max_tokens=2)[0])
        return set(names) - set(before)
    _wait(replaced, 120, "Serve to restart the killed replica")
    assert name not in names[-2:]
    st = serve.status().applications["strata"].deployments["EngineReplica"]
    assert st.replica_states.get("RUNNING", 0) == 2


def test_round_robin_moves_conversations_between_replicas_and_reuses_less(client, url):
    """The same conversations with affinity off: every conversation visits both replicas, and its follow-up
    turns reuse fewer prompt tokens than with affinity (a turn whose previous turn ran elsewhere reuses little)."""
    _deploy(replicas=2, routing="round_robin")
    seen = _conversations(client, "round robin")
    for turns in seen:
        assert len({name for name, _, _ in turns}) == 2, turns
    moved = [(before, reused) for turns in seen for (a, before, _), (b, _, reused) in zip(turns, turns[1:]) if a != b]
    assert moved and all(reused < before - NEAR for before, reused in moved), seen
