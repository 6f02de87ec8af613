"""Speculative decoding's cost: a verify window (K drafts + 1 per row) against a 1-token window, and tokens/s by the
acceptance rate.

    python bench/spec_speed.py --model demo                          # CPU: the demo model (checks the script)
    python bench/spec_speed.py --real-shapes --layers 48 --experts int4 --tokens-per-window 2.14   # the H200

A window computes the same positions whether its drafts are accepted or not, so windows are timed with drafts put on
the device (all K offered in every window); random weights accept none by themselves. Each batch runs on a runner of
that many slots. 1-token windows are timed read one by one and dispatched ahead (the scheduler's lookahead); verify
windows are never dispatched ahead. Tokens/s at acceptance alpha (the chance a draft is accepted, given the ones
before it were) is the batch times (1 - alpha^(K+1)) / (1 - alpha) over the window's time; --tokens-per-window gives
spec_tok_s_b1 from a measured rate instead (the trained tiny model's). Real shapes: random weights, every expert
resident, the MTP head one more full-attention MoE layer; several layer counts are fitted to 48 as engine_speed does.
--also-k: more draft counts timed at batch 1 on the same engine. Writes JSON as it goes.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import results_file  # noqa: E402  (bench/, beside this script)
import summary  # noqa: E402  (bench/, beside this script)

BATCHES = (1, 4, 16)
ROUNDS = 3
REAL_LAYERS = 48


def window_seconds(runner, batch: int, context: int, windows: int, k: int | None) -> float:
    """Median over ROUNDS of the seconds per window of `batch` rows at position `context`, read one by one (verify
    windows are never dispatched ahead): k None a 1-token window, else a verify window offering k drafts a row."""
    from strata.plan import idle_plan
    plan = replace(idle_plan(runner.n_slots), decode_active=np.arange(runner.n_slots) < batch,
                   decode_pos=np.full(runner.n_slots, context, np.int32))
    if k is not None:
        plan = replace(plan, draft_len=np.full(runner.n_slots, k, np.int32))

    def one(i):
        if k is not None:
            offer_drafts(runner, k)
        runner.run(replace(plan, decode_tokens=np.full(runner.n_slots, 5, np.int32), decode_pos=plan.decode_pos + i))
    one(0)                                  # compiles
    rounds = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        for i in range(windows):
            one(i % 8)
        rounds.append((time.perf_counter() - t) / windows)
    return float(np.median(rounds))


def offer_drafts(runner, k: int) -> None:
    """k drafts (a constant token) on the device for every slot, fresh: the next verify window offers them all."""
    s = runner.spec
    s.bank = {**s.bank, "drafted": runner.engine.backend.to_device(
        np.concatenate([np.full((k, runner.n_slots), 7), np.full((1, runner.n_slots), k)]).astype(np.int32))}
    s.fresh[:] = True


def emitted(alpha: float, k: int) -> float:
    """Tokens a verify window of k drafts emits on average at per-draft acceptance alpha."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def measure(engine, k: int, also: list, context: int, windows: int, batches, out: dict, write) -> dict:
    from engine_speed import measure_batched
    from strata.engine.runner import WindowRunner
    for b in batches:
        out[f"plain_s_b{b}"], _ = measure_batched(engine, b, context, windows)
        out[f"plain_ahead_s_b{b}"], _ = measure_batched(engine, b, context, windows, ahead=True)
        write()
        t = time.perf_counter()
        out[f"verify_s_b{b}"] = window_seconds(WindowRunner(engine, b, 16), b, context, windows, k)
        out[f"verify_compile_and_time_s_b{b}"] = time.perf_counter() - t
        print(f"  batch {b}: 1-token window {1000 * out[f'plain_s_b{b}']:.2f} ms (ahead "
              f"{1000 * out[f'plain_ahead_s_b{b}']:.2f}), verify {k}+1 {1000 * out[f'verify_s_b{b}']:.2f} ms", flush=True)
        write()
    for k2 in also:
        out[f"verify_k{k2}_s_b1"] = window_seconds(WindowRunner(with_k(engine, k2), 1, 16), 1, context, windows, k2)
        print(f"  batch 1: verify {k2}+1 {1000 * out[f'verify_k{k2}_s_b1']:.2f} ms", flush=True)
        write()
    with_k(engine, k)
    return out


def with_k(engine, k: int):
    """The engine with spec = k (its compiled verify windows are keyed by k; weights and experts shared)."""
    s = engine.settings
    engine.settings = replace(s, sched=replace(s.sched, spec=k))
    return engine


def real_engine(n_layers: int, k: int, context: int, experts: str, smoke: bool):
    """An engine at Qwen3-Next-80B-A3B shapes with n_layers layers and an MTP head, random weights (experts in the
    given format), every expert resident (bench/engine_speed.py's reader and synthetic experts)."""
    import ml_dtypes

    from strata.demo import QWEN3_NEXT_80B
    from strata.jax_backend.random_weights import RandomDeviceReader
    from strata.experts.synthetic import SyntheticStore
    from strata.backend import get_backend
    from strata.config import Settings
    from strata.engine import Engine
    from strata.engine.spec import MtpHead
    from strata.model.config import ModelConfig
    from strata.model.params import params_from_reader

    class WithHead(RandomDeviceReader):
        def has(self, name: str) -> bool:
            return not name.endswith("experts.gate_up_proj")

    over = {"num_experts": 16, "vocab_size": 4096} if smoke else {}
    cfg = ModelConfig.from_hf(dict(QWEN3_NEXT_80B, num_hidden_layers=n_layers, **over),
                              source=f"qwen3-next-80b shapes x{n_layers}")
    backend = get_backend("jax")
    params = params_from_reader(cfg, WithHead(ml_dtypes.bfloat16))
    engine = Engine(cfg, params, backend, Settings.build(dtype="bfloat16", max_context=context + 64, prefill=16,
                                                         parallel=max(BATCHES), spec=k, mtp=True))
    n_moe = sum(cfg.is_sparse_layer(i) for i in range(n_layers))
    store = SyntheticStore(experts, cfg.hidden_size, cfg.moe_intermediate_size, n_moe, cfg.num_experts)
    engine.attach_experts(store, say=lambda line: None)
    pool = backend.pool_write(backend.pool_alloc(cfg.num_experts, store.layout.nbytes),
                              np.arange(cfg.num_experts, dtype=np.int32),
                              [store.blob(0, e) for e in range(cfg.num_experts)])
    engine.mtp = (MtpHead(store.layout, cfg.num_experts), pool)
    return engine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--real-shapes", action="store_true")
    ap.add_argument("--layers", default="48")
    ap.add_argument("--experts", default="int4", choices=("bf16", "int8", "int4", "nvfp4"))
    ap.add_argument("--k", type=int, default=4, help="drafts a verify window offers per row")
    ap.add_argument("--also-k", default="", help="more draft counts timed at batch 1 (comma separated)")
    ap.add_argument("--context", type=int, default=4096, help="position of the rows (real shapes; demo: 256)")
    ap.add_argument("--windows", type=int, default=16, help="windows per timed round")
    ap.add_argument("--acceptance", type=float, default=None,
                    help="per-draft acceptance spec_tok_s_b1 is given at")
    ap.add_argument("--tokens-per-window", type=float, default=None,
                    help="tokens a verify window emits, measured (bench/spec_acceptance.py): spec_tok_s_b1 from it")
    ap.add_argument("--smoke", action="store_true", help="real shapes but 16 experts and a 4K vocabulary (a CPU)")
    ap.add_argument("--out", default=None, help="JSON file to write (default bench/results/<name>.json)")
    args = ap.parse_args()
    print(results_file.server_xla_flags(), flush=True)          # before the first JAX call (stamp's)
    result = {"bench": "spec_speed", **results_file.stamp(), "k": args.k, "acceptance": args.acceptance,
              "tokens_per_window": args.tokens_per_window, "complete": False}
    also = [int(x) for x in args.also_k.split(",") if x]
    if args.real_shapes:
        counts = [int(x) for x in args.layers.split(",")]
        name = "spec_speed_real_shapes" + ("_smoke" if args.smoke else "") + f"_{args.experts}"
        result.update(model="qwen3-next-80b shapes, random weights" + (" (smoke)" if args.smoke else ""),
                      experts=args.experts, context=args.context, layers={})
        write = lambda: results_file.write(result, args.out, name)           # noqa: E731
        for n in counts:
            print(f"{n} layers:", flush=True)
            t = time.perf_counter()
            engine = real_engine(n, args.k, args.context, args.experts, args.smoke)
            per = result["layers"][n] = {"build_s": time.perf_counter() - t}
            measure(engine, args.k, also, args.context, args.windows, BATCHES, per, write)
            del engine
        ns = np.array(counts, float)
        figures = {}
        for key in result["layers"][counts[0]]:
            ts = np.array([result["layers"][n][key] for n in counts])
            slope, fixed = np.polyfit(ns, ts, 1) if len(ns) > 1 else (ts[0] / ns[0], 0.0)
            figures[key] = float(fixed + REAL_LAYERS * slope)
        result["at_48_layers"] = figures
    else:
        from strata import Engine
        context = min(args.context, 256)
        engine = Engine.load(args.model, max_context=context + 64, prefill=16, parallel=max(BATCHES), spec=args.k,
                             mtp=True, say=lambda line: None)
        name = f"spec_speed_{args.model}_{engine.backend.device.platform}"
        result.update(model=args.model, context=context, note="random weights: timings only")
        write = lambda: results_file.write(result, args.out, name)           # noqa: E731
        figures = measure(engine, args.k, also, context, args.windows, BATCHES, {}, write)
        result.update(figures)
    for b in BATCHES:
        plain = figures[f"plain_s_b{b}"]
        result[f"spec_verify_cost_ratio_b{b}"] = figures[f"verify_s_b{b}"] / plain
        result[f"plain_tok_s_b{b}"] = b / min(plain, figures[f"plain_ahead_s_b{b}"])     # the server's faster form
        result[f"spec_tok_s_by_acceptance_b{b}"] = {
            f"{a:.1f}": b * emitted(a, args.k) / figures[f"verify_s_b{b}"] for a in np.arange(0.0, 1.01, 0.1)}
    for k in also:
        result[f"spec_verify_cost_ratio_k{k}_b1"] = figures[f"verify_k{k}_s_b1"] / figures["plain_s_b1"]
    if args.tokens_per_window is not None:
        result["spec_tok_s_b1"] = args.tokens_per_window / figures["verify_s_b1"]
    elif args.acceptance is not None:
        result["spec_tok_s_b1"] = emitted(args.acceptance, args.k) / figures["verify_s_b1"]
    result["complete"] = True
    print(f"verify {args.k}+1 / 1-token window, batch 1: {result['spec_verify_cost_ratio_b1']:.2f}"
          + (f"; spec_tok_s_b1 {result['spec_tok_s_b1']:.1f} (plain {result['plain_tok_s_b1']:.1f})"
             if "spec_tok_s_b1" in result else ""))
    path = write()
    if path.parent == summary.RESULTS:
        summary.refresh()
    return 0


if __name__ == "__main__":
    sys.exit(main())
