"""A pytest plugin that says where the suite's time goes: per test (setup, call and teardown together), its wall time
and the seconds JAX spent tracing, lowering and compiling, with the number of compilations and persistent-cache hits.
On when STRATA_TEST_COMPILE_REPORT names a file: each xdist worker appends JSON lines to FILE.<worker>; summarize them
with `python tests/compile_report.py FILE` (per file, slowest first); `--write` also records each file's seconds in
tests/file_seconds.json, which orders the suite's files (tests/conftest.py); `--json OUT` writes the per-file sums
with the machine, date and commit, for bench/results/."""
from __future__ import annotations

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
            if event.endswith("backend_compile_duration"):
                self.totals["compiles"] += 1

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


def summarize(path: str, write: bool = False, json_out: str | None = None) -> None:
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
        result = {"bench": "test_suite", "machine": f"cpu:{platform.machine()} x{os.cpu_count()} ({platform.node()})",
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "commit": commit, "total": dict(total), "files": {n: dict(c) for n, c in per_file.items()}}
        with open(json_out, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")
    if write:
        seconds = {name: round(c["wall_s"], 1) for name, c in sorted(per_file.items())}
        out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_seconds.json")
        with open(out, "w") as f:
            f.write(json.dumps(seconds, indent=0) + "\n")


if __name__ == "__main__":
    args = sys.argv[2:]
    summarize(sys.argv[1], write="--write" in args, json_out=args[args.index("--json") + 1] if "--json" in args else None)
