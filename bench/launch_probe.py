"""Where a decoded token's time goes on a GPU, and what XLA's command buffers (CUDA graphs) change.

    python bench/launch_probe.py --out OUT.json          # GPU: one child process per XLA_FLAGS variant
    python bench/launch_probe.py --smoke                 # the same on a CPU in a minute (tiny shapes)

Per variant (a fresh process, since XLA reads its flags once): random weights at Qwen3-Next-80B-A3B shapes (int4
experts, all resident), decode at batch 1 (ms per token through the engine API, host clock with a sync per token, as
engine_speed; and one-row windows through the WindowRunner, the server's path, traced too) and a window of 4 rows;
a profiler trace of one decode token (the compute stream's busy time against its span, the number
of kernels, the host's time in Execute). The copy probe asks whether copies of pinned host rows inside a compiled
function (device_put of a dynamic slice, static count) overlap compute that does not depend on them: the time of
copies alone, compute alone and both in one function.
(Whether XLA used command buffers shows in the timings, the no_command_buffers variant against the others: the
optimized HLO text that `compiled.as_text()` returns does not show them.)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402

ALL_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
VARIANTS = {           # name -> (XLA_FLAGS added, kernels)
    "default": ("", "auto"),
    "no_command_buffers": ("--xla_gpu_enable_command_buffer=", "auto"),
    "all_command_buffers": (f"--xla_gpu_enable_command_buffer={ALL_COMMANDS} --xla_gpu_graph_min_graph_size=1",
                            "auto"),
    "default_xla_kernels": ("", "xla"),      # the kernels' share: auto against xla under the same flags
}


def child(variant: str, layers: int, context: int, smoke: bool) -> dict:
    import jax
    import ml_dtypes

    from engine_speed import measure_batched
    from strata.demo import QWEN3_NEXT_80B
    from strata.jax_backend.random_weights import RandomDeviceReader
    from strata.backend import get_backend
    from strata.config import Settings
    from strata.engine import Engine
    from strata.model.config import ModelConfig
    from strata.model.params import params_from_reader
    from strata.experts.synthetic import SyntheticStore
    from trace_summary import trace_summary
    kernels = VARIANTS[variant][1]
    over = {"num_experts": 16, "vocab_size": 4096} if smoke else {}
    cfg = ModelConfig.from_hf(dict(QWEN3_NEXT_80B, num_hidden_layers=layers, **over), source="probe")
    backend = get_backend("jax", kernels=kernels)
    params = params_from_reader(cfg, RandomDeviceReader(ml_dtypes.bfloat16))
    engine = Engine(cfg, params, backend, Settings.build(dtype="bfloat16", max_context=context + 64, prefill=16,
                                                         parallel=4, kernels=kernels))
    n_moe = sum(cfg.is_sparse_layer(i) for i in range(layers))
    engine.attach_experts(SyntheticStore("int4", cfg.hidden_size, cfg.moe_intermediate_size, n_moe,
                                         cfg.num_experts), say=lambda line: None)
    seq = engine.sequence()
    seq.read(np.arange(16) % cfg.vocab_size)
    seq.pos = context                      # decode at this context (the cache rows between are unread zeros)
    sp = (np.array([0.0], np.float32), np.array([0], np.int32), np.array([1.0], np.float32),
          np.array([0.0], np.float32))
    seed = np.zeros(2, np.uint32)
    tok = seq.decode(1, sp, seed, 1)
    for i in range(3):
        tok = seq.decode(tok, sp, seed, i + 2)
    n = 32
    t = time.perf_counter()
    for i in range(n):
        tok = seq.decode(tok, sp, seed, i + 10)
    ms_b1 = 1000 * (time.perf_counter() - t) / n
    seq.pos -= n + 4

    def one():
        nonlocal tok
        tok = seq.decode(tok, sp, seed, 99)
        seq.pos -= 1
    trace = trace_summary(one, top=40)
    ms_b4 = 1000 * measure_batched(engine, 4, context, 16)[0]
    # the server's path at batch 1: one decode window of one row through the WindowRunner, timed and traced
    from dataclasses import replace

    from strata.engine.runner import WindowRunner
    from strata.plan import idle_plan
    runner = WindowRunner(engine, 1, 16)
    runner.warm_up()
    plan = replace(idle_plan(1), decode_active=np.ones(1, bool), decode_pos=np.full(1, context, np.int32),
                   decode_tokens=np.ones(1, np.int32))
    window = lambda: runner.run(plan)            # noqa: E731 - the same position each time: timing only
    window()
    t = time.perf_counter()
    for _ in range(n):
        window()
    ms_runner_b1 = 1000 * (time.perf_counter() - t) / n
    runner_trace = trace_summary(window, top=40)
    return {"variant": variant, "xla_flags": os.environ.get("XLA_FLAGS", ""), "kernels": kernels,
            "pallas_ops": sorted(backend.pallas_ops), "layers": layers, "context": context,
            "decode_ms_per_token_b1": ms_b1, "decode_ms_per_window_b4": ms_b4, "trace": trace,
            "runner_ms_per_window_b1": ms_runner_b1, "runner_trace_b1": runner_trace,
            "device": str(jax.devices()[0])}


COPY_FORMS = {   # child name -> (how the rows are copied, XLA flags)
    "copy_probe": ("device_put", ""),
    "copy_probe_kernel": ("kernel", ""),
    # the copy kernel on a second stream (jax compute_on "gpu_stream:1", XLA's experimental stream annotation): the
    # way a window could copy one layer's experts while it computes another's
    "copy_probe_kernel_stream": ("kernel_stream", "--xla_gpu_experimental_stream_annotation=true"),
}


def copy_probe(smoke: bool, form: str = "device_put") -> dict:
    """Copies of pinned host rows (static count, dynamic rows) beside independent matmuls, in one function. form:
    device_put of each row (XLA's copies), the host-rows kernel (kernels/host_rows.py) on the compute stream, or
    that kernel on a second stream."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from strata.jax_backend.kernels.host_rows import copy_host_rows
    dev = jax.devices()[0]
    interpret = dev.platform != "gpu"
    nbytes = 4096 * 16 if smoke else 1_646_592            # one int4 expert blob at real shapes
    rows, m = (32, 4) if smoke else (512, 48)             # a host chunk of `rows` experts; m copied per call
    n_mm, d = (2, 256) if smoke else (12, 4096)
    kind = "pinned_host" if "pinned_host" in {x.kind for x in dev.addressable_memories()} else None
    host = np.random.default_rng(0).integers(0, 255, (rows, nbytes), dtype=np.uint8)
    chunk = jax.device_put(host, jax.sharding.SingleDeviceSharding(dev, memory_kind=kind)) if kind else \
        jax.device_put(host, dev)
    idx = jnp.asarray(np.random.default_rng(1).permutation(rows)[:m].astype(np.int32))
    a = jax.random.normal(jax.random.key(0), (d, d), jnp.bfloat16)

    def copies(chunk, idx):
        if form == "device_put":
            out = [jax.device_put(lax.dynamic_index_in_dim(chunk, idx[i], keepdims=False), jax.memory.Space.Device)
                   for i in range(m)]
            return jnp.stack(out)
        def kernel(chunk, idx):
            return copy_host_rows(jnp.zeros((m, nbytes), jnp.uint8), chunk, idx, 0, m, interpret=interpret)
        if form != "kernel_stream":
            return kernel(chunk, idx)
        from jax.experimental import compute_on as co
        # the function form: compute_on2 in JAX 0.10, renamed compute_on by 0.11 (whose context form is gone)
        on = getattr(co, "compute_on2", co.compute_on)
        return on(kernel, compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)(chunk, idx)

    def compute(a):
        x = a
        for _ in range(n_mm):
            x = jnp.tanh(x @ a)
        return x

    f_copy = jax.jit(copies)
    f_compute = jax.jit(compute)
    f_both = jax.jit(lambda chunk, idx, a: (copies(chunk, idx), compute(a)))

    def t(f, *args):
        jax.block_until_ready(f(*args))
        ts = []
        for _ in range(10):
            s = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts.append(time.perf_counter() - s)
        return 1000 * float(np.median(ts))
    got = np.asarray(f_copy(chunk, idx))
    assert np.array_equal(got, host[np.asarray(idx)]), "the probe's copies are wrong"
    r = {"copy_ms": t(f_copy, chunk, idx), "compute_ms": t(f_compute, a), "both_ms": t(f_both, chunk, idx, a),
         "copied_bytes": m * nbytes, "memory_kind": kind, "form": form}
    r["copy_gb_s"] = r["copied_bytes"] / r["copy_ms"] / 1e6
    r["overlap"] = (r["copy_ms"] + r["compute_ms"] - r["both_ms"]) / min(r["copy_ms"], r["compute_ms"])
    hlo = f_both.lower(chunk, idx, a).compile().as_text()
    r["hlo_async_ops"] = {k: len(re.findall(k, hlo)) for k in ("copy-start", "async-start", "dynamic-slice",
                                                                 "command_buffer", "_xla_stream_annotation")}
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-copy-probe", action="store_true")
    ap.add_argument("--dump", default=None, help="XLA's HLO dumps per variant under DUMP/<variant> (text)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child:
        r = copy_probe(args.smoke, COPY_FORMS[args.child][0]) if args.child in COPY_FORMS else \
            child(args.child, args.layers, args.context, args.smoke)
        print("RESULT " + json.dumps(r))
        return 0
    result = {"bench": "launch_probe", **results_file.stamp(), "runs": {}}
    base = os.environ.get("XLA_FLAGS", "")
    for v in [x for x in args.variants.split(",") if x] + ([] if args.no_copy_probe else list(COPY_FORMS)):
        flags = COPY_FORMS[v][1] if v in COPY_FORMS else VARIANTS[v][0]
        if args.dump and v not in COPY_FORMS:
            flags += f" --xla_dump_to={args.dump}/{v} --xla_dump_hlo_as_text"
        env = dict(os.environ, XLA_FLAGS=f"{base} {flags}".strip())
        cmd = [sys.executable, __file__, "--child", v, "--layers", str(args.layers), "--context", str(args.context)]
        p = subprocess.run(cmd + (["--smoke"] if args.smoke else []), env=env, capture_output=True, text=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            result["runs"][v] = {"error": (p.stderr or p.stdout)[-1500:]}
            print(f"{v}: FAILED\n{result['runs'][v]['error']}", flush=True)
            continue
        r = json.loads(line[-1][7:])
        result["runs"][v] = r
        if v in COPY_FORMS:
            print(f"{v}: copies {r['copy_ms']:.2f} ms ({r['copy_gb_s']:.1f} GB/s), compute "
                  f"{r['compute_ms']:.2f} ms, both {r['both_ms']:.2f} ms: overlap {100 * r['overlap']:.0f}% "
                  f"{r['hlo_async_ops']}", flush=True)
            continue
        gpu = {k: x for k, x in r["trace"].items() if "GPU" in k or "gpu" in k}
        busy = max(gpu.values(), key=lambda x: x.get("events", 0)) if gpu else {}
        host = r["trace"].get("/host:CPU / python", {})
        execute = next((ms for name, _, ms in host.get("top", []) if "Execute" in name), None)
        print(f"{v}: b1 {r['decode_ms_per_token_b1']:.2f} ms/token (engine API), "
              f"{r['runner_ms_per_window_b1']:.2f} ms/window (runner), b4 {r['decode_ms_per_window_b4']:.2f} ms/window"
              f"; compute stream busy {busy.get('busy_ms')} of span {busy.get('span_ms')} ms, "
              f"{busy.get('events')} events; host Execute {execute} ms", flush=True)
        for name, t in r["runner_trace_b1"].items():     # the server's path: where a one-row window's time goes
            if isinstance(t, dict) and t.get("span_ms", 0) >= 0.2:
                print(f"  runner b1 {name}: span {t['span_ms']} busy {t['busy_ms']} ms, {t['events']} events")
                for kname, count, ms in t["top"][:15]:
                    print(f"      {ms:8.3f} ms {count:5d}x {kname}")
    results_file.write(result, args.out, "launch_probe" + ("_smoke" if args.smoke else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
