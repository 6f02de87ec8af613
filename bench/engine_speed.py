"""Prompt and decode speed of the engine (the XLA-only baseline that later kernels are measured against).

    python bench/engine_speed.py --model demo                      # CPU: the demo model through Engine.load
    python bench/engine_speed.py --real-shapes --layers 4,8        # GPU: random weights at Qwen3-Next-80B-A3B shapes

Real shapes: 48 layers do not fit one H200 in bf16 (~154 GB of experts), so the model is built with fewer layers
(the 3:1 linear:full pattern kept), the time per layer is the least-squares slope over several layer counts, and a
48-layer figure is the intercept (embedding, final norm, lm_head) plus 48 x the slope. Bytes per decoded token are counted from the
parameter tree (experts at k/E of their size) plus the sequence state each token reads and writes.
Writes JSON (machine, date, commit, figures) to --out.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import results_file  # noqa: E402  (bench/, beside this script)
from strata.demo import QWEN3_NEXT_80B  # noqa: E402
from strata.jax_backend.random_weights import RandomDeviceReader  # noqa: E402
import summary  # noqa: E402  (bench/, beside this script)

REAL_LAYERS = 48
ROUNDS = 3          # decode timings: rounds of `decode` tokens or windows each, the median round kept


def timed(fn, repeat: int) -> float:
    """Median seconds of fn() over `repeat` runs; fn must block until its device work is done."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def measure(engine, prompt_len: int, decode_tokens: int, repeat: int) -> dict:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, engine.cfg.vocab_size, prompt_len).tolist()

    def read():
        seq = engine.sequence()
        seq.read(ids, part_size=engine.settings.sched.prefill)
        return seq

    t = time.perf_counter()
    read()                                                    # compile
    compile_prompt_s = time.perf_counter() - t
    say(f"prompt compiled and read once in {compile_prompt_s:.1f} s")
    # at least 3 reads: a median of 2 is their mean, so one slow read counts half (at f2417c9 this script's 8-layer
    # part measured 59.3 ms with --repeat 2, where prompt_probe's median of 3 reads of the same call gave 45.9 ms)
    reads = [timed(read, 1) for _ in range(max(repeat, 3))]
    t_prompt = float(np.median(reads))
    sp = (np.array([0.0], np.float32), np.array([0], np.int32), np.array([1.0], np.float32),
          np.array([0.0], np.float32))
    seed = np.zeros(2, np.uint32)
    say(f"prompt {prompt_len} tokens: median of {len(reads)} reads {1000 * t_prompt:.1f} ms "
        f"({prompt_len / t_prompt:.0f} tok/s)")
    seq = read()
    t = time.perf_counter()
    tok = seq.decode(1, sp, seed, 1)                          # compile
    compile_decode_s = time.perf_counter() - t
    per_round = []
    for r in range(ROUNDS):                                   # the median round, as measure_batched
        seq.pos -= decode_tokens if r else 0                  # the same positions each round (timing only)
        t = time.perf_counter()
        for step in range(decode_tokens):
            tok = seq.decode(tok, sp, seed, step + 2)         # int() of the token syncs every step
        per_round.append((time.perf_counter() - t) / decode_tokens)
    t_decode = float(np.median(per_round))
    say(f"engine API decode compiled in {compile_decode_s:.1f} s; {1000 * t_decode:.2f} ms per token")
    return {"prompt_tokens": prompt_len, "prompt_s": t_prompt, "prompt_reads_s": reads,
            "prompt_tok_s": prompt_len / t_prompt, "decode_s_per_token": t_decode, "decode_tok_s_b1": 1.0 / t_decode,
            "compile_prompt_s": compile_prompt_s, "compile_decode_s": compile_decode_s}


def say(line: str) -> None:
    """Progress on stdout as it happens: a run cut off at its time limit still shows how far it got."""
    print(f"  [{time.strftime('%H:%M:%S')}] {line}", flush=True)


def measure_batched(engine, batch: int, context: int, windows: int, ahead: bool = False) -> float:
    """Seconds per decode window of `batch` rows at position `context`, through the WindowRunner as the server runs
    them (one compiled window for all rows), in steady decoding as the scheduler plans it (token, position + 1,
    step + 1). ahead: each window is dispatched before the last one is read, as the scheduler's lookahead does.
    The rows' state is whatever warm-up left: timing does not depend on it."""
    from dataclasses import replace

    from strata.engine.runner import WindowRunner
    from strata.plan import idle_plan
    runner = WindowRunner(engine, batch, 16)
    plan = replace(idle_plan(batch), decode_active=np.ones(batch, bool),
                   decode_pos=np.full(batch, context, np.int32))
    # the first window compiles the decode (warm_up() would also compile the prompt-part buckets, unused here: at
    # real shapes each compilation costs seconds per layer, which kept runs of 12 and more layers past their limit)
    t = time.perf_counter()
    tokens = runner.run(replace(plan, decode_tokens=np.arange(batch, dtype=np.int32))).decode_next
    first_s = time.perf_counter() - t
    step = lambda i, tok: replace(plan, decode_tokens=tok, decode_pos=plan.decode_pos + i,  # noqa: E731
                                  steps=plan.steps + i)
    per_round, host = [], []
    spent = np.zeros(2)                       # a round's host seconds in dispatch() and in collect() (wait, read)

    def dispatch(plan, after=None):
        t0 = time.perf_counter()
        w = runner.dispatch(plan, after=after)
        spent[0] += time.perf_counter() - t0
        return w

    def collect(w):
        t0 = time.perf_counter()
        nxt = runner.collect(w).decode_next
        spent[1] += time.perf_counter() - t0
        return nxt
    for _ in range(ROUNDS):                   # the median round: one slow round (a pause on the host) is not the figure
        spent[:] = 0.0
        t = time.perf_counter()               # each round at positions context + 1 .. (timing only)
        if ahead:
            w = dispatch(step(1, tokens))
            for i in range(2, windows + 2):
                w_next = dispatch(step(i, np.full(batch, -1, np.int32)), after=w) if i <= windows else None
                tokens = collect(w)
                w = w_next
        else:
            for i in range(1, windows + 1):
                tokens = collect(dispatch(step(i, tokens)))
        per_round.append((time.perf_counter() - t) / windows)
        host.append(tuple(spent / windows))
    i = int(np.argsort(per_round)[len(per_round) // 2])
    s = float(per_round[i])
    say(f"batch {batch}{', dispatched ahead' if ahead else ''}: first window (compile) {first_s:.1f} s, then "
        f"{1000 * s:.2f} ms per window (host: {1000 * host[i][0]:.2f} ms in dispatch, {1000 * host[i][1]:.2f} in "
        f"collect)")
    return s, host[i]


# --- real shapes, random weights built on the device


def decode_bytes_per_token(cfg, params, context: int, expert_bytes: int, kv_dtype) -> dict:
    """HBM bytes one decoded token must move: weights it reads (k experts of expert_bytes each per sparse layer) +
    state it reads and writes (the KV cache in kv_dtype: int8 with a float32 scale per token and head)."""
    from strata.model.params import is_sparse
    kv_row = cfg.head_dim * np.dtype(kv_dtype).itemsize + (4 if np.dtype(kv_dtype) == np.int8 else 0)
    per_kind = {}
    for lp, kind in zip(params["layers"], cfg.layer_types):
        b = cfg.num_experts_per_tok * expert_bytes if is_sparse(lp) else 0
        for name, leaf in lp.items():
            b += leaf.size * leaf.dtype.itemsize
        if kind == "linear_attention":
            b += 2 * (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4)
        else:
            b += 2 * context * cfg.num_kv_heads * kv_row                                 # read K and V
        per_kind.setdefault(kind, b)
    row = params["embed"].shape[1] * params["embed"].dtype.itemsize
    head = params["lm_head"].size * params["lm_head"].dtype.itemsize + row
    n_full = REAL_LAYERS // 4
    total = head + n_full * per_kind["full_attention"] + (REAL_LAYERS - n_full) * per_kind["linear_attention"]
    return {"bytes_per_token_48_layers": total, "lm_head_and_embedding_bytes": head,
            "linear_layer_bytes": per_kind["linear_attention"], "full_layer_bytes": per_kind["full_attention"]}


def hbm_bandwidth() -> float:
    """Read+write bytes per second of a large elementwise op (the roofline's denominator)."""
    import jax
    import jax.numpy as jnp
    n = (1 << 30) if jax.devices()[0].platform == "gpu" else (1 << 24)
    x = jnp.ones((n,), jnp.float32)                           # 4 GiB on a GPU
    f = jax.jit(lambda a: a * 2.0)
    f(x).block_until_ready()
    t = timed(lambda: f(x).block_until_ready(), 5)
    return 2 * x.size * 4 / t


BATCHES = (1, 4, 16)  # decode windows through the WindowRunner (batch 1 too: the server's path); beside them the
                      # engine API's one-sequence decode (Sequence.decode: two calls and a sync per token)


def real_shapes(layer_counts: list[int], prompt_len: int, decode_tokens: int, repeat: int,
                overrides: dict | None = None, experts: str = "bf16", kernels: str = "auto", kv: str = "auto",
                partial=None, kernel_config=None) -> dict:
    """partial(out): called after each layer count with what is measured so far (a run cut short keeps it).
    kernel_config: the JAX backend's KernelConfig (default: its defaults); fields off their defaults make the run a
    comparison."""
    import ml_dtypes

    from strata.config import Settings
    from strata.engine import Engine
    from strata.backend import get_backend
    from strata.jax_backend.kernel_config import KernelConfig
    from strata.model.config import ModelConfig
    from strata.model.params import params_from_reader
    backend = get_backend("jax", kernels=kernels, kernel_config=kernel_config or KernelConfig())
    changed = backend.kernel_config.changed()
    out = {"layers": {}, "hbm_bytes_per_s": hbm_bandwidth(), "kernels": kernels,
           "free_memory_bytes_at_start": backend.free_memory_bytes(),
           "pallas_ops": sorted(backend.pallas_ops), "kernel_config": asdict(backend.kernel_config), "kv": kv}
    if changed:                                        # never a headline (bench/summary.py)
        out["comparison"] = ", ".join(f"{k} {v}" for k, v in changed.items())
    for n in layer_counts:
        cfg = ModelConfig.from_hf(dict(QWEN3_NEXT_80B, num_hidden_layers=n, **(overrides or {})),
                                  source=f"qwen3-next-80b shapes x{n}")
        t = time.perf_counter()
        params = params_from_reader(cfg, RandomDeviceReader(ml_dtypes.bfloat16))
        build_s = time.perf_counter() - t
        say(f"{n} layers: dense weights drawn in {build_s:.1f} s")
        engine = Engine(cfg, params, backend, Settings.build(
            dtype="bfloat16", max_context=prompt_len + 2 * decode_tokens + 8, prefill=min(prompt_len, 4096),
            parallel=max(BATCHES), kernels=kernels, kv=kv))
        from strata.experts.synthetic import SyntheticStore
        n_moe = sum(cfg.is_sparse_layer(i) for i in range(n))
        store = SyntheticStore(experts, cfg.hidden_size, cfg.moe_intermediate_size, n_moe, cfg.num_experts)
        t = time.perf_counter()
        engine.attach_experts(store, say=lambda line: None)          # every expert resident
        attach_s = time.perf_counter() - t
        say(f"{n} layers: {n_moe * cfg.num_experts} {experts} experts placed in {attach_s:.1f} s")
        r = out["layers"][n] = {"build_s": build_s, "attach_experts_s": attach_s,
                                **decode_bytes_per_token(cfg, params, prompt_len, store.layout.nbytes, engine.kv_dtype)}
        r.update(measure(engine, prompt_len, decode_tokens, repeat))
        if partial is not None:
            partial(out)
        for b in BATCHES:              # the .partial file after each batch: a 48-layer run cut off keeps them
            # host: the median round's seconds a window in the runner's dispatch() and in collect() (which waits)
            r[f"decode_s_per_window_b{b}"], r[f"decode_host_s_b{b}"] = measure_batched(engine, b, prompt_len,
                                                                                     decode_tokens)
            r[f"decode_ahead_s_per_window_b{b}"], r[f"decode_ahead_host_s_b{b}"] = measure_batched(
                engine, b, prompt_len, decode_tokens, ahead=True)
            if partial is not None:
                partial(out)
        print(f"  {n} layers: prompt {r['prompt_tok_s']:.0f} tok/s, decode (engine API) {r['decode_tok_s_b1']:.2f} tok/s, "
              + ", ".join(f"b{b} {1000 * r[f'decode_s_per_window_b{b}']:.1f} "
                          f"(ahead {1000 * r[f'decode_ahead_s_per_window_b{b}']:.1f}) ms/window" for b in BATCHES),
              flush=True)
        del engine, params
    # least squares over the layer counts: time = fixed + layers x per_layer (two points alone are at the mercy of noise)
    ns = np.array(sorted(out["layers"]), float)
    fits = [("prompt_s", "prompt"), ("decode_s_per_token", "decode_engine_api")]
    fits += [(f"decode_s_per_window_b{b}", f"decode_b{b}") for b in BATCHES]
    fits += [(f"decode_ahead_s_per_window_b{b}", f"decode_ahead_b{b}") for b in BATCHES]
    for key, per in fits:
        ts = np.array([out["layers"][int(n)][key] for n in ns])
        # one layer count: the time scaled in proportion (exact when that count is 48)
        slope, fixed = np.polyfit(ns, ts, 1) if len(ns) > 1 else (ts[0] / ns[0], 0.0)
        out[f"{per}_s_per_layer"] = float(slope)
        out[f"{per}_s_fixed"] = float(fixed)
        out[f"{per}_s_48_layers"] = float(fixed + REAL_LAYERS * slope)
        out[f"{per}_fit_max_residual_s"] = float(np.abs(ts - (fixed + slope * ns)).max())
    b = out["layers"][max(layer_counts)]
    out["prompt_tok_s_48_layers"] = prompt_len / out["prompt_s_48_layers"]
    out["decode_engine_api_tok_s_b1_48_layers"] = 1.0 / out["decode_engine_api_s_48_layers"]
    for batch in BATCHES:
        out[f"decode_tok_s_b{batch}_48_layers"] = batch / out[f"decode_b{batch}_s_48_layers"]
        out[f"decode_ahead_tok_s_b{batch}_48_layers"] = batch / out[f"decode_ahead_b{batch}_s_48_layers"]
    bytes_tok = b["bytes_per_token_48_layers"]
    out["decode_roofline_tok_s"] = out["hbm_bytes_per_s"] / bytes_tok
    out["decode_fraction_of_roofline"] = out["decode_tok_s_b1_48_layers"] / out["decode_roofline_tok_s"]
    return out


def main() -> int:
    from strata.jax_backend.kernel_config import KernelConfig
    from strata.jax_backend.xla_flags import command_buffer_update
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--real-shapes", action="store_true")
    ap.add_argument("--layers", default="4,8,12")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512 demo, 4096 real shapes)")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--experts", default="bf16", choices=("bf16", "int8", "int4", "nvfp4"),
                    help="real shapes: the format of the (all resident) experts; dense weights stay bf16")
    ap.add_argument("--kernels", default="auto", choices=("auto", "xla", "pallas"),
                    help="real shapes: the JAX backend's kernels (auto: the Pallas kernels that measured faster)")
    for f in fields(KernelConfig):      # a field off its default makes the run a comparison, never a headline
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                        help=f"real shapes: the JAX backend's KernelConfig.{f.name} (default {f.default})")
    ap.add_argument("--kv", default="auto", choices=("auto", "int8", "bfloat16"), help="real shapes: the KV cache")
    ap.add_argument("--command-buffer-update", default="skip_temp", choices=("skip_temp", "xla_default"),
                    help="the server's command_buffer_update setting, applied before JAX starts (default: the server's)")
    ap.add_argument("--smoke", action="store_true",
                    help="real shapes but 16 experts and a 4K vocabulary: checks the script on a CPU in seconds")
    ap.add_argument("--out", default=None, help="JSON file to write (default bench/results/<name>.json)")
    args = ap.parse_args()
    say(command_buffer_update(args.command_buffer_update))          # before the first JAX call (stamp's)
    stamp = results_file.stamp()
    if args.real_shapes:
        prompt = args.prompt or 4096
        path = {"xla": "XLA-only (no Pallas kernels)", "auto": "the Pallas kernels that measured faster (PALLAS_AUTO)",
                "pallas": "every Pallas kernel"}[args.kernels]
        result = {"bench": "engine_speed_real_shapes", **stamp, "path": path,
                  "dtype": "bfloat16", "experts": args.experts,
                  **real_shapes([int(x) for x in args.layers.split(",")], prompt, args.decode, args.repeat,
                                {"num_experts": 16, "vocab_size": 4096} if args.smoke else None, args.experts,
                                args.kernels, args.kv, partial=lambda out: results_file.write(
                                    {"bench": "engine_speed_partial", **stamp, **out},
                                    (args.out or "engine_speed") + ".partial", ""),
                                kernel_config=KernelConfig(**{f.name: getattr(args, f.name)
                                                              for f in fields(KernelConfig)}))}
        name = "engine_speed_real_shapes" + ("" if args.experts == "bf16" else f"_{args.experts}") + \
            f"_{args.kernels}" + ("" if args.kv == "auto" else f"_kv{args.kv}") + ("_smoke" if args.smoke else "")
        print(f"\n| figure | value |\n|---|---|\n"
              f"| HBM read+write | {result['hbm_bytes_per_s'] / 1e12:.2f} TB/s |\n"
              f"| prompt {prompt} tok, 48 layers (scaled) | {result['prompt_tok_s_48_layers']:.0f} tok/s |\n"
              f"| decode b1, engine API, 48 layers (scaled) | {result['decode_engine_api_tok_s_b1_48_layers']:.2f} tok/s |\n"
              + "".join(f"| decode b{b}, 48 layers (scaled) | {result[f'decode_tok_s_b{b}_48_layers']:.2f} tok/s "
                        f"(dispatched ahead {result[f'decode_ahead_tok_s_b{b}_48_layers']:.2f}) |\n"
                        for b in BATCHES) +
              f"| decode bytes/token, 48 layers | {result['layers'][max(result['layers'])]['bytes_per_token_48_layers'] / 1e9:.3f} GB |\n"
              f"| decode roofline | {result['decode_roofline_tok_s']:.0f} tok/s |\n"
              f"| decode fraction of roofline | {100 * result['decode_fraction_of_roofline']:.1f}% |")
    else:
        from strata import Engine
        prompt = args.prompt or 512
        engine = Engine.load(args.model, max_context=prompt + 2 * args.decode + 8, prefill=min(prompt, 1024))
        result = {"bench": "engine_speed", **stamp, "model": args.model, "dtype": str(engine.dtype),
                  "note": "demo model: random weights", **measure(engine, prompt, args.decode, args.repeat)}
        name = f"engine_speed_{args.model}_{engine.backend.device.platform}"
        print(f"prompt {prompt} tokens: {result['prompt_tok_s']:.0f} tok/s; decode b1: "
              f"{result['decode_tok_s_b1']:.1f} tok/s ({result['machine']})")
    path = results_file.write(result, args.out, name)
    if path.parent == summary.RESULTS:
        summary.refresh()
    return 0


if __name__ == "__main__":
    sys.exit(main())
