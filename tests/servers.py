"""Real servers on loopback for the serve and e2e tests: `running_server(engine, **config)` runs the app on hypercorn in a
background thread (its own event loop) on a socket pre-bound to 127.0.0.1 port 0, and stops it cleanly at exit;
`serve_command(args)` runs `strata serve` as a user does, in its own process."""
from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

from strata.config import Settings
from strata.serve.app import create_app
from strata.serve.server import bind_socket, run_app, socket_url

# small shapes; max_context small so "prompt over max_context" is cheap to send; no warm-up: a test compiles only the
# window shapes its requests use (the warm-up itself: `strata serve` in test_readme, test_drain, test_compile_cache)
DEFAULTS = dict(port=0, parallel=2, prefill=64, max_context=512, queue_limit=8, warm_up=False)
STARTUP_TIMEOUT_S = 600.0


@dataclass
class Server:
    url: str
    app: object
    scheduler: object
    config: Settings

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60.0), **kw)


@contextmanager
def running_server(engine, scheduler=None, **overrides):
    """-> Server with .url; `scheduler` defaults to the real Scheduler over `engine` built from the config."""
    cfg = Settings.build(**{**DEFAULTS, **overrides})
    if scheduler is None:
        from strata.serve.server import scheduler_for
        scheduler = scheduler_for(engine, cfg.sched, cfg.model.max_context)
    app = create_app(engine, scheduler, cfg)
    sock = bind_socket("127.0.0.1", 0)
    url = socket_url(sock)
    control: dict = {}
    errors: list[BaseException] = []
    up = threading.Event()

    def thread_main():
        async def main():
            stop = asyncio.Event()
            control["loop"], control["stop"] = asyncio.get_running_loop(), stop
            up.set()
            await run_app(app, sock, stop.wait)

        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported to the test below
            errors.append(e)
        finally:
            up.set()

    thread = threading.Thread(target=thread_main, name="strata-test-server", daemon=True)
    thread.start()
    up.wait(30)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        # one client for the whole wait: each httpx.get builds an SSL context (~25 ms of CPU), a third of every
        # poll's time taken from the warm-up's compilations on a 2-core machine
        with httpx.Client(timeout=2.0) as poll:
            while True:
                if errors or not thread.is_alive():
                    raise RuntimeError(f"the test server did not start: {errors[0] if errors else 'thread ended'!r}")
                try:
                    if poll.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the test server at {url} was not healthy after {STARTUP_TIMEOUT_S} s")
                time.sleep(0.05)
        yield Server(url, app, scheduler, cfg)
    finally:
        if "loop" in control:
            try:
                control["loop"].call_soon_threadsafe(control["stop"].set)
            except RuntimeError:
                pass          # the loop already ended
        thread.join(timeout=60)
        assert not thread.is_alive(), "the test server did not stop within 60 s"
        if errors:
            raise errors[0]


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    url: str | None = None
    seen: list = field(default_factory=list)      # stderr lines up to "ready"
    rc: int | None = None
    rest: str = ""                                # every stderr line, once it stopped


@contextmanager
def serve_command(args: list, timeout_s: float = 300.0, until: str = "ready"):
    """`python -m strata.cli serve ARGS` on the CPU (port 0 in ARGS or its config): -> ServeProcess once its log says
    ready (until="serving": once it names its URL, while it still loads) (.url from the "serving ... on URL" line,
    .seen the lines so far); SIGTERM at exit unless it ended, then .rc and .rest."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("STRATA_API_KEY", None)
    p = subprocess.Popen([sys.executable, "-m", "strata.cli", "serve", *args],
                         stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in p.stderr], daemon=True).start()
    sp = ServeProcess(p)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert p.poll() is None, "".join(sp.seen)
                continue
            sp.seen.append(line)
            m = re.search(r"serving \S+ on (http://127\.0\.0\.1:\d+)", line)
            sp.url = sp.url or (m and m.group(1))
            if line.startswith(f"strata serve: {until}") and sp.url:
                break
        assert sp.url, "".join(sp.seen)
        yield sp
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            sp.rc = p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
        sp.rest = "".join(sp.seen) + "".join(iter(lambda: lines.get(timeout=5) if not lines.empty() else "", ""))


def alone_then_together(ask, prompts: list, timeout: float) -> tuple[list, list]:
    """ask(prompt) for each prompt one after another, then for all at once from threads (each joined within
    timeout seconds) -> (the answers alone, the answers together), in the prompts' order."""
    alone = [ask(p) for p in prompts]
    together: list = [None] * len(prompts)

    def worker(i):
        together[i] = ask(prompts[i])
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return alone, together
