"""Grammar pace: a json_schema stream beside a plain one, with the grammar row's masks given after dispatch (late
masks, the default where windows chain) and without (the row drops out of every other window dispatched ahead).

    python bench/grammar_pace.py                       # demo model, CPU: two streams, 3 rounds each way

The Scheduler (no HTTP) serves both streams at once on two slots, greedy; each stream's events are timed as they
come. Reports each stream's median gap between events while both run, their ratio (json / plain), and the plain
stream's tokens/s, for both ways; the text of each way must be the same. Writes JSON to --out.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import results_file  # noqa: E402  (bench/, beside this script)

from strata import Engine  # noqa: E402
from strata.engine.runner import WindowRunner  # noqa: E402
from strata.sched.request import Delta, Finished, Request  # noqa: E402
from strata.sched.scheduler import Scheduler  # noqa: E402
from strata.serve.grammar import Grammars  # noqa: E402

SCHEMA = {"type": "object", "properties": {"notes": {"type": "string", "minLength": 60, "maxLength": 90},
                                           "count": {"type": "integer"}}, "required": ["notes", "count"]}


def serve_pair(engine: Engine, late: bool, tokens: int) -> dict:
    """Both streams at once -> {stream: (text, event times)}."""
    runner = WindowRunner(engine, 2, 64)
    if not late:
        runner.capacity = replace(runner.capacity, late_masks=False)
    sched = Scheduler(runner, tokenizer=engine.tokenizer, eos_token_ids=engine.eos_token_ids, queue_limit=4,
                      warm_up=False)
    grammars = Grammars(engine.tokenizer, engine.cfg.vocab_size, engine.eos_token_ids)
    tok = engine.tokenizer
    prompt = lambda text: tuple(tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])))  # noqa
    reqs = [Request(id="json", prompt_ids=prompt("Describe the river as JSON."), max_tokens=tokens,
                    stop_token_ids=(), constraint=grammars.json(SCHEMA)),
            Request(id="plain", prompt_ids=prompt("Describe the river."), max_tokens=tokens, stop_token_ids=())]
    out: dict = {}

    async def one(req):
        text, times = "", []
        async with sched.submit(req) as receive:
            async for ev in receive:
                if isinstance(ev, Delta):
                    text += ev.content + ev.reasoning
                    times.append(time.perf_counter())
                elif not isinstance(ev, Finished):
                    raise RuntimeError(f"{req.id}: {ev}")
        out[req.id] = (text, times)

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(sched.run)
            async with anyio.create_task_group() as inner:
                for r in reqs:
                    inner.start_soon(one, r)
            tg.cancel_scope.cancel()
    anyio.run(main)
    return out


def gaps_while_both(out: dict) -> dict:
    """Each stream's gaps between events from the later first event to the earlier last one."""
    start = max(t[0] for _, t in out.values())
    end = min(t[-1] for _, t in out.values())
    return {k: [b - a for a, b in zip(t, t[1:]) if a >= start and b <= end] for k, (_, t) in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", type=int, default=120, help="max_tokens of each stream")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = Engine.load(args.model, max_context=1024, prefill=64, say=lambda line: None)
    serve_pair(engine, True, 8)                       # compile both ways' shapes before timing
    serve_pair(engine, False, 8)
    figures, texts = {}, {}
    for late in [True, False] * args.rounds:          # interleaved rounds
        out = serve_pair(engine, late, args.tokens)
        name = "late_masks" if late else "masks_at_dispatch"
        texts.setdefault(name, {k: v[0] for k, v in out.items()})
        if texts[name] != {k: v[0] for k, v in out.items()}:
            raise SystemExit(f"{name}: the text changed between rounds")
        g = gaps_while_both(out)
        f = figures.setdefault(name, {"json_gap_ms": [], "plain_gap_ms": [], "plain_tokens_per_s": []})
        f["json_gap_ms"].append(statistics.median(g["json"]) * 1e3)
        f["plain_gap_ms"].append(statistics.median(g["plain"]) * 1e3)
        f["plain_tokens_per_s"].append(len(g["plain"]) / sum(g["plain"]))
    if texts["late_masks"] != texts["masks_at_dispatch"]:
        raise SystemExit("late masks changed the text")
    result = {}
    for name, f in figures.items():
        med = {k: statistics.median(v) for k, v in f.items()}
        med["json_over_plain_gap"] = med["json_gap_ms"] / med["plain_gap_ms"]
        result[name] = {**med, "rounds": f}
        print(f"{name}: json gap {med['json_gap_ms']:.1f} ms, plain gap {med['plain_gap_ms']:.1f} ms "
              f"(ratio {med['json_over_plain_gap']:.2f}), plain {med['plain_tokens_per_s']:.1f} tok/s")
    results_file.write(dict(bench="grammar_pace", **results_file.stamp(), model=args.model, tokens=args.tokens,
                            schema=SCHEMA, json_text=texts["late_masks"]["json"], **result),
                       args.out, f"grammar_pace_{args.model}_cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
