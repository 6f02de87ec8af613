"""kernels/host_rows.copy_host_rows against its numpy reference: rows of a host chunk (pinned host memory) copied into
a device buffer whose other rows must keep their bytes, for several row strides, ranges and orders; on the CPU in
Pallas interpret mode, on the GPU compiled (STRATA_TEST_DEVICE=gpu)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata.jax_backend.kernels import experts as KE
from strata.jax_backend.kernels import host_rows as K


def pinned(a):
    return jax.device_put(a, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))


@pytest.mark.parametrize("nbytes", [4096, 8192, 3 * 4096])
@pytest.mark.parametrize("lo,hi", [(0, 5), (2, 4), (3, 3), (0, 0), (5, 7)])
def test_copies_rows_lo_to_hi_and_keeps_the_rest(nbytes, lo, hi, interpret):
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (9, nbytes), dtype=np.uint8)
    dst = np.full((7, nbytes), 0xFF, np.uint8)                     # poisoned: a row the kernel should not touch
    rows = rng.integers(0, 9, 7).astype(np.int32)
    rows[[i for i in range(7) if not lo <= i < hi]] = -10**6      # never read: would fault or copy garbage
    got = K.copy_host_rows(jnp.asarray(dst), pinned(src), jnp.asarray(rows), jnp.int32(lo), jnp.int32(hi),
                           interpret=interpret)
    np.testing.assert_array_equal(np.asarray(got), K._reference(dst, src, rows, lo, hi))


@pytest.mark.parametrize("copy", ["loop", "kernel"])
def test_the_loop_and_the_kernel_give_the_reference_inside_jit(copy, interpret):
    """Inside a jitted function with device-computed bounds (as experts_fetching calls them)."""
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (16, 4096), dtype=np.uint8)
    dst = rng.integers(0, 256, (6, 4096), dtype=np.uint8)
    wanted = np.sort(rng.choice(16, 4, replace=False)).astype(np.int32)
    fn = KE.copy_rows_loop if copy == "loop" else (
        lambda *a: K.copy_host_rows(*a, interpret=interpret))

    @jax.jit
    def run(d, s, w):
        lo = jnp.searchsorted(w, 3).astype(jnp.int32)             # the wanted rows of a chunk holding rows 3..15
        hi = jnp.searchsorted(w, 16).astype(jnp.int32)
        rows = jnp.pad(w - 3, (0, 2), constant_values=-1)
        return fn(d, s, rows, lo, hi), lo, hi

    got, lo, hi = run(jnp.asarray(dst), pinned(src[3:]), jnp.asarray(wanted))
    rows = np.pad(wanted - 3, (0, 2), constant_values=-1)
    np.testing.assert_array_equal(np.asarray(got), K._reference(dst, src[3:], rows, int(lo), int(hi)))
    assert int(hi) - int(lo) == int(np.sum(wanted >= 3))


def test_bad_shapes_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="not a multiple of 4096"):
        K.copy_host_rows(jnp.zeros((2, 100), jnp.uint8), jnp.zeros((3, 100), jnp.uint8),
                         jnp.zeros(2, jnp.int32), 0, 1, interpret=True)
    with pytest.raises(ValueError, match="destination rows"):
        K.copy_host_rows(jnp.zeros((2, 4096), jnp.uint8), jnp.zeros((3, 8192), jnp.uint8),
                         jnp.zeros(2, jnp.int32), 0, 1, interpret=True)


@pytest.mark.parametrize("copy", ["loop", "kernel"])
def test_backend_pool_fill_and_host_rows_with_either_copy(copy, interpret):
    """JaxBackend.pool_fill (batches of FILL_BATCH, entries from several chunks, padding that must write nothing)
    and host_rows, with the XLA loop and with the kernel: the pool holds exactly the rows asked for, every other slot
    keeps its bytes."""
    from functools import partial

    from strata.jax_backend.backend import FILL_BATCH, JaxBackend
    ops = JaxBackend()
    ops.copy_rows = KE.copy_rows_loop if copy == "loop" else partial(K.copy_host_rows, interpret=interpret)
    rng = np.random.default_rng(0)
    nbytes = 4096
    chunks_np = [rng.integers(0, 256, (n, nbytes), dtype=np.uint8) for n in (5, 9, 4)]
    chunks = [ops.host_chunk(c) for c in chunks_np]
    n_slots = FILL_BATCH + 40
    pool_np = rng.integers(0, 256, (n_slots, nbytes), dtype=np.uint8)
    m = FILL_BATCH + 7                                            # two calls, the second padded
    per = [3, m - 3 - 2, 2]                                        # entries taken from each chunk, in chunk order
    rows = np.concatenate([rng.integers(0, len(c), k) for c, k in zip(chunks_np, per)]).astype(np.int32)
    bounds = np.concatenate([[0], np.cumsum(per)])
    slots = rng.permutation(n_slots)[:m].astype(np.int32)
    want = pool_np.copy()
    for c in range(3):
        for i in range(bounds[c], bounds[c + 1]):
            want[slots[i]] = chunks_np[c][rows[i]]
    got = ops.pool_fill(jnp.asarray(pool_np), slots, chunks, bounds, rows)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(ops.host_rows(chunks[1], [8, 0, 3]), chunks_np[1][[8, 0, 3]])


def test_backend_stage_layer_copies_a_layers_chunks_whole_end_to_end():
    """HostFetch.stage_layer (streamed prompt parts): a layer's pinned chunks on the device, laid end to end; one
    chunk comes back as it is."""
    from strata.jax_backend.backend import JaxBackend
    ops = JaxBackend()
    rng = np.random.default_rng(0)
    chunks_np = [rng.integers(0, 256, (n, 4096), dtype=np.uint8) for n in (5, 3)]
    chunks = [ops.host_chunk(c) for c in chunks_np]
    staged = ops.stage_layer(chunks)
    ops.wait(staged)
    assert staged.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(staged), np.concatenate(chunks_np))
    np.testing.assert_array_equal(np.asarray(ops.stage_layer(chunks[1:])), chunks_np[1])


@pytest.mark.parametrize("n", [0, 1, 5, 8, 9, 17, 20, 21])
def test_host_prefix_copies_the_blocks_up_to_n(n):
    """JaxBackend.host_prefix (a prompt part's staged host KV): rows [0, n) of a host array on the device, copied in
    blocks of 8 rows (the last one clamped to the array's 21 rows), rows past n's last block zero; inside jit with n
    computed on the device."""
    from strata.jax_backend.backend import JaxBackend
    host = np.random.default_rng(n).standard_normal((21, 2, 4)).astype(np.float32)
    got = np.asarray(jax.jit(lambda h, n: JaxBackend.host_prefix(h, n, 8))(pinned(host), jnp.int32(n)))
    copied = min(-(-n // 8) * 8, 21)
    np.testing.assert_array_equal(got[:copied], host[:copied])
    np.testing.assert_array_equal(got[copied:], 0)
