"""N concurrent streaming clients against a Strata server: time to first token, per-client and aggregate tokens/s,
p50/p99 inter-token latency (over the whole load, and while every client streams: no prompt being read), and the
scheduler's own overhead per window (from /metrics: window wall time minus the
device calls inside it).

    python bench/serve_load.py --clients 1,2,4,8                      # starts `strata serve` on the demo model
    python bench/serve_load.py --base http://127.0.0.1:8080 ...       # an already running server

Writes JSON (machine, date, commit, figures per N) to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

import results_file  # bench/, beside this script

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, seconds: float) -> bool:
    """Wait until a started server's /health answers 200 (or `seconds` pass) -> False if the process exited first."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            return False
        time.sleep(0.5)
    return True


def metric_sums(text: str) -> dict[str, float]:
    """Every sample of the Prometheus text, by name (labels summed)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+eE\d.naNIf]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


async def one_client(client: httpx.AsyncClient, base: str, i: int, tokens: int, prompt_words: int) -> dict:
    # every client generates exactly `tokens` (ignore_eos: the random demo model would end at random moments)
    body = {"model": "default", "max_tokens": tokens, "stream": True, "temperature": 1.0, "seed": i,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"client {i}: " + "the heron waits by the pond " * prompt_words}]}
    t0 = time.perf_counter()
    stamps = []
    generated = 0
    async with client.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if ev.get("usage"):
                generated = ev["usage"]["completion_tokens"]
            for ch in ev.get("choices") or []:
                d = ch.get("delta") or {}
                if d.get("content") or d.get("reasoning_content"):
                    stamps.append(time.perf_counter())
    t1 = time.perf_counter()
    gaps = np.diff(stamps) * 1000 if len(stamps) > 1 else np.array([])
    # text events can carry several tokens (the server merges what is waiting): rates count tokens from usage
    return {"ttft_ms": (stamps[0] - t0) * 1000 if stamps else None, "tokens": generated, "seconds": t1 - t0,
            "tok_s": (generated - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0, "gaps_ms": gaps,
            "stamps": np.asarray(stamps)}


def steady(runs: list) -> dict:
    """While every client streams (from the last first text event to the first last one): tokens/s in all (each
    client's events in the span, times its tokens per event) and the p50/p99 gaps between text events there."""
    live = [r for r in runs if len(r["stamps"]) > 1]
    if len(live) < len(runs) or not live:
        return {}
    lo, hi = max(r["stamps"][0] for r in live), min(r["stamps"][-1] for r in live)
    if hi <= lo:
        return {}
    tokens, gaps = 0.0, []
    for r in live:
        st = r["stamps"]
        per_event = (r["tokens"] - 1) / (len(st) - 1)
        inside = (st > lo) & (st <= hi)
        tokens += per_event * int(inside.sum())
        gaps.append(np.diff(st[(st >= lo) & (st <= hi)]) * 1000)
    gaps = np.concatenate(gaps)
    return {"steady_seconds": hi - lo, "steady_tok_s": tokens / (hi - lo),
            "steady_inter_event_ms_p50": float(np.percentile(gaps, 50)) if gaps.size else None,
            "steady_inter_event_ms_p99": float(np.percentile(gaps, 99)) if gaps.size else None}


async def load(base: str, n: int, tokens: int, prompt_words: int) -> dict:
    async with httpx.AsyncClient() as client:
        before = metric_sums((await client.get(base + "/metrics")).text)
        t = time.perf_counter()
        runs = await asyncio.gather(*(one_client(client, base, i, tokens, prompt_words) for i in range(n)))
        wall = time.perf_counter() - t
        after = metric_sums((await client.get(base + "/metrics")).text)
    gaps = np.concatenate([r["gaps_ms"] for r in runs]) if runs else np.array([])
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    window = next((v for k, v in delta.items() if "window_seconds" in k and k.endswith("_sum")), None)
    device = next((v for k, v in delta.items() if "device_seconds" in k), None)
    parts = {part: next((v for k, v in delta.items() if f"window_{part}_seconds" in k), None)
             for part in ("plan", "apply", "handoff")}
    return {
        "clients": n,
        "ttft_ms_median": float(np.median([r["ttft_ms"] for r in runs if r["ttft_ms"] is not None])),
        "per_client_tok_s_median": float(np.median([r["tok_s"] for r in runs])),
        "aggregate_tok_s": sum(r["tokens"] for r in runs) / wall,
        "tokens": sum(r["tokens"] for r in runs),
        "inter_event_ms_p50": float(np.percentile(gaps, 50)) if gaps.size else None,
        "inter_event_ms_p99": float(np.percentile(gaps, 99)) if gaps.size else None,
        "window_seconds": window, "device_seconds": device,
        **{f"{part}_seconds": v for part, v in parts.items()},
        "scheduler_overhead_fraction": (1 - device / window) if window and device is not None else None,
        **steady(runs),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=None)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=40)
    ap.add_argument("--serve-args", default="", help="extra flags for the server this script starts")
    ap.add_argument("--server-log", default=None, help="the started server's stderr to this file (default: kept "
                    "in memory, printed if it fails to start)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    counts = [int(x) for x in args.clients.split(",")]
    proc = None
    base = args.base
    if base is None:
        port = free_port()
        cmd = [sys.executable, "-m", "strata.cli", "serve", "--model", args.model, "--port", str(port),
               "--parallel", str(max(counts)), "--queue-limit", str(4 * max(counts))] + args.serve_args.split()
        log = open(args.server_log, "w") if args.server_log else subprocess.PIPE      # a pipe nobody reads fills up
        proc = subprocess.Popen(cmd, cwd=ROOT, stderr=log, text=True)
        base = f"http://127.0.0.1:{port}"
        if not wait_healthy(base, proc, 600):
            print(proc.stderr.read() if proc.stderr else open(args.server_log).read(), file=sys.stderr)
            return 1
    results: list = []
    try:
        asyncio.run(load(base, 1, 8, 4))                          # warm every path once
        stamp = results_file.stamp()                              # (a small JAX context beside the server's)
        for n in counts:                                          # written after each count: a run cut off keeps them
            results.append(asyncio.run(load(base, n, args.tokens, args.prompt_words)))
            out = {"bench": "serve_load", **stamp, "model": args.model, "max_tokens": args.tokens,
                   "serve_args": args.serve_args, "results": results,
                   **{f"aggregate_tok_s_{r['clients']}_clients": r["aggregate_tok_s"] for r in results},
                   **{f"inter_event_ms_p99_{r['clients']}": r["inter_event_ms_p99"] for r in results},
                   **{f"steady_tok_s_{r['clients']}_clients": r.get("steady_tok_s") for r in results},
                   **{f"steady_inter_event_ms_p99_{r['clients']}": r.get("steady_inter_event_ms_p99")
                      for r in results}}
            platform = stamp["machine"].split(":")[0]
            results_file.write(out, args.out, f"serve_load_{args.model.replace(':', '_')}_{platform}")
    finally:
        if proc:
            proc.terminate()
            proc.wait(30)
    print("| clients | TTFT ms | per-client tok/s | aggregate tok/s | inter-event p50 ms | p99 ms | all streaming: "
          "tok/s, p99 ms | sched overhead | plan / apply / handoff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ov = r["scheduler_overhead_fraction"]
        both = (f"{r['steady_tok_s']:.1f}, {r['steady_inter_event_ms_p99']:.1f}" if r.get("steady_tok_s") else "")
        print(f"| {r['clients']} | {r['ttft_ms_median']:.0f} | {r['per_client_tok_s_median']:.1f} | "
              f"{r['aggregate_tok_s']:.1f} | {r['inter_event_ms_p50']:.1f} | {r['inter_event_ms_p99']:.1f} | {both} | "
              f"{'' if ov is None else f'{100 * ov:.1f}%'} | "
              + " / ".join("" if r[f"{p}_seconds"] is None or not r["window_seconds"] else
                           f"{100 * r[f'{p}_seconds'] / r['window_seconds']:.1f}%" for p in ("plan", "apply", "handoff"))
              + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
