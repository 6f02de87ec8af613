"""The prompt cache: time to first token of a follow-up turn after a long history, with the cache and without, and
the cost of parking and resuming a conversation.

    python bench/prompt_cache.py --quick                                        # CPU: the demo model, small sizes
    python bench/prompt_cache.py --real-shapes --layers 48 --experts int4       # GPU: Qwen3-Next-80B-A3B shapes

For each history length H: a first turn reads H tokens (a prompt that ends with an assistant header) and replies;
the follow-up sends the conversation back with --new tokens more and asks for one token. Its time to first token is
taken with the cache (the stored conversation reused) and without (cache_prompt false: all of it read), against the
--new tokens read alone. Then, for the longest history: another prompt takes the only slot (the conversation is
parked: its KV and checkpoints copied to host RAM) and the follow-up resumes it; the executor's park and resume
calls are timed on their own. Through the Scheduler over a WindowRunner (no HTTP). Writes JSON as it goes
(bench "followup_ttft"; its ttft_ms_64k is SUMMARY.json's followup_ttft_ms_64k).
--park-only: only the copies, on the runner (no prompt read: their cost does not depend on the KV's values): the
longest history's KV saved from slot 0 and loaded into slot 1, three times (the first compiles). --kv-resident N
--kv-parked 0|auto: with the KV's host tier, parks that copy it or keep it in place.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import results_file  # noqa: E402  (bench/, beside this script)

from strata.sched.request import Request  # noqa: E402
from strata.sched.scheduler import Scheduler  # noqa: E402

HEADER = 3                 # the assistant header's tokens at the end of each prompt (a checkpoint at its start)


def say(line: str) -> None:
    print(line, flush=True)


def label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def demo_engine(max_context: int, prefill: int, **kv):
    from strata import Engine
    return Engine.load("demo", max_context=max_context, prefill=prefill, **kv)


def real_engine(layers: int, experts: str, max_context: int, prefill: int, **kv):
    """Random weights at Qwen3-Next-80B-A3B shapes (bench/engine_speed.py's), every expert resident."""
    import ml_dtypes
    from strata.demo import QWEN3_NEXT_80B
    from strata.jax_backend.random_weights import RandomDeviceReader
    from strata.experts.synthetic import SyntheticStore
    from strata.backend import get_backend
    from strata.config import Settings
    from strata.engine import Engine
    from strata.model.config import ModelConfig
    from strata.model.params import params_from_reader
    cfg = ModelConfig.from_hf(dict(QWEN3_NEXT_80B, num_hidden_layers=layers), source=f"qwen3-next-80b x{layers}")
    tokenizer = id_tokenizer(cfg.vocab_size)          # first: a failure here costs no model build
    params = params_from_reader(cfg, RandomDeviceReader(ml_dtypes.bfloat16))
    engine = Engine(cfg, params, get_backend("jax"), Settings.build(dtype="bfloat16", max_context=max_context,
                                                                    prefill=prefill, parallel=1, **kv))
    n_moe = sum(cfg.is_sparse_layer(i) for i in range(layers))
    engine.attach_experts(SyntheticStore(experts, cfg.hidden_size, cfg.moe_intermediate_size, n_moe,
                                         cfg.num_experts), say=lambda line: None)
    engine.tokenizer = tokenizer
    return engine


def id_tokenizer(vocab: int):
    """A tokenizer for random ids (the scheduler detokenizes what it streams): the `tokenizers` library's word-level
    model over names t0..t{vocab-1}, loaded as any model directory's."""
    import json
    import tempfile

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    from strata.tokenizer import Tokenizer
    d = Path(tempfile.mkdtemp(prefix="ids-tokenizer-"))
    HFTokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return Tokenizer.from_dir(d)


class Timed:
    """Wraps the runner's park and resume calls (save_kv and to_host; load_kv and restore) to time them."""

    def __init__(self, runner):
        self.runner, self.seconds = runner, {"park": 0.0, "resume": 0.0}
        for name, kind in (("save_kv", "park"), ("to_host", "park"), ("load_kv", "resume"), ("restore", "resume")):
            setattr(runner, name, self.wrap(getattr(runner, name), kind))

    def wrap(self, fn, kind):
        def timed(*a):
            t = time.perf_counter()
            out = fn(*a)
            if kind == "resume":                 # the copies are queued: wait for them
                self.runner.engine.backend.to_host(self.runner.states[0][next(iter(self.runner.states[0]))][0, 0])
            self.seconds[kind] += time.perf_counter() - t
            return out
        return timed


def measure(engine, histories: list[int], new: int, reply: int, every: int, ram_gib: float, out: dict, write):
    from strata.engine.runner import WindowRunner
    vocab = engine.cfg.vocab_size
    rng = np.random.default_rng(0)
    runner = WindowRunner(engine, 1, engine.settings.sched.prefill)
    timer = Timed(runner)
    sched = Scheduler(runner, tokenizer=engine.tokenizer, eos_token_ids=(), max_context=engine.settings.model.max_context,
                      queue_limit=4, checkpoint_every=every, checkpoint_ram_gib=ram_gib)

    def tokens(n):
        return tuple(int(t) for t in rng.integers(0, vocab, n))

    async def ttft(req) -> tuple[float, object]:
        t = time.perf_counter()
        first, final = None, None
        async with sched.submit(req) as receive:
            async for ev in receive:
                first = first or time.perf_counter()
                final = ev
        return 1000 * ((first or time.perf_counter()) - t), final

    def turn(id, prompt, max_tokens=1, **kw):
        return Request(id=id, prompt_ids=prompt, max_tokens=max_tokens, turn_at=len(prompt) - HEADER,
                       stop_token_ids=(), **kw)

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(sched.run)
            for rep in range(2):                 # the first round compiles; the second is kept
                alone, _ = await ttft(turn(f"alone{rep}", tokens(new), cache_prompt=False))
            out["ttft_ms_new_alone"] = alone
            say(f"{new} new tokens alone: {alone:.0f} ms to the first token")
            for h in histories:
                first = tokens(h)
                await ttft(turn(f"h{h}", first, max_tokens=reply))
                conv = tuple(sched.cache.live[0].tokens)
                follow = conv + tokens(new)
                cached, fin = await ttft(turn(f"f{h}", follow))
                reused = fin.timings.get("reused", 0)
                cold, _ = await ttft(turn(f"c{h}", follow, cache_prompt=False, checkpoints=False))
                k = label(h)
                out[f"ttft_ms_{k}"], out[f"ttft_cold_ms_{k}"], out[f"reused_{k}"] = cached, cold, reused
                out[f"ratio_to_new_alone_{k}"] = cached / alone
                say(f"history {h}: follow-up of {new} tokens, first token in {cached:.0f} ms with the cache "
                    f"({reused} reused, {cached / alone:.2f}x the new tokens alone), {cold:.0f} ms without")
                write(out)
            # parking: the longest conversation gives its only slot to another prompt, then comes back
            h = histories[-1]
            first = tokens(h)
            await ttft(turn("park-first", first, max_tokens=reply))
            follow = tuple(sched.cache.live[0].tokens) + tokens(new)
            timer.seconds.update(park=0.0, resume=0.0)
            await ttft(turn("other", tokens(new), cache_prompt=False))
            resumed, fin = await ttft(turn("park-follow", follow))
            k = label(h)
            out[f"park_ms_{k}"] = 1000 * timer.seconds["park"]
            out[f"resume_ms_{k}"] = 1000 * timer.seconds["resume"]
            out[f"ttft_after_resume_ms_{k}"] = resumed
            out[f"reused_after_resume_{k}"] = fin.timings.get("reused", 0)
            out["parked"] = sched.metrics()["conversations_parked"]
            out["resumed"] = sched.metrics()["conversations_resumed"]
            say(f"history {h}: parked in {out[f'park_ms_{k}']:.0f} ms, resumed in {out[f'resume_ms_{k}']:.0f} ms; "
                f"follow-up after it {resumed:.0f} ms to the first token ({out[f'reused_after_resume_{k}']} reused)")
            write(out)
            tg.cancel_scope.cancel()
    anyio.run(main)
    return out


def measure_park(engine, n: int, out: dict, write) -> dict:
    """save_kv of n positions from slot 0 and load_kv into slot 1 (waited for), three rounds; the last is kept."""
    from strata.engine.runner import WindowRunner
    runner = WindowRunner(engine, 2, engine.settings.sched.prefill)
    wait = lambda: engine.backend.to_host(runner.states[0][next(iter(runner.states[0]))][0, 0])  # noqa: E731
    wait()
    k = label(n)
    for rep in range(3):
        t = time.perf_counter()
        saved = runner.save_kv(0, n)
        t1 = time.perf_counter()
        runner.load_kv(1, saved)
        wait()
        t2 = time.perf_counter()
        blocks = len(saved.data) if isinstance(saved.data, list) else 0         # 0: kept in place (ParkedRow)
        out.update({f"park_kv_ms_{k}": 1000 * (t1 - t), f"resume_kv_ms_{k}": 1000 * (t2 - t1),
                    f"park_kv_bytes_{k}": saved.nbytes, f"park_kv_blocks_{k}": blocks})
        say(f"{n} positions: KV saved in {1000 * (t1 - t):.1f} ms, loaded in {1000 * (t2 - t1):.1f} ms "
            f"({saved.nbytes / 2**20:.1f} MiB in {blocks} blocks; round {rep})")
    write(out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the demo model on a CPU: histories 256,512,1024, 64 new")
    ap.add_argument("--real-shapes", action="store_true")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", default="int4", choices=("bf16", "int8", "int4", "nvfp4"))
    ap.add_argument("--histories", default="8192,32768,65536")
    ap.add_argument("--new", type=int, default=1024, help="tokens of the follow-up turn")
    ap.add_argument("--reply", type=int, default=32, help="tokens of the first turn's reply")
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--checkpoint-every", type=int, default=0, help="0: the prefill size (the server's auto)")
    ap.add_argument("--checkpoint-ram-gib", type=float, default=16.0)
    ap.add_argument("--park-only", action="store_true", help="only the KV copies of the longest history (no prompt)")
    ap.add_argument("--kv-resident", type=int, default=0, help="the KV's device window (0: one tier)")
    ap.add_argument("--kv-parked", default="auto", help="host-tier rows for parking in place (0: parks copy)")
    ap.add_argument("--out", default=None, help="JSON file to write (default bench/results/followup_ttft.json)")
    args = ap.parse_args()
    print(results_file.server_xla_flags(), flush=True)          # before the first JAX call (stamp's)
    if args.quick:
        args.histories, args.new, args.reply, args.prefill = "256,512,1024", 64, 8, 256
    args.checkpoint_every = args.checkpoint_every or args.prefill
    histories = [int(x) for x in args.histories.split(",")]
    max_context = max(histories) + args.new + 2 * args.reply + 64
    kv = dict(kv_resident=args.kv_resident, kv_parked=args.kv_parked if args.kv_parked == "auto" else
              int(args.kv_parked))
    if args.real_shapes:
        engine = real_engine(args.layers, args.experts, max_context, args.prefill, **kv)
    else:
        engine = demo_engine(max_context, args.prefill, **kv)
    bench = "park_kv" if args.park_only else "followup_ttft"
    out = {"bench": bench, **results_file.stamp(), "model": "qwen3-next-80b shapes" if args.real_shapes
           else "demo", "layers": args.layers if args.real_shapes else None, "new_tokens": args.new,
           "histories": histories, "checkpoint_every": args.checkpoint_every, "prefill": args.prefill, **kv}
    name = bench + ("_smoke" if args.quick or not args.real_shapes else "")
    write = lambda result: results_file.write(result, args.out, name)      # noqa: E731
    if args.park_only:
        measure_park(engine, max(histories), out, write)
    else:
        measure(engine, histories, args.new, args.reply, args.checkpoint_every, args.checkpoint_ram_gib, out, write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
