"""The Starlette app: OpenAI routes (chat and text completions, streamed as SSE or whole; with and without /v1),
/v1/models, llama.cpp's /tokenize, /detokenize and /props, /health, /slots, /metrics, /openapi.json; API-key gate,
CORS, body-size limit; the lifespan that loads the model and warms the scheduler up in the background (the port
answers meanwhile: /health is 503 "loading"), and drain() for a graceful shutdown.

One generation request: read the body (at most max_body_bytes) -> validate (openai_api, against the model's vocabulary
and context) -> render the chat template, tokenize and compile a grammar (off the event loop) -> check the lengths ->
Request -> scheduler.submit -> turn the events (Delta*, then Finished per choice | Failed) into one JSON response or
SSE chunks, tool calls parsed out of the text. A client that goes away is noticed by a watcher on the ASGI receive
channel; its request is cancelled in the scheduler, which frees its slots by the next window.
"""
from __future__ import annotations

import hmac
import json
import logging
import math
import time
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, Awaitable, Callable

import anyio
import anyio.abc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from strata.config import Settings
from strata.errors import StrataError
from strata.model.control import entries as cv_entries
from strata.sched.request import Delta, Failed, Finished, QueueFull, Request, SamplingParams
from strata.serve import openai_api as oa
from strata.serve.images import expand, image_parts, read_images, settings_for
from strata.serve.openai_api import ApiError
from strata.serve.tool_calls import Parsed, ToolCallParser
from strata.tokenizer import ChatTemplateError, release_freed_memory

log = logging.getLogger("strata.serve")

KEEPALIVE_S = 15.0        # an SSE comment goes out when nothing else was sent for this long; a stream's headers
                          # wait this long at most for its first event (so a queued request can still get a JSON 503)
RETRY_AFTER_S = 5         # Retry-After of a 503 while loading or draining
BIG_BODY = 1 << 20        # after a body this large, freed heap pages are given back to the system
POLL_S = 1.0              # how often a waiting response checks that the scheduler is still running
_RESERVED_TEMPLATE_ARGS = {"messages", "add_generation_prompt", "tools", "documents"}


# ---------------------------------------------------------------------------------------------------------------------
# metrics

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/chat/completions", "/completions", "/models",
          "/tokenize", "/detokenize", "/props", "/health", "/slots", "/metrics", "/openapi.json", "/")
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


_STAGE_COUNTERS = (
    ("handoff_seconds", "strata_stage_handoff_seconds", "Host time handing a layer split's hidden rows to the stage"),
    ("expert_hits", "strata_stage_expert_hits", "Routes whose expert was in the stage's device slots"),
    ("expert_misses", "strata_stage_expert_misses", "Routes whose expert was not"),
    ("expert_fills", "strata_stage_expert_fills", "Experts written into the stage's device slots"),
    ("expert_bytes_copied", "strata_stage_expert_bytes_copied", "Expert bytes copied host to the stage's device"),
    ("expert_peer_routes", "strata_stage_expert_peer_routes",
     "The stage's prompt-part routes computed on a peer device (prefill_help)"),
)


def _stage_families(stages: list):
    """A layer split's per-stage counters, labelled by stage, device and layers."""
    for key, name, doc in _STAGE_COUNTERS:
        c = CounterMetricFamily(name, doc, labels=["stage", "device", "layers"])
        for st in stages:
            if isinstance(st.get(key), (int, float)):
                c.add_metric([str(st["stage"]), st["device"], st["layers"]], float(st[key]))
        if stages:
            yield c


class _SchedulerCollector:
    """The scheduler's counters, read at scrape time (none while the model loads)."""

    def __init__(self, state):
        self.state = state

    def collect(self):
        scheduler = self.state.scheduler
        if scheduler is None:
            return
        try:
            m = dict(scheduler.metrics())
        except Exception as e:  # a scrape must not fail because the scheduler is mid-change
            log.warning("the scheduler's metrics could not be read: %s: %s", type(e).__name__, e)
            m = {}
        try:
            slots = list(scheduler.slots())
        except Exception:
            slots = []
        yield from scheduler_families(m, slots)


def scheduler_families(m: dict, slots: list):
    """The metric families of one scheduler's metrics() and slots() (serve/ray_app.py labels each replica's)."""
    def num(key):
        v = m.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    for key, name, doc in (
        ("requests_finished", "strata_requests_finished", "Requests that ended with a finish reason"),
        ("requests_failed", "strata_requests_failed", "Requests that ended with an error"),
        ("prompt_tokens", "strata_prompt_tokens", "Prompt tokens read"),
        ("generated_tokens", "strata_generated_tokens", "Tokens generated"),
        ("windows", "strata_windows", "Scheduler windows run"),
        ("windows_ahead", "strata_windows_ahead",
         "Decode windows dispatched before the previous window's tokens were read"),
        ("windows_pipelined", "strata_windows_pipelined",
         "Of those, a layer split's windows of the other group of slots, which wait for nothing of the previous"),
        ("windows_late_masks", "strata_windows_late_masks",
         "Of those, windows whose grammar rows got their masks after dispatch, computed while the window ran"),
        ("device_seconds_sum", "strata_window_device_seconds", "Device time inside the scheduler's windows"),
        ("plan_seconds_sum", "strata_window_plan_seconds", "Scheduler time planning windows"),
        ("apply_seconds_sum", "strata_window_apply_seconds", "Scheduler time applying window results and text"),
        ("handoff_seconds_sum", "strata_window_handoff_seconds", "Time handing windows to the worker thread"),
        ("expert_hits", "strata_expert_hits", "Routes whose expert was in a device slot"),
        ("expert_misses", "strata_expert_misses", "Routes whose expert was not"),
        ("expert_fills", "strata_expert_fills", "Experts written into device slots (misses, refills, swaps)"),
        ("expert_window_copies", "strata_expert_window_copies",
         "Missing experts a decode window copied from host memory by itself"),
        ("expert_bytes_copied", "strata_expert_bytes_copied", "Expert bytes copied host to device"),
        ("expert_copy_seconds", "strata_expert_copy_seconds", "Time spent copying experts to the device"),
        ("expert_cpu_routes", "strata_expert_cpu_routes", "Routes computed on the CPU"),
        ("expert_cpu_seconds", "strata_expert_cpu_seconds", "Time spent computing experts on the CPU"),
        ("expert_loans", "strata_expert_loans", "Device slots lent to prompt parts"),
        ("expert_layers_streamed", "strata_expert_layers_streamed",
         "MoE layers whose experts a prompt part copied whole (stream_parts)"),
        ("expert_peer_routes", "strata_expert_peer_routes",
         "Prompt parts' routes computed on a peer device (prefill_help)"),
        ("expert_swaps", "strata_expert_swaps", "Adaptive expert swaps between windows"),
        ("prompt_cache_hits", "strata_prompt_cache_hits", "Prompts that continued a stored conversation"),
        ("prompt_cache_tokens_reused", "strata_prompt_cache_tokens_reused",
         "Prompt tokens reused from the prompt cache instead of read"),
        ("checkpoints_taken", "strata_checkpoints_taken", "Prompt-cache checkpoints taken"),
        ("checkpoints_evicted", "strata_checkpoints_evicted",
         "Checkpoints dropped to keep the checkpoint RAM budget (least recently used first)"),
        ("conversations_parked", "strata_conversations_parked",
         "Conversations whose KV and checkpoints moved to host RAM when their slot was needed"),
        ("conversations_resumed", "strata_conversations_resumed", "Parked conversations resumed into a slot"),
        ("conversations_dropped", "strata_conversations_dropped",
         "Stored conversations dropped (the RAM budget, an error in their slot)"),
        ("windows_verifying", "strata_windows_verifying", "Windows that verified drafts (speculative decoding)"),
        ("drafts_verified", "strata_drafts_verified", "Drafts verified"),
        ("drafts_accepted", "strata_drafts_accepted", "Drafts accepted"),
        ("nonfinite_rows", "strata_nonfinite_rows", "Rows whose logits or residual went non-finite"),
        ("guard_retries", "strata_guard_retries", "Requests the numerics guard retried on another numerics path"),
        ("guard_tokens_resumed", "strata_guard_tokens_resumed",
         "Tokens the guard's retries resumed from a prompt-cache checkpoint instead of reading them again"),
        ("guard_failed", "strata_guard_failed", "Requests the numerics guard ended with the error non_finite"),
        ("expert_slots_repaired", "strata_expert_slots_repaired",
         "Device expert slots that failed their checksum and were rewritten from the host tier"),
        ("guard_rebuilds", "strata_guard_rebuilds", "Rebuilds of the expert device state after a storm of failures"),
        ("kv_spills", "strata_kv_spills", "Moves of a slot's attention KV window that sent positions to host RAM"),
        ("kv_positions_spilled", "strata_kv_positions_spilled", "Positions of attention KV sent to host RAM"),
        ("kv_reloads", "strata_kv_reloads",
         "Prompts that resumed below their slot's host part, whose window was read back from host RAM"),
        ("kv_parks_by_reference", "strata_kv_parks_by_reference",
         "Conversations parked with their host KV kept in place (kv_parked rows) instead of copied"),
    ):
        if (v := num(key)) is not None:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], v)
            yield c
    yield from _stage_families(m.get("stages") or [])
    if (v := num("expert_slots_resident")) is not None:
        yield GaugeMetricFamily("strata_expert_slots_resident", "Device slots holding an expert", value=v)
    if (v := num("checkpoint_ram_bytes")) is not None:
        yield GaugeMetricFamily("strata_checkpoint_ram_bytes",
                                "Host RAM held by checkpoints and parked conversations", value=v)
    if (v := num("conversations_parked_now")) is not None:
        yield GaugeMetricFamily("strata_conversations_parked_now", "Conversations parked in host RAM", value=v)
    if (v := num("kv_host_positions")) is not None:
        yield GaugeMetricFamily("strata_kv_host_positions", "Positions of attention KV in host RAM, all slots",
                                value=v)
    if (v := num("kv_rows_free")) is not None:
        yield GaugeMetricFamily("strata_kv_rows_free", "Host KV rows free for conversations parked in place",
                                value=v)
    if (v := num("queue_depth")) is not None:
        yield GaugeMetricFamily("strata_queue_depth", "Requests waiting for a slot", value=v)
    if (v := num("tokens_per_s")) is not None:
        yield GaugeMetricFamily("strata_tokens_per_second",
                                "Generated tokens per second over the recent windows", value=v)
    windows, wsum = num("windows"), num("window_seconds_sum")
    if windows is not None and wsum is not None:
        yield SummaryMetricFamily("strata_window_seconds", "Wall time of the scheduler's windows",
                                  count_value=windows, sum_value=wsum)
    gaps = SummaryMetricFamily("strata_inter_token_seconds", "Gaps between a stream's tokens, by whether the "
                               "window also read a prompt part", labels=["window"])
    for label, key in (("decode", ""), ("part", "_beside_parts")):
        if (n := num(f"inter_tokens{key}")) is not None:
            gaps.add_metric([label], count_value=n, sum_value=num(f"inter_token_seconds{key}_sum"))
    yield gaps
    g = GaugeMetricFamily("strata_slots", "Sequence slots by state", labels=["state"])
    counts = {"free": 0, "reading": 0, "generating": 0}
    for s in slots:
        st = s.get("state") if isinstance(s, dict) else None
        if isinstance(st, str):
            counts[st] = counts.get(st, 0) + 1
    for st, n in counts.items():
        g.add_metric([st], n)
    yield g
    drafting = [s for s in slots if isinstance(s, dict) and "drafts" in s]
    if drafting:
        acc = GaugeMetricFamily("strata_slot_draft_acceptance", "Share of the drafts verified for a slot's request "
                                "that were accepted", labels=["slot"])
        for s in drafting:
            acc.add_metric([str(s["id"])], s["drafts_accepted"] / s["drafts"] if s["drafts"] else 0.0)
        yield acc


class ServeMetrics:
    """One registry per app, so several apps (tests) in one process don't collide."""

    def __init__(self, state):
        self.registry = r = CollectorRegistry(auto_describe=False)
        self.http_requests = Counter("strata_http_requests", "HTTP requests by route and status code",
                                     ["route", "code"], registry=r)
        self.rejected = Counter("strata_requests_rejected", "Generation requests refused before admission",
                                ["reason"], registry=r)
        self.cancelled = Counter("strata_requests_cancelled", "Requests whose client went away before the end",
                                 registry=r)
        self.active = Gauge("strata_requests_active", "Generation requests in flight (queued or in a slot)",
                            registry=r)
        self.ttft = Histogram("strata_time_to_first_token_seconds", "Seconds from admission to the first text",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("strata_request_duration_seconds", "Seconds from admission to the end",
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.completion_tokens = Histogram("strata_completion_tokens", "Tokens generated per request",
                                           buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384), registry=r)
        # a front end whose scheduler is remote puts its own collector in this one's place (serve/ray_app.py)
        self.scheduler_collector = _SchedulerCollector(state)
        r.register(self.scheduler_collector)

    @staticmethod
    def route_label(path: str) -> str:
        if path in ROUTES:
            return path
        if path.startswith(("/v1/models/", "/models/")):
            return "/v1/models/{id}"
        return "other"

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


# ---------------------------------------------------------------------------------------------------------------------
# state


class ServeState:
    """What the routes share: the engine and scheduler (None while the model loads), the phase (loading -> ready ->
    draining), the served names and the metrics."""

    def __init__(self, engine, scheduler, config: Settings, on_scheduler_exit: Callable[[], None] | None = None):
        self.config = config
        self.engine = self.scheduler = self.tokenizer = None
        self.names = config.served_names
        self.model_name = self.names[0]
        self.created = oa.now()
        self.metrics = ServeMetrics(self)
        self.scheduler_error: str | None = None    # the scheduler stopped after start-up
        self.startup_error: BaseException | None = None   # ... or the model failed to load or warm up
        self.phase = "loading"                     # -> "ready" -> "draining"
        self.responses = 0                         # generation responses in flight
        self.on_scheduler_exit = on_scheduler_exit
        self._grammars = None
        # set by a front end whose scheduler is remote (serve/ray_app.py): the slots one request may use (default:
        # the scheduler's), headers naming who served a request, [DONE] after a stream's error object, and what
        # /slots and /metrics await first (the remote scheduler asks its replicas then: they are not read at a scrape)
        self.slot_count: int | None = None
        self.response_headers: Callable[[str], dict] | None = None
        self.refresh: Callable[[], Awaitable[None]] | None = None
        self.done_after_error = False
        self.sampling_defaults: dict = {}          # the model's generation_config.json's, for fields a body omits
        self.image_settings = None                 # the model's image processor's (a model with a vision tower)
        if engine is not None:
            self.attach(engine, scheduler)

    def attach(self, engine, scheduler) -> None:
        if engine.tokenizer is None:
            raise StrataError("strata serve needs the model's tokenizer (tokenizer.json beside the weights)")
        self.engine, self.scheduler, self.tokenizer = engine, scheduler, engine.tokenizer
        self.sampling_defaults = self._model_sampling_defaults()
        self.image_settings = settings_for(self.tokenizer.source) if engine.images is not None else None

    def _model_sampling_defaults(self) -> dict:
        """The sampling defaults of generation_config.json beside the tokenizer (vLLM's reading of it), logged."""
        path = self.tokenizer.source / "generation_config.json"
        try:
            config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (OSError, ValueError) as e:
            log.warning("%s is not readable JSON (%s): the API's own sampling defaults apply", path, e)
            return {}
        if not isinstance(config, dict):
            return {}
        defaults, refused = oa.generation_defaults(config, oa.Limits(vocab_size=self.vocab_size))
        for reason in refused:
            log.warning("%s: %s; that field keeps the API's default", path, reason)
        if defaults:
            log.info("sampling defaults from %s for the fields a request leaves out: %s", path,
                     ", ".join(f"{k} {v}" for k, v in defaults.items()))
        return defaults

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    @property
    def max_context(self) -> int | str:
        """The scheduler's; while loading, the setting (which may still be "auto")."""
        return int(self.scheduler.max_context) if self.scheduler is not None else self.config.model.max_context

    @property
    def vocab_size(self) -> int:
        return int(self.engine.cfg.vocab_size)

    def limits(self) -> oa.Limits:
        slots = self.slot_count if self.slot_count is not None else len(self.scheduler.slots())
        return oa.Limits(vocab_size=self.vocab_size, max_context=self.max_context, slots=slots,
                         control_vector=self.control_vector)

    @property
    def vision(self) -> bool:
        """Whether the model takes images (its vision tower is loaded)."""
        return self.engine is not None and self.engine.images is not None

    @property
    def control_vector(self) -> bool:
        """Whether the engine loads a control vector (the setting; a remote front end has no engine of its own)."""
        return self.config.model.control_vector is not None

    def headers_for(self, request_id: str) -> dict:
        return self.response_headers(request_id) if self.response_headers is not None else {}

    def grammars(self):
        """The model's tokenizer for grammars and token bytes (serve/grammar.py), made at first use (in a worker
        thread: for a large vocabulary it takes a moment)."""
        if self._grammars is None:
            from strata.serve.grammar import Grammars
            self._grammars = Grammars(self.tokenizer, self.vocab_size, self.engine.eos_token_ids)
        return self._grammars

    def check_admitting(self) -> None:
        """ApiError(503, Retry-After) unless new generation requests are taken now."""
        if self.scheduler_error is not None:
            raise ApiError(503, f"the server cannot generate: its scheduler stopped ({self.scheduler_error}); "
                                f"restart the server", code="scheduler_stopped")
        if self.phase == "loading":
            raise ApiError(503, "the model is loading (warm-up); retry shortly (GET /health answers 200 once ready)",
                           code="loading", headers={"Retry-After": str(RETRY_AFTER_S)})
        if self.phase != "ready":
            raise ApiError(503, "the server is shutting down and takes no new requests; retry (another replica, or "
                                "this one once restarted)", code="shutting_down",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            served = ", ".join(repr(n) for n in self.names)
            raise ApiError(404, f"model {name!r} is not served here; this server serves {served} (GET /v1/models)",
                           param="model", code="model_not_found")

    async def start(self, load: Callable[[], tuple] | None, on_ready: Callable[[], None] | None):
        """Load the model (when `load` is given: -> (engine, scheduler)), run the scheduler's warm-up, then serve:
        phase "ready". A failure is kept in startup_error and ends the server through on_scheduler_exit."""
        t0 = time.perf_counter()
        try:
            if load is not None:
                engine, scheduler = await anyio.to_thread.run_sync(load)
                self.attach(engine, scheduler)
            async with anyio.create_task_group() as tg:
                await tg.start(self.run_scheduler)
                if self.phase == "loading":
                    self.phase = "ready"
                config = self.config
                log.info("ready: scheduler warmed up in %.0f ms (%d slots, prompt parts of %d tokens, max_context %d)",
                         (time.perf_counter() - t0) * 1000, config.sched.parallel, config.sched.prefill,
                         self.max_context)
                if on_ready is not None:
                    on_ready()
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as e:
            if self.startup_error is None and self.scheduler_error is None:
                self.startup_error = e
                what = "load" if self.scheduler is None else "warm up"
                # a StrataError is the command line's one error line (server.serve raises it); others are logged
                (log.debug if isinstance(e, StrataError) else log.error)("the model failed to %s: %s", what,
                                                                         _describe(e))
                log.debug("traceback", exc_info=e)
                if self.on_scheduler_exit is not None:
                    self.on_scheduler_exit()

    async def run_scheduler(self, *, task_status=anyio.TASK_STATUS_IGNORED):
        """scheduler.run, with a crash after start-up turned into a 503 for everyone instead of silent hangs."""
        started = False

        class _Status:
            def started(self_, value=None):
                nonlocal started
                started = True
                task_status.started(value)

        try:
            await self.scheduler.run(task_status=_Status())
            if started:
                raise RuntimeError("the scheduler's run() returned")
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as e:
            if not started:
                raise
            self.scheduler_error = _describe(e)
            log.error("the scheduler stopped: %s; new requests get 503", self.scheduler_error, exc_info=e)
            if self.on_scheduler_exit is not None:
                self.on_scheduler_exit()

    async def drain(self, timeout_s: float, hurry: anyio.Event | None = None) -> None:
        """Graceful shutdown: refuse new requests (503, Retry-After), answer every queued one with a JSON 503, let
        the running ones finish for up to timeout_s (or until `hurry` is set), then end the rest with
        finish_reason "abort"; returns once every response has been sent."""
        was = self.phase
        self.phase = "draining"
        if was != "ready" or self.scheduler is None:
            return
        queued = self.scheduler.drain("the server is shutting down; this request was not started: retry it")
        t0 = time.perf_counter()
        running = self.responses - queued
        log.info("draining: new requests get 503; %d queued answered 503; waiting up to %g s for %d running",
                 queued, timeout_s, max(running, 0))
        with anyio.move_on_after(timeout_s):
            while self.responses > 0 and not (hurry is not None and hurry.is_set()):
                await anyio.sleep(0.02)
        if self.responses > 0:
            n = self.scheduler.abort()
            log.info("drain: %d requests still running after %.1f s end with finish_reason abort", n,
                     time.perf_counter() - t0)
            with anyio.move_on_after(10.0):
                while self.responses > 0:
                    await anyio.sleep(0.02)
        log.info("drained in %.1f s", time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------------------------------
# helpers


def _describe(e: BaseException) -> str:
    """`Type: message` of the exception, looking inside exception groups (task groups wrap what really happened)."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(_describe(x) for x in e.exceptions)
    return f"{type(e).__name__}: {e}"


def _json_default(o: Any):
    if hasattr(o, "item"):          # numpy scalars
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


class _JSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"),
                          default=_json_default).encode("utf-8")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> Response:
    return _JSON(oa.error_body(status, message, param, code), status_code=status, headers=headers)


async def read_body(request: HttpRequest, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {int(declared)} bytes; this server accepts at most {limit} bytes "
                            f"(max_body_bytes); send a shorter request", code="body_too_large", headers=CLOSE)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is over {limit} bytes, the most this server accepts "
                                f"(max_body_bytes); send a shorter request", code="body_too_large", headers=CLOSE)
        chunks.append(chunk)
    request.scope["strata.body_bytes"] = size
    return b"".join(chunks)


# An answer sent before the request's body was read ends the connection: the server cannot read the next request
# on it, and a client that reused it would see it close without an answer.
CLOSE = {"Connection": "close"}


async def drain_body(request: HttpRequest, limit: int) -> dict:
    """Read and drop the body of a request answered without it (unknown route, wrong method, no API key), so the
    connection stays usable; -> the headers the answer needs (CLOSE when the body is over `limit`)."""
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return CLOSE
    except ClientDisconnect:
        return CLOSE
    return {}


def _api(fn):
    """Route wrapper: ApiError -> its JSON; anything else -> 500 JSON (logged); a vanished client -> nothing."""

    async def endpoint(request: HttpRequest):
        try:
            return await fn(request)
        except ApiError as e:
            state: ServeState = request.app.state.strata
            if e.status == 503:
                state.metrics.rejected.labels(e.code or "busy").inc()
            elif e.status == 413:
                state.metrics.rejected.labels("too_large").inc()
            else:
                state.metrics.rejected.labels("invalid").inc()
            log.info("%d %s %s: %s", e.status, request.method, request.url.path, e.message)
            return error_response(e.status, e.message, e.param, e.code, e.headers)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as e:
            log.error("500 %s %s: %s: %s", request.method, request.url.path, type(e).__name__, e, exc_info=e)
            return error_response(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")
        finally:
            if request.scope.get("strata.body_bytes", 0) > BIG_BODY:   # its objects are garbage by now
                await anyio.to_thread.run_sync(release_freed_memory)

    endpoint.__name__ = fn.__name__
    return endpoint


def ends_inside_think(text: str) -> bool:
    """True when the text's last `<think>` comes after its last `</think>` (the prompt opened a reasoning block)."""
    return text.rfind("<think>") > text.rfind("</think>")


# ---------------------------------------------------------------------------------------------------------------------
# generation routes


async def _body(request: HttpRequest, model: type, state: ServeState, generation: bool = True):
    """Read, parse and check a body against `model` (a pydantic body of openai_api); generation routes first check
    that the server takes requests now, and that the model named is served here."""
    raw = await read_body(request, state.config.serve.max_body_bytes)
    if generation:
        state.check_admitting()
    elif state.tokenizer is None:
        state.check_admitting()                    # loading: the tokenizer is not there yet
    body = oa.parse_json_body(raw)
    del raw
    if generation:
        model_name = body.get("model")
        if isinstance(model_name, str):
            state.check_model(model_name)
    return model.parse(body, state.limits())


def _char_bound(state: ServeState, chars: int, param: str) -> None:
    """Refuse, before tokenizing, a text that cannot fit the context whatever its tokens: one token decodes to at most
    max_token_chars characters, so n characters are at least n / max_token_chars tokens."""
    per = state.tokenizer.max_token_chars
    least = -(-chars // per)
    if least >= state.max_context:
        raise oa.bad(param, f"the prompt is {chars} characters, so at least {least} tokens (a token of this model is "
                            f"at most {per} characters), but max_context is {state.max_context}: shorten the prompt, "
                            f"or start the server with a larger --max-context", code="context_length_exceeded")


async def chat_completions(request: HttpRequest):
    state: ServeState = request.app.state.strata
    params: oa.ChatRequest = await _body(request, oa.ChatRequest, state)
    messages = params.message_dicts
    _char_bound(state, sum(len(_text_of(m.get("content"))) for m in messages), "messages")
    images = await _images(state, messages)
    kwargs = {k: v for k, v in params.template_kwargs.items() if k not in _RESERVED_TEMPLATE_ARGS}
    # tool_choice "none": the model is not shown the tools (so it has none to call) and its text is not parsed
    choice = params.tool_choice_kind
    tools = list(params.tools) if params.tools and choice != "none" else None
    trusted = state.config.serve.special_tokens_in_messages
    try:
        text, ids = await anyio.to_thread.run_sync(
            lambda: state.tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools,
                                                special_tokens_in_messages=trusted, **kwargs))
    except ChatTemplateError as e:
        raise oa.bad("messages", f"the conversation cannot be rendered with the model's chat template: {e}",
                     code="invalid_messages") from None
    reasoning = ends_inside_think(text[-4096:])
    turn_at = await anyio.to_thread.run_sync(lambda: _turn_at(state.tokenizer, messages, tools, text, ids, kwargs))
    cache_ids = None
    if images:
        n = len(ids)
        ids, cache_ids = expand(ids, images, state.engine.images.vc)
        turn_at = None if turn_at is None else turn_at + len(ids) - n      # (the images come before it)
    if choice in ("required", "function"):
        forced = [t for t in tools if choice == "required" or isinstance(t.get("function"), dict)
                  and t["function"].get("name") == params.tool_function]
        most = state.config.serve.max_tool_calls if params.parallel_tool_calls is not False else 1
        constraint = await _grammar(state, "tools", lambda g: g.tool_calls(forced, most, reasoning))
    else:
        constraint = await _constraint(state, params, reasoning)
    return _generate(state, "chat", params, ids, reasoning=reasoning, mt_param=params.max_tokens_param,
                     constraint=constraint, tools=tools, turn_at=turn_at, images=tuple(images), cache_ids=cache_ids)


def _text_of(content) -> str:
    """A message content's text (its text parts' when it has image parts)."""
    if isinstance(content, (list, tuple)):
        return "".join(p.get("text", "") for p in content)
    return content or ""


async def _images(state: ServeState, messages: list[dict]) -> list:
    """The messages' images, read and preprocessed (each read once the tower has seen it: by content hash), or a
    400 naming the part that cannot be used."""
    parts = image_parts(messages)
    if not parts:
        return []
    encoder = state.engine.images if state.engine is not None else None
    if encoder is None:
        why = ("images are not served through --replicas yet" if state.refresh is not None   # (Ray's front end)
               else "its checkpoint has no vision tower, or the vision setting is off")
        raise oa.bad(parts[0][0], f"{parts[0][0]}: this server takes no images: {why}; send text parts only",
                     code="images_unsupported")
    settings = state.image_settings
    max_pixels = min(state.config.model.max_image_pixels, settings.max_pixels)
    images = await anyio.to_thread.run_sync(lambda: read_images(parts, settings, max_pixels))
    # the tower's work in a worker thread now, so that the scheduler finds each image encoded
    for image in images:
        await anyio.to_thread.run_sync(lambda: encoder.encode(image))
    return images


def _turn_at(tok, messages: list[dict], tools, text: str, ids: list[int], kwargs: dict) -> int | None:
    """Where the prompt's generation prompt (the last assistant header) starts, in tokens: the prompt cache takes a
    checkpoint there, where the next turn's prompt stops sharing this one. None when the template's text without
    the generation prompt is not a prefix of the prompt's, or its tokens do not end the prompt's."""
    try:
        bare = tok.apply_chat_template(messages, add_generation_prompt=False, tools=tools, **kwargs)
    except ChatTemplateError:
        return None
    if not text.startswith(bare) or len(bare) == len(text):
        return None
    tail = tok.encode(text[len(bare):], add_special_tokens=False)
    at = len(ids) - len(tail)
    return at if 0 < at and list(ids[at:]) == tail else None


async def _constraint(state: ServeState, params, reasoning: bool):
    """The grammar of a response_format, or None."""
    schema = params.json_schema
    if schema is None:
        return None
    return await _grammar(state, "response_format", lambda g: g.json(schema, reasoning))


async def _grammar(state: ServeState, param: str, make):
    """make(Grammars) in a worker thread; a grammar that cannot be built is the request's fault (400)."""
    from strata.serve.grammar import GrammarError, NoToolCallForm
    try:
        return await anyio.to_thread.run_sync(lambda: make(state.grammars()))
    except NoToolCallForm as e:
        raise oa.bad("tool_choice", f"tool_choice 'required' or a named function cannot be served by this model: "
                                    f"{e}; use tool_choice 'auto' or 'none'", code="unsupported_tool_choice") from None
    except GrammarError as e:
        raise oa.bad(param, f"{param} cannot be turned into a grammar: {e}", code="invalid_schema") from None


async def completions(request: HttpRequest):
    state: ServeState = request.app.state.strata
    params: oa.CompletionRequest = await _body(request, oa.CompletionRequest, state)
    if isinstance(params.prompt, str):
        text = params.prompt
        _char_bound(state, len(text), "prompt")
        ids = await anyio.to_thread.run_sync(lambda: state.tokenizer.encode(text, add_special_tokens=False))
    else:
        ids = list(params.prompt)
        text = state.tokenizer.decode(ids) if params.echo else ""
    constraint = await _constraint(state, params, False)
    return _generate(state, "text", params, ids, reasoning=False, mt_param="max_tokens",
                     echo_text=text if params.echo else "", constraint=constraint)


def _generate(state: ServeState, kind: str, params, ids: list[int], *, reasoning: bool,
              mt_param: str, echo_text: str = "", constraint=None, tools: list | None = None,
              turn_at: int | None = None, images: tuple = (), cache_ids: tuple | None = None) -> "GenerationResponse":
    n, limit = len(ids), state.max_context
    if n == 0:
        raise oa.bad("messages" if kind == "chat" else "prompt", "the prompt is empty after tokenization",
                     code="empty_prompt")
    if n >= limit:
        raise oa.bad("messages" if kind == "chat" else "prompt",
                     f"the prompt is {n} tokens but max_context is {limit}: a prompt must be at most {limit - 1} "
                     f"tokens so that at least one token can be generated; shorten the prompt, or start the server "
                     f"with a larger --max-context", code="context_length_exceeded")
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = limit - n
    elif n + max_tokens > limit:
        raise oa.bad(mt_param, f"the prompt is {n} tokens and {mt_param} is {max_tokens}: {n + max_tokens} tokens "
                               f"exceed max_context {limit}; the largest {mt_param} for this prompt is {limit - n}",
                     code="context_length_exceeded")
    state.check_admitting()                         # again: the server may have begun to drain while this tokenized
    s = params.sampling(state.sampling_defaults)
    rid = oa.new_id("chatcmpl" if kind == "chat" else "cmpl")
    scale = 1.0 if params.control_vector_scale is None else params.control_vector_scale
    # a stored state depends on the scale its tokens were read with: the prompt cache keeps scales apart
    key = (("control_vector_scale", scale),) if state.control_vector else ()
    req = Request(id=rid, prompt_ids=tuple(int(i) for i in ids), max_tokens=int(max_tokens),
                  sampling=SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                                          seed=s.seed, presence_penalty=s.presence_penalty,
                                          frequency_penalty=s.frequency_penalty,
                                          repetition_penalty=s.repetition_penalty, logit_bias=s.logit_bias),
                  stop=tuple(params.stop), reasoning=reasoning,
                  stop_token_ids=() if params.ignore_eos else None, n=params.choices, logprobs=params.logprob_count,
                  constraint=constraint, cache_prompt=params.cache_prompt is not False,
                  checkpoints=params.strata_checkpoint is not False, turn_at=turn_at,
                  chat=kind == "chat", cache_key=key, control_scale=scale, images=images, cache_ids=cache_ids)
    try:
        events = state.scheduler.submit(req)
    except QueueFull as e:
        raise ApiError(503, str(e), code="queue_full",
                       headers={"Retry-After": str(max(1, int(math.ceil(e.retry_after_s))))}) from None
    except ValueError as e:                         # the scheduler's own check of what it can run
        raise oa.bad(None, f"the request cannot be run: {e}") from None
    return GenerationResponse(state, req, events, kind, params.streaming, params.include_usage, echo_text, tools)


class _Choice:
    """One choice of a response as it arrives: its text, its tool calls (parsed out of the content when the request
    offered tools) and its logprobs."""

    def __init__(self, index: int, tools: list | None):
        self.index = index
        self.parser = ToolCallParser(tools) if tools else None
        self.content, self.reasoning, self.text = [], [], []     # text: a text completion's, in order
        self.parsed = Parsed()
        self.logprobs: list = []
        self.offset = 0                  # characters of a text completion's text so far (logprobs' text_offset)
        self.finished: Finished | None = None

    def content_of(self, d: Delta, final: bool = False) -> Parsed:
        """What a Delta's content (or, final, the end of the reply) shows: text and tool-call deltas."""
        if self.parser is None:
            return Parsed(content=d.content)
        out = self.parser.push(d.content)
        if final:
            out.add(self.parser.finish())
        self.parsed.add(out)
        return out

    def finish_reason(self) -> str:
        calls = self.parser is not None and self.parser.calls
        return "tool_calls" if calls and self.finished.reason == "stop" else self.finished.reason

    def tool_calls(self) -> list[dict]:
        calls: dict[int, list] = {}
        for d in self.parsed.calls:
            if d.id is not None:
                calls[d.index] = [d.id, d.name, d.arguments]
            else:
                calls[d.index][2] += d.arguments
        return [oa.tool_call(*calls[i]) for i in sorted(calls)]


class GenerationResponse:
    """An ASGI response that drives one submitted request to its end, streamed (SSE) or whole (JSON)."""

    def __init__(self, state: ServeState, req: Request, events: anyio.abc.ObjectReceiveStream, kind: str,
                 stream: bool, include_usage: bool, echo_text: str, tools: list | None = None):
        self.state, self.req, self.events, self.kind = state, req, events, kind
        self.stream, self.include_usage, self.echo_text = stream, include_usage, echo_text
        self.choices = [_Choice(i, tools if kind == "chat" else None) for i in range(req.n)]
        self.created = oa.now()
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.ended = False          # a Finished or Failed came from the scheduler
        self.disconnected = False
        self.started = False        # the response's headers went out
        state.responses += 1        # counted from submission: drain() waits for it

    async def __call__(self, scope, receive, send):
        m = self.state.metrics
        m.active.inc()

        async def tracked_send(message):
            if message["type"] == "http.response.start":
                self.started = True
            await send(message)

        try:
            async with anyio.create_task_group() as tg:
                async def watch_disconnect():
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            if not self.ended:
                                self.disconnected = True
                            tg.cancel_scope.cancel()
                            return

                tg.start_soon(watch_disconnect)
                try:
                    if self.stream:
                        await self._stream(tracked_send)
                    else:
                        await self._whole(tracked_send)
                except OSError:            # the transport went away under a send
                    self.disconnected = True
                except Exception as e:     # a bug answering this request: it alone fails
                    log.error("%s: 500: %s", self.req.id, _describe(e), exc_info=e)
                    if not self.started:
                        await _send_json(tracked_send, 500, oa.error_body(500, f"internal error: {_describe(e)}",
                                                                          code="internal_error"))
                    elif not self.disconnected:
                        await tracked_send({"type": "http.response.body", "more_body": False, "body": oa.sse(
                            oa.error_body(500, f"internal error: {_describe(e)}", code="internal_error"))})
                tg.cancel_scope.cancel()
        finally:
            m.active.dec()
            self.state.responses -= 1
            if not self.ended:
                self.state.scheduler.cancel(self.req.id)
                m.cancelled.inc()
                log.info("%s: the client went away after %.0f ms; its slot is freed", self.req.id,
                         (time.perf_counter() - self.t0) * 1000)
            with anyio.CancelScope(shield=True):
                try:
                    await self.events.aclose()
                except Exception:
                    pass

    # -- events

    async def _next(self, timeout: float) -> list | None:
        """The next event and whatever else is already waiting; None when nothing came within `timeout`."""
        got = []
        with anyio.move_on_after(timeout):
            try:
                got.append(await self.events.receive())
            except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                got.append(Failed("the scheduler ended this request without a result", 500))
        if not got:
            if self.state.scheduler_error is not None:
                return [Failed(f"the scheduler stopped ({self.state.scheduler_error}); restart the server", 503)]
            return None
        while not isinstance(got[-1], Failed) and not self._all_finished(got):
            try:
                got.append(self.events.receive_nowait())
            except anyio.WouldBlock:
                break
            except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                got.append(Failed("the scheduler ended this request without a result", 500))
        return got

    def _all_finished(self, got: list) -> bool:
        """Whether `got` holds the last choice's Finished (the stream ends after it)."""
        done = sum(c.finished is not None for c in self.choices) + sum(isinstance(e, Finished) for e in got)
        return done >= len(self.choices)

    def _token_bytes(self, token: int) -> bytes:
        return self.state.grammars().token_bytes(token)

    def _mark_first(self, d: Delta):
        if self.t_first is None and (d.content or d.reasoning):
            self.t_first = time.perf_counter()
            self.state.metrics.ttft.observe(self.t_first - self.t0)

    def _finish_log(self, fin: Finished):
        self.ended = True
        now = time.perf_counter()
        m = self.state.metrics
        m.duration.observe(now - self.t0)
        m.completion_tokens.observe(fin.completion_tokens)
        first = self.t_first or now
        gen_s = max(now - first, 1e-9)
        rate = max(fin.completion_tokens - 1, 0) / gen_s
        # the scheduler logs the request's one info line; this adds what only HTTP sees (time to first text)
        log.debug("%s: prompt %d tokens, %d generated, finish %s; first text after %.0f ms, %.0f ms in all "
                 "(%.1f tok/s after the first)%s", self.req.id, fin.prompt_tokens, fin.completion_tokens, fin.reason,
                 (first - self.t0) * 1000, (now - self.t0) * 1000, rate, _timings_text(fin.timings))

    def _fail_log(self, f: Failed):
        self.ended = True
        self.state.metrics.duration.observe(time.perf_counter() - self.t0)
        if f.status == 503 and self.state.phase == "draining":
            log.info("%s: 503 (not started before the shutdown)", self.req.id)
        else:
            log.warning("%s: failed (%d): %s", self.req.id, f.status, f.message)

    async def _send_failed(self, send, f: Failed):
        code = "shutting_down" if f.status == 503 and self.state.phase == "draining" else "generation_failed"
        headers = {"Retry-After": str(RETRY_AFTER_S)} if f.status == 503 else {}
        await _send_json(send, f.status, _failed_body(f, code), {**headers, **self.state.headers_for(self.req.id)})

    # -- whole responses

    async def _whole(self, send):
        while True:
            evs = await self._next(POLL_S)
            if evs is None:
                continue
            for ev in evs:
                if isinstance(ev, Delta):
                    self._mark_first(ev)
                    c = self.choices[ev.index]
                    c.reasoning.append(ev.reasoning)
                    c.content.append(ev.content)
                    c.text.append(ev.reasoning + ev.content)
                    c.logprobs.extend(ev.logprobs)
                elif isinstance(ev, Finished):
                    self.choices[ev.index].finished = ev
                    if all(c.finished is not None for c in self.choices):
                        await _send_json(send, 200, self._whole_body(ev), self.state.headers_for(self.req.id))
                        return
                elif isinstance(ev, Failed):
                    self._fail_log(ev)
                    await self._send_failed(send, ev)
                    return

    def _whole_body(self, last: Finished) -> dict:
        completion = sum(c.finished.completion_tokens for c in self.choices)
        self._finish_log(replace(last, completion_tokens=completion))
        timings = dict(last.timings) if last.timings else None
        want_lp = self.req.logprobs is not None
        choices = []
        for c in self.choices:
            if self.kind == "chat":
                shown = c.content_of(Delta(content="".join(c.content)), final=True)
                lp = oa.chat_logprobs(c.logprobs, self._token_bytes) if want_lp else None
                choices.append({"index": c.index, "message": oa.chat_message(shown.content, "".join(c.reasoning),
                                                                              c.tool_calls()),
                                "logprobs": lp, "finish_reason": c.finish_reason()})
            else:
                lp = oa.completion_logprobs(c.logprobs, self._token_bytes, len(self.echo_text)) if want_lp else None
                choices.append({"index": c.index, "text": self.echo_text + "".join(c.text), "logprobs": lp,
                                "finish_reason": c.finished.reason})
        build = oa.chat_response if self.kind == "chat" else oa.completion_response
        return build(self.req.id, self.state.model_name, self.created, choices, last.prompt_tokens, completion,
                     timings, last.cached_tokens)

    # -- streamed responses

    async def _stream(self, send):
        rid, model, created = self.req.id, self.state.model_name, self.created
        iu = self.include_usage
        chat = self.kind == "chat"

        async def out(data):
            await send({"type": "http.response.body", "body": data if isinstance(data, bytes) else oa.sse(data),
                        "more_body": True})

        async def start():
            extra = [(k.lower().encode(), v.encode()) for k, v in self.state.headers_for(rid).items()]
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"), *extra]})
            for c in self.choices:
                if chat:
                    await out(oa.chat_chunk(rid, model, created, {"role": "assistant", "content": ""},
                                            include_usage=iu, index=c.index))
                elif self.echo_text:
                    await out(oa.completion_chunk(rid, model, created, self.echo_text, include_usage=iu,
                                                  index=c.index))
                    c.offset = len(self.echo_text)

        last_write = time.perf_counter()
        while True:
            evs = await self._next(POLL_S)
            if not self.started:
                # the headers wait for the first event (at most KEEPALIVE_S): a request that fails before it starts,
                # a queued one at shutdown say, gets a JSON error with its status instead of a 200 stream
                if evs is not None and isinstance(evs[0], Failed):
                    self._fail_log(evs[0])
                    await self._send_failed(send, evs[0])
                    return
                if evs is None and time.perf_counter() - self.t0 < KEEPALIVE_S:
                    continue
                await start()
                last_write = time.perf_counter()
            if evs is None:
                if time.perf_counter() - last_write >= KEEPALIVE_S:
                    await out(b": keep-alive\n\n")
                    last_write = time.perf_counter()
                continue
            pieces: list = []          # (choice, delta or text, [TokenLogprob], finish reason): merged, then sent
            terminal = None
            for ev in evs:
                if isinstance(ev, Delta):
                    self._mark_first(ev)
                    self._pieces(pieces, self.choices[ev.index], ev)
                elif isinstance(ev, Finished):
                    c = self.choices[ev.index]
                    c.finished = ev
                    self._pieces(pieces, c, Delta(index=c.index), final=True)
                    pieces.append((c, None, [], c.finish_reason()))
                    if all(x.finished is not None for x in self.choices):
                        terminal = ev
                else:
                    terminal = ev
            buf = bytearray()
            for c, piece, lps, reason in _merged(pieces):
                buf += oa.sse(self._chunk(c, piece, lps, reason))
            if isinstance(terminal, Finished):
                completion = sum(c.finished.completion_tokens for c in self.choices)
                self._finish_log(replace(terminal, completion_tokens=completion))
                if iu:
                    buf += oa.sse(oa.usage_chunk(rid, model, created, "chat.completion.chunk" if chat else
                                                 "text_completion", terminal.prompt_tokens, completion,
                                                 terminal.cached_tokens))
                buf += oa.sse("[DONE]")
            elif isinstance(terminal, Failed):
                # each unfinished choice ends with finish_reason "error", then the error object says why
                self._fail_log(terminal)
                for c in self.choices:
                    if c.finished is None:
                        buf += oa.sse(self._chunk(c, None, [], "error"))
                buf += oa.sse(_failed_body(terminal, "generation_failed"))
                if self.state.done_after_error:
                    buf += oa.sse("[DONE]")
            if buf:
                await out(bytes(buf))
                last_write = time.perf_counter()
            if terminal is not None:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return

    def _pieces(self, pieces: list, c: _Choice, d: Delta, final: bool = False) -> None:
        """A Delta's chunks-to-be for choice c: reasoning, content and tool-call pieces (a text completion's text),
        its logprobs on the first of them (on an empty delta when it shows nothing)."""
        lps = list(d.logprobs)
        if self.kind != "chat":
            if d.reasoning + d.content or lps:
                pieces.append((c, d.reasoning + d.content, lps, None))
            return
        shown = c.content_of(d, final)
        out = []
        if d.reasoning:
            out.append({"reasoning_content": d.reasoning})
        if shown.content:
            out.append({"content": shown.content})
        out += [{"tool_calls": [oa.tool_call_delta(x.index, x.id, x.name, x.arguments)]} for x in shown.calls]
        if lps and not out:
            out.append({})
        for i, delta in enumerate(out):
            pieces.append((c, delta, lps if i == 0 else [], None))

    def _chunk(self, c: _Choice, piece, lps: list, reason: str | None) -> dict:
        rid, model, created, iu = self.req.id, self.state.model_name, self.created, self.include_usage
        want_lp = self.req.logprobs is not None
        if self.kind == "chat":
            lp = oa.chat_logprobs(lps, self._token_bytes) if want_lp and lps else None
            return oa.chat_chunk(rid, model, created, piece if piece is not None else {}, reason, include_usage=iu,
                                 index=c.index, logprobs=lp)
        lp = None
        if want_lp and lps:
            lp = oa.completion_logprobs(lps, self._token_bytes, c.offset)
            c.offset += sum(len(t) for t in lp["tokens"])
        return oa.completion_chunk(rid, model, created, piece or "", reason, include_usage=iu, index=c.index,
                                   logprobs=lp)


def _failed_body(f: Failed, code: str) -> dict:
    """The error object of a failed request: its own code (non_finite) or `code`, and its detail fields."""
    body = oa.error_body(f.status, f.message, code=f.code or code)
    body["error"].update(dict(f.detail))
    return body


def _merged(pieces: list) -> list:
    """Consecutive pieces of one choice and one kind joined (text to text, one call's argument fragments), their
    logprobs concatenated, so a batch of events goes out as few chunks."""
    out: list = []
    for c, piece, lps, reason in pieces:
        if out and reason is None and out[-1][3] is None and out[-1][0] is c:
            joined = _join(out[-1][1], piece)
            if joined is not None:
                out[-1] = (c, joined, out[-1][2] + lps, None)
                continue
        out.append((c, piece, lps, reason))
    return out


def _join(a, b):
    """a and b as one piece, or None when they cannot be one."""
    if isinstance(a, str) and isinstance(b, str):
        return a + b
    if not (isinstance(a, dict) and isinstance(b, dict)) or not a or not b or a.keys() != b.keys():
        return None
    key = next(iter(a))
    if key in ("content", "reasoning_content"):
        return {key: a[key] + b[key]}
    if key == "tool_calls":
        x, y = a[key][0], b[key][0]
        if x["index"] == y["index"] and "id" not in y:
            return {key: [{**x, "function": {**x["function"], "arguments": x["function"]["arguments"]
                                             + y["function"]["arguments"]}}]}
    return None


def _timings_text(t: dict | None) -> str:
    if not t:
        return ""
    parts = []
    for k, v in t.items():
        if isinstance(v, float):
            parts.append(f"{k} {v:.1f}")
        elif isinstance(v, (int, str)):
            parts.append(f"{k} {v}")
    return "; " + ", ".join(parts) if parts else ""


async def _send_json(send, status: int, body: dict, headers: dict | None = None):
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":"), default=_json_default).encode("utf-8")
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *extra]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


# ---------------------------------------------------------------------------------------------------------------------
# other routes


async def models(request: HttpRequest):
    s: ServeState = request.app.state.strata
    return _JSON(oa.models_list(s.names, s.created, s.max_context, s.vision))


async def model(request: HttpRequest):
    s: ServeState = request.app.state.strata
    mid = request.path_params["model_id"]
    s.check_model(mid)
    return _JSON(oa.model_card(mid, s.created, s.max_context, s.vision))


async def health(request: HttpRequest):
    s: ServeState = request.app.state.strata
    if s.scheduler_error is not None:
        return _JSON({"status": "error", "message": f"the scheduler stopped: {s.scheduler_error}"}, status_code=503)
    if s.startup_error is not None:
        return _JSON({"status": "error", "message": f"the model failed to start: {_describe(s.startup_error)}"},
                     status_code=503)
    if s.phase != "ready":
        return _JSON({"status": s.phase}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    return _JSON({"status": "ok"})


async def slots(request: HttpRequest):
    s: ServeState = request.app.state.strata
    if s.refresh is not None and s.scheduler is not None:
        await s.refresh()
    return _JSON(list(s.scheduler.slots()) if s.scheduler is not None else [])


async def metrics(request: HttpRequest):
    s: ServeState = request.app.state.strata
    if s.refresh is not None and s.scheduler is not None:
        await s.refresh()
    return Response(s.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


async def tokenize(request: HttpRequest):
    """llama.cpp's POST /tokenize: {"content", "add_special", "parse_special", "with_pieces"} -> {"tokens"}."""
    s: ServeState = request.app.state.strata
    body: oa.TokenizeRequest = await _body(request, oa.TokenizeRequest, s, generation=False)
    text = body.content
    _char_bound(s, len(text), "content")
    parse_special = body.parse_special is not False
    ids = await anyio.to_thread.run_sync(lambda: s.tokenizer.encode(text, add_special_tokens=bool(body.add_special),
                                                                     parse_special=parse_special))
    if body.with_pieces:
        tok = s.tokenizer
        return _JSON({"tokens": [{"id": i, "piece": tok.decode([i])} for i in ids]})
    return _JSON({"tokens": ids})


async def detokenize(request: HttpRequest):
    """llama.cpp's POST /detokenize: {"tokens"} -> {"content"}."""
    s: ServeState = request.app.state.strata
    body: oa.DetokenizeRequest = await _body(request, oa.DetokenizeRequest, s, generation=False)
    return _JSON({"content": await anyio.to_thread.run_sync(lambda: s.tokenizer.decode(body.tokens))})


async def props(request: HttpRequest):
    """llama.cpp's GET /props: the server's generation defaults, slots, model and chat template (and a layer split's
    stages)."""
    s: ServeState = request.app.state.strata
    c = s.config
    d = oa.Sampling()._replace(**s.sampling_defaults)
    out = {"default_generation_settings": {"n_ctx": s.max_context, "params": {
                "temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
                "presence_penalty": d.presence_penalty, "frequency_penalty": d.frequency_penalty,
                "repetition_penalty": d.repetition_penalty, "max_tokens": -1, "stop": [], "ignore_eos": False}},
           "total_slots": c.sched.parallel, "model_path": str(c.model.model), "model_alias": s.model_name,
           "served_model_names": list(s.names), "max_context": s.max_context, "status": s.phase,
           "modalities": {"vision": s.vision, "audio": False}, "build_info": f"strata {_version()}"}
    if s.control_vector:          # --control-vector: its files; a request's control_vector_scale multiplies it
        out["control_vector"] = {"files": [{"path": p, "scale": k} for p, k in cv_entries(c.model.control_vector)],
                                 "default_scale": 1.0}
    if s.scheduler is not None and (stages := s.scheduler.metrics().get("stages")):
        out["stages"] = stages           # a layer split: each stage's device, layers, cache counters, hand-off time
    tok = s.tokenizer
    if tok is not None:
        out.update(vocab_size=s.vocab_size, chat_template=tok.chat_template, bos_token=tok.bos_token,
                   eos_token=tok.eos_token)
    return _JSON(out)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("strata")
    except Exception:   # noqa: BLE001 - not installed (a source tree on the path)
        return "dev"


# (method, path, summary, body model): the routes /openapi.json describes; the OpenAI ones are also answered
# without /v1
API_ROUTES = [
    ("POST", "/v1/chat/completions", "Chat completion, streamed (SSE) or whole", "ChatRequest"),
    ("POST", "/v1/completions", "Text completion, streamed (SSE) or whole", "CompletionRequest"),
    ("GET", "/v1/models", "The served model names", None),
    ("GET", "/v1/models/{model_id}", "One served model", None),
    ("POST", "/tokenize", "Text to token ids (llama.cpp's server)", "TokenizeRequest"),
    ("POST", "/detokenize", "Token ids to text (llama.cpp's server)", "DetokenizeRequest"),
    ("GET", "/props", "Generation defaults, slots, model and chat template (llama.cpp's server)", None),
    ("GET", "/health", "200 when serving; 503 while loading, draining or stopped", None),
    ("GET", "/slots", "Each slot's state", None),
    ("GET", "/metrics", "Prometheus metrics", None),
    ("GET", "/openapi.json", "This document", None),
]


async def openapi(request: HttpRequest):
    return _JSON(oa.openapi("strata", _version(), API_ROUTES))


async def index(request: HttpRequest):
    s: ServeState = request.app.state.strata
    return _JSON({"name": "strata", "model": s.model_name, "max_context": s.max_context, "status": s.phase,
                  "routes": [f"{m} {p}" for m, p, _, _ in API_ROUTES]})


async def _http_exception(request: HttpRequest, exc: HTTPException):
    if exc.status_code == 404:
        msg = f"no route {request.url.path}; routes: /v1/chat/completions, /v1/completions, /v1/models, " \
              f"/tokenize, /detokenize, /props, /health, /slots, /metrics, /openapi.json"
        code = "not_found"
    elif exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow", "")
        msg = f"{request.method} is not allowed on {request.url.path}; use {allow or 'another method'}"
        code = "method_not_allowed"
    else:
        msg, code = str(exc.detail), None
    log.info("%d %s %s: %s", exc.status_code, request.method, request.url.path, msg)
    headers = dict(exc.headers or {})
    headers.update(await drain_body(request, request.app.state.strata.config.serve.max_body_bytes))
    return error_response(exc.status_code, msg, code=code, headers=headers)


# ---------------------------------------------------------------------------------------------------------------------
# gate: API key + per-route counts


class _Gate:
    """Pure ASGI middleware: the Bearer-key check (constant time; /health is open) and per-route request counts."""

    def __init__(self, app, state: ServeState):
        self.app, self.state = app, state
        key = state.config.serve.api_key
        self.key = key.encode() if key else None

    def _authorized(self, scope) -> bool:
        header = b""
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.strip().partition(b" ")
        ok_scheme = scheme.lower() == b"bearer"
        return hmac.compare_digest(token.strip() if ok_scheme else b"", self.key) and ok_scheme

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        status = [0]

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.key is not None and path != "/health" and not self._authorized(scope):
                log.info("401 %s %s: missing or wrong API key", scope.get("method"), path)
                self.state.metrics.rejected.labels("unauthorized").inc()
                drained = await drain_body(HttpRequest(scope, receive), self.state.config.serve.max_body_bytes)
                resp = error_response(401, "missing or wrong API key: send the header 'Authorization: Bearer "
                                           "<key>' with the key the server was started with (--api-key or "
                                           "STRATA_API_KEY)", code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer", **drained})
                await resp(scope, receive, counting_send)
                return
            await self.app(scope, receive, counting_send)
        finally:
            self.state.metrics.http_requests.labels(self.state.metrics.route_label(path), str(status[0] or 499)).inc()


# ---------------------------------------------------------------------------------------------------------------------
# the app


def create_app(engine, scheduler, config: Settings, *,
               load: Callable[[], tuple] | None = None,
               on_scheduler_exit: Callable[[], None] | None = None,
               on_ready: Callable[[], None] | None = None) -> Starlette:
    """The Starlette app serving `engine` through `scheduler`, or, with engine and scheduler None, what `load()`
    returns as (engine, scheduler), loaded in a worker thread once the app runs. Its lifespan starts that, then
    `scheduler.run` (warm-up included) and on_ready(), in the background: the app answers from the start (/health
    503 "loading" until the warm-up ends). state.drain() shuts it down gracefully."""
    state = ServeState(engine, scheduler, config, on_scheduler_exit)

    @asynccontextmanager
    async def lifespan(app):
        async with anyio.create_task_group() as tg:
            tg.start_soon(state.start, load, on_ready)
            try:
                yield
            finally:
                if state.phase != "draining":
                    state.phase = "stopped"
                tg.cancel_scope.cancel()

    routes = []
    for prefix in ("/v1", ""):                  # the OpenAI routes, with and without /v1
        routes += [
            Route(f"{prefix}/chat/completions", _api(chat_completions), methods=["POST"]),
            Route(f"{prefix}/completions", _api(completions), methods=["POST"]),
            Route(f"{prefix}/models", _api(models), methods=["GET"]),
            Route(f"{prefix}/models/{{model_id:path}}", _api(model), methods=["GET"]),
        ]
    routes += [
        Route("/tokenize", _api(tokenize), methods=["POST"]),
        Route("/detokenize", _api(detokenize), methods=["POST"]),
        Route("/props", _api(props), methods=["GET"]),
        Route("/health", _api(health), methods=["GET"]),
        Route("/slots", _api(slots), methods=["GET"]),
        Route("/metrics", _api(metrics), methods=["GET"]),
        Route("/openapi.json", _api(openapi), methods=["GET"]),
        Route("/", _api(index), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_exception})
    app.state.strata = state
    app.add_middleware(_Gate, state=state)
    origins = config.serve.cors_origins
    if origins:                                 # outermost: a preflight OPTIONS is answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["*"], max_age=600)
    return app
