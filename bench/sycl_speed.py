"""The SYCL backend on the demo model: prompt and decode tokens/s, and device launches per decoded token.

    python bench/sycl_speed.py                       # OpenCL CPU device -> bench/results/sycl_speed_cpu.json
    python bench/sycl_speed.py --device level_zero:gpu:0 --out bench/results/sycl_speed_gpu.json

On the CPU device this is a correctness path, not a speed claim: every launch costs tens of microseconds there. The
number that decides speed on an Intel GPU is the count of device launches per decoded token, counted by the
backend (SyclBackend.count_launches: every task submitted to the queue, dpnp's and the backend's own kernels, plus
the host uploads it makes). It is split into the part outside the layers (embedding, final norm, lm_head, sampling:
a forward pass with no layers) and the part per layer (per layer kind: a forward pass with only that layer), and
broken down by op; the goal is fewer than 15 launches per layer per window. A window of S slots runs the decode
rows together (strata/backend.py's rows mode): projections, routing and experts over the S rows at once, and
the state ops (attention, the gated delta rule) as one kernel over all S rows each, so a window costs about what one
row costs. The window figures are counted on the WindowRunner, less the one-row count outside the layers.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import results_file  # noqa: E402  (bench/, beside this script)
from engine_speed import measure  # noqa: E402

GOAL_PER_LAYER = 15
# the backend ops whose launches are counted apart (a fused op counts its inner ops' launches as its own)
OPS = ("norm_linears", "linears", "linear_add", "swiglu_out", "route", "expert_slots", "attention_block",
       "delta_block", "rms_norm", "linear", "silu", "sigmoid", "softplus", "softmax", "rope", "kv_write", "attention",
       "causal_conv", "gated_delta_step", "gated_delta_chunked", "valid_mask", "take_row", "set_row", "topk",
       "experts_pool", "route_counts", "sample")
XP = ("where", "repeat", "sum", "sqrt", "exp", "zeros_like", "arange", "all", "isfinite")


def machine(ops) -> str:
    import dpctl
    import dpnp

    from strata.sycl_backend import runtime
    return (f"sycl:{runtime.describe(ops.sycl_device)} ({platform.node()}, dpnp {dpnp.__version__}, "
            f"dpctl {dpctl.__version__}, {platform.processor() or platform.machine()})")


def decode_fn(engine, cfg, params, n_tokens=1):
    """One decode step of a fresh sequence holding 8 tokens, for a model restricted to (cfg, params)."""
    from strata.model.forward import forward, init_state
    ops = engine.backend
    sp = (np.zeros(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32), np.zeros(1, np.float32))
    seed = np.zeros(2, np.uint32)
    state = ops.to_device(init_state(cfg, engine.capacity, engine.dtype, engine.kv_dtype))
    prompt = np.arange(3, 11, dtype=np.int32)
    args = engine.path.args()
    _, state = forward(ops, cfg, params, state, prompt, np.int32(0), np.int32(8),
                       engine.path.traced(engine.layout, args, np.int32(8)), all_logits=False)
    box = {"state": state, "pos": 8}

    def step():
        one = np.int32(1)
        logits, box["state"] = forward(ops, cfg, params, box["state"], np.array([7], np.int32), np.int32(box["pos"]),
                                       one, engine.path.traced(engine.layout, args, one), all_logits=False)
        nxt = ops.sample(logits, *sp, ops.prng_keys(seed[None], np.int32(box["pos"])[None]))
        box["pos"] += 1
        return int(nxt[0])
    return step


def count(ops, fn, n=4) -> float:
    fn()
    with ops.count_launches() as c:
        for _ in range(n):
            fn()
    return c.device_launches / n, c.ops / n


def breakdown(ops, fn) -> dict:
    """Device launches per op (top-level calls only) for one call of fn; the rest is dpnp array arithmetic written
    in the forward pass (x + y, astype, slices that copy, ...)."""
    stats, calls = collections.Counter(), collections.Counter()
    depth = [0]
    saved = {}

    def wrap(label, f):
        @functools.wraps(f)
        def g(*a, **k):
            c = ops._counter
            before = c.device_launches if c else 0
            depth[0] += 1
            try:
                return f(*a, **k)
            finally:
                depth[0] -= 1
                if c is not None and depth[0] == 0:
                    stats[label] += c.device_launches - before
                    calls[label] += 1
        return g

    for name in OPS:
        saved[name] = ops.__dict__.get(name)
        setattr(ops, name, wrap(name, getattr(ops, name)))
    for name in XP:
        saved["xp." + name] = ops.xp.__dict__.get(name)
        ops.xp.__dict__[name] = wrap("xp." + name, getattr(ops.xp, name))
    try:
        fn()
        with ops.count_launches() as c:
            fn()
    finally:
        for name in OPS:
            if saved[name] is None:
                delattr(ops, name)
        for name in XP:
            ops.xp.__dict__.pop(name, None)
    out = {k: {"launches": v, "calls": calls[k]} for k, v in stats.most_common()}
    out["forward arithmetic (dpnp operators)"] = {"launches": c.device_launches - sum(stats.values())}
    return out


def subtract(a: dict, b: dict) -> dict:
    """Launches per op of a layer: a decode step with the layer minus one without any layer."""
    out = {}
    for k, v in a.items():
        n = v["launches"] - b.get(k, {}).get("launches", 0)
        calls = v.get("calls", 0) - b.get(k, {}).get("calls", 0)
        if n or calls:
            out[k] = {"launches": n, **({"calls": calls} if "calls" in v else {})}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["launches"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="opencl:cpu")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sycl_speed_cpu.json"))
    args = ap.parse_args()

    from strata import Engine
    from strata.engine.runner import WindowRunner
    from strata.plan import idle_plan
    t0 = time.perf_counter()
    engine = Engine.load("demo", backend="sycl", device=args.device, max_context=args.prompt + args.decode + 64,
                         prefill=args.prompt)
    ops, cfg, params = engine.backend, engine.cfg, engine.params
    load_s = time.perf_counter() - t0
    print(f"sycl_speed: {machine(ops)}; demo loaded in {load_s * 1000:.0f} ms (the kernels build at first use, "
          f"before the timed runs)", flush=True)
    speed = measure(engine, args.prompt, args.decode, args.repeat)
    print(f"sycl_speed: prompt {speed['prompt_tok_s']:.0f} tok/s, decode {speed['decode_tok_s_b1']:.1f} tok/s",
          flush=True)

    # launches: the whole decode step, the part outside the layers, one layer of each kind
    total, total_ops = count(ops, decode_fn(engine, cfg, params))
    no_layers = decode_fn(engine, dataclasses.replace(cfg, layer_types=()), dict(params, layers=[]))
    fixed, fixed_ops = count(ops, no_layers)
    fixed_breakdown = breakdown(ops, no_layers)
    per_kind = {}
    for kind in sorted(set(cfg.layer_types)):
        i = cfg.layer_types.index(kind)
        one = decode_fn(engine, dataclasses.replace(cfg, layer_types=(kind,)),
                        dict(params, layers=[params["layers"][i]]))
        n, n_ops = count(ops, one)
        per_kind[kind] = {"launches": n - fixed, "python_calls": n_ops - fixed_ops,
                          "breakdown": subtract(breakdown(ops, one), fixed_breakdown)}
    n_layers = len(cfg.layer_types)
    per_layer = (total - fixed) / n_layers
    print(f"sycl_speed: {total:.0f} device launches per decoded token = {fixed:.0f} outside the layers + "
          f"{per_layer:.1f} per layer (" + ", ".join(f"{k} {v['launches']:.0f}" for k, v in per_kind.items())
          + f"); goal < {GOAL_PER_LAYER} per layer", flush=True)

    # a window of S slots' decode rows on the WindowRunner
    windows = {}
    for s in (1, 4):
        runner = WindowRunner(engine, s, 16)
        plan = dataclasses.replace(idle_plan(s), decode_active=np.ones(s, bool), decode_tokens=np.full(s, 7, np.int32),
                                   decode_pos=np.arange(8, 8 + s, dtype=np.int32))
        n, _ = count(ops, lambda: runner.run(plan))
        t = time.perf_counter()
        for _ in range(8):
            runner.run(plan)
        dt = (time.perf_counter() - t) / 8
        windows[s] = {"launches_per_window": n, "launches_per_layer_per_window": (n - fixed) / n_layers,
                      "window_s": dt, "decode_tok_s": s / dt}
        print(f"sycl_speed: window of {s} decode rows: {n:.0f} launches ({(n - fixed) / n_layers:.1f} per layer), "
              f"{s / dt:.1f} tok/s", flush=True)

    out = {
        "bench": "sycl_speed",
        "machine": machine(ops),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": results_file.commit(),
        "model": "demo",
        "dtype": "float32",
        "note": "demo model: random weights; the CPU device is a correctness path, not a speed claim",
        "load_s_incl_kernel_build": load_s,
        **speed,
        "launches": {
            "per_decoded_token": total,
            "outside_layers_per_token": fixed,
            "outside_layers_breakdown": fixed_breakdown,
            "per_layer_per_token": per_layer,
            "per_layer_kind": per_kind,
            "python_calls_per_token": total_ops,
            "goal_per_layer_per_window": GOAL_PER_LAYER,
            "windows": windows,
            "counted": "tasks submitted to the device queue (dpnp kernels and copies, the backend's OpenCL "
                       "kernels) + host uploads the backend makes; python_calls: backend ops and ops.xp calls",
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"sycl_speed: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
