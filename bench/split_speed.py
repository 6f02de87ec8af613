"""The layer split's cost: decode at batch 1 and 4 (windows dispatched ahead, as the server runs them) and a prompt
part of 4K tokens, split vs not, on the same model.

    python bench/split_speed.py --model demo --split 2                       # CPU: checks the script
    python bench/split_speed.py --model random:qwen3-next-80b-a3b --split 24 --one-device   # one H200

--one-device puts every stage on the first device (the machine has one GPU): the figures then show the hand-off and
the per-stage dispatch cost, not two GPUs' memory or compute, and the result says so. Every expert resident. Writes
JSON (machine, date, commit, figures) as it goes.
"""
from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import results_file  # noqa: E402  (bench/, beside this script)
from engine_speed import measure_batched, say, timed  # noqa: E402  (bench/, beside this script)

BATCHES = (1, 4)


def one_device(backend_cls) -> None:
    """Every stage's backend on the first device: the split's code path on a one-GPU machine."""
    backend_cls.device_count = lambda self: 8

    def on_device(self, i):
        other = copy.copy(self)
        other._zeros = {}
        return other
    backend_cls.on_device = on_device


def prompt_seconds(engine, tokens: int, repeat: int) -> float:
    ids = np.random.default_rng(0).integers(0, engine.cfg.vocab_size, tokens).tolist()

    def read():
        seq = engine.sequence()
        seq.read(ids, part_size=engine.settings.sched.prefill)
        jax.block_until_ready(seq.state)
    read()                                                    # compiles
    return timed(read, repeat)


def run(args, split: str | None) -> dict:
    from strata import Engine
    e = Engine.load(args.model, max_context=args.context + 64, prefill=args.prompt, layer_split=split,
                    parallel=max(BATCHES), say=say)
    out = {"stages": [st.describe() for st in e.stages]}
    for b in BATCHES:
        s, host = measure_batched(e, b, args.context, args.windows, ahead=True)
        out[f"decode_ms_b{b}"], out[f"decode_tok_s_b{b}"] = 1000 * s, b / s
        out[f"decode_host_dispatch_ms_b{b}"] = 1000 * host[0]
    p = prompt_seconds(e, args.prompt, args.repeat)
    out["prompt_ms"], out["prompt_tok_s"] = 1000 * p, args.prompt / p
    say(f"split {split}: " + ", ".join(f"{k} {v:.2f}" for k, v in out.items() if isinstance(v, float)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--split", default="2", help="layer_split for the split runs (default 2)")
    ap.add_argument("--one-device", action="store_true", help="every stage on the first device (one-GPU machines)")
    ap.add_argument("--context", type=int, default=4096, help="decode position")
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens, one part")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print(results_file.server_xla_flags(), flush=True)          # before the first JAX call (stamp's)
    if args.one_device:
        from strata.jax_backend.backend import JaxBackend
        one_device(JaxBackend)
    result = {"bench": "split_speed", **results_file.stamp(), "model": args.model, "split": args.split,
              "one_device": args.one_device, "context": args.context, "prompt_tokens": args.prompt,
              "note": "every stage on one device: hand-off and dispatch cost only" if args.one_device else ""}
    name = f"split_speed_{'one_device_' if args.one_device else ''}{args.model.replace(':', '_').replace('/', '_')}"
    for label, split in (("unsplit", None), ("split", args.split)):
        result[label] = run(args, split)
        gc.collect()                      # the engine before the next one loads (it holds cycles)
        results_file.write(result, args.out, name)
    for b in BATCHES:
        result[f"split_over_unsplit_decode_b{b}"] = result["split"][f"decode_ms_b{b}"] / result["unsplit"][
            f"decode_ms_b{b}"]
    result["split_over_unsplit_prompt"] = result["split"]["prompt_ms"] / result["unsplit"]["prompt_ms"]
    results_file.write(result, args.out, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
