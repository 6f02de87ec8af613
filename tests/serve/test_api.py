"""The HTTP API against a real server (hypercorn on loopback, the real Scheduler over the demo model): the official
openai client streaming and not, chat and completions; SSE framing; /v1/models /health /slots /metrics; the API key;
body limits; a client that goes away; two clients at once; the `strata serve` command. Cases the real scheduler
can't produce on demand (a full queue, a failure mid-stream, a scheduler that stops) use tests/serve/fake_scheduler.py.
"""
from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest

from fake_scheduler import FakeScheduler, fail_at_once, fail_midway, fail_non_finite, hold
from servers import serve_command
from strata.sched.request import Delta, Finished
from strata.serve.app import ends_inside_think

HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(demo_engine, serve):
    with serve(demo_engine, parallel=2, prefill=64, max_context=1024) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def sse_events(resp) -> list[str]:
    """The `data:` payloads of an SSE response (or of what is left of its line iterator), in order."""
    out = []
    for line in (resp.iter_lines() if isinstance(resp, httpx.Response) else resp):
        if line.startswith("data: "):
            out.append(line[len("data: "):])
        else:
            assert line == "" or line.startswith(":"), f"unexpected SSE line {line!r}"
    return out


def wait_until(pred, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


# --- the openai client ------------------------------------------------------------------------------------------------

def test_chat_non_streaming_is_well_formed(client):
    r = client.chat.completions.create(model="demo", messages=HI, max_tokens=8, temperature=0)
    assert r.id.startswith("chatcmpl-") and len(r.id) > len("chatcmpl-")
    assert r.object == "chat.completion" and r.model == "demo" and r.created > 0
    assert len(r.choices) == 1
    ch = r.choices[0]
    assert ch.index == 0 and ch.message.role == "assistant" and isinstance(ch.message.content, str)
    assert ch.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and 1 <= u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    if ch.finish_reason == "length":
        assert u.completion_tokens == 8


def _stream_chat(client, **kw):
    chunks = list(client.chat.completions.create(model="demo", stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return chunks, text, finish


def test_chat_streamed_text_equals_non_streamed_text_greedy(client):
    kw = dict(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to five."}],
              max_tokens=12, temperature=0)
    whole = client.chat.completions.create(model="demo", **kw)
    chunks, text, finish = _stream_chat(client, stream_options={"include_usage": True}, **kw)
    assert text == whole.choices[0].message.content
    assert finish == [whole.choices[0].finish_reason]
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.model == "demo" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    # include_usage: the last chunk has no choices and the usage of the whole request
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    # the same prompt again: the prompt cache gives the streamed request what the whole one stored
    streamed, first = chunks[-1].usage.model_dump(), whole.usage.model_dump()
    cached = streamed.pop("prompt_tokens_details")["cached_tokens"]
    assert first.pop("prompt_tokens_details")["cached_tokens"] <= cached and 0 < cached < streamed["prompt_tokens"]
    assert streamed == first
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streamed_equals_non_streamed_greedy(client):
    kw = dict(model="demo", prompt="Once upon a time", max_tokens=10, temperature=0)
    whole = client.completions.create(**kw)
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion" and whole.model == "demo"
    assert whole.choices[0].finish_reason in ("stop", "length") and isinstance(whole.choices[0].text, str)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_token_id_prompt_and_echo(client, demo_engine):
    ids = demo_engine.tokenizer.encode("Once upon a time")
    a = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=6, temperature=0)
    b = client.completions.create(model="demo", prompt=ids, max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == b.usage.prompt_tokens == len(ids)
    e = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=6, temperature=0, echo=True)
    assert e.choices[0].text == "Once upon a time" + a.choices[0].text


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="demo", messages=HI, max_tokens=10, temperature=0.9, top_p=0.95, seed=1234,
              extra_body={"top_k": 40, "min_p": 0.01})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_stop_string_ends_the_text_before_it(client):
    # the random demo model may end early: take the first of a few prompts whose greedy text is long enough
    for i in range(10):
        messages = [{"role": "user", "content": f"Say something, number {i}."}]
        text = client.chat.completions.create(model="demo", messages=messages, max_tokens=16,
                                              temperature=0).choices[0].message.content
        candidates = [c for c in dict.fromkeys(text[2:]) if c != "\ufffd"]
        if len(text) >= 4 and candidates:
            break
    else:
        pytest.fail("none of 10 prompts gave a greedy text of 4+ characters to pick a stop string from")
    stop = candidates[0]
    r = client.chat.completions.create(model="demo", messages=messages, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:text.index(stop)]
    _, streamed, _ = _stream_chat(client, messages=messages, max_tokens=16, temperature=0, stop=stop)
    assert streamed == r.choices[0].message.content


def test_accepted_client_fields(client):
    """Fields real clients send are accepted (unknown ones ignored); developer is a system message."""
    r = client.chat.completions.create(
        model="demo", messages=[{"role": "developer", "content": "Be brief."},
                                    {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        max_completion_tokens=4, temperature=0.5, top_p=0.9, seed=5, stop="\n\n", n=1, user="u-1",
        reasoning_effort="low", presence_penalty=0.0, frequency_penalty=0.0,
        extra_body={"top_k": 20, "min_p": 0.05, "some_future_field": {"x": 1}, "stream": False})
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 4
    assert r.model == "demo"


# --- raw SSE framing --------------------------------------------------------------------------------------------------

def test_sse_framing(server):
    body = {"model": "demo", "messages": HI, "max_tokens": 6, "temperature": 0, "stream": True}
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in chunks[0]                       # only with stream_options.include_usage
    final = chunks[-1]["choices"][0]
    assert final["finish_reason"] in ("stop", "length") and final["delta"] == {}
    assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-1])
    for ch in chunks[1:-1]:
        assert set(ch["choices"][0]["delta"]) <= {"content", "reasoning_content"}


def test_completions_sse_with_usage(server):
    body = {"prompt": "abc", "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])
    assert usage["choices"] == [] and usage["object"] == "text_completion"
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + usage["usage"]["completion_tokens"]
    assert json.loads(events[-3])["choices"][0]["finish_reason"] in ("stop", "length")


# --- other routes -----------------------------------------------------------------------------------------------------

def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo", "default"]     # "default": the alias clients of one model send
    assert client.models.retrieve("demo").id == "demo"
    r = httpx.get(server.url + "/v1/models/nope")
    assert r.status_code == 404 and "demo" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "not_found_error"


def test_health_slots_metrics(server, client):
    h = httpx.get(server.url + "/health")
    assert h.status_code == 200 and h.json() == {"status": "ok"}
    client.chat.completions.create(model="demo", messages=HI, max_tokens=2, temperature=0)
    slots = httpx.get(server.url + "/slots").json()
    assert isinstance(slots, list) and len(slots) == server.config.sched.parallel
    for s in slots:
        assert {"id", "state", "read", "generated", "prompt_tokens", "request"} <= set(s)
        assert s["state"] in ("free", "reading", "generating")
    m = httpx.get(server.url + "/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    text = m.text
    for name in ("strata_http_requests_total", "strata_requests_finished_total", "strata_requests_failed_total",
                 "strata_prompt_tokens_total", "strata_generated_tokens_total", "strata_queue_depth",
                 "strata_tokens_per_second", "strata_window_seconds_count", "strata_window_seconds_sum",
                 "strata_slots", "strata_time_to_first_token_seconds_bucket", "strata_requests_active",
                 "strata_expert_hits_total", "strata_expert_misses_total", "strata_expert_bytes_copied_total",
                 "strata_expert_cpu_seconds_total", "strata_expert_slots_resident"):
        assert re.search(rf"^{name}(\{{| )", text, re.M), f"{name} missing from /metrics"
    # the demo model with every expert resident: every route hits, nothing is copied after load
    assert float(re.search(r"^strata_expert_slots_resident (\S+)", text, re.M).group(1)) == 64
    assert float(re.search(r"^strata_expert_hits_total (\S+)", text, re.M).group(1)) > 0
    assert float(re.search(r"^strata_expert_misses_total (\S+)", text, re.M).group(1)) == 0
    finished = float(re.search(r"^strata_requests_finished_total (\S+)", text, re.M).group(1))
    assert finished >= 1
    assert re.search(r'^strata_http_requests_total\{code="200",route="/v1/chat/completions"\} [1-9]', text, re.M)


def test_unknown_route_and_wrong_method_are_json(server):
    r = httpx.get(server.url + "/v2/nothing")
    assert r.status_code == 404 and "/v1/chat/completions" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "POST" in r.json()["error"]["message"]


# --- two clients, a client that goes away -----------------------------------------------------------------------------

def _stream_text(url, body, out, key):
    try:
        with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]", events[-3:]
        out[key] = "".join(json.loads(e)["choices"][0]["delta"].get("content", "")
                           for e in events[:-1] if json.loads(e)["choices"])
    except BaseException as e:  # noqa: BLE001
        out[key] = e


def test_two_clients_short_and_long_prompt_both_finish(server, client):
    """The field report's shape: A decodes while B's long prompt is read in parts; both end, same text as alone."""
    filler = "\n".join(f"line {i}: the quick brown fox" for i in range(12))     # a few hundred tokens: parts of 64
    a = {"model": "demo", "messages": HI, "max_tokens": 24, "temperature": 0, "stream": True}
    b = {"model": "demo", "messages": [{"role": "user", "content": filler + "\nSummarise."}], "max_tokens": 8,
         "temperature": 0, "stream": True}
    alone = {}
    _stream_text(server.url, a, alone, "a")
    _stream_text(server.url, b, alone, "b")
    together = {}
    ta = threading.Thread(target=_stream_text, args=(server.url, a, together, "a"))
    tb = threading.Thread(target=_stream_text, args=(server.url, b, together, "b"))
    ta.start()
    tb.start()
    ta.join(120)
    tb.join(120)
    assert not ta.is_alive() and not tb.is_alive(), "a client hung"
    for k in "ab":
        assert not isinstance(together[k], BaseException), together[k]
        assert together[k] == alone[k], k


def test_client_that_goes_away_frees_its_slot(server, client):
    body = {"model": "demo", "messages": HI, "max_tokens": 500, "temperature": 0.8, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and '"content"' in line and '"role"' not in line:
                    break
        # leaving the block closes the connection mid-stream
    wait_until(lambda: all(s["state"] == "free" for s in httpx.get(server.url + "/slots").json()),
               timeout=20, what="the slot of the client that went away to be free")
    r = client.chat.completions.create(model="demo", messages=HI, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1


# --- API key and body limits (a second server) ------------------------------------------------------------------------

def test_api_key_and_body_limit(demo_engine, serve):
    # parallel and prefill as the module server: its compilations are reused
    with serve(demo_engine, parallel=2, prefill=64, max_context=512, api_key="s3cret", max_body_bytes=4096) as s:
        assert httpx.get(s.url + "/health").status_code == 200              # open without the key
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/metrics"),
                                 ("GET", "/slots")):
                r = httpx.request(method, s.url + path, headers=headers, json={"messages": HI})
                assert r.status_code == 401, (headers, path)
                err = r.json()["error"]
                assert "Authorization: Bearer" in err["message"] and err["type"] == "authentication_error"
                assert r.headers["www-authenticate"] == "Bearer"
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.models.list().data[0].id == "demo"
        auth = {"Authorization": "Bearer s3cret"}
        # oversized body: declared length, and chunked (no length)
        big = json.dumps({"messages": [{"role": "user", "content": "x" * 10000}]}).encode()
        r = httpx.post(s.url + "/v1/chat/completions", content=big, headers=auth)
        assert r.status_code == 413 and "4096" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/chat/completions", content=iter([big[:3000], big[3000:]]), headers=auth)
        assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
        r = good.chat.completions.create(model="demo", messages=HI, max_tokens=2, temperature=0)
        assert r.usage.completion_tokens >= 1


# --- behaviours driven with the fake scheduler ------------------------------------------------------------------------

def test_queue_full_is_503_with_retry_after(demo_engine, serve):
    fake = FakeScheduler(parallel=1, queue_limit=1, script=hold)
    with serve(demo_engine, scheduler=fake, parallel=1, queue_limit=1) as s:
        body = {"messages": HI, "max_tokens": 4, "stream": True}
        with httpx.Client(base_url=s.url, timeout=30) as c1, c1.stream("POST", "/v1/chat/completions",
                                                                          json=body) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")                         # in the slot
            out = {}
            second = threading.Thread(target=lambda: out.setdefault(
                "r", httpx.post(s.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 4}, timeout=30)))
            second.start()
            wait_until(lambda: fake.waiting == 1, what="the second request to queue")
            r = httpx.post(s.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 4})
            assert r.status_code == 503 and r.headers["retry-after"] == "2"
            assert "busy" in r.json()["error"]["message"] and r.json()["error"]["code"] == "queue_full"
            c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.APIStatusError) as e:
                c.chat.completions.create(model="demo", messages=HI, max_tokens=4)
            assert e.value.status_code == 503
            fake.do_release()
            events = sse_events(lines)
        second.join(30)
        assert events[-1] == "[DONE]" and out["r"].status_code == 200
        assert out["r"].json()["choices"][0]["message"]["content"] == "first last"
        m = httpx.get(s.url + "/metrics").text
        assert re.search(r'^strata_requests_rejected_total\{reason="queue_full"\} 2', m, re.M)


def test_disconnect_cancels_in_scheduler(demo_engine, serve):
    fake = FakeScheduler(parallel=1, script=hold)
    with serve(demo_engine, scheduler=fake, parallel=1) as s:
        # streamed: the client reads one chunk and goes away
        with httpx.Client(base_url=s.url, timeout=30) as c:
            with c.stream("POST", "/v1/chat/completions", json={"messages": HI, "stream": True}) as r:
                next(r.iter_lines())
        wait_until(lambda: len(fake.cancelled) == 1, what="the scheduler to be told")
        assert fake.cancelled == [fake.submitted[0].id]
        # not streamed: the client sends its request and closes the connection while the server waits for the end
        host, port = s.url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "x"}).encode()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            wait_until(lambda: len(fake.running) == 1, what="the request to start")
        wait_until(lambda: len(fake.cancelled) == 2, what="the scheduler to be told")
        assert fake.cancelled[1] == fake.submitted[1].id
        m = httpx.get(s.url + "/metrics").text
        assert re.search(r"^strata_requests_cancelled_total 2", m, re.M)


def test_failures_from_the_scheduler(demo_engine, serve):
    fake = FakeScheduler(parallel=1, script=fail_midway)
    with serve(demo_engine, scheduler=fake, parallel=1) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        # mid-stream: the text so far, then an error event (the openai client raises it)
        with httpx.Client(base_url=s.url, timeout=30) as h, h.stream(
                "POST", "/v1/chat/completions", json={"messages": HI, "stream": True}) as r:
            events = sse_events(r)
        chunks = [json.loads(e) for e in events]
        assert chunks[1]["choices"][0]["delta"] == {"reasoning_content": "thinking "}
        assert chunks[2]["choices"][0]["delta"] == {"content": "partial "}
        assert chunks[-1]["error"]["message"] == "non-finite logits at position 7"
        with pytest.raises(openai.APIError, match="position 7"):
            list(c.chat.completions.create(model="demo", messages=HI, stream=True))
        # not streamed: the status and message of the failure
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": HI})
        assert r.status_code == 500 and "position 7" in r.json()["error"]["message"]
        fake.script = fail_at_once
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500 and "position 3" in r.json()["error"]["message"]


def test_a_non_finite_failure_reaches_clients_as_an_explicit_error(demo_engine, serve):
    """Streamed: the text so far, a chunk with finish_reason "error", then the error object with code non_finite,
    the position and the attempts; not streamed: HTTP 500 with that object."""
    fake = FakeScheduler(parallel=1, script=fail_non_finite)
    attempts = [{"numerics": "default", "position": 9}, {"numerics": "cpu_experts", "position": 9}]
    with serve(demo_engine, scheduler=fake, parallel=1) as s:
        with httpx.Client(base_url=s.url, timeout=30) as h, h.stream(
                "POST", "/v1/chat/completions", json={"messages": HI, "stream": True}) as r:
            chunks = [json.loads(e) for e in sse_events(r)]
        assert chunks[-2]["choices"][0]["finish_reason"] == "error"
        err = chunks[-1]["error"]
        assert (err["code"], err["position"], err["attempts"]) == ("non_finite", 9, attempts)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500
        err = r.json()["error"]
        assert (err["code"], err["position"], err["attempts"], err["type"]) == ("non_finite", 9, attempts,
                                                                                "server_error")


def test_scheduler_that_stops_turns_into_503(demo_engine, serve):
    fake = FakeScheduler(parallel=1)
    with serve(demo_engine, scheduler=fake, parallel=1) as s:
        assert httpx.post(s.url + "/v1/chat/completions", json={"messages": HI}).status_code == 200
        fake.do_crash()
        wait_until(lambda: httpx.get(s.url + "/health").status_code == 503, what="/health to report it")
        assert "fake scheduler crash" in httpx.get(s.url + "/health").json()["message"]
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": HI})
        assert r.status_code == 503 and "restart" in r.json()["error"]["message"]


def test_reasoning_passes_through_and_prompt_detection(demo_engine, serve):
    async def think(req, sched):
        yield Delta(reasoning="hmm ")
        yield Delta(reasoning="ok", content="")
        yield Delta(content="Answer.")
        yield Finished("stop", len(req.prompt_ids), 3)

    fake = FakeScheduler(parallel=1, script=think)
    with serve(demo_engine, scheduler=fake, parallel=1) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model="demo", messages=HI, reasoning_effort="high")
        msg = r.choices[0].message
        assert msg.content == "Answer." and msg.model_extra["reasoning_content"] == "hmm ok"
        chunks = list(c.chat.completions.create(model="demo", messages=HI, stream=True))
        reasoning = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                            for ch in chunks if ch.choices)
        assert reasoning == "hmm ok"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Answer."
        # the demo template does not open <think>: the request is not marked as reasoning
        assert fake.submitted[-1].reasoning is False
        # text completions get reasoning and content as one text
        t = c.completions.create(model="demo", prompt="x")
        assert t.choices[0].text == "hmm okAnswer."
    assert ends_inside_think("<|im_start|>assistant\n<think>\n")
    assert not ends_inside_think("<think>a</think>\n\n")
    assert ends_inside_think("<think>a</think> x <think>")
    assert not ends_inside_think("no tags")


# --- the command ------------------------------------------------------------------------------------------------------

def test_strata_serve_command(tmp_path):
    """`strata serve` as a user runs it: startup lines name the model and URL, it serves, SIGTERM stops it (0)."""
    cfg = tmp_path / "s.toml"
    cfg.write_text('model = "demo"\nport = 0\nparallel = 1\nprefill = 64\nmax_context = 1024\n')
    with serve_command(["--config", str(cfg), "--max-context", "768"]) as sp:
        seen = sp.seen
        assert any(re.search(r"serving demo on http://127\.0\.0\.1:\d+: 1 parallel, prompt parts of 64 tokens, "
                             r"max_context 768", line) for line in seen), "".join(seen)
        assert all(line.startswith(("strata ", "strata.")) or not line.strip() for line in seen), "".join(seen)
        r = httpx.post(sp.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 3, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "demo"
        r = httpx.post(sp.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 800}, timeout=60)
        assert r.status_code == 400 and "768" in r.json()["error"]["message"]
    assert sp.rc == 0, sp.rest
    assert "Traceback" not in sp.rest, sp.rest


def test_quiet_stream_gets_keepalive_comments(demo_engine, serve, monkeypatch):
    """While a request waits (queued, or a long prompt being read) the stream carries SSE comments, so proxies and
    clients with read timeouts see a live connection; clients ignore them."""
    import strata.serve.app as app_module
    monkeypatch.setattr(app_module, "KEEPALIVE_S", 0.05)
    monkeypatch.setattr(app_module, "POLL_S", 0.02)
    fake = FakeScheduler(parallel=1, script=hold)
    with serve(demo_engine, scheduler=fake, parallel=1) as s:
        with httpx.Client(base_url=s.url, timeout=30) as c, c.stream(
                "POST", "/v1/chat/completions", json={"messages": HI, "stream": True}) as r:
            lines = r.iter_lines()
            comments = 0
            for line in lines:
                comments += line.startswith(":")
                if comments == 2:
                    break
            fake.do_release()
            events = sse_events(lines)
        assert events[-1] == "[DONE]"
        assert [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-2]] == ["last"]


def test_ignore_eos_generates_exactly_max_tokens(client):
    """The ignore_eos extension: end-of-sequence tokens do not end the request; max_tokens does."""
    r = client.completions.create(model="demo", prompt="x", max_tokens=300, temperature=1.0, seed=7,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 300
