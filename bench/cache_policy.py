"""The expert cache's adaptive policy in simulation: hit rate and bytes copied per token for decode windows over a
partial cache, as bench/offload_speed.py runs them on the GPU, but with the routing drawn directly (no model) and
blobs of 4 KiB, so a CPU runs thousands of windows in seconds. The cache, its placement and its swaps are the real
ExpertCache code; only the expert bytes are small. Bytes per token are counted at the real blob size.

    python bench/cache_policy.py                     # Qwen3-Next-80B shapes: 48 layers x 512 experts, 7,825 slots
    python bench/cache_policy.py --smoke             # a few windows, to check the script

Routing: per token and layer, logits ~ N(0, 1) per expert, plus a bias on a fixed hot 20% of each layer's experts
for the skewed runs (bias 1.2 gives them ~80% of the routes, as offload_speed's router bias does), then the top k.
A window copies each distinct missed expert of each layer once (window fetch); swaps between windows copy one blob
each. Reported per (routing, batch, policy): hit rate, copies and swaps per window, MB per token at 1.57 MiB a blob.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402
from strata.experts.synthetic import SyntheticStore  # noqa: E402

REAL_BLOB = 1_646_592          # an int4 (group 128) expert at Qwen3-Next-80B shapes, bytes


def routes(rng, n_tokens: int, n_layers: int, n_experts: int, k: int, hot, bias: float) -> np.ndarray:
    """[n_tokens, n_layers, k] expert ids: the top k of N(0, 1) logits (+ bias on each layer's hot set)."""
    logits = rng.standard_normal((n_tokens, n_layers, n_experts), dtype=np.float32)
    if hot is not None:
        for p in range(n_layers):
            logits[:, p, hot[p]] += bias
    return np.argpartition(-logits, k, axis=-1)[..., :k]


def simulate(cache, rng, rows: int, windows: int, warm: int, k: int, hot, bias: float, adapt_swaps: int,
             margin: float, z: float) -> dict:
    n_layers, n_experts = cache.n_layers, cache.n_experts
    hits = misses = copies = swaps0 = 0
    for w in range(warm + windows):
        if w == warm:
            hits = misses = copies = 0
            swaps0 = cache.stats.swaps
        ids = routes(rng, rows, n_layers, n_experts, k, hot, bias)                 # [rows, Lp, k]
        table = cache.table()
        counts = np.zeros((n_layers, n_experts), np.int64)
        for p in range(n_layers):
            e = ids[:, p, :].reshape(-1)
            np.add.at(counts[p], e, 1)
            resident = table[p, e] >= 0
            hits += int(resident.sum())
            misses += int((~resident).sum())
            copies += len(np.unique(e[~resident]))
        cache.observe_all(counts)
        cache.end_window()
        cache.adapt(adapt_swaps, margin=margin, z=z)
    swaps = cache.stats.swaps - swaps0
    return {"hit_rate": hits / max(hits + misses, 1), "copies_per_window": copies / windows,
            "swaps_per_window": swaps / windows,
            "mb_per_token": (copies + swaps) * REAL_BLOB / (windows * rows) / 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--windows", type=int, default=400)
    ap.add_argument("--warm", type=int, default=200)
    ap.add_argument("--margins", default="1,2,4")
    ap.add_argument("--zs", default="0", help="significance terms: a swap needs margin + z * sqrt(both counts)")
    ap.add_argument("--swaps", default="8,64")
    ap.add_argument("--decays", default="0.97,0.99")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from strata.experts.cache import ExpertCache
    from strata.jax_backend.backend import JaxBackend
    n_layers, n_experts, k, slots = 48, 512, 10, 7825
    if args.smoke:
        n_layers, args.windows, args.warm = 4, 20, 10
        slots = n_layers * n_experts * 7825 // (48 * 512)
    ops = JaxBackend()
    store = SyntheticStore("int4", 32, 64, n_layers, n_experts, distinct=8)       # 4 KiB blobs
    hot_rng = np.random.default_rng(7)
    hot = [hot_rng.choice(n_experts, n_experts // 5, replace=False) for _ in range(n_layers)]
    result = {"bench": "cache_policy", **results_file.stamp(), "layers": n_layers, "experts": n_experts, "k": k,
              "slots": slots, "windows": args.windows, "warm": args.warm, "blob_bytes_counted": REAL_BLOB,
              "runs": []}
    print("| routing | batch | adapt_swaps | margin | z | decay | hit rate | copies/window | swaps/window | MB/token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for routing, rows, swaps, margin, z, decay in itertools.product(
            ("uniform", "skewed"), (1, 4), [int(s) for s in args.swaps.split(",")],
            [float(m) for m in args.margins.split(",")], [float(x) for x in args.zs.split(",")],
            [float(d) for d in args.decays.split(",")]):
        t = time.perf_counter()
        cache = ExpertCache(ops, store, slots, n_layers, n_experts, decay=decay)
        cache.place()                                                  # in order, as offload_speed starts
        r = simulate(cache, np.random.default_rng(1), rows, args.windows, args.warm, k,
                     hot if routing == "skewed" else None, 1.2, swaps, margin, z)
        r.update(routing=routing, rows=rows, adapt_swaps=swaps, margin=margin, z=z, decay=decay,
                 seconds=time.perf_counter() - t)
        result["runs"].append(r)
        print(f"| {routing} | {rows} | {swaps} | {margin:g} | {z:g} | {decay:g} | {100 * r['hit_rate']:.1f}% | "
              f"{r['copies_per_window']:.0f} | {r['swaps_per_window']:.1f} | {r['mb_per_token']:.0f} |", flush=True)
    results_file.write(result, args.out, "cache_policy_smoke" if args.smoke else "cache_policy_cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
