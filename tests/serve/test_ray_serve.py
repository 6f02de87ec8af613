"""Strata on Ray Serve (serve/ray_app.py): one local Ray instance on the CPU for the module, two engine replicas of
the demo model behind the ingress, the official openai client and raw SSE on loopback. The server's API (streaming,
a malformed body, stop strings, a client that goes away), the ingress's /metrics and /slots (every replica's, asked
at the scrape; a stopped replica reported), conversation affinity (interleaved conversations stay on their replica
and reuse their prompts; round-robin does not), balance, and faults: a replica that dies before the first token (the
request is retried on the other) or mid-stream (an explicit error and [DONE]; Serve brings the replica back)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from strata.config import Settings
from strata.serve.ray_app import HEADER, SURVEY_TIMEOUT_S, application

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
    serve.run(application(Settings.build(allow_faults=True, **{**SETTINGS, **kw})), name="strata", route_prefix="/")



@pytest.fixture(scope="module")
def jax_cache():
    """One JAX compile cache for every Ray instance of the module: replicas after the first load their windows. It is
    the test session's cache (tests/conftest.py), so a later run of the suite loads them too."""
    return os.environ["JAX_COMPILATION_CACHE_DIR"]


# --- `strata serve --replicas N`: its own local Ray instance (this test runs before the module's instance starts) ----

def test_strata_serve_replicas_serves_and_stops_on_sigint(jax_cache, tmp_path):
    """Every setting but the model, the port and the compile cache at its default (warm-up on, parallel, prefill, a
    CPU a replica, max_context "auto": the ingress takes the number the replicas' memory plan made of it)."""
    port = _free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "strata.cli", "serve", "--model", "tiny", "--replicas", "2", "--port", str(port),
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
        _wait(up, 500, "strata serve --replicas 2 to become healthy")
        r = httpx.post(base + "/v1/chat/completions", json={"messages": HI, "max_tokens": 4}, timeout=120)
        assert r.status_code == 200 and r.headers[HEADER] and r.json()["usage"]["completion_tokens"] >= 1
        # the ingress serves once a replica does; the other may still be warming up. Then /slots and /metrics cover
        # both: parallel's default of 2 slots each, both answering
        def listed():
            return Counter(s["replica"] for s in httpx.get(base + "/slots", timeout=60).json())
        _wait(lambda: len(listed()) == 2, 400, "the second replica to start")
        slots = listed()
        assert set(slots.values()) == {2} and r.headers[HEADER] in slots
        answering = re.findall(r'^strata_replica_up\{replica="(\w+)"\} 1\.0$', httpx.get(base + "/metrics").text, re.M)
        assert sorted(answering) == sorted(slots)
        # tiny's 4096 positions fit a CPU's memory: auto is all of them, and the ingress counts with that
        assert httpx.get(base + "/v1/models").json()["data"][0]["max_context"] == 4096
        r = httpx.post(base + "/v1/chat/completions", json={"messages": HI, "max_tokens": 4096}, timeout=120)
        assert r.status_code == 400 and "exceed max_context 4096" in r.json()["error"]["message"]
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(120)
    assert code == 0, log.read_text()[-3000:]
    assert "through Ray Serve: 2 engine replicas" in log.read_text()


@pytest.fixture(scope="module")
def url(jax_cache, tmp_path_factory):
    SETTINGS["compile_cache"] = jax_cache
    # the replica that removes this file dies before its reply's first token (test_..._retried_on_the_other)
    SETTINGS["fault_replica_exit"] = str(tmp_path_factory.mktemp("faults") / "replica_exit")
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


# --- routing ------------------------------------------------------------------------------------------------------------
# (before any test leaves a stream early: Serve reports a cancelled request complete only once its replica has wound
# the stream down, later than the slot frees, and the router counts it as load on that replica until then)

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


# --- the ingress's /metrics and /slots: every replica's, asked at the scrape -----------------------------------------

SLOT_KEYS = {"id", "state", "request", "prompt_tokens", "reused", "read", "generated", "numerics", "attempts",
             "poisoned", "conversation_tokens", "checkpoints"}       # a slot of the single server's /slots


def _scrape(url) -> dict:
    """/metrics, parsed as Prometheus text: {(sample name, replica label or None, other labels): value}. Each family is
    there once, whatever the number of replicas."""
    r = httpx.get(url + "/metrics", timeout=60)
    assert r.status_code == 200
    families = list(text_string_to_metric_families(r.text))
    names = Counter(f.name for f in families)
    assert all(n == 1 for n in names.values()), [name for name, n in names.items() if n > 1]
    out = {}
    for f in families:
        for sample in f.samples:
            labels = dict(sample.labels)
            out[sample.name, labels.pop("replica", None), tuple(sorted(labels.items()))] = sample.value
    return out


def _replicas(url) -> dict:
    """/slots: replica -> its slots."""
    by: dict = {}
    for slot in httpx.get(url + "/slots", timeout=60).json():
        by.setdefault(slot["replica"], []).append(slot)
    return by


def test_metrics_label_each_replicas_counters_which_add_up_to_the_requests_made(client, url):
    names = sorted(_replicas(url))
    assert len(names) == 2
    before = _scrape(url)
    served: dict = {n: [0, 0] for n in names}            # replica -> [requests, tokens generated]
    for i in range(6):
        name, r = _chat(client, [{"role": "user", "content": f"Metrics question {i}?"}], max_tokens=5,
                        extra_body={"ignore_eos": True})
        served[name][0] += 1
        served[name][1] += r.usage.completion_tokens
    after = _scrape(url)

    def delta(sample, name, **labels):
        key = (sample, name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)
    for name, (requests, tokens) in served.items():
        assert after["strata_replica_up", name, ()] == 1
        assert delta("strata_requests_finished_total", name) == requests
        assert delta("strata_generated_tokens_total", name) == tokens == 5 * requests
        assert delta("strata_windows_total", name) >= 5 * requests / 2       # the two slots may share windows
        assert delta("strata_ray_requests_total", name) == requests        # the ingress's count agrees
        assert sum(after["strata_slots", name, (("state", st),)] for st in ("free", "reading", "generating")) == 2
        assert after["strata_queue_depth", name, ()] == 0
    # the ingress's own counters carry no replica label, and no replica's counter is left without one
    assert after["strata_http_requests_total", None, (("code", "200"), ("route", "/v1/chat/completions"))] >= 6
    assert not [k for k in after if k[0] == "strata_requests_finished_total" and k[1] is None]


def test_slots_list_each_replicas_slots_as_they_are_at_the_request(url):
    by = _replicas(url)
    assert len(by) == 2
    for name, slots in by.items():
        assert sorted(s["id"] for s in slots) == [0, 1]
        assert all(SLOT_KEYS <= set(s) and s["pid"] > 0 and s["node"] for s in slots), slots
    prompt = [{"role": "user", "content": "Slots: count the rivers of the world, slowly."}]
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                      json={"messages": prompt, "stream": True, "max_tokens": 400, "ignore_eos": True}) as r:
        name = r.headers[HEADER]
        lines = r.iter_lines()
        assert len(_sse([next(lines), next(lines), next(lines)])) >= 2
        now = _replicas(url)
        busy = [s for s in now[name] if s["state"] == "generating"]
        assert len(busy) == 1 and busy[0]["generated"] >= 1 and busy[0]["request"], now[name]
        assert all(s["state"] == "free" for other, slots in now.items() if other != name for s in slots), now
    _wait(lambda: all(s["state"] == "free" for s in _replicas(url)[name]), 30, f"replica {name}'s slot to be freed")


# --- replicas that stop answering or die ------------------------------------------------------------------------------------------------

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


def test_a_replica_that_does_not_answer_is_reported_and_the_scrape_still_succeeds(url):
    pids = {name: slots[0]["pid"] for name, slots in _replicas(url).items()}
    stopped, running = sorted(pids)
    os.kill(pids[stopped], signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        got = _scrape(url)
        took = time.monotonic() - t0
        slots = _replicas(url)
    finally:
        os.kill(pids[stopped], signal.SIGCONT)
    assert SURVEY_TIMEOUT_S - 0.5 <= took < SURVEY_TIMEOUT_S + 15, took
    assert got["strata_replica_up", stopped, ()] == 0 and got["strata_replica_up", running, ()] == 1
    assert ("strata_requests_finished_total", running, ()) in got
    # of the stopped replica, only the ingress's own series (its count of requests routed there) and up = 0
    assert {k[0] for k in got if k[1] == stopped} == {"strata_replica_up", "strata_ray_requests_total"}
    assert set(slots) == {running}
    # going on, it answers again
    _wait(lambda: _scrape(url).get(("strata_replica_up", stopped, ())) == 1, 30, f"replica {stopped} to answer")
    assert set(_replicas(url)) == set(pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _two_replicas_again(url, gone: str):
    """Serve starts a replica in the place of `gone`: /slots lists two replicas again, both answering."""
    def back():
        by = _replicas(url)
        return len(by) == 2 and gone not in by
    _wait(back, 180, "Serve to restart the dead replica")
    assert serve.status().applications["strata"].deployments["EngineReplica"].replica_states.get("RUNNING", 0) == 2


def test_a_replica_that_dies_before_the_first_token_is_retried_on_the_other(client, url):
    fault = Path(SETTINGS["fault_replica_exit"])
    pids = {name: slots[0]["pid"] for name, slots in _replicas(url).items()}
    retried = _metric(url, "strata_ray_retried_total")
    deaths = _metric(url, "strata_ray_replica_deaths_total")
    fault.touch()
    raw = client.chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": "Retry me."}], max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(raw.parse())
    assert not fault.exists(), "no replica took the fault"
    dead = [name for name, pid in pids.items() if not _alive(pid)]
    assert len(dead) == 1, pids
    # the client saw none of it: one whole reply, from the other replica
    assert raw.headers[HEADER] in pids and raw.headers[HEADER] != dead[0]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"] and chunks[-1].usage.completion_tokens == 8
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert _metric(url, "strata_ray_retried_total") == retried + 1
    assert _metric(url, "strata_ray_replica_deaths_total") == deaths + 1
    _two_replicas_again(url, dead[0])


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
