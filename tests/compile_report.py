"""A pytest plugin that says where the suite's time goes: per test (setup, call and teardown together), its wall time
and the seconds JAX spent tracing, lowering and compiling, with the number of compilations and persistent-cache hits.
On when STRATA_TEST_COMPILE_REPORT names a file: each xdist worker appends JSON lines to FILE.<worker>; summarize them
with `python tests/compile_report.py FILE` (per file, slowest first); `--write` also records each file's seconds in
tests/file_seconds.json, which orders the suite's files (tests/conftest.py); `--json OUT --cache empty|warm
--pytest-s S` writes the per-file sums with the machine, date, commit and pytest's own time, for bench/results/."""
from __future__ import annotations

import argparse
import collections
import datetime
import glob
import json
import os
import platform
import subprocess
import sys
import time

import pytest

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "compile_s"}


class CompileReport:
    def __init__(self, path: str):
        self.path = path
        self.totals: collections.Counter = collections.Counter()
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)

    def _duration(self, event: str, secs: float, **_kw) -> None:
        if event in EVENTS:
            self.totals[EVENTS[event]] += secs
            self.totals["compiles"] += EVENTS[event] == "compile_s"

    def _event(self, event: str, **_kw) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.totals["cache_hits"] += 1

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before, t0 = self.totals.copy(), time.perf_counter()
        yield
        row = {"test": item.nodeid, "wall_s": round(time.perf_counter() - t0, 3)}
        for key in ("trace_s", "lower_s", "compile_s", "compiles", "cache_hits"):
            value = self.totals[key] - before[key]
            row[key] = round(value, 3) if isinstance(value, float) else value
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{self.path}.{worker}", "a") as f:
            f.write(json.dumps(row) + "\n")


def pytest_configure(config):
    path = os.environ.get("STRATA_TEST_COMPILE_REPORT")
    if path and not config.pluginmanager.has_plugin("strata-compile-report"):
        config.pluginmanager.register(CompileReport(path), "strata-compile-report")


def summarize(path: str, write: bool = False, json_out: str | None = None, cache: str | None = None,
              pytest_s: float | None = None) -> None:
    per_file: dict = collections.defaultdict(collections.Counter)
    for name in glob.glob(path + ".gw*") + glob.glob(path + ".main"):
        for line in open(name):
            row = json.loads(line)
            counter = per_file[row["test"].split("::")[0]]
            counter["tests"] += 1
            for key, value in row.items():
                if key != "test":
                    counter[key] += value
    total = collections.Counter()
    print(f"{'file':58s} {'tests':>5s} {'wall s':>8s} {'compile':>8s} {'trace':>7s} {'lower':>7s} {'#comp':>6s} "
          f"{'hits':>6s}")
    for name, c in sorted(per_file.items(), key=lambda kv: -kv[1]["wall_s"]):
        total.update(c)
        print(f"{name:58s} {c['tests']:5d} {c['wall_s']:8.1f} {c['compile_s']:8.1f} {c['trace_s']:7.1f} "
              f"{c['lower_s']:7.1f} {c['compiles']:6d} {c['cache_hits']:6d}")
    print(f"{'total':58s} {total['tests']:5d} {total['wall_s']:8.1f} {total['compile_s']:8.1f} {total['trace_s']:7.1f} "
          f"{total['lower_s']:7.1f} {total['compiles']:6d} {total['cache_hits']:6d}")
    if json_out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        rounded = lambda c: {k: round(v, 2) if isinstance(v, float) else v for k, v in c.items()}  # noqa: E731
        result = {"bench": "test_suite", "machine": f"cpu:{platform.machine()} x{os.cpu_count()} ({platform.node()})",
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "commit": commit, "cache": cache, "pytest_wall_s": pytest_s, "total": rounded(total),
                  "files": {n: rounded(c) for n, c in sorted(per_file.items(), key=lambda kv: -kv[1]["wall_s"])}}
        with open(json_out, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")
    if write:
        seconds = {name: round(c["wall_s"], 1) for name, c in sorted(per_file.items())}
        out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_seconds.json")
        with open(out, "w") as f:
            f.write(json.dumps(seconds, indent=0) + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Sum a STRATA_TEST_COMPILE_REPORT run per test file.")
    ap.add_argument("report", help="the FILE given as STRATA_TEST_COMPILE_REPORT (its FILE.gw* parts are read)")
    ap.add_argument("--write", action="store_true", help="record each file's seconds in tests/file_seconds.json")
    ap.add_argument("--json", metavar="OUT", help="write the sums as a bench/results file")
    ap.add_argument("--cache", choices=("empty", "warm"), help="with --json: the compile cache the run started with")
    ap.add_argument("--pytest-s", type=float, help="with --json: pytest's own wall time for the run, in seconds")
    a = ap.parse_args()
    summarize(a.report, write=a.write, json_out=a.json, cache=a.cache, pytest_s=a.pytest_s)
