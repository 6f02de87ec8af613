"""Per-kernel speed against its floor (issue 4): time, bytes moved, FLOPs, and the fraction of the H200's measured
HBM rate (3.6 TB/s read+write, ../shared/notes/pallas-gpu.md) each kernel reaches, beside the XLA op it replaces.
Each kernel's output is checked against that XLA op on the same inputs before it is timed.

    python bench/kernel_speed.py            # GPU: Qwen3-Next-80B-A3B expert shapes (H 2048, I 512), int4 blobs
    python bench/kernel_speed.py --smoke    # the same on a CPU in Pallas interpret mode, tiny shapes

Kernels: the decode expert op (kernels/expert_decode.py, int4 dequantized in the kernel) at 1, 4 and 16 tokens of
10 routes each, against experts.experts_from_pool's gather form.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402
from engine_speed import timed  # noqa: E402
from synthetic_experts import SyntheticStore  # noqa: E402

HBM_BYTES_PER_S = 3.6e12      # measured on the H200 this project uses (read + write)


def expert_decode(hidden: int, inter: int, n_slots: int, tokens: list[int], k: int, repeat: int, interpret: bool):
    import jax
    import jax.numpy as jnp

    from strata.jax_backend.kernels.expert_decode import experts_decode_int4
    from strata.jax_backend.kernels.experts import experts_from_pool
    store = SyntheticStore("int4", hidden, inter, 1, n_slots, distinct=min(64, n_slots))
    lay = store.layout
    pool = jax.device_put(np.stack([store.blob(0, e) for e in range(n_slots)]))
    xla = jax.jit(experts_from_pool, static_argnames=("layout", "max_distinct"))
    rows = []
    rng = np.random.default_rng(0)
    for t in tokens:
        slots = jnp.asarray(np.stack([rng.choice(n_slots, k, replace=False) for _ in range(t)]).astype(np.int32))
        weight = jnp.asarray(rng.random((t, k)).astype(np.float32))
        x = jnp.asarray(rng.standard_normal((t, hidden)).astype(np.float32), jnp.bfloat16)
        ref = xla(lay, pool, x.astype(jnp.float32), slots, weight, max_distinct=n_slots)
        got = experts_decode_int4(lay, pool, x.astype(jnp.float32), slots, weight, interpret=interpret)
        err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
        run_xla = lambda: xla(lay, pool, x, slots, weight, max_distinct=n_slots).block_until_ready()  # noqa: E731
        run_ker = lambda: experts_decode_int4(lay, pool, x, slots, weight,  # noqa: E731
                                              interpret=interpret).block_until_ready()
        run_xla(), run_ker()                                 # compile before timing
        t_xla, t_ker = timed(run_xla, repeat), timed(run_ker, repeat)
        distinct = len(np.unique(np.asarray(slots)))
        nbytes = distinct * lay.nbytes                       # each distinct blob read once at best
        flops = 2 * 3 * t * k * hidden * inter
        rows.append({"tokens": t, "routes": t * k, "distinct_experts": distinct, "bytes_floor": nbytes,
                     "flops": flops, "xla_us": 1e6 * t_xla, "kernel_us": 1e6 * t_ker,
                     "floor_us": 1e6 * nbytes / HBM_BYTES_PER_S,
                     "kernel_fraction_of_hbm": nbytes / t_ker / HBM_BYTES_PER_S,
                     "xla_fraction_of_hbm": nbytes / t_xla / HBM_BYTES_PER_S,
                     "kernel_tflops": flops / t_ker / 1e12, "kernel_vs_xla_rel_err": err})
        r = rows[-1]
        print(f"expert decode int4, {t} token(s) x {k} routes: kernel {r['kernel_us']:.1f} us, XLA {r['xla_us']:.1f} us,"
              f" floor {r['floor_us']:.1f} us ({nbytes / 1e6:.1f} MB); kernel at "
              f"{100 * r['kernel_fraction_of_hbm']:.0f}% of HBM, XLA {100 * r['xla_fraction_of_hbm']:.0f}%; "
              f"kernel vs XLA relative error {err:.1e}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on a CPU, kernels interpreted")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import jax
    interpret = jax.devices()[0].platform != "gpu"
    if args.smoke:
        shapes = dict(hidden=256, inter=128, n_slots=16, tokens=[1, 2], k=4, repeat=2)
    else:
        shapes = dict(hidden=2048, inter=512, n_slots=512, tokens=[1, 4, 16], k=10, repeat=args.repeat)
    result = {"bench": "kernel_speed", **results_file.stamp(), "interpret": interpret,
              "hbm_bytes_per_s": HBM_BYTES_PER_S, "shapes": {k: v for k, v in shapes.items() if k != "repeat"},
              "expert_decode_int4": expert_decode(**shapes, interpret=interpret)}
    name = "kernel_speed_smoke" if args.smoke else f"kernel_speed_{jax.devices()[0].platform}"
    results_file.write(result, args.out, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
