"""Decode and prompt speed with experts offloaded: a 16 GB card's expert cache on an H200.

    python bench/offload_speed.py                  # GPU: Qwen3-Next-80B-A3B shapes, 48 layers, int4 experts
    python bench/offload_speed.py --smoke          # the same script on a CPU in a minute (tiny shapes)

Random weights at real shapes; the routed experts in int4 (group 128) come from host RAM (strata/experts/synthetic.py),
the device cache is capped at --cache-gib (12 GiB stands for a 16 GB card). Routing from random weights is near
uniform; the skewed run adds a fixed router bias so that ~20% of each layer's experts take ~80% of the routes, and the
adaptive policy (decayed counts, swaps between windows) has something to find.

Per run: decode tokens/s at batch 1 and 4 (through the WindowRunner, as the server runs them), prompt tokens/s for a
4K and a 32K prompt, the hit rate, bytes copied host -> device per second, and the bound those bytes imply at the
best host-to-device rate measured in the same run (one large pinned buffer, expert-sized pinned buffers, or the
window's own copies): bound = that rate / bytes copied per token (misses and swaps).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402
import summary  # noqa: E402
from engine_speed import timed  # noqa: E402
from strata.demo import QWEN3_NEXT_80B  # noqa: E402
from strata.jax_backend.random_weights import RandomDeviceReader  # noqa: E402
from strata.experts.synthetic import SyntheticStore  # noqa: E402
from trace_summary import print_summary, trace_summary  # noqa: E402

GIB = 1 << 30


def _bytes_per_s(copy, nbytes: int) -> float:
    """nbytes over the median time of copy() (which blocks until its copy is done), after one untimed run."""
    copy()
    return nbytes / timed(copy, 3)


def h2d_rate(nbytes: int, n: int = 64) -> dict:
    """Host -> device bytes/s: `n` separate expert-sized numpy buffers (how misses are copied), and one large one."""
    import jax
    dev = jax.devices()[0]
    blobs = [np.random.default_rng(i).integers(0, 255, nbytes, dtype=np.uint8) for i in range(n)]
    per_blob = _bytes_per_s(lambda: jax.block_until_ready(jax.device_put(blobs, dev)), n * nbytes)
    big = np.concatenate(blobs)
    one = _bytes_per_s(lambda: jax.block_until_ready(jax.device_put(big, dev)), big.nbytes)
    pinned_host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    on_device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    pinned = [jax.device_put(b, pinned_host) for b in blobs]        # one pinned buffer per expert
    per_pinned = _bytes_per_s(lambda: jax.block_until_ready(jax.device_put(pinned, on_device)), n * nbytes)
    one_pinned = jax.device_put(np.zeros(1 << 30, np.uint8), pinned_host)    # the copy engine's own rate
    one_pinned_rate = _bytes_per_s(lambda: jax.block_until_ready(jax.device_put(one_pinned, on_device)),
                                   one_pinned.size)
    del one_pinned
    # the copies a window-fetch decode makes: rows of one pinned chunk, copied inside a compiled function (pool_fill)
    from strata.jax_backend.backend import JaxBackend
    ops = JaxBackend()
    chunk = ops.host_chunk(big.reshape(n, nbytes))
    pool = [ops.pool_alloc(n, nbytes)]                              # the pool is donated: each fill returns the next
    rows = np.arange(n)

    def fill():
        pool[0] = jax.block_until_ready(ops.pool_fill(pool[0], rows, [chunk], [0, n], rows))
    in_window = _bytes_per_s(fill, n * nbytes)
    rates = {"h2d_bytes_per_s_pinned_one_buffer": one_pinned_rate, "h2d_bytes_per_s_pinned_expert_buffers": per_pinned,
             "h2d_bytes_per_s_expert_buffers": per_blob, "h2d_bytes_per_s_one_buffer": one,
             "h2d_bytes_per_s_compiled_chunk_copies": in_window}
    # the bound's rate: the best host -> device rate measured here, whatever form of copy reached it
    best = max(("h2d_bytes_per_s_pinned_one_buffer", "h2d_bytes_per_s_pinned_expert_buffers",
                "h2d_bytes_per_s_compiled_chunk_copies"), key=rates.get)
    return {**rates, "bound_rate_bytes_per_s": rates[best], "bound_rate_from": best}


def build(cfg_overrides: dict, cache_slots: int | None, cache_gib: float, skew: float | None, max_context: int,
          prefill: int, adapt_swaps: int, window_fetch: bool, stream_parts: bool = True):
    import jax.numpy as jnp
    import ml_dtypes

    from strata.backend import get_backend
    from strata.config import Settings
    from strata.engine import Engine
    from strata.model.config import ModelConfig
    from strata.model.params import is_sparse, params_from_reader
    cfg = ModelConfig.from_hf(dict(QWEN3_NEXT_80B, num_hidden_layers=48, **cfg_overrides), source="qwen3-next shapes")
    ops = get_backend("jax")
    params = params_from_reader(cfg, RandomDeviceReader(ml_dtypes.bfloat16))
    hot = None
    if skew is not None:
        rng = np.random.default_rng(7)
        hot = [rng.choice(cfg.num_experts, max(1, cfg.num_experts // 5), replace=False) for _ in range(48)]
        for lp, h in zip([lp for lp in params["layers"] if is_sparse(lp)], hot):
            b = np.zeros(cfg.num_experts, np.float32)
            b[h] = skew
            lp["router_bias"] = jnp.asarray(b)
    store = SyntheticStore("int4", cfg.hidden_size, cfg.moe_intermediate_size, 48, cfg.num_experts)
    slots = cache_slots or int(cache_gib * GIB // store.layout.nbytes)
    opts = Settings.build(dtype="bfloat16", max_context=max_context, prefill=prefill, parallel=4,
                          expert_cache=min(slots, 48 * cfg.num_experts), adapt_swaps=adapt_swaps,
                          window_fetch=window_fetch, stream_parts=stream_parts)
    engine = Engine(cfg, params, ops, opts)
    lines = []
    engine.attach_experts(store, say=lines.append)
    return engine, store, hot, lines


def decode_run(engine, n_rows: int, tokens: int, warm: int, trace: bool = False, ahead: bool = True) -> dict:
    """n_rows sequences decoding together through the WindowRunner (a short prompt each, then `tokens` windows).
    ahead: each timed window is dispatched before the last one is read, as the server's lookahead does when the
    runner chains (every expert resident, or window fetch); otherwise one by one."""
    from strata.engine.runner import WindowRunner
    from strata.plan import idle_plan
    from strata.plan import PromptPart
    runner = WindowRunner(engine, n_rows, min(64, engine.settings.sched.prefill))
    rng = np.random.default_rng(1)
    nxt = np.zeros(n_rows, np.int32)
    base = idle_plan(n_rows)
    for s in range(n_rows):
        prompt = rng.integers(0, engine.cfg.vocab_size, 32).astype(np.int32)
        r = runner.run(replace(base, part=PromptPart(slot=s, tokens=prompt, start=0, last=True)))
        nxt[s] = r.part_next
    pos = np.full(n_rows, 32, np.int32)
    plan = replace(base, decode_active=np.ones(n_rows, bool))
    cache = engine.experts.cache

    def window():
        nonlocal nxt, pos
        r = runner.run(replace(plan, decode_tokens=nxt, decode_pos=pos))
        nxt, pos = r.decode_next.astype(np.int32), pos + 1
        return r

    for _ in range(warm):
        window()
    ahead = ahead and runner.chains
    st0 = dict(cache.stats.as_dict())
    t0 = time.perf_counter()
    call_s, between0 = 0.0, runner.between_s
    if ahead:         # the rows continue on the device: each plan's tokens are -1 (WindowPlan.continued)
        cur = replace(plan, decode_tokens=nxt, decode_pos=pos)
        w = runner.dispatch(cur)
        for i in range(tokens):
            following = cur.continued()
            w_next = runner.dispatch(following, after=w) if i < tokens - 1 else None
            r = runner.collect(w)
            call_s += r.decode_s
            w, cur = w_next, following
        nxt, pos = r.decode_next.astype(np.int32), cur.decode_pos
    else:
        for _ in range(tokens):
            call_s += window().decode_s                  # no prompt part here
    # the cache's host work between windows (refill, swaps): with window fetch it overlaps the next window's device
    # work, so it is part of runner.run's time but not necessarily of the window's
    between_s = runner.between_s - between0
    dt = time.perf_counter() - t0
    st = cache.stats.as_dict()
    extra = {}
    if trace:                         # after the timed windows, so the profiler costs them nothing
        extra["trace"] = trace_summary(window)
        print_summary(extra["trace"])
    hits, misses = st["hits"] - st0["hits"], st["misses"] - st0["misses"]
    copied = st["bytes_copied"] - st0["bytes_copied"]
    return {"rows": n_rows, "windows": tokens, "dispatched_ahead": ahead, "seconds": dt, "tok_s": n_rows * tokens / dt,
            "window_ms": 1000 * dt / tokens, "hit_rate": hits / max(hits + misses, 1),
            "decode_call_ms": 1000 * call_s / tokens, "between_windows_host_ms": 1000 * between_s / tokens,
            "swaps_per_window": (st["swaps"] - st0["swaps"]) / tokens,
            "bytes_copied_per_window": copied / tokens, "copy_bytes_per_s": copied / dt,
            "copy_seconds_share": (st["copy_seconds"] - st0["copy_seconds"]) / dt, **extra}


def prompt_run(engine, n: int) -> dict:
    cache = engine.experts.cache
    st0 = dict(cache.stats.as_dict())
    ids = np.random.default_rng(2).integers(0, engine.cfg.vocab_size, n).tolist()
    t = time.perf_counter()
    engine.sequence().read(ids, part_size=engine.settings.sched.prefill)
    dt = time.perf_counter() - t
    engine.experts.moe.settle()                  # streamed parts' routing counts (hits and misses)
    st = cache.stats.as_dict()
    return {"tokens": n, "seconds": dt, "tok_s": n / dt, "bytes_copied": st["bytes_copied"] - st0["bytes_copied"],
            "layers_streamed": st["streamed_layers"] - st0["streamed_layers"],
            "copy_bytes_per_s": (st["bytes_copied"] - st0["bytes_copied"]) / dt,
            "hit_rate": (st["hits"] - st0["hits"]) / max(st["hits"] - st0["hits"] + st["misses"] - st0["misses"], 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on a CPU: checks the script")
    ap.add_argument("--cache-gib", type=float, default=12.0)
    ap.add_argument("--decode", type=int, default=24)
    ap.add_argument("--warm", type=int, default=64,
                    help="windows before timing: the cache adapts (swaps between windows, up to 64 each)")
    ap.add_argument("--prompts", default="4096,32768", help="prompt lengths to time (empty: none)")
    ap.add_argument("--skew-bias", type=float, default=1.2,
                    help="router logit bias of the hot 20%% of experts (router logits have std ~1 at these random "
                         "weights; 1.2 gives them ~80%% of the top-10 routes)")
    ap.add_argument("--runs", default="uniform,skewed,resident")
    ap.add_argument("--layer-by-layer", action="store_true",
                    help="decode windows layer by layer, misses copied between layers (window_fetch off)")
    ap.add_argument("--batches", default="1,4", help="decode batch sizes to time")
    ap.add_argument("--no-stream-parts", action="store_true",
                    help="prompt parts copy only their misses into borrowed slots (stream_parts off)")
    ap.add_argument("--one-by-one", action="store_true",
                    help="read each decode window before dispatching the next (the server's --no-lookahead)")
    ap.add_argument("--trace", action="store_true",
                    help="after each decode run, profile one more window and print where its time went")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # before the first JAX call (stamp's); XLA's own allocator, as the offloading configs set it: the host mirror's
    # pinned chunks need it (docs/operations.md)
    print(results_file.server_xla_flags("xla_default"), flush=True)
    stamp = results_file.stamp()
    over, slots, prompts, prefill = {}, None, [int(x) for x in args.prompts.split(",") if x], 4096
    if args.smoke:
        over = {"num_experts": 32, "vocab_size": 1024, "hidden_size": 256, "moe_intermediate_size": 128,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_attention_heads": 2,
                "intermediate_size": 256, "shared_expert_intermediate_size": 128}
        slots, prompts, prefill = 48 * 32 // 3, [256], 128
    result = {"bench": "offload_speed", **stamp, "experts": "int4 (group 128)", "dense": "bfloat16",
              "path": ("XLA-only expert op; " + (
                  "layers run one at a time, misses copied into slots between them" if args.layer_by_layer else
                  "decode windows compiled whole, each layer's misses copied from pinned host chunks by the device "
                  "(window_fetch); prompt parts layer by layer, " + (
                      "misses through borrowed slots" if args.no_stream_parts else
                      "each layer's experts copied whole while the layer before computes (stream_parts)"))),
              "cache_gib": args.cache_gib, "window_fetch": not args.layer_by_layer,
              "stream_parts": not args.no_stream_parts, "runs": {}}
    if not args.smoke:
        result.update(h2d_rate(1 << 20 | (620 << 10)))
    for name, skew in (("uniform", None), ("skewed", args.skew_bias), ("resident", None)):
        if name not in args.runs.split(","):
            continue
        t = time.perf_counter()
        # "resident": every expert in the device cache (one compiled window, nothing copied): the compute floor
        n_slots = 48 * (32 if args.smoke else QWEN3_NEXT_80B["num_experts"]) if name == "resident" else slots
        engine, store, hot, lines = build(over, n_slots, args.cache_gib, skew, max(prompts, default=0) + 256, prefill,
                                          adapt_swaps=64, window_fetch=not args.layer_by_layer,
                                          stream_parts=not args.no_stream_parts)
        for line in lines:
            print(line, flush=True)
        run = {"build_s": time.perf_counter() - t, "slots": engine.experts.cache.n_slots,
               "slot_bytes": store.layout.nbytes, "experts_total": 48 * engine.cfg.num_experts,
               "decode": {}, "prompt": {}}
        for rows in [int(b) for b in args.batches.split(",") if b]:
            r = decode_run(engine, rows, args.decode, args.warm, trace=args.trace, ahead=not args.one_by_one)
            run["decode"][f"b{rows}"] = r
            print(f"{name}: decode b{rows} {r['tok_s']:.1f} tok/s, {r['window_ms']:.1f} ms/window "
                  f"({'dispatched ahead; ' if r['dispatched_ahead'] else ''}{r['decode_call_ms']:.1f} in the runner's "
                  f"calls, of which {r['between_windows_host_ms']:.1f} the "
                  f"cache's host work between windows, {r['swaps_per_window']:.0f} swaps), hit rate "
                  f"{100 * r['hit_rate']:.1f}%, {r['bytes_copied_per_window'] / 1e6:.0f} MB copied per window "
                  f"({r['copy_bytes_per_s'] / 1e9:.1f} GB/s)", flush=True)
        if hot is not None:
            run["skew_bias"] = skew
            counts = engine.experts.cache.routed
            run["hot_share_of_routes"] = float(sum(counts[p, h].sum() for p, h in enumerate(hot)) / counts.sum())
        if name == "uniform" and prompts:
            t = time.perf_counter()           # one untimed part first: its compilations are not a prompt's speed
            prompt_run(engine, min(prompts[0], prefill))
            run["prompt_warm_up_s"] = time.perf_counter() - t
            for n in prompts:
                r = prompt_run(engine, n)
                run["prompt"][str(n)] = r
                print(f"{name}: prompt {n} tokens {r['tok_s']:.0f} tok/s, {r['copy_bytes_per_s'] / 1e9:.1f} GB/s "
                      f"copied, hit rate {100 * r['hit_rate']:.1f}%", flush=True)
        result["runs"][name] = run
        results_file.write(result, args.out, "offload_speed_partial")      # what a cut-off call keeps
        del engine
        gc.collect()                      # the mirror's pinned chunks go before the next run pins its own
    rate = result.get("bound_rate_bytes_per_s")
    if rate:
        for run in result["runs"].values():
            for r in run["decode"].values():
                per_token = r["bytes_copied_per_window"] / r["rows"]
                r["copy_bound_tok_s"] = rate / per_token if per_token else None
                r["fraction_of_copy_bound"] = r["tok_s"] / r["copy_bound_tok_s"] if per_token else None
            for r in run["prompt"].values():        # the bound of a prompt: its bytes copied at the best rate
                r["copy_bound_tok_s"] = rate * r["tokens"] / r["bytes_copied"] if r["bytes_copied"] else None
                r["fraction_of_copy_bound"] = r["tok_s"] / r["copy_bound_tok_s"] if r["bytes_copied"] else None
        print(f"\nhost->device, pinned: {result['h2d_bytes_per_s_pinned_one_buffer'] / 1e9:.1f} GB/s in one 1 GiB "
              f"buffer, {result['h2d_bytes_per_s_pinned_expert_buffers'] / 1e9:.1f} GB/s in expert-sized buffers, "
              f"{result['h2d_bytes_per_s_compiled_chunk_copies'] / 1e9:.1f} GB/s as a window copies them; pageable: "
              f"{result['h2d_bytes_per_s_expert_buffers'] / 1e9:.1f} GB/s in expert-sized buffers, "
              f"{result['h2d_bytes_per_s_one_buffer'] / 1e9:.1f} GB/s in one buffer. The bound uses the best: "
              f"{rate / 1e9:.1f} GB/s ({result['bound_rate_from']})")
        print("| routing | batch | tok/s | hit rate | GB/s copied | bound (copy) tok/s | of bound |\n|---|---|---|---|---|---|---|")
        for name, run in result["runs"].items():
            for b, r in run["decode"].items():
                bound = r["copy_bound_tok_s"]
                print(f"| {name} | {b} | {r['tok_s']:.1f} | {100 * r['hit_rate']:.1f}% | "
                      f"{r['copy_bytes_per_s'] / 1e9:.1f} | {bound:.1f} | {100 * r['fraction_of_copy_bound']:.0f}% |"
                      if bound else f"| {name} | {b} | {r['tok_s']:.1f} | {100 * r['hit_rate']:.1f}% | 0 | - | - |")
            for n, r in run["prompt"].items():
                if r["copy_bound_tok_s"]:
                    print(f"| {name} | prompt {n} | {r['tok_s']:.0f} | {100 * r['hit_rate']:.1f}% | "
                          f"{r['copy_bytes_per_s'] / 1e9:.1f} | {r['copy_bound_tok_s']:.0f} | "
                          f"{100 * r['fraction_of_copy_bound']:.0f}% |")
    name = "offload_speed_smoke" if args.smoke else "offload_speed_h200_int4"
    path = results_file.write(result, args.out, name + ("_layer_by_layer" if args.layer_by_layer else ""))
    if not args.smoke and path.parent == summary.RESULTS:
        summary.refresh()
    return 0


if __name__ == "__main__":
    sys.exit(main())
