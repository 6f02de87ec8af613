"""A scheduler that implements the HTTP layer's contract without an engine, for the cases the real one can't make
happen on demand: a full admission queue, a request that fails mid-stream, a client that goes away mid-request, a
scheduler that stops. Each request runs `script(req, sched)`, an async generator of events."""
from __future__ import annotations

import math

import anyio

from strata.sched.request import Delta, Failed, Finished, QueueFull, Request


async def words(req: Request, sched: "FakeScheduler"):
    """Generates 'w0 w1 ...' up to max_tokens (at most 8), then Finished."""
    n = min(req.max_tokens, 8)
    for i in range(n):
        yield Delta(content=f"w{i} ")
    yield Finished("length" if n == req.max_tokens else "stop", len(req.prompt_ids), n, {"read_ms": 1.0})


async def hold(req: Request, sched: "FakeScheduler"):
    """One token, then waits until `sched.release` is set (or the request is cancelled)."""
    yield Delta(content="first ")
    await sched.release.wait()
    yield Delta(content="last")
    yield Finished("stop", len(req.prompt_ids), 2)


async def fail_midway(req: Request, sched: "FakeScheduler"):
    yield Delta(reasoning="thinking ")
    yield Delta(content="partial ")
    yield Failed("non-finite logits at position 7", 500)


async def fail_non_finite(req: Request, sched: "FakeScheduler"):
    yield Delta(content="partial ")
    yield Failed("non-finite logits at position 9 again at the same position after 2 attempts", 500, "non_finite",
                 (("position", 9), ("attempts", [{"numerics": "default", "position": 9},
                                                 {"numerics": "cpu_experts", "position": 9}])))


async def fail_at_once(req: Request, sched: "FakeScheduler"):
    yield Failed("non-finite logits at position 3 while reading the prompt", 500)


class FakeScheduler:
    def __init__(self, engine=None, *, parallel: int = 1, prefill: int = 64, max_context: int = 1024,
                 queue_limit: int = 2, script=words):
        self.parallel, self.max_context, self.queue_limit, self.script = parallel, max_context, queue_limit, script
        self.submitted: list[Request] = []
        self.cancelled: list[str] = []
        self.release = anyio.Event()
        self.crash = anyio.Event()
        self.waiting = 0
        self.running: dict[str, Request] = {}
        self._send, self._recv = anyio.create_memory_object_stream(max_buffer_size=math.inf)
        self.finished = 0

    def submit(self, req: Request):
        if self.waiting >= self.queue_limit:
            raise QueueFull(self.waiting, retry_after_s=2)
        self.submitted.append(req)
        self.waiting += 1
        send, recv = anyio.create_memory_object_stream(max_buffer_size=math.inf)
        self._send.send_nowait((req, send))
        return recv

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def slots(self):
        reqs = list(self.running.values())
        return [{"id": i, "state": "generating" if i < len(reqs) else "free",
                 "request": reqs[i].id if i < len(reqs) else None,
                 "prompt_tokens": len(reqs[i].prompt_ids) if i < len(reqs) else 0, "read": 0, "generated": 0}
                for i in range(self.parallel)]

    def metrics(self):
        return {"requests_finished": self.finished, "requests_failed": 0, "prompt_tokens": 0, "generated_tokens": 0,
                "queue_depth": self.waiting, "windows": 0, "window_seconds_sum": 0.0, "tokens_per_s": 0.0}

    # the server runs on its own event loop (another thread): tests poke the scheduler through these
    def do_release(self) -> None:
        self._loop.call_soon_threadsafe(self.release.set)

    def do_crash(self) -> None:
        self._loop.call_soon_threadsafe(self.crash.set)

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED):
        import asyncio
        self._loop = asyncio.get_running_loop()
        limiter = anyio.Semaphore(self.parallel)
        task_status.started()
        async with anyio.create_task_group() as tg:
            async def crash():
                await self.crash.wait()
                raise RuntimeError("fake scheduler crash")

            tg.start_soon(crash)
            async for req, send in self._recv:
                tg.start_soon(self._serve, req, send, limiter)

    async def _serve(self, req, send, limiter):
        async with limiter:
            self.waiting -= 1
            self.running[req.id] = req
            try:
                async with send:
                    async for ev in self.script(req, self):
                        if req.id in self.cancelled:
                            return
                        try:
                            send.send_nowait(ev)
                        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                            return
                        await anyio.sleep(0)
                    self.finished += 1
            finally:
                self.running.pop(req.id, None)
