"""Do host-to-device copies issued outside a compiled window overlap the window's compute? Before building prefetch
on one, each way a copy can be issued is timed alone, beside a compute that does not depend on it, and both.

    python bench/overlap_probe.py --out OUT.json       # GPU: 512 MB copies beside ~20 ms of matmuls
    python bench/overlap_probe.py --smoke              # the same on a CPU in seconds (tiny sizes)

Copy forms, each from pinned host memory unless named: `device_put` (PJRT's transfer of a pinned_host array to the
device, its own stream), `device_put_pageable` (from a numpy array), `compiled` (a jitted function whose input lives
in pinned_host and whose output on the device: the copy runs inside an executable), `chunks` (device_put of 8 blocks
of 1/8 each, as a prefetch of several experts would issue them). Per form: copy alone, compute alone, the compute
dispatched first and the copy issued while it runs, and the reverse; overlap = (alone + alone - both) / the shorter
one (1: fully hidden, 0: serial). Medians of `--repeat` rounds. JSON written after each form.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402  (bench/, beside this script)
from engine_speed import timed  # noqa: E402  (bench/, beside this script)


def median_s(fn, repeat: int) -> float:
    fn()                                                  # compiles / warms
    return timed(fn, repeat)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--copy-mb", type=int, default=512)
    ap.add_argument("--matmuls", type=int, default=12, help="chained [n, n] bf16 matmuls of the compute")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--command-buffer-update", default=None, choices=("skip_temp", "xla_default"),
                    help="applied before JAX starts (default: the server's setting)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.command_buffer_update is None:
        print(results_file.server_xla_flags(), flush=True)       # before the first JAX call (stamp's)
    else:
        from strata.jax_backend.xla_flags import command_buffer_update
        print(command_buffer_update(args.command_buffer_update), flush=True)
    import jax
    import jax.numpy as jnp
    if args.smoke:
        args.copy_mb, args.n, args.matmuls, args.repeat = 8, 512, 4, 3
    dev = jax.devices()[0]
    on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    result = {"bench": "overlap_probe", **results_file.stamp(), "copy_mb": args.copy_mb,
              "compute": f"{args.matmuls} chained bf16 [{args.n}, {args.n}] matmuls", "forms": {}}

    @jax.jit
    def compute(a, b):
        for _ in range(args.matmuls):
            a = jnp.tanh(a @ b)                           # tanh keeps values bounded over the chain
        return a
    a = jax.device_put(jnp.ones((args.n, args.n), jnp.bfloat16) * 0.01, on_dev)
    b = jax.device_put(jnp.ones((args.n, args.n), jnp.bfloat16) * 0.01, on_dev)
    host = np.random.default_rng(0).integers(0, 255, args.copy_mb << 20, dtype=np.uint8)
    src = jax.device_put(host, pinned)
    chunks = [jax.device_put(c, pinned) for c in np.split(host, 8)]
    to_device = jax.jit(lambda x: x, out_shardings=on_dev)

    copies = {
        "device_put": lambda: [jax.device_put(src, on_dev)],
        "device_put_pageable": lambda: [jax.device_put(host, on_dev)],
        "compiled": lambda: [to_device(src)],
        "chunks": lambda: [jax.device_put(c, on_dev) for c in chunks],
    }
    t_compute = median_s(lambda: compute(a, b).block_until_ready(), args.repeat)
    result["compute_ms"] = 1000 * t_compute
    print(f"compute alone {1000 * t_compute:.2f} ms", flush=True)
    for name, copy in copies.items():
        def alone():
            jax.block_until_ready(copy())

        def compute_then_copy():
            y = compute(a, b)
            jax.block_until_ready((y, copy()))

        def copy_then_compute():
            c = copy()
            jax.block_until_ready((compute(a, b), c))
        t_copy = median_s(alone, args.repeat)
        t1, t2 = median_s(compute_then_copy, args.repeat), median_s(copy_then_compute, args.repeat)
        shorter = min(t_copy, t_compute)
        form = {"copy_ms": 1000 * t_copy, "copy_gb_s": (args.copy_mb << 20) / t_copy / 1e9,
                "compute_then_copy_ms": 1000 * t1, "copy_then_compute_ms": 1000 * t2,
                "overlap_compute_first": (t_copy + t_compute - t1) / shorter,
                "overlap_copy_first": (t_copy + t_compute - t2) / shorter}
        result["forms"][name] = form
        print(f"{name}: copy {form['copy_ms']:.2f} ms ({form['copy_gb_s']:.1f} GB/s), both {1000 * t1:.2f} / "
              f"{1000 * t2:.2f} ms, overlap {form['overlap_compute_first']:.2f} / {form['overlap_copy_first']:.2f}",
              flush=True)
        path = results_file.write(result, args.out, "overlap_probe" + ("_smoke" if args.smoke else ""))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
