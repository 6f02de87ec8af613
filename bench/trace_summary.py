"""Where a compiled call spends its time: run it under the JAX profiler and summarise the Perfetto trace.

    from trace_summary import trace_summary
    print_summary(trace_summary(lambda: step().block_until_ready()))

Per thread of the trace (host threads, and on a GPU each stream): the span from its first to its last event, the
time it was busy (the union of its events), and its busiest event names with their count and total milliseconds.
On a GPU the gap between span and busy on the compute stream is time the device waited (for the host, a sync, a copy).
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import tempfile


def _busy_ms(intervals: list) -> float:
    """Total length of the union of [start, end) intervals (microseconds in, milliseconds out)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1000


def traced_events(fn) -> list | dict:
    """fn is run once untimed, then once under the profiler -> the trace's complete events, each
    {"thread": "process / thread", "name", "ts", "dur" (us), "args"}, or {"error": ...} when the profiler is not
    available here."""
    import jax
    try:
        fn()
        d = tempfile.mkdtemp()
        with jax.profiler.trace(d, create_perfetto_trace=True):
            fn()
        path = glob.glob(os.path.join(d, "**", "*perfetto_trace.json.gz"), recursive=True)[0]
        with gzip.open(path) as f:
            events = json.load(f)
    except Exception as e:                       # noqa: BLE001 - a summary of why, not a failed bench
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    events = events["traceEvents"] if isinstance(events, dict) else events
    proc, thread = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            proc[e.get("pid")] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[(e.get("pid"), e.get("tid"))] = e["args"]["name"]
    return [{"thread": f"{proc.get(e.get('pid'), e.get('pid'))} / {thread.get((e.get('pid'), e.get('tid')), e.get('tid'))}",
             "name": e["name"], "ts": float(e["ts"]), "dur": float(e.get("dur", 0)), "args": e.get("args", {})}
            for e in events if e.get("ph") == "X"]


def trace_summary(fn, top: int = 12) -> dict:
    """fn is run once untimed, then once under the profiler. -> {thread: {span_ms, busy_ms, events, top}}, or
    {"error": ...} when the profiler is not available here."""
    events = traced_events(fn)
    if isinstance(events, dict):
        return events
    per: dict = {}
    for e in events:
        a, b = e["ts"], e["ts"] + e["dur"]
        t = per.setdefault(e["thread"], {"intervals": [], "names": {}})
        t["intervals"].append((a, b))
        n = t["names"].setdefault(e["name"][:70], [0, 0.0])
        n[0] += 1
        n[1] += (b - a) / 1000
    out = {}
    for key, t in per.items():
        iv = t["intervals"]
        names = sorted(t["names"].items(), key=lambda kv: -kv[1][1])[:top]
        out[key] = {"span_ms": round((max(b for _, b in iv) - min(a for a, _ in iv)) / 1000, 3),
                    "busy_ms": round(_busy_ms(iv), 3), "events": len(iv),
                    "top": [[n, c, round(ms, 3)] for n, (c, ms) in names]}
    return out


def print_summary(summary: dict, min_span_ms: float = 0.2) -> None:
    if "error" in summary:
        print(f"trace: {summary['error']}")
        return
    for key, t in summary.items():
        if t["span_ms"] < min_span_ms:
            continue
        print(f"trace {key}: span {t['span_ms']:.2f} ms, busy {t['busy_ms']:.2f} ms, {t['events']} events")
        for name, count, ms in t["top"]:
            print(f"    {ms:9.3f} ms {count:6d}x  {name}")
