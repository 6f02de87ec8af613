"""Qwen3.8-Flash-Next (qwen4_exp) at real shapes on one GPU, each figure beside its floor: random weights
(`random:qwen3.8-flash-next`: 48 layers, 512 int4 experts a layer, as many on the device as the plan fits), the PLE
table (47.7 GiB of float8) where the plan puts it (host RAM on an 80-141 GB card), a 4K prompt, decode at batch 1
(the engine API, and windows dispatched ahead as the server runs them) and at batch 16.

    python bench/flash_speed.py                 # GPU: ~85 GB of device memory for every expert (an H200)
    python bench/flash_speed.py --smoke         # CPU: the same code at a small shape, in a minute

Floors: decode moves the dense weights, k experts a layer (batch B: the expected distinct experts of B rows) and the
sequence state over the measured HBM bandwidth; a prompt's FLOPs (2 x the active parameters a token, plus causal
attention's) over the measured bf16 matmul rate. Writes JSON to bench/results/ (or --out) after every figure.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_speed  # noqa: E402  (bench/, beside this script)
import results_file  # noqa: E402
import summary  # noqa: E402

MODEL = "random:qwen3.8-flash-next"
# --smoke: the release's layer pattern and features at a CPU's size (registered as a random: model for the run)
SMOKE = dict(vocab_size=4096, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
             head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
             linear_value_head_dim=32, num_experts=16, moe_intermediate_size=64, shared_expert_intermediate_size=64,
             hc_lowrank=32, ple_embed_dim=128, heads_per_ngram=4, ngram_vocab_size_base=5000, indexer_head_dim=32,
             indexer_budget=256, eos_token_id=4000,
             layer_types=["linear_attention"] * 3 + ["full_attention"])


def matmul_rate() -> float:
    """bf16 FLOP/s of a large matrix product on the device (the prompt floor's denominator)."""
    import jax
    import jax.numpy as jnp
    n = 8192 if jax.devices()[0].platform == "gpu" else 512
    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    return 2 * n ** 3 / engine_speed.timed(lambda: f(a).block_until_ready(), 5)


def device_bytes(tree) -> tuple[int, int]:
    """(bytes, parameters) of a parameter tree's device arrays (a HostRows table is on the host: not counted)."""
    import jax
    leaves = [a for a in jax.tree.leaves(tree) if hasattr(a, "nbytes")]
    return sum(int(a.nbytes) for a in leaves), sum(int(a.size) for a in leaves)


def floors(engine, context: int, prompt: int, hbm: float, flops: float) -> dict:
    """Each figure's floor from the model's bytes and FLOPs (see the module docstring)."""
    cfg, params = engine.cfg, engine.params
    dense_bytes, dense_params = device_bytes({k: v for k, v in params.items() if k != "embed"})
    expert = engine.experts.store.layout.nbytes
    n_moe = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_layers))
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    state = sum(int(a.nbytes) for layer in engine.init_state() for a in layer.values()) / engine.capacity
    full = cfg.layer_types.count("full_attention")
    linear = cfg.num_layers - full
    # per token: the delta rule's state read and written; K, V and the index keys of `context` positions read
    kv_row = 2 * cfg.num_kv_heads * cfg.head_dim * np.dtype(engine.kv_dtype).itemsize + cfg.qsa.head_dim * 4
    state_tok = 2 * linear * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4 \
        + full * context * kv_row
    out = {"hbm_bytes_per_s": hbm, "matmul_flop_per_s": flops, "dense_device_bytes": dense_bytes,
           "expert_bytes": expert, "state_bytes_per_position": state}
    for b in (1, 16):
        distinct = E * (1 - (1 - k / E) ** b)
        moved = dense_bytes + n_moe * distinct * expert + b * state_tok
        out[f"decode_bytes_b{b}"] = moved
        out[f"decode_floor_tok_s_b{b}"] = b * hbm / moved
    active = dense_params - int(params["lm_head"].size) + n_moe * k * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    attn = full * 2 * 2 * cfg.num_heads * cfg.head_dim * prompt * prompt / 2      # QK^T and PV, causal half
    prompt_flops = 2 * active * prompt + attn + 2 * int(params["lm_head"].size)   # the logits of the last row
    out.update(active_params_per_token=active, prompt_flops=prompt_flops,
               prompt_floor_tok_s=prompt * flops / prompt_flops)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=32, help="decode windows (tokens) per timed round")
    ap.add_argument("--ple-table", default="auto", choices=("auto", "device", "host"))
    ap.add_argument("--mirror-gib", type=float, default=40.0,
                    help="host RAM for experts the device cannot hold (resident_budget_gib), beside the PLE table")
    ap.add_argument("--command-buffer-update", default=None, choices=("skip_temp", "xla_default"),
                    help="the server's command_buffer_update setting (default: the server's), before JAX starts")
    ap.add_argument("--smoke", action="store_true", help="a small shape on the CPU: checks the script")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    say = engine_speed.say
    say(results_file.server_xla_flags(args.command_buffer_update))
    stamp = results_file.stamp()
    model = MODEL
    if args.smoke:
        from strata import builtin, demo
        demo.RANDOM_SHAPES["smoke-flash"] = dict(demo.QWEN38_FLASH_NEXT, **SMOKE)
        builtin.BUILTIN_MODELS["random:smoke-flash"] = builtin._random("smoke-flash")
        model, args.prompt = "random:smoke-flash", min(args.prompt, 512)
    name = "flash_speed" + ("_smoke" if args.smoke else "")
    out = {"bench": name, **stamp, "model": model, "experts": "int4", "prompt_tokens": args.prompt,
           "command_buffer_update": args.command_buffer_update or "server default"}

    def record():
        results_file.write(out, args.out, name)
    from strata import Engine
    hbm, flops = engine_speed.hbm_bandwidth(), matmul_rate()      # before the engine takes the device's memory
    lines = []
    t = time.perf_counter()
    engine = Engine.load(model, max_context=args.prompt + 2 * args.decode + 64, prefill=args.prompt, parallel=16,
                         ple_table=args.ple_table, resident_budget_gib=args.mirror_gib, say=lambda line: (lines.append(line), say(line)))
    plan = engine.experts.plan
    out.update(load_s=time.perf_counter() - t, plan=lines, expert_slots=plan.slots - plan.staging,
               experts_total=plan.total_experts)
    say(f"loaded in {out['load_s']:.0f} s")
    out.update(floors(engine, args.prompt, args.prompt, hbm, flops))
    record()
    out.update(engine_speed.measure(engine, args.prompt, args.decode, 3))
    out["q38_prompt_tok_s_4k"] = out["prompt_tok_s"]
    record()
    # windows dispatched ahead where the runner chains them (every expert on the device, or window fetch); a
    # layer-by-layer decode (misses copied between layers) runs its windows one by one, and is then no headline
    chains = engine.path.compiled_rows
    out["decode_windows_ahead"] = chains
    for b in (1, 16):
        s, host = engine_speed.measure_batched(engine, b, args.prompt, args.decode, ahead=chains)
        out[f"decode_ahead_s_per_window_b{b}"], out[f"decode_ahead_host_s_b{b}"] = s, host
        out[f"q38_decode_tok_s_b{b}" if chains else f"decode_tok_s_b{b}_one_by_one"] = b / s
        out[f"decode_fraction_of_floor_b{b}"] = b / s / out[f"decode_floor_tok_s_b{b}"]
        record()
    out["prompt_fraction_of_floor"] = out["prompt_tok_s"] / out["prompt_floor_tok_s"]
    path = results_file.write(out, args.out, name)
    print(f"\n| figure | measured | floor |\n|---|---|---|\n"
          f"| prompt {args.prompt} tokens | {out['prompt_tok_s']:.0f} tok/s | {out['prompt_floor_tok_s']:.0f} |\n"
          f"| decode b1 (engine API) | {out['decode_tok_s_b1']:.1f} tok/s | {out['decode_floor_tok_s_b1']:.0f} |\n"
          + "".join(f"| decode b{b}{', dispatched ahead' if chains else ', one window at a time'} | "
                    f"{b / out[f'decode_ahead_s_per_window_b{b}']:.1f} tok/s | {out[f'decode_floor_tok_s_b{b}']:.0f} |\n"
                    for b in (1, 16)))
    if path.parent == summary.RESULTS and not args.smoke:
        summary.refresh()
    return 0


if __name__ == "__main__":
    sys.exit(main())
