"""The scheduler's cost per decode window: the same windows driven by the Scheduler (no HTTP) and by the engine bench
alone (engine_speed.measure_batched, one window dispatched ahead), at each batch.

    python bench/sched_overhead.py                          # CPU: the demo model, batches 1, 4 and 16
    python bench/sched_overhead.py --profile 16             # ... and cProfile's top functions of the batch-16 run
    python bench/sched_overhead.py --batches 1,4 --slots 16  # b streams on a 16-slot runner (the others idle)
    python bench/sched_overhead.py --logprobs 5              # ... each stream asking for logprobs (shaped windows)

Per batch b: b requests of --tokens tokens each (no stop token), admitted together on a b-slot WindowRunner (or
one of --slots slots, the rest idle); the windows while all b generate are timed (wall ms a window, and the
scheduler's own plan / apply / hand-off seconds from its metrics), against measure_batched's ms a window for b rows.
Writes JSON (machine, date, commit).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402
from engine_speed import measure_batched, say  # noqa: E402

from strata import Engine  # noqa: E402
from strata.engine.runner import WindowRunner  # noqa: E402
from strata.sched.request import Request  # noqa: E402
from strata.sched.scheduler import Scheduler  # noqa: E402

KEYS = ("windows", "window_seconds_sum", "plan_seconds_sum", "apply_seconds_sum", "handoff_seconds_sum",
        "device_seconds_sum", "generated_tokens")


def served(engine, batch: int, slots: int, tokens: int, profile: bool, logprobs: int | None = None) -> dict:
    """ms a window while all `batch` streams generate on a runner of `slots` slots, and the scheduler's parts of it."""
    runner = WindowRunner(engine, slots, engine.settings.sched.prefill)
    sched = Scheduler(runner, tokenizer=engine.tokenizer, eos_token_ids=engine.eos_token_ids, queue_limit=batch,
                      max_context=engine.settings.model.max_context, lookahead=True)
    reqs = [Request(id=f"r{i}", prompt_ids=tuple(range(5 + i, 21 + i)), max_tokens=tokens, stop_token_ids=(),
                    logprobs=logprobs) for i in range(batch)]
    marks: dict = {}
    prof = cProfile.Profile() if profile else None

    def mark(name):
        marks[name] = (time.perf_counter(), {k: sched.metrics().get(k, 0) for k in KEYS})

    async def client(req, counts):
        async with sched.submit(req) as receive:
            async for _ in receive:
                counts[req.id] += 1
                if "steady" not in marks and min(counts.values()) >= 2:
                    mark("steady")                     # every stream is generating: prompts are read
                    if prof:
                        prof.enable()
        if "end" not in marks:                         # the first stream to end
            if prof:
                prof.disable()
            mark("end")

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(sched.run)
            counts = {r.id: 0 for r in reqs}
            async with anyio.create_task_group() as clients:
                for r in reqs:
                    clients.start_soon(client, r, counts)
            tg.cancel_scope.cancel()
    anyio.run(main)
    (t0, a), (t1, b) = marks["steady"], marks["end"]
    n = b["windows"] - a["windows"]
    d = {k: (b[k] - a[k]) for k in KEYS}
    out = {"windows": n, "ms_per_window": 1000 * (t1 - t0) / n,
           "tokens_per_s": d["generated_tokens"] / (t1 - t0)}
    for k in ("plan", "apply", "handoff", "device"):
        out[f"{k}_ms_per_window"] = 1000 * d[f"{k}_seconds_sum"] / n
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        out["profile_top"] = s.getvalue()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=200, help="tokens each stream generates")
    ap.add_argument("--profile", type=int, default=0, help="a batch whose scheduled run cProfile records")
    ap.add_argument("--slots", type=int, default=0, help="the served runner's slots (default: the batch's)")
    ap.add_argument("--logprobs", type=int, default=None, help="each request asks for this many alternatives' "
                                                                    "logprobs (the windows are shaped)")
    ap.add_argument("--no-row-buckets", action="store_true", help="every window runs all slots (row_buckets off)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    engine = Engine.load("demo", max_context=1024, prefill=32, parallel=max(batches + [args.slots]),
                         row_buckets=not args.no_row_buckets)
    out = {"bench": "sched_overhead", **results_file.stamp(), "model": "demo", "tokens": args.tokens,
           "slots": args.slots or "batch", "logprobs": args.logprobs,
           "row_buckets": not args.no_row_buckets, "runs": {}}
    for b in batches:
        alone = 1000 * measure_batched(engine, b, 64, windows=args.tokens, ahead=True)[0]
        run = served(engine, b, max(b, args.slots), args.tokens, profile=b == args.profile, logprobs=args.logprobs)
        run.update(engine_ms_per_window=alone, overhead=run["ms_per_window"] / alone)
        out["runs"][f"b{b}"] = run
        say(f"batch {b}: {run['ms_per_window']:.2f} ms a window served ({run['tokens_per_s']:.0f} tok/s) against "
            f"{alone:.2f} ms for the engine alone ({run['overhead']:.2f}x); plan {run['plan_ms_per_window']:.2f}, "
            f"apply {run['apply_ms_per_window']:.2f}, hand-off {run['handoff_ms_per_window']:.2f}, device "
            f"{run['device_ms_per_window']:.2f} ms a window")
        if "profile_top" in run:
            say(run["profile_top"])
        results_file.write(out, args.out, "sched_overhead_cpu_demo" + (f"_{args.slots}_slots" if args.slots else "")
                           + (f"_logprobs_{args.logprobs}" if args.logprobs is not None else "")
                           + ("_no_row_buckets" if args.no_row_buckets else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
