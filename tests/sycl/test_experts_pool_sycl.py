"""The SYCL backend's expert op over a pool of packed expert blobs (strata/weights/quant.py), every format: the
decode kernel bit for bit against quant.decode_expert, the slot selection against its numpy reference, and
experts_pool against quant.expert_reference computed from the same blobs, in the gathered (few routes) and blocked
(prompt part) forms, with skipped routes (-1) and a pool whose unreferenced slots hold NaN bytes."""
from __future__ import annotations

import dpnp
import numpy as np
import pytest

from strata.sycl_backend.kernels import blob_decode as k_blob
from strata.weights import quant

H, I = 256, 48              # int4: gate/up in 2 groups of 128, down in 1 group of 48; nvfp4: 16 and 3 blocks per row
N = 12                      # pool slots
EXPERTS = (1, 2, 4, 5, 7, 8, 10, 11)     # slots holding experts; 0, 3, 6, 9 hold NaN bytes (0xFF)

# Limits on max |got - want| / max |want|: both sides decode the same blobs to the same fp32 weights (the decode
# test holds that bit for bit), so these cover fp32 accumulation against quant.expert_reference's float64 only.
LIMIT = {"f32": 3e-6, "bf16": 3e-6, "int8": 3e-6, "int4": 3e-6, "nvfp4": 3e-6}


def make_pool(lay, rng):
    pool = np.full((N, lay.nbytes), 0xFF, np.uint8)
    h, i = lay.hidden, lay.inter
    for s in EXPERTS:
        gate, up = (rng.standard_normal((i, h)).astype(np.float32) / 8 for _ in range(2))
        down = rng.standard_normal((h, i)).astype(np.float32) / 5
        pool[s] = quant.encode_expert(lay, gate, up, down)
    return pool


def make_routes(rng, t, kk, skip=0.2):
    slots = np.stack([rng.choice(EXPERTS, kk, replace=False) for _ in range(t)]).astype(np.int32)
    slots[rng.random(slots.shape) < skip] = -1
    slots[0, 0] = -1                                   # at least one skipped route
    weight = rng.random((t, kk)).astype(np.float32)
    return slots, weight


def assert_bits(got, want, what):
    got = dpnp.asnumpy(got)
    assert got.shape == want.shape, what
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"{what}: NaN positions differ"
    g, w = got[~nan].view(np.uint32), want[~nan].view(np.uint32)
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, f"{what}: {bad.size} values differ, first {got[~nan][bad[0]]!r} vs {want[~nan][bad[0]]!r}"


def assert_close(got, want, limit, what):
    got = dpnp.asnumpy(got)
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    err = np.abs(got.astype(np.float64) - want).max()
    scale = max(np.abs(want).max(), 1e-30)
    assert err <= limit * scale, f"{what}: max |diff| {err:.3e} > {limit} x {scale:.3e}"


@pytest.mark.parametrize("shape", ["main", "odd"])
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_blob_decode_bit_exact(ops, rng, fmt, shape):
    """Decoded experts (some slots twice, a -1 entry: zeros) equal quant.decode_expert bit for bit; then the same
    on random bytes (every code, NaN and subnormal patterns included), which no encoder emits. "odd": rows that are
    not whole 16-value chunks (nvfp4: 3 and 5 blocks; int4: one group of 40 and of 22)."""
    h, i = (H, I) if shape == "main" else ((48, 80) if fmt == "nvfp4" else (40, 22))
    lay = quant.layout(fmt, h, i)
    pool = make_pool(lay, rng)
    sel = np.array([7, 1, 11, -1, 1, 4], np.int32)
    out = tuple(dpnp.full(s, np.nan, dtype=dpnp.float32, sycl_queue=ops.queue)
                for s in ((6, i, h), (6, i, h), (6, h, i)))
    k_blob.blob_decode(ops.kernels, ops.to_device(pool), ops.to_device(sel), lay, out=out)
    for name, got, want in zip(quant.MATRICES, out, k_blob.blob_decode_reference(lay, pool, sel)):
        assert_bits(got, want, f"{fmt} {name}")
    raw = rng.integers(0, 256, (3, lay.nbytes), dtype=np.uint8)
    sel = np.array([2, 0, 1], np.int32)
    got = k_blob.blob_decode(ops.kernels, ops.to_device(raw), ops.to_device(sel), lay)
    with np.errstate(all="ignore"):
        want = k_blob.blob_decode_reference(lay, raw, sel)
    for name, g, w in zip(quant.MATRICES, got, want):
        assert_bits(g, w, f"{fmt} {name} (random bytes)")


@pytest.mark.parametrize("nslots,r,t,kk", [(12, 8, 3, 4), (12, 2, 3, 4), (700, 64, 40, 8), (1, 1, 1, 1)])
def test_pool_select(ops, rng, nslots, r, t, kk):
    """Distinct slots ascending, routes remapped, skipped / out-of-bound routes to the zero expert with weight 0
    (the pool spans several of the kernel's 256-slot chunks in the third case)."""
    slots = rng.integers(-1, nslots, (t, kk)).astype(np.int32)
    weight = rng.random((t, kk)).astype(np.float32)
    got = k_blob.pool_select(ops.kernels, ops.to_device(slots), ops.to_device(weight), nslots, r)
    for name, g, w in zip(("sel", "idx", "weight"), got, k_blob.pool_select_reference(slots, weight, nslots, r)):
        assert np.array_equal(dpnp.asnumpy(g), w), name


@pytest.mark.parametrize("t,kk", [(1, 4), (70, 4)], ids=["gathered", "blocked"])
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_experts_pool(ops, rng, fmt, t, kk):
    lay = quant.layout(fmt, H, I)
    pool = make_pool(lay, rng)
    slots, weight = make_routes(rng, t, kk)
    x = rng.standard_normal((t, H)).astype(np.float32)
    want = quant.expert_reference(lay, pool, x, slots, weight)
    dev_pool, dev_x, dev_w = ops.to_device(pool), ops.to_device(x), ops.to_device(weight)
    got = ops.experts_pool(dev_x, slots, dev_w, dev_pool, lay, len(EXPERTS))
    assert got.shape == (t, H) and got.dtype == np.float32
    assert_close(got, want, LIMIT[fmt], f"{fmt} T={t} host slots")
    got = ops.experts_pool(dev_x, ops.to_device(slots), dev_w, dev_pool, lay, len(EXPERTS))
    assert_close(got, want, LIMIT[fmt], f"{fmt} T={t} device slots")


@pytest.mark.parametrize("t,kk", [(1, 4), (70, 4)], ids=["gathered", "blocked"])
def test_skipped_routes_contribute_exactly_zero(ops, rng, t, kk):
    """Rows whose routes are all skipped are exactly 0, even with NaN weights on the skipped routes; a skipped
    route beside a computed one changes nothing (bit for bit against the call without it)."""
    lay = quant.layout("int4", H, I)
    pool = ops.to_device(make_pool(lay, rng))
    slots, weight = make_routes(rng, t, kk, skip=0.0)
    slots[:, 1:] = -1
    slots[0, :] = -1
    weight[slots < 0] = np.nan
    x = ops.to_device(rng.standard_normal((t, H)).astype(np.float32))
    for s in (slots, ops.to_device(slots)):
        got = dpnp.asnumpy(ops.experts_pool(x, s, ops.to_device(weight), pool, lay, len(EXPERTS)))
        assert np.array_equal(got[0], np.zeros(H, np.float32))
        assert np.isfinite(got).all()
        one = dpnp.asnumpy(ops.experts_pool(x, slots[:, :1].copy(), ops.to_device(weight[:, :1].copy()), pool,
                                            lay, len(EXPERTS)))
        assert np.array_equal(got, one)
    none = ops.experts_pool(x, np.full((t, kk), -1, np.int32), ops.to_device(weight), pool, lay, len(EXPERTS))
    assert np.array_equal(dpnp.asnumpy(none), np.zeros((t, H), np.float32))


def test_experts_pool_refuses_bad_slots(ops, rng):
    lay = quant.layout("int8", H, I)
    pool = ops.to_device(make_pool(lay, rng))
    x = ops.to_device(np.ones((1, H), np.float32))
    w = ops.to_device(np.ones((1, 4), np.float32))
    with pytest.raises(ValueError, match="max_distinct"):
        ops.experts_pool(x, np.array([[1, 2, 4, 5]], np.int32), w, pool, lay, 3)
    with pytest.raises(ValueError, match="outside the pool"):
        ops.experts_pool(x, np.array([[1, 2, 4, N]], np.int32), w, pool, lay, 8)
    with pytest.raises(ValueError, match="uint8"):
        ops.experts_pool(x, np.array([[1, 2, 4, 5]], np.int32), w, pool, quant.layout("int4", H, I), 8)


def test_launches_per_call(ops, rng):
    """Gathered form: pool_select, blob_decode and the two gathered expert kernels, plus the slots' upload."""
    lay = quant.layout("nvfp4", H, I)
    pool = ops.to_device(make_pool(lay, rng))
    slots, weight = make_routes(rng, 1, 4, skip=0.0)       # three routes computed (all skipped launches nothing)
    x, w = ops.to_device(rng.standard_normal((1, H)).astype(np.float32)), ops.to_device(weight)
    ops.experts_pool(x, slots, w, pool, lay, len(EXPERTS))                 # warm
    with ops.count_launches() as c:
        ops.experts_pool(x, slots, w, pool, lay, len(EXPERTS))
    assert c.kernels == 4 and c.uploads == 1, c.as_dict()
