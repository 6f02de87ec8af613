"""Draft acceptance of a model's MTP head in Strata's own engine: greedy chat requests served one at a time through
the Scheduler, every decode window verifying K drafts (a fixed DraftPolicy), for each K given; spec off's replies as
well, which the spec replies must equal.

    python bench/spec_acceptance.py                              # the trained tiny model on the CPU, K 1 and 4
    python bench/spec_acceptance.py --model PATH --k 1,2,4 --max-tokens 128

Per K: drafts offered and accepted, the accepted share, tokens a verify window emits on average (accepted + 1), and
the chance that draft i is accepted once drafts 1..i-1 were. The prompts ask about the topics and packages the tiny
model's training held out (docs/tiny-model.md). Acceptance only: windows compile at first use and nothing is timed.
Writes JSON (bench/results/spec_<model>_<platform>.json by default).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import results_file  # noqa: E402  (bench/, beside this script)

PROMPTS = ("What does the return statement do?", "How do slicings work?", "What is the nonlocal statement for?",
           "How are string literals written?", "What does fnmatch match?", "How do I configure the logging module?",
           "What does pprint print?", "How are numbers written in Python?")


def recording_policy(k: int):
    """A DraftPolicy offering k drafts in every window that keeps each verified row's (offered, accepted)."""
    from strata.sched.drafts import DraftPolicy

    class Recording(DraftPolicy):
        def __init__(self):
            super().__init__(k, adaptive=False)
            self.rows: list[tuple[int, int]] = []

        def record(self, slot: int, offered: int, accepted: int) -> None:
            super().record(slot, offered, accepted)
            self.rows.append((offered, accepted))
    return Recording()


def serve(engine, prompts, max_tokens: int, prefill: int, drafts=None) -> tuple[list[str], dict]:
    """Each prompt's greedy reply, one request at a time on one slot -> (replies, the scheduler's metrics)."""
    from strata.engine.runner import WindowRunner
    from strata.sched.request import Delta, Request, SamplingParams
    from strata.sched.scheduler import Scheduler
    runner = WindowRunner(engine, 1, prefill)
    runner.warm_up = lambda: 0.0            # acceptance does not depend on it: each shape compiles when first used
    sched = Scheduler(runner, tokenizer=engine.tokenizer, eos_token_ids=engine.eos_token_ids, queue_limit=4,
                      drafts=drafts)
    tok, replies = engine.tokenizer, []

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(sched.run)
            for i, text in enumerate(prompts):
                ids = tuple(tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])))
                req = Request(id=f"q{i}", prompt_ids=ids, max_tokens=max_tokens,
                              sampling=SamplingParams(temperature=0.0))
                reply = ""
                async with sched.submit(req) as receive:
                    async for ev in receive:
                        if isinstance(ev, Delta):
                            reply += ev.content + ev.reasoning
                replies.append(reply)
            tg.cancel_scope.cancel()
    anyio.run(main)
    return replies, sched.metrics()


def summarise(k: int, rows: list[tuple[int, int]], metrics: dict) -> dict:
    offered = sum(o for o, _ in rows)
    accepted = sum(a for _, a in rows)
    by_position = []
    for i in range(1, k + 1):
        reached = [a for o, a in rows if o >= i and a >= i - 1]
        by_position.append(round(sum(a >= i for a in reached) / len(reached), 4) if reached else None)
    return {"k": k, "verify_windows": len(rows), "drafts_offered": offered, "drafts_accepted": accepted,
            "acceptance": round(accepted / offered, 4) if offered else None,
            "tokens_per_verify_window": round(sum(a + 1 for _, a in rows) / len(rows), 4) if rows else None,
            "acceptance_by_position": by_position, "generated_tokens": metrics.get("generated_tokens")}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--k", default="1,4", help="draft lengths, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    from strata import Engine
    shape = dict(max_context=args.max_context, prefill=args.prefill, say=lambda line: None)
    plain, _ = serve(Engine.load(args.model, **shape), PROMPTS, args.max_tokens, args.prefill)
    runs = []
    for k in (int(x) for x in args.k.split(",")):
        drafts = recording_policy(k)
        replies, metrics = serve(Engine.load(args.model, spec=k, mtp=True, **shape), PROMPTS, args.max_tokens,
                                 args.prefill, drafts)
        runs.append({**summarise(k, drafts.rows, metrics), "replies_equal_spec_off": replies == plain})
        print(runs[-1], flush=True)
    import jax
    name = Path(args.model).name
    result = {**results_file.stamp(), "bench": "spec_acceptance", "model": name, "greedy": True,
              "max_tokens": args.max_tokens, "prompts": list(PROMPTS), "runs": runs,
              "replies_spec_off": plain}
    results_file.write(result, args.out, f"spec_{name}_{jax.devices()[0].platform}")
    return result


if __name__ == "__main__":
    main()
