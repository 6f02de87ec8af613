"""JAX's persistent compilation cache for `strata serve` (config key `compile_cache`): every compiled window and
prompt-part bucket is written to a directory, and a restart with the same model, shapes and JAX version loads it
instead of compiling again (the warm-up compiles every bucket before the server accepts requests: tens of seconds
at real shapes). JAX keys each entry by the computation, its shapes, the backend and the compiler version, so a
changed model or JAX compiles afresh; nothing stale is loaded.

The cache is process-wide state in JAX: the server enables it once (open_cache, through strata/backend.py), before
anything compiles; CacheCounter counts what JAX reports (compilations that asked the cache, and hits) for its log.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from strata.errors import ConfigError

# compilations faster than this are not written (JAX's default jax_persistent_cache_min_compile_time_secs is 1; a
# window's compile at real shapes takes seconds, the demo model's tens of milliseconds, which a cache read would not
# beat by much)
MIN_COMPILE_S = 0.1


def enable(path: str) -> dict:
    """Point JAX's persistent compilation cache at `path` (created if missing). -> {"path", "entries", "bytes"}: what
    the directory already holds. Raises ConfigError naming the directory when it cannot be created or written."""
    import jax
    p = Path(path).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"compile_cache = {path!r}: the directory cannot be created ({e.strerror}); "
                          f"compile_cache must be a writable directory") from None
    if not p.is_dir() or not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(f"compile_cache = {path!r} is not a writable directory; compile_cache must be one")
    jax.config.update("jax_compilation_cache_dir", str(p))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    files = [f for f in p.rglob("*") if f.is_file()]
    return {"path": str(p), "entries": len(files), "bytes": sum(f.stat().st_size for f in files)}


class CacheCounter:
    """Counts JAX's compilation-cache events from start() to stop(): `requests` (compilations that asked the cache)
    and `hits` (loaded from it)."""

    EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
              "/jax/compilation_cache/cache_hits": "hits"}

    def __init__(self):
        self.requests = 0
        self.hits = 0

    def _on_event(self, event: str, **kwargs) -> None:
        name = self.EVENTS.get(event)
        if name is not None:
            setattr(self, name, getattr(self, name) + 1)

    def start(self) -> "CacheCounter":
        import jax.monitoring
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def stop(self) -> None:
        import jax.monitoring
        jax.monitoring.unregister_event_listener(self._on_event)


@dataclass
class PersistentCache:
    """JAX's persistent compilation cache as the server holds it (strata/backend.py CompileCache)."""
    path: str
    entries: int                 # files the directory held before start-up
    bytes: int
    counter: CacheCounter

    def stop(self) -> tuple[int, int]:
        """Stop counting -> (compilations loaded from the cache, compilations that asked it)."""
        self.counter.stop()
        return self.counter.hits, self.counter.requests


def open_cache(path: str) -> PersistentCache:
    """enable(path), and count from now on what the cache serves."""
    return PersistentCache(**enable(path), counter=CacheCounter().start())
