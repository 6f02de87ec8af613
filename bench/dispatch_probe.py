"""How much of a decode window is the host's, and what dispatching windows ahead of their results would give.

    python bench/dispatch_probe.py --out OUT.json        # GPU: Qwen3-Next-80B-A3B shapes, int4 experts resident
    python bench/dispatch_probe.py --smoke               # the same code on a CPU in a minute (tiny shapes)

bench/launch_probe.py's traces (H200, 8 layers) found a one-row window taking ~2.15 ms while the compute stream was
busy ~0.95 ms of it. Per batch (WindowRunner rows), this times the same compiled decode window called five ways:
- runner: WindowRunner.run(plan), the server's path, the plan advanced as the scheduler advances steady decoding
  (the rows stay on the device); runner_resend: the same plan each time (its rows are sent each window);
- same_rows: the compiled window alone, its rows a device-side copy of one array, result read back each call;
- fresh_rows: the same with the rows array sent from the host before each call;
- chained: N calls dispatched back to back, each taking the rows its predecessor returned, one read at the end:
  the window's rate when the host dispatches ahead of the device (the bound of an asynchronous scheduler);
- device_put and to_host alone (one [3, S] int32 array each way).
The window's device time comes from a profiler trace (the compute stream's busy time).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402


def per_call_ms(fn, n: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return 1000 * (time.perf_counter() - t) / n


def probe_batch(engine, batch: int, context: int, n: int) -> dict:
    import jax

    from strata.engine.runner import WindowRunner, _with_result_rows
    from strata.plan import idle_plan
    from trace_summary import trace_summary
    runner = WindowRunner(engine, batch, 16)
    t = time.perf_counter()
    runner.warm_up()
    warm_s = time.perf_counter() - t
    plan = replace(idle_plan(batch), decode_active=np.ones(batch, bool), decode_pos=np.full(batch, context, np.int32),
                   decode_tokens=np.arange(batch, dtype=np.int32))
    r = {"batch": batch, "warm_up_s": warm_s,
         "runner_resend_ms": per_call_ms(lambda: runner.run(plan), n)}        # the same plan: rows sent each time
    state = {"plan": plan}

    def advance():          # as the scheduler plans steady decoding: each row's token, position + 1, step + 1
        p = state["plan"]
        res = runner.run(p)
        state["plan"] = replace(p, decode_tokens=res.decode_next, decode_pos=p.decode_pos + 1, steps=p.steps + 1)
    r["runner_ms"] = per_call_ms(advance, n)
    e, ops = engine, engine.backend
    rows_np = _with_result_rows(np.stack([plan.decode_tokens, plan.decode_pos, plan.steps]))   # [ROWS, S]
    stable = runner.window_args(plan)
    rows_dev = ops.to_device(rows_np)

    def call(rows):             # rows are donated: each call gets its own copy
        runner.states, rows_out = runner._decode(e.params, e.expert_args(), runner.states, rows + 0, *stable)
        return runner._peel(rows_out)
    r["same_rows_ms"] = per_call_ms(lambda: np.asarray(call(rows_dev)), n)
    def fresh():
        runner.states, rows_out = runner._decode(e.params, e.expert_args(), runner.states, ops.to_device(rows_np),
                                                 *stable)
        return np.asarray(runner._peel(rows_out))
    r["fresh_rows_ms"] = per_call_ms(fresh, n)


    def chained():              # the successor's rows as the window returns them (donated: the same buffer)
        rows = rows_dev + 0
        for _ in range(n):
            runner.states, rows = runner._decode(e.params, e.expert_args(), runner.states, rows, *stable)
        return np.asarray(runner._peel(rows))
    chained()
    t = time.perf_counter()
    chained()
    r["chained_ms"] = 1000 * (time.perf_counter() - t) / n
    r["device_put_ms"] = per_call_ms(lambda: jax.block_until_ready(ops.to_device(rows_np)), n)
    out = call(rows_dev)
    r["to_host_ms"] = per_call_ms(lambda: np.asarray(ops.to_host(out + 0)), n)
    trace = trace_summary(lambda: np.asarray(call(rows_dev)), top=5)
    gpu = [x for k, x in trace.items() if isinstance(x, dict) and "GPU" in k]
    busy = max(gpu, key=lambda x: x.get("events", 0)) if gpu else {}
    r["device_busy_ms"], r["device_events"] = busy.get("busy_ms"), busy.get("events")
    return r




def probe_ahead(engine, batch: int, context: int, n: int) -> dict:
    """The runner's windows dispatched ahead (dispatch(next, after=w), then collect(w), as engine_speed's ahead loop
    and the scheduler's lookahead do), with the host's time split: in the compiled call, in start_to_host, in the
    rest of dispatch, in collect. At 48 layers and batch 1 (1c03f95) dispatch took 6.06 ms of a 6.33 ms window
    (2.45 ms one by one), as if the call waited for the window before it. Variants: as the runner runs; without
    start_to_host (the result read when collected); and the bare compiled call chained with each window's result
    kept alive and read one window later (no runner). Markers on stderr ("== ahead: <variant>") let the XLA log
    (TF_CPP_VMODULE=command_buffer_thunk=3) be split by variant."""
    from strata.engine.runner import WindowRunner, _decode_rows, _result_rows, _with_result_rows
    from strata.plan import idle_plan
    runner = WindowRunner(engine, batch, 16)
    ops = engine.backend
    plan = replace(idle_plan(batch), decode_active=np.ones(batch, bool), decode_pos=np.full(batch, context, np.int32))
    tokens = runner.run(replace(plan, decode_tokens=np.arange(batch, dtype=np.int32))).decode_next   # compiles
    step = lambda i, tok: replace(plan, decode_tokens=tok, decode_pos=plan.decode_pos + i,  # noqa: E731
                                  steps=plan.steps + i)
    spent = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    decode, start = runner._decode, ops.start_to_host
    out = {}
    for variant in ("runner", "no_start_to_host", "runner_again"):
        print(f"== ahead: {variant}", file=sys.stderr, flush=True)
        runner._decode = timed("call", decode)
        ops.start_to_host = timed("start_to_host", (lambda x: None) if variant == "no_start_to_host" else start)
        try:
            for _ in range(2):                      # the second round is the one kept (the first warms the path)
                spent.clear()
                t = time.perf_counter()
                w = timed("dispatch", runner.dispatch)(step(1, tokens))
                for i in range(2, n + 2):
                    w_next = (timed("dispatch", runner.dispatch)(step(i, np.full(batch, -1, np.int32)), after=w)
                              if i <= n else None)
                    tokens = timed("collect", runner.collect)(w).decode_next
                    w = w_next
                total = time.perf_counter() - t
        finally:
            runner._decode, ops.start_to_host = decode, start
        out[variant] = {"window_ms": 1000 * total / n, **{f"{k}_ms": 1000 * v / n for k, v in spent.items()}}
    e = engine
    stable = runner.window_args(plan)
    # the window as it was before 770b404+: its result a fresh output array of the window itself (a new address
    # each window while the last one is still held), against the runner's form (results peeled by a second call)
    def fresh_result(states, rows):
        return _result_rows(rows), states, rows
    fresh = ops.compile(lambda *args, greedy: fresh_result(*_decode_rows(ops, e.cfg, e.layout, *args, greedy=greedy)),
                        donate_argnums=(2, 3), static_argnames=("greedy",))
    peeled = lambda *args, greedy: (lambda st, r: (runner._peel(r), st, r))(  # noqa: E731
        *runner._decode(*args, greedy=greedy))
    for variant, fn in (("bare_chain_fresh_result", fresh), ("bare_chain_peeled", peeled)):
        print(f"== ahead: {variant}, results read one window late", file=sys.stderr, flush=True)
        rows = ops.to_device(_with_result_rows(np.stack([np.asarray(tokens, np.int32), plan.decode_pos, plan.steps])))
        for _ in range(2):
            spent.clear()
            t = time.perf_counter()
            prev = None
            call, read = timed("call", fn), timed("read", np.asarray)
            for _ in range(n):
                res, runner.states, rows = call(e.params, e.expert_args(), runner.states, rows, *stable, greedy=True)
                if prev is not None:
                    read(prev)
                prev = res
            np.asarray(prev)
            total = time.perf_counter() - t
        out[variant] = {"window_ms": 1000 * total / n, **{f"{k}_ms": 1000 * v / n for k, v in spent.items()}}
    print("== ahead: end", file=sys.stderr, flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--ahead-only", action="store_true",
                    help="only probe_ahead (the runner's windows dispatched ahead, the host's time split)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import jax
    import ml_dtypes

    from engine_speed import QWEN3_NEXT_80B, RandomDeviceReader
    from strata.backend import get_backend
    from strata.config import Settings
    from strata.engine import Engine
    from strata.model.config import ModelConfig
    from strata.model.params import params_from_reader
    from synthetic_experts import SyntheticStore
    over = {"num_experts": 16, "vocab_size": 4096} if args.smoke else {}
    cfg = ModelConfig.from_hf(dict(QWEN3_NEXT_80B, num_hidden_layers=args.layers, **over), source="dispatch probe")
    backend = get_backend("jax", kernels="auto")
    params = params_from_reader(cfg, RandomDeviceReader(ml_dtypes.bfloat16))
    engine = Engine(cfg, params, backend, Settings.build(dtype="bfloat16", max_context=args.context + 64,
                                                         prefill=16, parallel=4, kernels="auto"))
    n_moe = sum(cfg.is_sparse_layer(i) for i in range(args.layers))
    engine.attach_experts(SyntheticStore("int4", cfg.hidden_size, cfg.moe_intermediate_size, n_moe,
                                         cfg.num_experts), say=lambda line: None)
    result = {"bench": "dispatch_probe", **results_file.stamp(), "layers": args.layers, "context": args.context,
              "device": str(jax.devices()[0]), "batches": {}}
    result["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    print(f"XLA_FLAGS={result['xla_flags']!r}")
    print("| batch | runner ms | runner resend ms | same rows ms | fresh rows ms | chained ms | device busy ms "
          "| put ms | read ms |")
    for b in [int(x) for x in args.batches.split(",")]:
        if args.ahead_only:
            r = result["batches"][b] = probe_ahead(engine, b, args.context, args.windows)
            for variant, v in r.items():
                print(f"ahead b{b} {variant}: " + ", ".join(f"{k} {x:.3f}" for k, x in v.items()), flush=True)
            continue
        r = probe_batch(engine, b, args.context, args.windows)
        result["batches"][b] = r
        print(f"| {b} | {r['runner_ms']:.3f} | {r['runner_resend_ms']:.3f} | {r['same_rows_ms']:.3f} | "
              f"{r['fresh_rows_ms']:.3f} | {r['chained_ms']:.3f} | {r['device_busy_ms']} | "
              f"{r['device_put_ms']:.3f} | {r['to_host_ms']:.3f} |",
              flush=True)
    results_file.write(result, args.out, "dispatch_probe" + ("_smoke" if args.smoke else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
