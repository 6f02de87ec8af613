"""Probe: can one compiled window fetch experts from pinned host memory by index, with no host round trip?

Inside jit, `device_put(dynamic_slice(host_array, e), device)` on an array in pinned_host memory should become one
host-to-device copy of just that slice (XLA's host offloading). This measures, on the current device:
- per-blob time of such copies in a while loop of dynamic length (the miss count is known only on the device),
- the same for a fixed-length loop and for a gather of several rows (which may copy the whole array),
- against the per-blob device_put of separately pinned blobs (what the layer-by-layer path does now),
- and other forms of the copy (written out, stacked, contiguous, static offsets, kernels/host_rows.py's kernel).
Writes JSON to $OUT/host_fetch_probe.json when OUT is set.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402
from engine_speed import timed  # noqa: E402

from strata.jax_backend.kernels.host_rows import copy_host_rows  # noqa: E402


class Shown(dict):
    """A result dict that prints each entry as it is recorded, so a run cut short still shows what it measured."""

    def __setitem__(self, key, value):
        print(f"{key:28s} {value}", flush=True)
        super().__setitem__(key, value)


def timeit(fn, reps=5):
    """Median seconds over `reps` runs after one untimed run (compilation)."""
    fn()
    return timed(fn, reps)


def main():
    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    small = dev.platform == "cpu"
    E, NB = (64, 65536) if small else (512, 1_646_592)        # int4 expert blob at Qwen3-Next-80B shapes
    L = 4 if small else 48
    rng = np.random.default_rng(0)
    one_layer_bytes = rng.integers(0, 255, (E, NB), dtype=np.uint8)     # the same bytes in every layer: quicker
    layers = [jax.device_put(one_layer_bytes, host) for _ in range(L)]
    jax.block_until_ready(layers)
    res = Shown()
    for k, v in {"bench": "host_fetch_probe", **results_file.stamp(), "device": str(dev), "jax": jax.__version__, "experts": E, "blob_bytes": NB, "layers": L}.items():
        res[k] = v

    def fetch_loop(h, ids, n, st):
        def body(i, st):
            blob = jax.device_put(jax.lax.dynamic_index_in_dim(h, ids[i], keepdims=False), on_dev)
            return jax.lax.dynamic_update_index_in_dim(st, blob, i, 0)
        return jax.lax.fori_loop(0, n, body, st)

    K = 10
    stage = jnp.zeros((K, NB), jnp.uint8, device=on_dev)

    @jax.jit
    def one_layer(h, ids, n, st):
        return fetch_loop(h, ids, n, st)

    ids = jnp.asarray(rng.permutation(E)[:K].astype(np.int32))
    out = one_layer(layers[0], ids, jnp.int32(7), stage)
    ok = np.array_equal(np.asarray(out)[:7], one_layer_bytes[np.asarray(ids)[:7]])
    res["loop_correct"] = bool(ok)
    hlo = one_layer.lower(layers[0], ids, jnp.int32(7), stage).compile().as_text()
    res["hlo_has_copy_start"] = "copy-start" in hlo
    res["hlo_bytes"] = len(hlo)
    for n in (1, 7, 10):
        t = timeit(lambda: one_layer(layers[0], ids, jnp.int32(n), stage).block_until_ready())
        res[f"loop_{n}_s"] = t
        res[f"loop_{n}_GBps"] = n * NB / t / 1e9

    # a whole window: L layers, each fetching n blobs into its staging buffer, plus a little compute per layer
    @jax.jit
    def window(hs, ids, n, x):
        for h in hs:
            st = fetch_loop(h, ids, n, jnp.zeros((K, NB), jnp.uint8))
            x = x + st[:, :1024].astype(jnp.float32).sum(0)
        return x

    x0 = jnp.zeros((1024,), jnp.float32)
    for n in (0, 7):
        t = timeit(lambda: window(layers, ids, jnp.int32(n), x0).block_until_ready(), reps=3)
        res[f"window_{L}x{n}_s"] = t
        res[f"window_{L}x{n}_GBps"] = L * n * NB / t / 1e9 if n else None

    # the current path: separately pinned blobs, device_put each, into a pool by a jitted scatter
    blobs = [jax.device_put(rng.integers(0, 255, (NB,), dtype=np.uint8), host) for _ in range(K)]
    t = timeit(lambda: jax.block_until_ready([jax.device_put(b, on_dev) for b in blobs[:7]]))
    res["device_put_7_s"] = t
    res["device_put_7_GBps"] = 7 * NB / t / 1e9

    # a gather of rows from the host array (may move the whole array: compare with its size)
    @jax.jit
    def gather(h, ids):
        return jax.device_put(jnp.take(h, ids, axis=0), on_dev)
    try:
        t = timeit(lambda: gather(layers[0], ids[:7]).block_until_ready())
        res["gather_7_s"] = t
        res["gather_7_GBps_effective"] = 7 * NB / t / 1e9
    except Exception as e:                       # noqa: BLE001 - the probe records what the compiler refuses
        res["gather_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    copy_variants(res, layers, ids, host, on_dev, NB, small)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "host_fetch_probe.json"), "w") as f:
            json.dump(res, f, indent=1)


def copy_variants(res: dict, layers, ids, host, on_dev, NB, small):
    """Other ways to copy 7 scattered blobs per layer for 48 layers: where does the per-copy overhead come from?"""
    L = len(layers)

    def record(name, fn, nbytes):
        try:
            t = timeit(fn, reps=3)
            res[f"{name}_s"], res[f"{name}_GBps"] = t, nbytes / t / 1e9
        except Exception as e:                   # noqa: BLE001 - the probe records what the compiler refuses
            res[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"

    # a large contiguous pinned buffer: the copy engine's own rate
    big = jax.device_put(np.zeros((256 if small else 1024) << 20, np.uint8), host)
    record("one_pinned_buffer", lambda: jax.device_put(big, on_dev).block_until_ready(), big.size)

    def over_layers(fetch):
        """A jitted window over every layer's host array h: fetch(h, arg) -> device arrays of rows (copied somehow);
        a little of each is summed, so no copy is optimised away."""
        @jax.jit
        def window(hs, arg):
            acc = jnp.zeros((1024,), jnp.float32)
            for h in hs:
                for b in fetch(h, arg):
                    acc = acc + b.reshape(-1, NB)[:, :1024].astype(jnp.float32).sum(0)
            return acc
        return lambda arg: window(layers, arg).block_until_ready()

    def row(h, i):
        return jax.lax.dynamic_index_in_dim(h, i, keepdims=False)                    # [NB] in host memory

    # 7 copies per layer written out (no loop, static count): is the loop's per-iteration sync the overhead?
    unrolled = over_layers(lambda h, ids: [jax.device_put(row(h, ids[j]), on_dev) for j in range(7)])
    record(f"unrolled_{L}x7", lambda: unrolled(ids), L * 7 * NB)
    # the 7 rows stacked in host memory, then one copy per layer
    stacked = over_layers(lambda h, ids: [jax.device_put(jnp.stack([row(h, ids[j]) for j in range(7)]), on_dev)])
    record(f"stacked_{L}x7", lambda: stacked(ids), L * 7 * NB)
    # a contiguous run of 7 rows by one dynamic slice per layer (the lower bound of a slice-by-offset copy)
    runs = over_layers(lambda h, start: [jax.device_put(jax.lax.dynamic_slice_in_dim(h, start, 7), on_dev)])
    record(f"contiguous_{L}x7", lambda: runs(jnp.int32(3)), L * 7 * NB)
    # static offsets: the copy needs no offset from the device
    static_rows = over_layers(lambda h, _: [jax.device_put(h[5 * j + 1], on_dev) for j in range(7)])
    record(f"static_{L}x7", lambda: static_rows(None), L * 7 * NB)

    # the project's kernel reading host rows directly (kernels/host_rows.py: zero copy over PCIe)
    def kernel_rows(h, idx):
        staging = jnp.zeros((idx.shape[0], NB), jnp.uint8)
        return copy_host_rows(staging, h, idx, jnp.int32(0), jnp.int32(idx.shape[0]), interpret=small)

    try:
        one = jax.jit(kernel_rows)
        got = one(layers[0], ids[:7])
        res["pallas_rows_correct"] = bool(np.array_equal(
            np.asarray(got), np.asarray(jax.device_get(layers[0]))[np.asarray(ids)[:7]]))
        record("pallas_rows_1x7", lambda: one(layers[0], ids[:7]).block_until_ready(), 7 * NB)
        kernel_window = over_layers(lambda h, ids: [kernel_rows(h, ids[:7])])
        record(f"pallas_rows_{L}x7", lambda: kernel_window(ids), L * 7 * NB)
    except Exception as e:                       # noqa: BLE001 - the probe records what the compiler refuses
        res["pallas_rows_error"] = f"{type(e).__name__}: {str(e)[:400]}"

if __name__ == "__main__":
    main()
