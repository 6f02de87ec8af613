"""Run the app on hypercorn: `serve(config)` (async) and `serve_forever(config)` (the CLI's entry).

The listening socket is bound first, so a port that is taken is reported at once, and connections are accepted from
then on: the model loads and the scheduler warms up in the background while /health answers 503 "loading". SIGTERM or
SIGINT drains (app.ServeState.drain) before hypercorn stops; a second signal cuts the drain short.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import time
from typing import Awaitable, Callable

from strata.backend import compile_cache_backends, enable_compile_cache, resolve_backend
from strata.builtin import builtin_note
from strata.config import Settings
from strata.errors import StrataError

log = logging.getLogger("strata.serve")

STARTUP_TIMEOUT_S = 3600.0     # warm-up compiles every bucket; a large model on a slow machine takes minutes
GRACEFUL_TIMEOUT_S = 5.0       # after the drain, hypercorn gives open connections this long


class _Prefix(logging.Formatter):
    """`strata <component>: message`: strata.serve -> "strata serve: ", strata.sched -> "strata sched: "; a message
    that already names its component ("strata batch: ...") is left as it is."""

    def format(self, record: logging.LogRecord) -> str:
        msg = super().format(record)
        if msg.startswith("strata "):
            return msg
        parts = record.name.split(".")
        component = parts[1] if len(parts) > 1 and parts[0] == "strata" else parts[0]
        return f"strata {component}: {msg}"


def configure_logging(level: int = logging.INFO) -> None:
    """One line per event on stderr, prefixed by component ("strata serve: ..."), for every strata.* logger
    (idempotent)."""
    logger = logging.getLogger("strata")
    if not any(getattr(h, "_strata", False) for h in logger.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(_Prefix("%(message)s"))
        h._strata = True
        logger.addHandler(h)
    logger.setLevel(level)
    logger.propagate = False


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound (not yet listening) to host:port; StrataError naming the address when that fails."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StrataError(f"cannot listen on {host}:{port}: the host does not resolve ({e.strerror}); "
                          f"pass --host with an IP address such as 127.0.0.1") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise StrataError(f"cannot listen on {host}:{port}: {e.strerror or e}; pass another --port "
                          f"(or stop the other server)") from None
    return sock


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def hypercorn_config(sock: socket.socket):
    """A hypercorn Config serving on `sock` (which it takes over: the caller must not close it)."""
    from hypercorn.config import Config
    hc = Config()
    hc.bind = [f"fd://{sock.detach()}"]
    hc.startup_timeout = STARTUP_TIMEOUT_S
    hc.graceful_timeout = GRACEFUL_TIMEOUT_S
    hc.accesslog = None
    quiet = logging.getLogger("strata.serve.hypercorn")   # hypercorn's own lines: warnings and errors only
    quiet.setLevel(logging.WARNING)
    hc.errorlog = quiet
    hc.keep_alive_timeout = 75.0
    return hc


async def run_app(app, sock: socket.socket, shutdown_trigger: Callable[[], Awaitable[None]]) -> None:
    """Serve `app` on the bound socket until `shutdown_trigger()` returns; the lifespan runs around it."""
    from hypercorn.asyncio import serve as hypercorn_serve
    await hypercorn_serve(app, hypercorn_config(sock), shutdown_trigger=shutdown_trigger)


def check_device(config: Settings) -> None:
    """A device the backend does not have is a StrataError naming the flag and what there is (rather than the
    backend's own error from deep inside the load)."""
    device = config.backend.device
    if not isinstance(device, str) or resolve_backend(config.backend.backend) != "jax":
        return
    import jax
    try:
        jax.devices(device)
    except RuntimeError:
        have = sorted({d.platform for d in jax.devices()})
        raise StrataError(f"--device {device} is not a device of this machine's jax backend (it has: "
                          f"{', '.join(have)}); pass --device {have[0]} or leave --device out (`strata doctor` "
                          f"lists the devices)") from None


def command_buffer_mode(config: Settings) -> tuple[str, str]:
    """The command-buffer update mode the server sets, and why when it is not the configured one: the KV's host
    tier (kv_resident) needs pinned host memory, which skip_temp's allocator leaves none of."""
    if config.model.kv_resident and config.backend.command_buffer_update != "xla_default":
        return "xla_default", " (kv_resident needs pinned host memory)"
    return config.backend.command_buffer_update, ""


def load_model(config: Settings, ready_hooks: list | None = None) -> tuple:
    """Load the model and build its scheduler: -> (engine, scheduler), for the app's lifespan (here, and in each
    Ray Serve engine replica). ready_hooks gets the compile cache's report, to call once the warm-up is done."""
    from strata.engine import Engine
    if note := builtin_note(config.model.model):
        log.info(note)
    if config.backend.backend in ("jax", "auto"):          # before JAX makes its GPU client
        from strata.jax_backend.xla_flags import command_buffer_update
        mode, why = command_buffer_mode(config)
        log.info(command_buffer_update(mode) + why)
    backend = resolve_backend(config.backend.backend)      # "auto" imports JAX to look
    check_device(config)
    if config.serve.compile_cache:
        hook = _compile_cache(backend, config.serve.compile_cache)
        if hook is not None and ready_hooks is not None:
            ready_hooks.append(hook)
    t0 = time.perf_counter()
    engine = Engine.load(settings=config.with_values({"backend": backend}))
    if engine.tokenizer is None:
        raise StrataError(f"{config.model.model} has no tokenizer.json beside it; strata serve needs one to render "
                          f"chat prompts")
    log.info("model %s loaded in %.0f ms (%s, %d layers, %d experts, %s)", config.model_name,
             (time.perf_counter() - t0) * 1000, engine.cfg.model_type, engine.cfg.num_layers,
             engine.cfg.num_experts, engine.dtype)
    return engine, scheduler_for(engine, config.sched, engine.settings.model.max_context)


def scheduler_for(engine, sched, max_context: int):
    """The server's Scheduler over a WindowRunner of `engine` (its Executor; the server owns the engine), from the
    scheduler settings (SchedSettings) and the model's values."""
    from strata.engine.runner import WindowRunner
    from strata.sched.guard import Guard
    from strata.sched.scheduler import Scheduler
    runner = WindowRunner(engine, sched.parallel, sched.prefill)
    return Scheduler(runner, tokenizer=engine.tokenizer, eos_token_ids=engine.eos_token_ids,
                     queue_limit=sched.queue_limit, lookahead=sched.lookahead, max_context=max_context,
                     window_tokens=sched.window_tokens, prompt_share=sched.prompt_share,
                     checkpoint_every=sched.checkpoint_tokens, checkpoint_ram_gib=sched.checkpoint_ram_gib,
                     guard=Guard(runner.numerics, sched.guard_storm, sched.guard_storm_seconds), warm_up=sched.warm_up)


async def serve(config: Settings, shutdown_event: asyncio.Event | None = None,
                hurry_event: asyncio.Event | None = None) -> int:
    """Listen, then load the model, build the scheduler and warm it up in the background; serve until
    `shutdown_event` is set (SIGINT/SIGTERM set it when run through serve_forever), drain, stop. Returns the exit
    code: 0 after a shutdown, 1 when the scheduler stopped; a model that fails to load or warm up is a StrataError."""
    from strata.serve.app import create_app
    try:
        from strata.sched.guard import Guard
        from strata.sched.scheduler import Scheduler
    except ImportError as e:
        raise StrataError(f"the scheduler is not available in this build ({e})") from None

    shutdown_event = shutdown_event or asyncio.Event()
    sock = bind_socket(config.serve.host, config.serve.port)
    ready_hooks: list[Callable[[], None]] = []

    def load():
        return load_model(config, ready_hooks)

    try:
        url = socket_url(sock)
        failed = []

        def on_scheduler_exit():
            failed.append(True)
            shutdown_event.set()

        app = create_app(None, None, config, load=load, on_scheduler_exit=on_scheduler_exit,
                         on_ready=lambda: [hook() for hook in ready_hooks])
        state = app.state.strata
        names = config.served_names
        log.info("serving %s on %s: %d parallel, prompt parts of %d tokens, max_context %s, queue limit %d, "
                 "bodies up to %d bytes, API key %s%s (loading; /health answers 503 until ready)", config.model_name,
                 url, config.sched.parallel, config.sched.prefill, config.model.max_context, config.sched.queue_limit,
                 config.serve.max_body_bytes, "required" if config.serve.api_key else "off",
                 f", also named {', '.join(names[1:])}" if len(names) > 1 else "")
        if config.serve.host not in ("127.0.0.1", "localhost", "::1") and not config.serve.api_key:
            log.warning("listening on %s without an API key: anyone who can reach this address can use the model "
                        "(pass --api-key or set STRATA_API_KEY)", config.serve.host)
        stop = asyncio.Event()

        async def lifecycle():
            await shutdown_event.wait()
            if not failed:
                hurry = hurry_event or asyncio.Event()
                log.info("shutting down: draining for up to %g s (a second signal ends the running requests now)",
                         config.serve.drain_timeout)
                await state.drain(config.serve.drain_timeout, hurry)
            stop.set()

        watcher = asyncio.ensure_future(lifecycle())
        try:
            await run_app(app, sock, stop.wait)
        finally:
            sock = None                        # hypercorn owns (and closed) it
            watcher.cancel()
        error = state.startup_error
        if error is not None:                  # already logged; one line for the CLI
            if isinstance(error, StrataError):
                raise error
            raise StrataError(f"the model failed to start: {type(error).__name__}: {error}") from None
        log.info("stopped")
        return 1 if failed else 0
    finally:
        if sock is not None:
            sock.close()


def _compile_cache(backend: str, path: str) -> Callable[[], None] | None:
    """Enable the backend's persistent compilation cache before anything compiles (strata/backend.py) and log what
    it holds. -> the callback that logs, once the warm-up is done, how many compilations it served; None (after a
    warning) when the backend has no such cache."""
    if backend not in compile_cache_backends():
        log.warning("compile_cache = %s is unused: the %s backend has no persistent compilation cache "
                    "(backends with one: %s)", path, backend, ", ".join(compile_cache_backends()))
        return None
    cache = enable_compile_cache(backend, path)
    log.info("compile cache %s: %d entries, %.1f MB before start-up", cache.path, cache.entries, cache.bytes / 1e6)

    def on_ready():
        hits, requests = cache.stop()
        log.info("compile cache: %d of %d compilations at start-up loaded from %s", hits, requests, cache.path)
    return on_ready


# The device work runs in a worker thread while the event loop streams text: with CPython's default GIL switch
# interval (sys.getswitchinterval() = 0.005), a worker that needs the GIL back can wait that long behind the loop,
# once or twice per window.
GIL_SWITCH_INTERVAL_S = 0.0005


def serve_forever(config: Settings) -> int:
    """Run `serve` until SIGINT or SIGTERM; -> the exit code."""
    configure_logging()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)

    async def main() -> int:
        event, hurry = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal():
            (hurry if event.is_set() else event).set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, on_signal)
            except (NotImplementedError, RuntimeError):
                pass
        return await serve(config, event, hurry)

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return 130
    except StrataError:
        raise
    except Exception as e:   # e.g. the scheduler's warm-up failed during the lifespan start-up
        log.error("stopped: %s: %s", type(e).__name__, e)
        log.debug("traceback", exc_info=e)
        return 1
