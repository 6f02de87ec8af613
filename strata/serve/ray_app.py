"""Strata on Ray Serve (pip install strata[ray]): an OpenAI ingress in front of a deployment of engine replicas.

The ingress is serve/app.py's own app (routes, validation, tokenizing, SSE) over a RemoteScheduler: a Request goes
to the engine deployment through a streaming handle routed by serve/ray_router.py, and its events come back as they
are made. Each EngineReplica is one engine, scheduler and prompt cache (server.load_model) on its own GPUs.
Responses name their replica (x-strata-replica); /metrics and /slots ask every replica at the scrape (a bounded wait
each): counters labelled replica="<name>", strata_replica_up, the router's decisions. A replica that dies before a
request's first token: the request is retried on another; mid-stream: an error chunk, the error object and [DONE].
    serve run configs/ray_serve.yaml          # import_path strata.serve.ray_app:build
    strata serve --replicas 2                 # a local Ray instance: serve_ray(settings)
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import signal
import threading
from collections import OrderedDict, defaultdict
from dataclasses import replace
from typing import Any

import anyio
import ray
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig

from strata.config import KEYS, SPECS, Faults, Settings, load_settings
from strata.errors import StrataError
from strata.sched.request import Delta, Failed, Finished, QueueFull, Request
from strata.serve.app import create_app, scheduler_families
from strata.serve.server import configure_logging, load_model

log = logging.getLogger("strata.serve")

HEADER = "x-strata-replica"
RETRIES = 2                    # replicas tried in turn for a request that got no token before its replica died
KNOWN = 4096                   # request ids whose replica is remembered for their response headers
SURVEY_TIMEOUT_S = 5.0         # how long /metrics and /slots wait for a replica before reporting it as not answering
# Serve's room for calls beyond parallel + queue_limit, so that a replica whose scheduler queue is full still answers
# the ingress's survey; a generation that takes it meets the full queue: a 503 queue_full, as from one server
SURVEY_ROOM = 4
DEATHS = (RayActorError, ActorDiedError, ActorUnavailableError)


def flat(settings: Settings, leave: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every setting by key but the groups in `leave`, as Settings.with_values takes them (what crosses to the
    deployments)."""
    return {key: getattr(getattr(settings, SPECS[key].group), key) for key in KEYS if SPECS[key].group not in leave}


class EngineReplica:
    """One engine, its scheduler and its prompt cache; `generate` streams a request's events in batches."""

    async def __init__(self, values: dict, faults: Faults | None = None):
        configure_logging()
        self.config = replace(Settings().with_values(values), faults=faults or Faults())
        ctx = serve.get_replica_context()
        self.name = ctx.replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()
        hooks: list = []
        self.engine, self.scheduler = await anyio.to_thread.run_sync(lambda: load_model(self.config, hooks))
        self.error: str | None = None
        self._grammars = None
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._task = asyncio.ensure_future(self._run(ready))
        await ready
        for hook in hooks:
            hook()
        log.info("replica %s ready (pid %d)", self.name, os.getpid())

    async def _run(self, ready: asyncio.Future):
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.scheduler.run)
                ready.set_result(None)
            self.error = "the scheduler's run() returned"
        except BaseException as e:  # noqa: BLE001 - kept for check_health, which makes Serve restart the replica
            self.error = f"{type(e).__name__}: {e}"
            log.error("replica %s: the scheduler stopped: %s", self.name, self.error)
            if not ready.done():
                ready.set_exception(e)

    def max_context(self) -> int:
        """The context this replica's engine holds: the setting, or what its memory plan made of "auto"."""
        return int(self.scheduler.max_context)

    async def snapshot(self, replica: str | None = None, replicas: list | None = None) -> dict:
        """The ingress's survey (/metrics, /slots): this replica's name, process, scheduler counters and slots now,
        and `replicas` (every replica's name, which the router wrote in) passed back."""
        return {"replica": self.name, "pid": os.getpid(), "node": self.node, "replicas": list(replicas or []),
                "metrics": dict(self.scheduler.metrics()), "slots": list(self.scheduler.slots())}

    def _fault_exit(self, path: str) -> None:
        try:
            os.unlink(path)                     # only the replica that removes the file dies, and only once
        except FileNotFoundError:
            return
        log.warning("replica %s: fault_replica_exit: killing this process before the reply's first token", self.name)
        os.kill(os.getpid(), signal.SIGKILL)

    def check_health(self):
        """Serve's health check: a replica whose scheduler stopped is restarted."""
        if self.error is not None:
            raise RuntimeError(f"the scheduler stopped: {self.error}")

    def _constraint(self, lark: str):
        from strata.serve.grammar import Constraint, Grammars
        if self._grammars is None:
            self._grammars = Grammars(self.engine.tokenizer, int(self.engine.cfg.vocab_size),
                                      self.engine.eos_token_ids)
        return Constraint(self._grammars.tok, lark, self._grammars.vocab)

    async def generate(self, req: Request, lark: str | None = None, routing: str = "affinity",
                       route: dict | None = None):
        """Batches of events; the first batch starts with a dict naming this replica and the route (the router's
        decision; `routing` is the policy the router was asked for)."""
        route = dict(route or {})
        if route.get("first", self.name) != self.name:
            route["kind"] = "fallback"          # Serve passed over the router's first choice (its queue was full)
        head = {"replica": self.name, "pid": os.getpid(), "node": self.node, "route": route.get("kind", "")}
        if lark is not None:
            req = replace(req, constraint=await anyio.to_thread.run_sync(lambda: self._constraint(lark)))
        try:
            events = self.scheduler.submit(req)
        except QueueFull as e:
            yield [head, Failed(f"{e} (replica {self.name})", 503, "queue_full")]
            return
        except ValueError as e:
            yield [head, Failed(f"the request cannot be run: {e}", 400)]
            return
        finished, ended = 0, False
        try:
            yield [head]
            if self.config.faults.replica_exit is not None:
                self._fault_exit(self.config.faults.replica_exit)
            async with events:
                async for ev in events:
                    batch = [ev]
                    while not isinstance(batch[-1], Failed):
                        try:
                            batch.append(events.receive_nowait())
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                    finished += sum(isinstance(e, Finished) for e in batch)
                    ended = isinstance(batch[-1], Failed) or finished >= req.n
                    yield batch
                    if ended:
                        return
        finally:
            if not ended:
                self.scheduler.cancel(req.id)


class RemoteScheduler:
    """What app.py asks of a scheduler (submit, cancel, run, drain, abort, slots, metrics, max_context), carried out
    by the engine deployment through a streaming handle."""

    def __init__(self, handle, max_context: int | str, routing: str):
        self.engine = handle
        self.handle = handle.options(stream=True)
        self.max_context, self.routing = max_context, routing     # "auto" until resolve_context()
        self.served: OrderedDict[str, str] = OrderedDict()      # request id -> replica
        self.known: set[str] = set()                             # the replicas the next survey asks first
        self.surveyed: dict[str, dict | None] = {}               # the last survey: replica -> its snapshot or None
        self.per_replica: dict[str, int] = defaultdict(int)
        self.routes: dict[str, int] = defaultdict(int)
        self.deaths = self.retried = 0
        self._live: dict[str, anyio.CancelScope] = {}
        self._tg = None

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED):
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            await anyio.sleep_forever()

    def submit(self, req: Request):
        send, receive = anyio.create_memory_object_stream(float("inf"))
        self._tg.start_soon(self._pump, req, send)
        return receive

    def cancel(self, request_id: str) -> None:
        scope = self._live.get(request_id)
        if scope is not None:
            scope.cancel()

    def drain(self, message: str) -> int:
        return 0                 # the replicas' queues drain with their replicas

    def abort(self) -> int:
        for scope in self._live.values():
            scope.cancel()
        return len(self._live)

    def resolve_context(self) -> int:
        """max_context as a number (app.py counts with it): the setting, or for "auto" what an engine replica's
        memory plan made of it. Blocks until a replica answers: call it from a worker thread."""
        if self.max_context == "auto":
            self.max_context = int(self.engine.max_context.remote().result())
        return self.max_context

    def slots(self) -> list[dict]:
        """Every slot of the last survey's replicas, each with its replica's name, node and process id."""
        return [{**s, "replica": name, "pid": snap["pid"], "node": snap["node"]}
                for name, snap in sorted(self.surveyed.items()) if snap is not None for s in snap["slots"]]

    async def survey(self) -> None:
        """Ask the replicas for their snapshots, all at once, each within SURVEY_TIMEOUT_S. The router writes the
        names of the replicas Serve runs into every answer: one not asked yet is asked in a second round, and a known
        one that is gone is dropped; a listed one that did not answer stays, as None."""
        got: dict[str, dict | None] = {}
        listed: set[str] | None = None
        targets: list = sorted(self.known) or [None]        # None: any replica (nothing known yet)
        for _ in range(2):
            answers = await self._ask_all(targets)
            for target, snap in zip(targets, answers):
                if snap is not None:
                    listed = set(snap["replicas"])
                    got[snap["replica"]] = snap
                elif target is not None:
                    got.setdefault(target, None)
            targets = sorted(listed - got.keys()) if listed is not None else []
            if not targets:
                break
        if listed is not None:              # else none answered: the same replicas are asked next time
            got = {name: snap for name, snap in got.items() if name in listed}
            self.known = set(got)
        self.surveyed = got

    async def _ask_all(self, targets: list) -> list:
        """The targets' snapshots (None: no answer), asked at once, each call in an empty context: a call made in an
        HTTP request's context carries that request's Serve id, under which Serve's router files pending calls, so
        concurrent calls of one request collide there (one of them is never sent)."""
        loop = asyncio.get_running_loop()
        return list(await asyncio.gather(*(loop.create_task(self._ask(t), context=contextvars.Context())
                                           for t in targets)))

    async def _ask(self, target: str | None) -> dict | None:
        response = self.engine.snapshot.remote(replica=target, replicas=None)
        with anyio.move_on_after(SURVEY_TIMEOUT_S):
            try:
                return await response
            except Exception as e:  # noqa: BLE001 - a replica that died or failed is reported, not raised
                log.warning("replica %s did not answer the ingress's survey: %s: %s", target, type(e).__name__, e)
                return None
        response.cancel()
        log.warning("replica %s did not answer the ingress's survey within %.0f s", target, SURVEY_TIMEOUT_S)
        return None

    def metrics(self) -> dict:
        return {}

    def headers(self, request_id: str) -> dict:
        name = self.served.get(request_id)
        return {HEADER: name} if name else {}

    def _note(self, req: Request, head: dict) -> None:
        name = head["replica"]
        self.known.add(name)
        self.served[req.id] = name
        while len(self.served) > KNOWN:
            self.served.popitem(last=False)
        self.per_replica[name] += 1
        if head["route"]:
            self.routes[head["route"]] += 1

    async def _pump(self, req: Request, send):
        constraint = req.constraint
        wire = replace(req, constraint=None)        # a compiled grammar stays here; the replica compiles its lark
        lark = constraint.lark if constraint is not None else None
        replica = None
        with anyio.CancelScope() as scope:
            self._live[req.id] = scope
            gen = None
            try:
                for attempt in range(RETRIES):
                    tokens = False
                    try:
                        gen = self.handle.generate.remote(wire, lark, routing=self.routing)
                        async for batch in gen:
                            for item in batch:
                                if isinstance(item, dict):
                                    replica = item["replica"]
                                    self._note(req, item)
                                    continue
                                tokens = tokens or isinstance(item, Delta)
                                await send.send(item)
                        gen = None
                        return
                    except DEATHS as e:
                        gen = None
                        self.deaths += 1
                        if not tokens and attempt + 1 < RETRIES:
                            self.retried += 1
                            log.warning("%s: replica %s died before the reply began (%s); retried on another",
                                        req.id, replica, type(e).__name__)
                            continue
                        log.warning("%s: replica %s died mid-stream: %s", req.id, replica, type(e).__name__)
                        await send.send(Failed(f"replica {replica} died while generating this reply ({type(e).__name__});"
                                               f" Ray restarts it: retry the request", 503, "replica_died"))
                        return
            finally:
                self._live.pop(req.id, None)
                if gen is not None:
                    gen.cancel()
                send.close()


class _RouteCollector:
    """The ingress's routing counters, read at scrape time."""

    def __init__(self, remote: RemoteScheduler):
        self.remote = remote

    def collect(self):
        r = self.remote
        c = CounterMetricFamily("strata_ray_requests", "Requests served, by engine replica", labels=["replica"])
        for name, n in sorted(r.per_replica.items()):
            c.add_metric([name], n)
        yield c
        c = CounterMetricFamily("strata_ray_routes", "Routing decisions: hit (the replica holding the prompt's "
                                "prefix), miss (no match long enough: least loaded), fallback (the match's replica "
                                "was overloaded), round_robin", labels=["kind"])
        for kind in ("hit", "miss", "fallback", "round_robin"):
            c.add_metric([kind], r.routes.get(kind, 0))
        yield c
        yield CounterMetricFamily("strata_ray_replica_deaths", "Streams whose engine replica died", value=r.deaths)
        yield CounterMetricFamily("strata_ray_retried", "Requests retried on another replica after theirs died "
                                  "before the reply began", value=r.retried)


class _ReplicaCollector:
    """Each replica's scheduler families from the last survey, every sample labelled with its replica, and whether
    each answered: in place of app.py's collector of a local scheduler."""

    def __init__(self, remote: RemoteScheduler):
        self.remote = remote

    def collect(self):
        up = GaugeMetricFamily("strata_replica_up", f"Whether the engine replica answered this scrape within "
                               f"{SURVEY_TIMEOUT_S:g} s (its other metrics are missing when not)", labels=["replica"])
        merged: dict[str, Metric] = {}              # one family a name, whatever the number of replicas
        for name, snap in sorted(self.remote.surveyed.items()):
            up.add_metric([name], 0.0 if snap is None else 1.0)
            if snap is None:
                continue
            for fam in scheduler_families(snap["metrics"], snap["slots"]):
                out = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
                out.samples += [s._replace(labels={"replica": name, **s.labels}) for s in fam.samples]
        yield up
        yield from merged.values()


@serve.ingress()
class Ingress:
    """serve/app.py's app over a RemoteScheduler of the engine deployment."""

    def __init__(self, engine, values: dict):
        configure_logging()
        self.config = Settings().with_values(values)
        self.engine_handle = engine

    def __serve_build_asgi_app__(self):
        config = self.config
        remote = RemoteScheduler(self.engine_handle, config.model.max_context, config.ray.routing)

        def load():
            from strata.engine.facts import model_facts
            remote.resolve_context()
            return model_facts(config), remote

        app = create_app(None, None, config, load=load)
        state = app.state.strata
        state.slot_count = config.sched.parallel
        state.response_headers = remote.headers
        state.done_after_error = True
        state.refresh = remote.survey
        state.metrics.registry.unregister(state.metrics.scheduler_collector)
        state.metrics.registry.register(_ReplicaCollector(remote))
        state.metrics.registry.register(_RouteCollector(remote))
        return app


def application(settings: Settings):
    """The Serve application: the ingress bound to `settings.ray.replicas` engine replicas with the affinity
    router."""
    r = settings.ray
    values = flat(settings)
    router = RequestRouterConfig(
        request_router_class="strata.serve.ray_router:AffinityRouter",
        request_router_kwargs={"block": r.affinity_block, "min_tokens": r.affinity_min_tokens,
                               "margin": r.affinity_margin, "capacity": r.affinity_blocks})
    engine = serve.deployment(EngineReplica, name="EngineReplica").options(
        num_replicas=max(1, r.replicas),
        max_ongoing_requests=settings.sched.parallel + settings.sched.queue_limit + SURVEY_ROOM,
        ray_actor_options={"num_gpus": r.gpus_per_replica, "num_cpus": r.cpus_per_replica},
        request_router_config=router, health_check_period_s=5, health_check_timeout_s=60,
        graceful_shutdown_timeout_s=settings.serve.drain_timeout)
    ingress = serve.deployment(Ingress, name="Ingress").options(
        num_replicas=1, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
    # the replicas are not given the ray group: a change of routing or replica count does not restart them
    return ingress.bind(engine.bind(flat(settings, leave=("ray",)), settings.faults), values)


def build(args: dict):
    """`serve run` / `serve deploy`'s application builder: args are Strata settings by key, and `config` (a TOML
    file of settings, the args on top of it)."""
    args = dict(args or {})
    return application(load_settings(args.pop("config", None), args))


def serve_ray(settings: Settings) -> int:
    """`strata serve --replicas N`: a local Ray instance (or settings.ray.ray_address's cluster) running the
    application on settings.serve.host:port until SIGINT or SIGTERM."""
    import ray
    configure_logging()
    r = settings.ray
    if r.ray_address:
        ray.init(address=r.ray_address, include_dashboard=False)
    else:
        ray.init(num_cpus=max(1, int(r.replicas * r.cpus_per_replica + 1)), include_dashboard=False,
                 object_store_memory=OBJECT_STORE_BYTES)
    # from before the deployment: a signal during serve.run stops the server once it is up, not with a traceback
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": settings.serve.host, "port": settings.serve.port})
        serve.run(application(settings), name="strata", route_prefix="/")
        log.info("serving %s on http://%s:%d through Ray Serve: %d engine replicas, routing %s",
                 settings.model_name, settings.serve.host, settings.serve.port, r.replicas, r.routing)
        stop.wait()
        log.info("shutting down")
        serve.shutdown()
        return 0
    except StrataError:
        raise
    finally:
        ray.shutdown()


OBJECT_STORE_BYTES = 128 << 20   # events are small; the object store only carries handles' results
