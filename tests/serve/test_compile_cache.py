"""compile_cache: `strata serve` with JAX's persistent compilation cache, as a user restarts it: the first start
writes the warm-up's compilations to the directory, the second loads them (its start-up log says how many) and
answers as the first did; a directory that cannot be used is refused with a message naming it, and a backend without
such a cache says so."""
from __future__ import annotations

import logging
import re

import httpx
import pytest

from servers import serve_command
from strata.backend import compile_cache_backends, enable_compile_cache
from strata.errors import ConfigError
from strata.jax_backend.compile_cache import enable
from strata.serve.server import _compile_cache

pytestmark = pytest.mark.heavy      # minutes on 2 CPU cores: started first (tests/conftest.py)

HI = [{"role": "user", "content": "Hi"}]


def _start(cache, cfg):
    """One start of the server: -> (entries before, hits, requests, the reply's text, log)."""
    with serve_command(["--config", str(cfg), "--compile-cache", str(cache)]) as sp:
        r = httpx.post(sp.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 8, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
    log = sp.rest                                # the cache's count is logged just after "ready"
    assert sp.rc == 0 and "Traceback" not in log, log
    before = re.search(r"compile cache (\S+): (\d+) entries", log)
    loaded = re.search(r"compile cache: (\d+) of (\d+) compilations at start-up loaded from (\S+)", log)
    assert before and loaded, log
    assert before.group(1) == loaded.group(3) == str(cache)
    return int(before.group(2)), int(loaded.group(1)), int(loaded.group(2)), text, log


def test_a_restart_loads_the_warm_ups_compilations(tmp_path):
    cfg = tmp_path / "s.toml"
    cfg.write_text('model = "demo"\nport = 0\nparallel = 1\nprefill = 64\nmax_context = 512\n')
    cache = tmp_path / "cache"
    entries, hits, requests, first, log = _start(cache, cfg)
    assert entries == 0 and hits == 0 and requests > 0, log
    written = [f for f in cache.rglob("*") if f.is_file()]
    assert written, "the first start wrote nothing to the cache"
    entries, hits, requests, second, log = _start(cache, cfg)
    assert entries == len(written), log
    assert hits > 0 and hits <= requests, log
    assert second == first                       # the loaded executables compute what the compiled ones did


def test_an_unusable_directory_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for path in (blocker, blocker / "below"):
        with pytest.raises(ConfigError, match=r"compile_cache = .*must be a writable directory"):
            enable(str(path))


def test_the_backends_declare_their_compile_caches(tmp_path, caplog):
    """The registry in strata/backend.py: jax has one; sycl has none, which enabling it says, and the server warns
    that the setting is unused and carries on."""
    assert compile_cache_backends() == ("jax",)
    with pytest.raises(ConfigError, match=r"compile_cache = .*: the sycl backend has no persistent compilation "
                                          r"cache \(backends with one: jax\)"):
        enable_compile_cache("sycl", str(tmp_path / "cache"))
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"compile_cache = .*must be a writable directory"):
        enable_compile_cache("jax", str(blocker))
    caplog.set_level(logging.WARNING, logger="strata.serve")
    assert _compile_cache("sycl", str(tmp_path / "cache")) is None
    warning = (f"compile_cache = {tmp_path / 'cache'} is unused: the sycl backend has no persistent compilation "
               f"cache (backends with one: jax)")
    assert caplog.messages == [warning]
    assert not (tmp_path / "cache").exists()
