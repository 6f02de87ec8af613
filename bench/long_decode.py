"""Decode at long contexts, against each window's floor; and the host KV tier's candidate forms, timed before one is built.

    python bench/long_decode.py --part decode --out OUT.json   # GPU: 48 layers at Qwen3-Next-80B-A3B shapes, int4 experts
    python bench/long_decode.py --part tier --out OUT.json     # GPU: the host tier's forms, one attention layer (XLA's
                                                               # default allocator: pinned host memory usable)
    python bench/long_decode.py --part decode --smoke          # either on a CPU in a minute (tiny shapes)

decode: every expert resident, all KV on the device (or the newest kv_resident positions, the rest in pinned host
RAM); windows dispatched ahead through the WindowRunner (the server's path) at position `context` for 1, 4 and 16 rows (the KV's content is whatever it holds: the split-K kernel reads
the visible keys, timing does not depend on their values). Floor of a window: the weights it reads (dense, plus the
distinct experts b rows route to, expected E (1 - (1 - k/E)^b) a layer) and each row's KV, over the measured HBM rate.
tier: attention of b rows over H = context - resident host positions of one layer, three ways: the decode kernel
reading pinned host KV in place (kernel_pinned), the host KV copied to the device first then the kernel (staged), and
numpy over the host KV on the CPU's cores (cpu); beside the resident part's kernel time. Floor: 12 layers x the host
part's bytes over the measured pinned host -> device rate.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402
from engine_speed import decode_bytes_per_token, hbm_bandwidth, measure_batched, say, timed  # noqa: E402

N_FULL = 12                     # full-attention layers of the 48


def window_floor(cfg, params, expert_bytes: int, kv_dtype, batch: int, context: int) -> float:
    """Bytes one decode window of `batch` rows at `context` must read or write (48 layers)."""
    weights = decode_bytes_per_token(cfg, params, 0, expert_bytes, kv_dtype)["bytes_per_token_48_layers"]
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    n_moe = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_layers))
    distinct = e * (1 - (1 - k / e) ** batch)
    weights += n_moe * (distinct - k) * expert_bytes
    kv_row = cfg.head_dim * np.dtype(kv_dtype).itemsize + (4 if np.dtype(kv_dtype) == np.int8 else 0)
    kv = batch * N_FULL * 2 * context * cfg.num_kv_heads * kv_row
    return {"weights_bytes": int(weights), "kv_bytes": int(kv)}


def decode_part(args, out: dict, save) -> None:
    import ml_dtypes

    from strata.backend import get_backend
    from strata.config import Settings
    from strata.demo import QWEN3_NEXT_80B
    from strata.engine import Engine
    from strata.experts.synthetic import SyntheticStore
    from strata.jax_backend.random_weights import RandomDeviceReader
    from strata.model.config import ModelConfig
    from strata.model.params import params_from_reader
    over = {"num_experts": 16, "vocab_size": 4096, "num_hidden_layers": 4} if args.smoke else {"num_hidden_layers": 48}
    cfg = ModelConfig.from_hf(dict(QWEN3_NEXT_80B, **over), source="long decode")
    backend = get_backend("jax", kernels="auto")
    out.update(hbm_bytes_per_s=hbm_bandwidth(), pallas_ops=sorted(backend.pallas_ops), runs={})
    params = params_from_reader(cfg, RandomDeviceReader(ml_dtypes.bfloat16))
    n_moe = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_layers))
    store = SyntheticStore("int4", cfg.hidden_size, cfg.moe_intermediate_size, n_moe, cfg.num_experts)
    if any(len(spec.split(":")) > 5 for spec in args.engines.split(";")):
        out["pinned_h2d_bytes_per_s"] = pinned_rate()
        say(f"pinned host -> device: {out['pinned_h2d_bytes_per_s'] / 1e9:.1f} GB/s")
    for spec in args.engines.split(";"):
        kv, cap, par, contexts, batches, *resident = spec.split(":")
        cap, par, resident = int(cap), int(par), int(resident[0]) if resident else 0
        contexts = [int(c) for c in contexts.split(",")]
        batches = [int(b) for b in batches.split(",")]
        part = min(4096, resident // 2) if resident else 4096
        if args.smoke:
            cap, contexts, resident, part = 1024, [256, 1000], resident and 256, 64 if resident else 256
        t = time.perf_counter()
        engine = Engine(cfg, params, backend, Settings.build(dtype="bfloat16", max_context=cap + 64, prefill=part,
                                                             parallel=par, kernels="auto", kv=kv,
                                                             kv_resident=resident, kv_parked=0))
        engine.attach_experts(store, say=lambda line: None)
        free = backend.free_memory_bytes()
        say(f"engine kv {kv}, {par} slots x {cap + 64} positions" + (f", {resident} on the device" if resident else "")
            + f": built in {time.perf_counter() - t:.1f} s" + (f", {free / 2**30:.1f} GiB free" if free is not None
                                                               else ""))
        tag = f"{kv}" + (f"_kv{resident}" if resident else "")
        for ctx in contexts:
            for b in batches:
                key = f"{tag}_{ctx}_b{b}"
                s, host = measure_batched(engine, b, ctx, args.windows, ahead=True)
                gc.collect()                    # the runner's slot states (its KV: up to ~50 GB) before the next
                # with a host tier, the first window's move keeps half the window on the device (KvTiers.fit_slot)
                on_host = max(0, ctx - engine.kv_resident // 2) if resident else 0
                f = window_floor(cfg, params, store.layout.nbytes, engine.kv_dtype, b, ctx - on_host)
                floor_s = (f["weights_bytes"] + f["kv_bytes"]) / out["hbm_bytes_per_s"]
                row = {"kv": kv, "context": ctx, "batch": b, "s_per_window": s, "tok_s": b / s,
                       "host_s": list(host), **f, "floor_s": floor_s, "fraction_of_floor": floor_s / s}
                if resident:
                    host_kv = window_floor(cfg, params, store.layout.nbytes, engine.kv_dtype, b, on_host)["kv_bytes"]
                    copy_s = host_kv / out["pinned_h2d_bytes_per_s"]
                    row.update(kv_resident=resident, host_positions=on_host, host_kv_bytes=host_kv,
                               copy_floor_s=copy_s, fraction_of_copy_floor=copy_s / s,
                               fraction_of_floor=(floor_s + copy_s) / s)
                out["runs"][key] = row
                say(f"{key}: {1000 * s:.2f} ms a window ({b / s:.1f} tok/s), floor {1000 * floor_s:.2f} ms"
                    + (f" + host part {1000 * row['copy_floor_s']:.2f} ms ({on_host} positions)" if resident else "")
                    + f" ({row['fraction_of_floor']:.0%})")
                save()
        if args.prompt and kv == args.prompt_kv:
            n = min(args.prompt, cap - 64) if not args.smoke else 512
            out.setdefault("prompts", {})[tag] = read_prompt(engine, cfg, n, part)
            save()
        del engine
        gc.collect()


def pinned_rate() -> float:
    """Bytes a second of one 1 GiB copy from pinned host memory to the device (the host tier's copy rate)."""
    import jax
    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    big = jax.device_put(np.zeros(1 << (30 if gpu else 24), np.uint8), pinned)
    on_device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    return big.size / timed(lambda: jax.block_until_ready(jax.device_put(big, on_device)), 3)


def read_prompt(engine, cfg, n: int, part: int) -> dict:
    """A prompt of n tokens read in parts of `part` on one slot of a WindowRunner (the server's path; with a host
    tier, the window moves as it fills); the first part (its compilation) is timed apart."""
    from dataclasses import replace

    from strata.engine.runner import WindowRunner
    from strata.plan import PromptPart, idle_plan
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, n).astype(np.int32)
    runner = WindowRunner(engine, 1, part)
    run = lambda a: runner.run(replace(idle_plan(1), part=PromptPart(  # noqa: E731
        slot=0, tokens=ids[a:a + part], start=a, last=a + part >= n)))
    t = time.perf_counter()
    run(0)
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    for a in range(0, n, part):
        run(a)
    s = time.perf_counter() - t
    out = {"tokens": n, "part": part, "s": s, "tok_s": n / s, "first_part_with_compile_s": compile_s,
           "kv_resident": engine.kv_resident}
    if runner.tiers is not None:
        out.update(kv_spills=runner.tiers.spills, host_positions=int(runner.tiers.base[0]))
    say(f"prompt of {n} tokens in parts of {part}" + (f", {engine.kv_resident} on the device" if engine.kv_resident
                                                       else "") + f": {s:.1f} s, {n / s:.0f} tok/s")
    return out


def cpu_attention(q, k, v, scale: float, threads: int) -> np.ndarray:
    """numpy: softmax(scale q.k) v of q [G, hd] (one row, one kv head's G query heads) over k, v [H, hd] bfloat16
    (ml_dtypes), in `threads` chunks merged by log-sum-exp (each chunk widened to float32 as it is read)."""
    def widen(x):                                       # bfloat16 bits -> float32, without ml_dtypes' slow cast
        return (x.view(np.uint16).astype(np.uint32) << 16).view(np.float32)

    def part(lo_hi):
        lo, hi = lo_hi
        logit = (widen(k[lo:hi]) @ q.T) * scale         # [n, G]
        m = logit.max(axis=0)
        p = np.exp(logit - m)
        return p.T @ widen(v[lo:hi]), m, p.sum(axis=0)
    edges = np.linspace(0, k.shape[0], threads + 1).astype(int)
    with ThreadPoolExecutor(threads) as pool:
        parts = list(pool.map(part, zip(edges[:-1], edges[1:])))
    m_all = np.max([m for _, m, _ in parts], axis=0)
    w = [np.exp(m - m_all) for _, m, _ in parts]
    acc = sum(wi[:, None] * a for wi, (a, _, _) in zip(w, parts))
    return acc / sum(wi * l for wi, (_, _, l) in zip(w, parts))[:, None]


def tier_part(args, out: dict, save) -> None:
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    from strata.jax_backend.kernels.decode_attention import _reference, decode_attention, tiered_decode_attention
    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    hq, hkv, hd = (16, 2, 256)
    scale = hd ** -0.5
    # interpret mode (a CPU) reads device memory only (kernels/host_rows.py): the smoke run's host tier is there
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host" if gpu else "device")
    on_device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    big = jax.device_put(np.zeros(1 << (30 if gpu else 24), np.uint8), pinned)
    rate = big.size / timed(lambda: jax.block_until_ready(jax.device_put(big, on_device)), 3)
    out.update(pinned_h2d_bytes_per_s=rate, cpu_threads=args.threads, cases={})
    say(f"pinned host -> device: {rate / 1e9:.1f} GB/s")
    del big
    interpret = not gpu
    contexts = [int(c) for c in args.tier_contexts.split(",")] if not args.smoke else [2048]
    resident = args.resident if not args.smoke else 512
    rng = np.random.default_rng(0)
    for ctx in contexts:
        h = ctx - resident
        for b in [int(x) for x in args.tier_batches.split(",")]:
            kh = (rng.standard_normal((b, h, hkv, hd), np.float32) * 0.5).astype(ml_dtypes.bfloat16)
            vh = rng.standard_normal((b, h, hkv, hd), np.float32).astype(ml_dtypes.bfloat16)
            q = rng.standard_normal((b, 1, hq, hd), np.float32).astype(ml_dtypes.bfloat16)
            k_host, v_host = jax.device_put(kh, pinned), jax.device_put(vh, pinned)
            k_dev = jax.device_put(jnp.zeros((b, resident, hkv, hd), jnp.bfloat16), on_device)
            qd = jax.device_put(q, on_device)
            pos_h = jnp.full((b,), h - 1, jnp.int32)
            pos_r = jnp.full((b,), resident - 1, jnp.int32)
            run = lambda k, v, pos: jax.block_until_ready(        # noqa: E731
                decode_attention(qd, k, v, None, None, pos, scale=scale, interpret=interpret))
            case = {"context": ctx, "resident": resident, "host_positions": h, "batch": b,
                    "host_bytes_per_layer": 2 * kh.nbytes}
            got = np.asarray(run(k_host, v_host, pos_h), np.float32)
            # does XLA hand the kernel the host operands in place, or copy them to the device first?
            hlo = decode_attention.lower(qd, k_host, v_host, None, None, pos_h, scale=scale,
                                         interpret=interpret).compile().as_text()
            case["hlo_copies"] = sum(hlo.count(w) for w in (" copy(", "copy-start("))
            want = _reference(q[:, :1], kh, vh, None, None, np.asarray(pos_h), scale)
            case["kernel_pinned_max_err"] = float(np.abs(got - want).max())
            case["resident_kernel_s"] = timed(lambda: run(k_dev, k_dev, pos_r), 5)
            case["kernel_pinned_s"] = timed(lambda: run(k_host, v_host, pos_h), 3)
            case["staged_s"] = timed(lambda: run(jax.device_put(k_host, on_device),
                                                 jax.device_put(v_host, on_device), pos_h), 3)
            qn = q.astype(np.float32)
            cpu_one = lambda: [cpu_attention(qn[r, 0, g * 8:(g + 1) * 8], kh[r, :, g], vh[r, :, g], scale,  # noqa: E731
                                             args.threads) for r in range(b) for g in range(hkv)]
            cpu_out = cpu_one()
            case["cpu_max_err"] = float(max(np.abs(o - want[r, 0, g * 8:(g + 1) * 8]).max()
                                            for (r, g), o in zip([(r, g) for r in range(b) for g in range(hkv)],
                                                                 cpu_out)))
            case["cpu_s"] = timed(cpu_one, 3)
            # both tiers in one call (the host tier's op): the resident part's keys follow the host part's
            kd = rng.standard_normal((b, resident, hkv, hd), np.float32).astype(ml_dtypes.bfloat16)
            k_res, v_res = jax.device_put(kd, on_device), jax.device_put(kd[:, ::-1].copy(), on_device)
            n_h = jnp.full((b,), h, jnp.int32)
            tiered = lambda: jax.block_until_ready(tiered_decode_attention(     # noqa: E731
                qd, k_res, v_res, None, None, pos_r, k_host, v_host, None, None, n_h, scale=scale,
                interpret=interpret))
            if b == 1:
                full_k = np.concatenate([kh, kd], axis=1)
                full_v = np.concatenate([vh, kd[:, ::-1]], axis=1)
                want_t = _reference(q[:, :1], full_k, full_v, None, None, np.full((b,), ctx - 1), scale)
                case["tiered_max_err"] = float(np.abs(np.asarray(tiered(), np.float32) - want_t).max())
            case["tiered_s"] = timed(tiered, 3)
            case["floor_s"] = case["host_bytes_per_layer"] / rate
            for form in ("kernel_pinned", "staged", "cpu", "tiered"):
                case[f"{form}_tok_s_12_layers"] = b / (N_FULL * case[f"{form}_s"])
                case[f"{form}_fraction_of_floor"] = case["floor_s"] / case[f"{form}_s"]
            out["cases"][f"{ctx}_b{b}"] = case
            say(f"{ctx} ({h} host positions), b{b}: a layer's host part: kernel on pinned "
                f"{1000 * case['kernel_pinned_s']:.2f} ms, staged {1000 * case['staged_s']:.2f} ms, cpu "
                f"{1000 * case['cpu_s']:.2f} ms; floor {1000 * case['floor_s']:.2f} ms; resident part "
                f"{1000 * case['resident_kernel_s']:.3f} ms; errors {case['kernel_pinned_max_err']:.1e} / "
                f"{case['cpu_max_err']:.1e}; both tiers in one call {1000 * case['tiered_s']:.2f} ms (error "
                f"{case.get('tiered_max_err', float('nan')):.1e})")
            save()
            del k_host, v_host, k_dev
            gc.collect()
        block = min(args.block, h // 4)
        out["spill"] = dict(spill_check(h, block), positions=block)
        say(f"spill of {block} positions into a pinned host tier of {h}: {out['spill']}")
        save()


def spill_check(h: int, block: int) -> dict:
    """A block of device KV written into a pinned host tier in place (a donated dynamic_update_slice in host
    memory, as the host tier would take positions leaving the device): correct, and at what rate."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    dev = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")

    def spill(host, blk, at):
        return lax.dynamic_update_slice(host, jax.device_put(blk, jax.memory.Space.Host), (0, at, 0, 0))
    f = jax.jit(spill, donate_argnums=(0,), out_shardings=pinned)
    try:
        host = jax.device_put(np.zeros((1, h, 2, 256), jnp.bfloat16), pinned)
        blk = jax.device_put(jnp.full((1, block, 2, 256), 3, jnp.bfloat16), dev)
        host = f(host, blk, jnp.int32(block))
        got = np.asarray(host[0, block - 1:2 * block + 1, 0, 0].astype(jnp.float32))
        ok = bool(got[0] == 0 and got[-1] == 0 and (got[1:-1] == 3).all())
        box = [host]

        def again():
            box[0] = f(box[0], blk, jnp.int32(0))
            jax.block_until_ready(box[0])
        s = timed(again, 5)
        return {"correct": ok, "s": s, "bytes_per_s": blk.nbytes / s, "kind": box[0].sharding.memory_kind}
    except Exception as e:                    # the probe's answer may be that XLA refuses it: recorded, not fatal
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("decode", "tier"), required=True)
    ap.add_argument("--engines", default="bfloat16:131072:16:32768,131072:1,4,16;int8:262144:16:131072,262144:1,4,16",
                    help="decode: ';'-separated kv:capacity:slots:contexts:batches[:kv_resident], one engine each "
                         "(any kv_resident: XLA's default command-buffer mode, which leaves pinned host memory usable)")
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=0, help="decode: also read a prompt of this many tokens")
    ap.add_argument("--prompt-kv", default="bfloat16")
    ap.add_argument("--tier-contexts", default="131072,262144")
    ap.add_argument("--tier-batches", default="1,4")
    ap.add_argument("--resident", type=int, default=16384)
    ap.add_argument("--block", type=int, default=1024, help="tier: positions a spill moves to the host")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.part == "decode" and not any(len(e.split(":")) > 5 for e in args.engines.split(";")):
        print(results_file.server_xla_flags(), flush=True)      # before the first JAX call (stamp's)
    out = {"bench": f"long_decode_{args.part}", **results_file.stamp(), "args": vars(args)}
    name = f"long_decode_{args.part}" + ("_smoke" if args.smoke else "")
    save = lambda: results_file.write(out, args.out, name)           # noqa: E731 - rewritten as it goes
    (decode_part if args.part == "decode" else tier_part)(args, out, save)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
