"""Fair streams: what a prompt part costs the stream decoding beside it, and what each window token budget gives.

    XLA_FLAGS=--xla_cpu_multi_thread_eigen=false taskset -c 0 python bench/fair_streams.py     # demo, 16K prompt

(One core, one XLA thread: on a shared machine, XLA's threads on two cores wait for each other whenever another
process holds one of them, and a window's time then varies many times over.)

Window costs: WindowRunner windows of one decode row, alone and beside a prompt part of each compiled part size at
positions across the prompt; medians over interleaved rounds. Streams: the Scheduler (no HTTP) serves stream A alone,
then A while slot B reads the long prompt, under each --budgets value (window_tokens[/prompt_share]): A's tokens/s and
gaps during B's
read against A alone, and B's read time against B alone. Writes JSON (machine, date, commit, figures) to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import results_file  # noqa: E402  (bench/, beside this script)

ROOT = Path(__file__).resolve().parents[1]

from strata import Engine  # noqa: E402
from strata.engine.runner import WindowRunner  # noqa: E402
from strata.plan import PromptPart, idle_plan  # noqa: E402
from strata.sched.request import Delta, Request  # noqa: E402
from strata.sched.scheduler import Scheduler  # noqa: E402


SETTLE = 10        # stream A's texts before its rate alone is timed


def say(line: str) -> None:
    print(line, flush=True)


def window_costs(engine, prefill: int, prompt: int, rounds: int) -> dict:
    """Median wall ms of a window: one decode row alone, and beside a part of each compiled size (positions spread
    over the prompt; all interleaved round by round, so a slow spell of the machine touches every figure). The first
    run of each shape compiles it: its seconds are the warm-up's cost of that size."""
    runner = WindowRunner(engine, 2, prefill)
    base = idle_plan(2)
    decode = replace(base, decode_active=np.array([True, False]), decode_pos=np.array([16, 0], np.int32))
    plans = {"decode": [decode]}
    for size in runner.buckets():
        starts = np.linspace(0, prompt - size, 5).astype(int)
        plans[size] = [replace(decode, part=PromptPart(slot=1, tokens=np.ones(size, np.int32), start=int(s),
                                                       last=False)) for s in starts]
    first_s = {}
    for k, ps in plans.items():
        t = time.perf_counter()
        runner.run(ps[0])
        first_s[k] = time.perf_counter() - t
    times = {k: [] for k in plans}
    for _ in range(rounds):
        for k, ps in plans.items():
            for p in ps:
                t = time.perf_counter()
                runner.run(p)
                times[k].append(time.perf_counter() - t)
    ms = {k: 1000 * float(np.median(v)) for k, v in times.items()}
    low = {k: 1000 * float(np.min(v)) for k, v in times.items()}
    out = {"decode_ms": ms["decode"], "decode_ms_min": low["decode"], "decode_compile_s": first_s["decode"],
           "parts": []}
    say(f"  decode row alone: {ms['decode']:.1f} ms (compiled in {first_s['decode']:.1f} s)")
    for size in (k for k in plans if k != "decode"):
        out["parts"].append({"part_tokens": size, "window_ms": ms[size], "window_ms_min": low[size],
                             "compile_s": first_s[size],
                             "prompt_tok_s": size / (ms[size] / 1000),
                             "stream_rate_fraction": ms["decode"] / ms[size]})
        say(f"  part {size:4d}: window {ms[size]:7.1f} ms: the stream at {ms['decode'] / ms[size]:.2f} of its rate, "
            f"the prompt at {size / (ms[size] / 1000):.0f} tok/s (compiled in {first_s[size]:.1f} s)")
    return out


def streams(engine, prefill: int, budget: tuple, prompt_ids, a_prompt, a_tokens: int) -> dict:
    """Stream A alone for a_tokens texts, then B's prompt read while A decodes, under budget = (window_tokens,
    prompt_share)."""
    runner = WindowRunner(engine, 2, prefill)
    sched = Scheduler(runner, tokenizer=engine.tokenizer, eos_token_ids=engine.eos_token_ids, queue_limit=4,
                      max_context=engine.settings.model.max_context, window_tokens=budget[0],
                      prompt_share=budget[1], lookahead=True)
    ctx = engine.settings.model.max_context
    a = Request(id="A", prompt_ids=tuple(a_prompt), max_tokens=ctx - len(a_prompt), stop_token_ids=())
    b = Request(id="B", prompt_ids=tuple(prompt_ids), max_tokens=1, stop_token_ids=())
    out: dict = {}

    def generated():
        return next(s["generated"] for s in sched.slots() if s["request"] == "A")

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(sched.run)
            stamps: list[float] = []
            b_sent, b_done = anyio.Event(), anyio.Event()

            async def stream_a():
                async with sched.submit(a) as receive:
                    async for ev in receive:
                        if isinstance(ev, Delta):
                            stamps.append(time.perf_counter())
                            if len(stamps) in (SETTLE, a_tokens):        # A alone: from its SETTLE-th text on
                                out.setdefault("alone", []).append((generated(), stamps[-1]))
                            if len(stamps) == a_tokens:
                                b_sent.set()
                        if b_done.is_set():
                            break

            async def stream_b():
                await b_sent.wait()
                out["a_before"], t0 = generated(), time.perf_counter()
                out["b_sent"] = t0
                async with sched.submit(b) as receive:
                    async for ev in receive:
                        if isinstance(ev, Delta) and "b_first" not in out:
                            out["b_first"] = time.perf_counter()
                            out["a_after"] = generated()
                b_done.set()
                sched.cancel("A")
            tg.start_soon(stream_a)
            tg.start_soon(stream_b)
            await b_done.wait()
            await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
            out["stamps"] = stamps
    anyio.run(main)
    st = np.array(out.pop("stamps"))
    (g0, t0), (g1, t1) = out.pop("alone")
    alone = st[(st >= t0) & (st <= t1)]
    during = st[(st > out["b_sent"]) & (st <= out["b_first"])]
    read_s = out["b_first"] - out["b_sent"]
    res = {"window_tokens": budget[0], "prompt_share": budget[1], "window_part": sched.window_part,
           "a_alone_tok_s": (g1 - g0) / (t1 - t0),
           "a_during_read_tok_s": (out["a_after"] - out["a_before"]) / read_s,
           "b_read_s": read_s, "b_read_tok_s": len(prompt_ids) / read_s,
           "a_gap_ms_p50": 1000 * float(np.median(np.diff(during))) if len(during) > 1 else None,
           "a_gap_ms_p99": 1000 * float(np.percentile(np.diff(during), 99)) if len(during) > 1 else None,
           "a_gap_ms_alone_p50": 1000 * float(np.median(np.diff(alone)))}
    res["a_rate_fraction"] = res["a_during_read_tok_s"] / res["a_alone_tok_s"]
    m = sched.metrics()
    res["inter_token_ms_beside_parts_mean"] = (1000 * m["inter_token_seconds_beside_parts_sum"]
                                               / max(m["inter_tokens_beside_parts"], 1))
    say(f"  window_tokens {budget[0]}, prompt_share {budget[1]}: A {res['a_during_read_tok_s']:.1f} tok/s during "
        f"B's read, "
        f"{res['a_alone_tok_s']:.1f} alone ({res['a_rate_fraction']:.2f}), gaps p50 {res['a_gap_ms_p50']:.1f} / "
        f"p99 {res['a_gap_ms_p99']:.1f} ms; B read {len(prompt_ids)} tokens in {read_s:.2f} s")
    return res


def read_alone(engine, prefill: int, prompt_ids) -> float:
    """Seconds to the first token of the long prompt with nothing else running."""
    runner = WindowRunner(engine, 2, prefill)
    sched = Scheduler(runner, tokenizer=engine.tokenizer, eos_token_ids=engine.eos_token_ids, queue_limit=4,
                      max_context=engine.settings.model.max_context)
    b = Request(id="B", prompt_ids=tuple(prompt_ids), max_tokens=1, stop_token_ids=())
    box = {}

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(sched.run)
            t = time.perf_counter()
            async with sched.submit(b) as receive:
                async for _ in receive:
                    box.setdefault("first", time.perf_counter() - t)
            tg.cancel_scope.cancel()
    anyio.run(main)
    return box["first"]


def served(base: str, prompt_ids, a_tokens: int) -> dict:
    """Through a running `strata serve`: client A streams; once it has received a_tokens texts, client B sends the
    long prompt (token ids) and streams its first token. -> A's texts a second alone and while B's prompt is read
    (the issue's "chunks a second"), its gaps, B's time to first token."""
    import httpx
    stamps, box = [], {}

    def stream(body, on_text):
        with httpx.Client(timeout=600) as c, c.stream("POST", base + "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data:") and line.strip() != "data: [DONE]":
                    if any(ch.get("text") for ch in json.loads(line[5:]).get("choices") or []):
                        if on_text():
                            return

    def a_text():
        stamps.append(time.perf_counter())
        if len(stamps) == a_tokens:
            threading.Thread(target=b_run).start()
        return "b_first" in box

    def b_run():
        box["b_sent"] = time.perf_counter()
        stream({"prompt": list(prompt_ids), "max_tokens": 1, "stream": True, "temperature": 0, "ignore_eos": True},
               lambda: box.setdefault("b_first", time.perf_counter()) and True)
    stream({"prompt": "Write a short function that reverses a linked list, with one test.",
            "stream": True, "temperature": 0, "ignore_eos": True}, a_text)
    st = np.array(stamps)
    alone = st[SETTLE:a_tokens]
    during = st[(st > box["b_sent"]) & (st <= box["b_first"])]
    read_s = box["b_first"] - box["b_sent"]
    res = {"a_alone_texts_s": (len(alone) - 1) / (alone[-1] - alone[0]), "a_during_read_texts_s": len(during) / read_s,
           "b_ttft_s": read_s, "a_gap_ms_p50": 1000 * float(np.median(np.diff(during))) if len(during) > 1 else None,
           "a_gap_ms_p99": 1000 * float(np.percentile(np.diff(during), 99)) if len(during) > 1 else None}
    res["a_rate_fraction"] = res["a_during_read_texts_s"] / res["a_alone_texts_s"]
    return res


def serve_runs(args, budgets, prompt_ids) -> list[dict]:
    """One `strata serve` per budget (the compile cache makes later warm-ups loads), each measured --stream-rounds
    times by served()."""
    import httpx
    cache = tempfile.mkdtemp(prefix="fair_streams_cache_")
    out = []
    for b in budgets:
        port = _free_port()
        cmd = [sys.executable, "-m", "strata.cli", "serve", "--model", args.model, "--port", str(port), "--parallel",
               "2", "--max-context", str(len(prompt_ids) + 1024), "--prefill", str(args.prefill), "--window-tokens",
               str(b[0]), "--prompt-share", str(b[1]), "--compile-cache", cache]
        proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 900
            while time.time() < deadline:
                try:
                    if httpx.get(base + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.5)
            rounds = [served(base, prompt_ids, args.a_tokens) for _ in range(args.stream_rounds)]
        finally:
            proc.terminate()
            proc.wait(60)
        row = {"window_tokens": b[0], "prompt_share": b[1],
               **{k: float(np.median([r[k] for r in rounds])) for k in rounds[0]},
               "rounds": rounds}
        say(f"  served, window_tokens {b[0]}, prompt_share {b[1]}: A {row['a_during_read_texts_s']:.1f} texts/s "
            f"during B's read, "
            f"{row['a_alone_texts_s']:.1f} alone ({row['a_rate_fraction']:.2f}), gaps p50 {row['a_gap_ms_p50']:.1f} / "
            f"p99 {row['a_gap_ms_p99']:.1f} ms; B's first token after {row['b_ttft_s']:.2f} s")
        out.append(row)
    return out


def _budgets(text: str) -> list[tuple[int, float]]:
    """"64,128/0.5" -> [(64, 1.0), (128, 0.5)]: window_tokens and prompt_share."""
    return [(int(b.split("/")[0]), float(b.split("/")[1]) if "/" in b else 1.0) for b in text.split(",")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--prompt", type=int, default=16384, help="tokens of the long prompt")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--budgets", default="16,32,64,128,512,64/0.5,128/0.5,128/0.33,256/0.33",
                    help="window_tokens[/prompt_share] values to serve under")
    ap.add_argument("--a-tokens", type=int, default=150, help="A's tokens alone before B arrives")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the window costs")
    ap.add_argument("--stream-rounds", type=int, default=3, help="rounds of the streams over every budget")
    ap.add_argument("--served", default=None, help="window_tokens[/prompt_share] values to serve also through "
                    "`strata serve` and HTTP clients")
    ap.add_argument("--only-served", action="store_true", help="only through `strata serve`")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    budgets = _budgets(args.budgets)
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(0, 256, args.prompt).tolist()
    if args.only_served:
        result = {"bench": "fair_streams", **results_file.stamp(), "model": args.model, "prefill": args.prefill,
                  "prompt_tokens": args.prompt, "load_average": os.getloadavg()[0], "cpus": os.cpu_count(),
                  "cpu_affinity": sorted(os.sched_getaffinity(0)),
                  "served": serve_runs(args, _budgets(args.served or args.budgets), long_prompt)}
        results_file.write(result, args.out, f"fair_streams_served_{args.model}_cpu")
        return 0
    ctx = args.prompt + 1024
    engine = Engine.load(args.model, max_context=ctx, prefill=args.prefill)
    say(f"{args.model}: max_context {ctx}, prefill {args.prefill}, load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} CPUs")
    costs = window_costs(engine, args.prefill, args.prompt, args.rounds)
    t = time.perf_counter()
    WindowRunner(engine, 2, args.prefill).warm_up()               # the rest of the warm-up (sampled decode rows)
    warm_s = costs["decode_compile_s"] + sum(p["compile_s"] for p in costs["parts"]) + time.perf_counter() - t
    say(f"warm-up (decode rows and every part size up to {args.prefill}): {warm_s:.1f} s")
    a_prompt = engine.tokenizer.encode("Write a short function that reverses a linked list, with one test.")
    alone, runs = [], {b: [] for b in budgets}
    for r in range(args.stream_rounds):                     # rounds over every budget: a slow spell touches each
        say(f"round {r + 1} of {args.stream_rounds}")
        alone.append(read_alone(engine, args.prefill, long_prompt))
        say(f"  B alone: {args.prompt} tokens read in {alone[-1]:.2f} s")
        for b in budgets:
            runs[b].append(streams(engine, args.prefill, b, long_prompt, a_prompt, args.a_tokens))
    table = []
    for b in budgets:
        row = {k: v for k, v in runs[b][0].items() if not isinstance(v, float)}
        row.update({k: float(np.median([x[k] for x in runs[b]])) for k, v in runs[b][0].items()
                    if isinstance(v, float)})
        row["b_read_vs_alone"] = row["b_read_s"] / float(np.median(alone))
        table.append({**row, "rounds": runs[b]})
    say("| window_tokens | prompt_share | part beside a row | A during B's read, tok/s | A alone, tok/s | A's share "
        "| A's gap p50 / p99 ms "
        "| B's read s | B's read / alone |")
    say("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        say(f"| {r['window_tokens']} | {r['prompt_share']} | {r['window_part']} | {r['a_during_read_tok_s']:.1f} | "
            f"{r['a_alone_tok_s']:.1f} | "
            f"{r['a_rate_fraction']:.2f} | {r['a_gap_ms_p50']:.1f} / {r['a_gap_ms_p99']:.1f} | {r['b_read_s']:.2f} | "
            f"{r['b_read_vs_alone']:.2f} |")
    result = {"bench": "fair_streams", **results_file.stamp(), "model": args.model, "max_context": ctx,
              "prefill": args.prefill, "prompt_tokens": args.prompt, "load_average": os.getloadavg()[0],
              "cpus": os.cpu_count(), "cpu_affinity": sorted(os.sched_getaffinity(0)), "warm_up_s": warm_s,
              "window_costs": costs, "b_alone_read_s": float(np.median(alone)), "b_alone_read_s_rounds": alone,
              "streams": table, "served": serve_runs(args, _budgets(args.served), long_prompt) if args.served else None,
              "note": "medians over rounds; a stream's share = its tokens/s while B's prompt is "
                                        "read over its tokens/s alone just before"}
    results_file.write(result, args.out, f"fair_streams_{args.model}_cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
