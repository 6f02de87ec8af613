"""Probe: can one compiled window fetch experts from pinned host memory by index, with no host round trip?

Inside jit, `device_put(dynamic_slice(host_array, e), device)` on an array in pinned_host memory should become one
host-to-device copy of just that slice (XLA's host offloading). This measures, on the current device:
- per-blob time of such copies in a while loop of dynamic length (the miss count is known only on the device),
- the same for a fixed-length loop and for a gather of several rows (which may copy the whole array),
- against the per-blob device_put of separately pinned blobs (what the layer-by-layer path does now).
Writes JSON to $OUT/host_fetch_probe.json when OUT is set.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from engine_speed import timed  # bench/, beside this script


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
    layers = [jax.device_put(rng.integers(0, 255, (E, NB), dtype=np.uint8), host) for _ in range(L)]
    jax.block_until_ready(layers)
    res = {"device": str(dev), "jax": jax.__version__, "experts": E, "blob_bytes": NB, "layers": L}

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
    ok = np.array_equal(np.asarray(out)[:7], np.asarray(jax.device_get(layers[0]))[np.asarray(ids)[:7]])
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
    for k, v in res.items():
        print(f"{k:28s} {v}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "host_fetch_probe.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
