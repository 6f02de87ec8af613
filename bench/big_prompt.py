"""A long prompt beside a stream: `strata serve` (demo, CPU) in its own process; one stream decodes while a big chat
request arrives; reports the stream's largest gap between chunks, how long the big request took and what it got, and
the server's resident memory before, at the peak and after.

    python bench/big_prompt.py                       # a 16 MB prompt (refused before tokenizing) and a 600 kB one
    python bench/big_prompt.py --chars 16000000 --max-context 65536
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def run(url: str, pid: int, chars: int, max_context: int) -> dict:
    gaps, peak = [], [rss_mb(pid)]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak.append(rss_mb(pid))
            time.sleep(0.05)

    def stream():
        with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/completions", json={
                "prompt": "x", "max_tokens": max_context - 8, "ignore_eos": True, "stream": True, "temperature": 0.7}) as r:
            last = None
            for line in r.iter_lines():
                now = time.perf_counter()
                if line.startswith("data: "):
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                if stop.is_set():
                    break

    before = rss_mb(pid)
    threads = [threading.Thread(target=watch), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    text = ("lorem ipsum dolor sit amet, " * (chars // 28 + 1))[:chars]
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "user", "content": text}], "max_tokens": 1})
    took = time.perf_counter() - t0
    del text
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(600)
    time.sleep(0.5)
    return {"chars": chars, "status": r.status_code, "answer": r.text[:120], "seconds": round(took, 2),
            "largest_gap_ms": round(max(gaps) * 1000), "rss_mb_before": round(before),
            "rss_mb_peak": round(max(peak)), "rss_mb_after": round(rss_mb(pid))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, nargs="*", default=[16_000_000, 600_000])
    ap.add_argument("--max-context", type=int, default=65536)
    args = ap.parse_args()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.Popen([sys.executable, "-m", "strata.cli", "serve", "--port", "0", "--parallel", "2",
                          "--prefill", "512", "--max-context", str(args.max_context), "--max-body-bytes",
                          str(64 << 20)], stderr=subprocess.PIPE, text=True, env=env)
    url = None
    for line in p.stderr:
        url = url or (m := re.search(r"on (http://\S+):", line)) and m.group(1)
        if "ready:" in line:
            break
    threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
    try:
        for chars in args.chars:
            print(run(url, p.pid, chars, args.max_context), flush=True)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(60)


if __name__ == "__main__":
    main()
