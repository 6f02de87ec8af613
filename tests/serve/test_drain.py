"""Graceful drain, with `strata serve` as a process: SIGTERM during 4 streams and 2 queued requests ends every stream
with a final chunk (finish_reason "abort") and [DONE], answers each queued request with a JSON 503 and Retry-After,
and exits 0 with no traceback; the port answers /health 503 "loading" before the warm-up ends."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from servers import serve_command

HI = [{"role": "user", "content": "hi"}]


def _stream(url: str, out: dict, key: str, body: dict) -> None:
    try:
        with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.headers.get("content-type", "").startswith("application/json"):
                r.read()
                out[key] = (r.status_code, dict(r.headers), r.json())
            else:
                out[key] = (r.status_code, dict(r.headers), [line[6:] for line in r.iter_lines()
                                                             if line.startswith("data: ")])
    except Exception as e:  # noqa: BLE001 - reported by the test
        out[key] = ("error", {}, repr(e))


def _wait(what: str, ok, timeout: float = 120.0, show=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {show()}"
        time.sleep(0.02)


def test_sigterm_drains_streams_and_queue_then_exits_0():
    args = ["--port", "0", "--parallel", "4", "--queue-limit", "2", "--max-context", "2048", "--prefill", "64",
            "--drain-timeout", "1"]
    with serve_command(args) as sp:
        url = sp.url
        out: dict = {}
        body = {"model": "demo", "messages": HI, "max_tokens": 2000, "temperature": 0.7, "stream": True,
                "ignore_eos": True}
        threads = [threading.Thread(target=_stream, args=(url, out, f"s{i}", body)) for i in range(4)]
        for i, t in enumerate(threads):         # one at a time: 4 at once would overflow the queue of 2
            t.start()
            _wait(f"{i + 1} slots generating",
                  lambda: sum(s["state"] == "generating" and s["generated"] > 0
                              for s in httpx.get(url + "/slots").json()) == i + 1,
                  show=lambda: {k: v[0] for k, v in out.items()})
        queued = [threading.Thread(target=_stream, args=(url, out, f"q{i}", {**body, "stream": i == 0}))
                  for i in range(2)]
        for t in queued:
            t.start()
        _wait("2 queued", lambda: "strata_queue_depth 2.0" in httpx.get(url + "/metrics").text)
        t0 = time.monotonic()
        sp.proc.send_signal(signal.SIGTERM)
        # while it drains, new requests get 503 with Retry-After and /health says so
        _wait("the drain", lambda: httpx.get(url + "/health").status_code == 503, timeout=10)
        r = httpx.post(url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
        assert r.status_code == 503 and "Retry-After" in r.headers and r.json()["error"]["code"] == "shutting_down"
        for t in threads + queued:
            t.join(60)
        rc = sp.proc.wait(60)
        took = time.monotonic() - t0
    for i in range(4):
        status, headers, events = out[f"s{i}"]
        assert status == 200, out[f"s{i}"]
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "abort", last
        assert len(events) > 3                       # it streamed text before the end
    for i in range(2):
        status, headers, body_ = out[f"q{i}"]
        assert status == 503, out[f"q{i}"]
        assert headers.get("retry-after") and body_["error"]["code"] == "shutting_down", out[f"q{i}"]
    assert rc == 0, sp.rest
    assert took < 30
    rest = sp.rest
    assert "Traceback" not in rest and "CancelledError" not in rest, rest
    assert "draining" in rest and "finish_reason abort" in rest, rest


def test_health_is_loading_until_warm_up_ends_then_ok():
    """The port answers from the start: /health 503 {"status": "loading"} and generation 503 with Retry-After until
    the warm-up ends (serve_command returns at the "serving ... on URL" line's URL, before "ready" when asked)."""
    seen = []
    with serve_command(["--port", "0", "--parallel", "1", "--max-context", "512", "--prefill", "64"],
                       until="serving") as sp:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                h = httpx.get(sp.url + "/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.01)
                continue
            seen.append((h.status_code, h.json()["status"]))
            if h.status_code == 200:
                break
            if len(seen) == 1:
                r = httpx.post(sp.url + "/v1/chat/completions", json={"messages": HI})
                assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "loading"
                assert httpx.get(sp.url + "/v1/models").json()["data"][0]["id"] == "demo"
            time.sleep(0.05)
    assert seen[0] == (503, "loading") and seen[-1] == (200, "ok"), seen
    assert sp.rc == 0
