"""Speculative decoding's cost: a verify window (K drafts + 1 per row) against a 1-token window, and tokens/s by the
acceptance rate.

    python bench/spec_speed.py --model demo                          # CPU: the demo model (checks the script)
    python bench/spec_speed.py --real-shapes --layers 4,12           # GPU: Qwen3-Next-80B-A3B shapes, random weights
    python bench/spec_speed.py --real-shapes --layers 4,12 --acceptance 0.7

A window computes the same positions whether its drafts are accepted or not, so windows are timed with drafts put on
the device (all K offered in every window); random weights accept none by themselves. Tokens/s at acceptance alpha
(the chance a draft is accepted, given the ones before it were) is the batch times the tokens a verify window emits
on average, (1 - alpha^(K+1)) / (1 - alpha), over the window's time. Real shapes: as bench/engine_speed.py, fewer
layers than 48 (the 3:1 pattern kept), each figure fitted as fixed + layers x per-layer over the layer counts and
given at 48 layers; the MTP head is one more full-attention MoE layer with random weights and its experts resident.
--acceptance: the rate spec_tok_s_b1 is recorded at (the trained tiny model's measured rate). Writes JSON.
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
    from strata.engine.spec import Spec
    from strata.plan import idle_plan
    plan = replace(idle_plan(runner.n_slots), decode_active=np.arange(runner.n_slots) < batch,
                   decode_pos=np.full(runner.n_slots, context, np.int32))
    if k is not None:
        plan = replace(plan, draft_len=np.full(runner.n_slots, k, np.int32))

    def one(i):
        if k is not None:                   # drafts offered in every window (a constant token each)
            s: Spec = runner.spec
            s.bank = {**s.bank, "drafted": runner.engine.backend.to_device(
                np.concatenate([np.full((k, runner.n_slots), 7), np.full((1, runner.n_slots), k)]).astype(np.int32))}
            s.fresh[:] = True
        runner.run(replace(plan, decode_tokens=np.full(runner.n_slots, 5, np.int32), decode_pos=plan.decode_pos + i))
    one(0)                                  # compiles
    rounds = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        for i in range(windows):
            one(i % 8)
        rounds.append((time.perf_counter() - t) / windows)
    return float(np.median(rounds))


def emitted(alpha: float, k: int) -> float:
    """Tokens a verify window of k drafts emits on average at per-draft acceptance alpha."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def measure(engine, k: int, context: int, windows: int, batches) -> dict:
    from strata.engine.runner import WindowRunner
    runner = WindowRunner(engine, max(batches), 16)
    out = {}
    for b in batches:
        out[f"plain_s_b{b}"] = window_seconds(runner, b, context, windows, None)
        out[f"verify_s_b{b}"] = window_seconds(runner, b, context, windows, k)
        print(f"  batch {b}: 1-token window {1000 * out[f'plain_s_b{b}']:.2f} ms, verify {k}+1 "
              f"{1000 * out[f'verify_s_b{b}']:.2f} ms", flush=True)
    return out


def real_engine(n_layers: int, k: int, context: int, smoke: bool):
    """An engine at Qwen3-Next-80B-A3B shapes with n_layers layers and an MTP head, random bf16 weights, every expert
    resident (bench/engine_speed.py's reader and synthetic experts)."""
    import ml_dtypes

    from engine_speed import QWEN3_NEXT_80B, RandomDeviceReader
    from synthetic_experts import SyntheticStore
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
    store = SyntheticStore("bf16", cfg.hidden_size, cfg.moe_intermediate_size, n_moe, cfg.num_experts)
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
    ap.add_argument("--layers", default="4,12")
    ap.add_argument("--k", type=int, default=4, help="drafts a verify window offers per row")
    ap.add_argument("--context", type=int, default=4096, help="position of the rows (real shapes; demo: 256)")
    ap.add_argument("--windows", type=int, default=16, help="windows per timed round")
    ap.add_argument("--acceptance", type=float, default=None,
                    help="per-draft acceptance spec_tok_s_b1 is given at (the trained tiny model's measured rate)")
    ap.add_argument("--smoke", action="store_true", help="real shapes but 16 experts and a 4K vocabulary (a CPU)")
    ap.add_argument("--out", default=None, help="JSON file to write (default bench/results/<name>.json)")
    args = ap.parse_args()
    result = {"bench": "spec_speed", **results_file.stamp(), "k": args.k, "acceptance": args.acceptance}
    if args.real_shapes:
        counts = [int(x) for x in args.layers.split(",")]
        per = {}
        for n in counts:
            print(f"{n} layers:", flush=True)
            engine = real_engine(n, args.k, args.context, args.smoke)
            per[n] = measure(engine, args.k, args.context, args.windows, BATCHES)
            del engine
        result.update(model="qwen3-next-80b shapes, random weights" + (" (smoke)" if args.smoke else ""),
                      context=args.context, layers=per)
        ns = np.array(counts, float)
        figures = {}
        for key in per[counts[0]]:
            ts = np.array([per[n][key] for n in counts])
            slope, fixed = np.polyfit(ns, ts, 1) if len(ns) > 1 else (ts[0] / ns[0], 0.0)
            figures[key] = float(fixed + REAL_LAYERS * slope)
        result["at_48_layers"] = figures
        name = "spec_speed_real_shapes" + ("_smoke" if args.smoke else "")
    else:
        from strata import Engine
        context = min(args.context, 256)
        engine = Engine.load(args.model, max_context=context + 64, prefill=16, parallel=max(BATCHES), spec=args.k,
                             mtp=True, say=lambda line: None)
        figures = measure(engine, args.k, context, args.windows, BATCHES)
        result.update(model=args.model, context=context, note="random weights: timings only")
        name = f"spec_speed_{args.model}_{engine.backend.device.platform}"
    result.update(figures)
    for b in BATCHES:
        result[f"spec_verify_cost_ratio_b{b}"] = figures[f"verify_s_b{b}"] / figures[f"plain_s_b{b}"]
        result[f"plain_tok_s_b{b}"] = b / figures[f"plain_s_b{b}"]
        result[f"spec_tok_s_by_acceptance_b{b}"] = {
            f"{a:.1f}": b * emitted(a, args.k) / figures[f"verify_s_b{b}"] for a in np.arange(0.0, 1.01, 0.1)}
    if args.acceptance is not None:
        result["spec_tok_s_b1"] = emitted(args.acceptance, args.k) / figures["verify_s_b1"]
    print(f"verify {args.k}+1 / 1-token window, batch 1: {result['spec_verify_cost_ratio_b1']:.2f}"
          + (f"; spec_tok_s_b1 at acceptance {args.acceptance}: {result['spec_tok_s_b1']:.1f}"
             if args.acceptance is not None else ""))
    path = results_file.write(result, args.out, name)
    if path.parent == summary.RESULTS:
        summary.refresh()
    return 0


if __name__ == "__main__":
    sys.exit(main())
