"""Prompt reading at Qwen3-Next-80B-A3B shapes: 4K, 32K and 128K prompts through the WindowRunner (the server's path),
each part's time against its position, and each part's floor.

    python bench/prompt_speed.py --out OUT.json            # GPU: 48 layers, int4 experts all resident, kernels auto
    python bench/prompt_speed.py --smoke                   # the same on a CPU in a minute (4 layers, tiny shapes)

One engine with the backend's default KernelConfig reads a 4K prompt (one part, median of --repeat reads) and then
prompts of each --prompts length in parts of 4K on one slot, timing every part (its start, ms, tok/s, and the floor:
prompt_probe's floors for a 4K part with attention over start + T/2 keys a query on average). Then each --variants
entry (KernelConfig fields, e.g. "gdn_chunk=128;decode_expert_warps=8") builds another engine on the same weights for a
comparison (the 4K read, its delta-rule states against the default's, and --variant-prompts when asked): those rows are
never headlines. The JSON is rewritten after every figure, so a run cut off keeps what ended.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402
from engine_speed import say  # noqa: E402

PART = 4096


def part_floor_ms(cfg, tokens: int, start: int, expert_bytes: int) -> float:
    """A part of `tokens` rows at `start`: prompt_probe's floors with attention over start + (tokens + 1) / 2 keys a
    query (causal within the part)."""
    from prompt_probe import BF16, HBM, floors
    f = floors(cfg, tokens, 0, expert_bytes, prompt=True)
    n_full = sum(1 for k in cfg.layer_types if k != "linear_attention")
    attn = 2 * 2 * tokens * (start + (tokens + 1) / 2) * cfg.num_heads * cfg.head_dim * n_full
    f["attn"]["floor_ms"] = 1000 * max(attn / BF16, f["attn"]["bytes"] / HBM)
    return sum(v["floor_ms"] for v in f.values())


def read_in_parts(engine, cfg, n: int, expert_bytes: int, repeat: int = 1, keep: dict | None = None) -> dict:
    """n tokens in parts of PART on one slot of a WindowRunner: each part's start, wall ms (the window is read before
    the next is dispatched) and floor; a one-part prompt is read `repeat` times after a compiling read, the median.
    keep: filled with the linear layers' delta-rule states after the read and its next token (host copies)."""
    from strata.engine.runner import WindowRunner
    from strata.plan import PromptPart, idle_plan
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, n).astype(np.int32)
    runner = WindowRunner(engine, 1, min(PART, n))

    def run(a):
        t = time.perf_counter()
        res = runner.run(replace(idle_plan(1), part=PromptPart(slot=0, tokens=ids[a:a + PART], start=a,
                                                               last=a + PART >= n)))
        if keep is not None:
            keep["next"] = res.part_next
        return time.perf_counter() - t
    compile_s = run(0)
    rounds = [[run(a) for a in range(0, n, PART)] for _ in range(repeat)]
    per_part = np.median(np.array(rounds), axis=0)
    s = float(per_part.sum())
    parts = [{"start": a, "tokens": min(PART, n - a), "ms": 1000 * float(t),
              "tok_s": min(PART, n - a) / float(t),
              "floor_ms": part_floor_ms(cfg, min(PART, n - a), a, expert_bytes)}
             for a, t in zip(range(0, n, PART), per_part)]
    floor_s = sum(p["floor_ms"] for p in parts) / 1000
    if keep is not None:
        keep["ssm"] = [np.asarray(engine.backend.to_host(st["ssm"]), np.float64) for st in runner.states if "ssm" in st]
    del runner
    gc.collect()
    return {"tokens": n, "part": PART, "s": s, "tok_s": n / s, "reads": len(rounds), "first_read_with_compile_s":
            compile_s, "floor_s": floor_s, "fraction_of_floor": floor_s / s, "parts": parts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="32768,131072", help="prompts read in parts of 4K after the 4K read")
    ap.add_argument("--repeat", type=int, default=3, help="reads of the 4K prompt (the median is its figure)")
    ap.add_argument("--variants", default="", help="';'-separated KernelConfig comparisons, e.g. gdn_chunk=128")
    ap.add_argument("--variant-prompts", default="", help="prompt lengths each variant reads in parts too")
    ap.add_argument("--stop-after", type=float, default=1e9, help="seconds after which no further variant starts")
    ap.add_argument("--smoke", action="store_true", help="4 layers, 16 experts, a 4K vocabulary, short prompts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    say(results_file.server_xla_flags())          # the server's XLA flags, before JAX starts
    import jax
    import ml_dtypes

    from strata.backend import get_backend
    from strata.config import Settings
    from strata.demo import QWEN3_NEXT_80B
    from strata.engine import Engine
    from strata.experts.synthetic import SyntheticStore
    from strata.jax_backend.kernel_config import KernelConfig
    from strata.jax_backend.random_weights import RandomDeviceReader
    from strata.model.config import ModelConfig
    from strata.model.params import params_from_reader
    global PART
    over = {"num_experts": 16, "vocab_size": 4096, "num_hidden_layers": 4} if args.smoke else {"num_hidden_layers": 48}
    if args.smoke:
        PART = 256
    cfg = ModelConfig.from_hf(dict(QWEN3_NEXT_80B, **over), source="prompt speed")
    lengths = [int(x) for x in args.prompts.split(",") if x]
    if args.smoke:
        lengths = [4 * PART]
    cap = max([PART] + lengths)
    params = params_from_reader(cfg, RandomDeviceReader(ml_dtypes.bfloat16))
    n_moe = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_layers))
    store = SyntheticStore("int4", cfg.hidden_size, cfg.moe_intermediate_size, n_moe, cfg.num_experts)
    out = {"bench": "prompt_speed", **results_file.stamp(), "model": "qwen3-next-80b shapes, random weights",
           "layers": cfg.num_layers, "experts": "int4", "kv": "the model's dtype (bfloat16)", "part": PART,
           "device": str(jax.devices()[0]), "runs": {}}

    def save():
        results_file.write(out, args.out, "prompt_speed" + ("_smoke" if args.smoke else ""))

    def engine_with(kernel_config):
        t = time.perf_counter()
        backend = get_backend("jax", kernels="auto", kernel_config=kernel_config)
        engine = Engine(cfg, params, backend, Settings.build(dtype="bfloat16", max_context=cap, prefill=PART,
                                                             parallel=1, kernels="auto"))
        engine.attach_experts(store, say=lambda line: None)
        say(f"engine {kernel_config.changed() or 'defaults'}: built in {time.perf_counter() - t:.1f} s")
        return engine, backend

    reference: dict = {}           # the default engine's 4K read: its delta-rule states and next token

    def run_set(name, kernel_config, prompts):
        engine, backend = engine_with(kernel_config)
        run = out["runs"].setdefault(name, {"kernel_config": kernel_config.changed(),
                                            "pallas_ops": sorted(backend.pallas_ops)})
        for n in prompts:
            keep = {} if n == PART else None
            r = read_in_parts(engine, cfg, n, store.layout.nbytes, args.repeat if n <= PART else 1, keep)
            if keep is not None and not reference:
                reference.update(keep)
            elif keep is not None:     # a variant against the default: the states' error, the same next token
                errs = [float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(keep["ssm"], reference["ssm"])]
                r["against_default"] = {"ssm_rel_err_max": max(errs), "ssm_rel_err_median": float(np.median(errs)),
                                        "same_next_token": bool(keep["next"] == reference["next"])}
                say(f"{name}: delta-rule states against the default's: relative error max {max(errs):.2e}, "
                    f"next token {'the same' if keep['next'] == reference['next'] else 'different'}")
            run[str(n)] = r
            say(f"{name}: {n} tokens in {r['s']:.2f} s ({r['tok_s']:.0f} tok/s; floor {r['floor_s']:.2f} s, "
                f"{r['fraction_of_floor']:.0%}); first read with compile {r['first_read_with_compile_s']:.1f} s")
            if len(r["parts"]) > 1:
                say("  parts (start: ms, tok/s): " + ", ".join(f"{p['start']}: {p['ms']:.0f}, {p['tok_s']:.0f}"
                                                            for p in r["parts"]))
            save()
        del engine
        gc.collect()

    t0 = time.perf_counter()
    run_set("default", KernelConfig(), [PART] + lengths)
    extra = [int(x) for x in args.variant_prompts.split(",") if x]
    for spec in (v for v in args.variants.split(";") if v):
        if time.perf_counter() - t0 > args.stop_after:
            out["runs"][spec] = {"skipped": f"started after --stop-after {args.stop_after} s"}
            say(f"{spec}: skipped (--stop-after)")
            save()
            continue
        known = {f.name: type(f.default) for f in fields(KernelConfig)}
        changes = {}
        for item in spec.split(","):
            key, _, value = item.partition("=")
            if key not in known:
                raise SystemExit(f"--variants: {key!r} is not a KernelConfig field; fields: {', '.join(known)}")
            changes[key] = known[key](value)
        run_set(spec, KernelConfig(**changes), [PART] + ([4 * PART] if args.smoke and extra else extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
