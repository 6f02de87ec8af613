"""kernels/expert_decode.experts_decode (the decode form of the expert op over int4 blobs, dequantizing them in the
kernel) against the numpy reference on the same blobs: a
poisoned pool (garbage and NaN bytes in unused slots), skipped routes with NaN weights, one token with every route
skipped, pools read through compacted sub-pools of 1, 2 and 3 chunks (the kernels' pool limit monkeypatched small);
on the CPU in Pallas interpret mode, on the GPU compiled (STRATA_TEST_DEVICE=gpu)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxprs import pool_operands
from test_expert_op import poisoned_pool, rel_err, routes

from strata.jax_backend.kernels import expert_decode as K
from strata.weights import quant as Q

H, I = 256, 128          # one int4 group of 128 columns or two, per matrix
# Relative Frobenius error limits against quant.expert_reference on the same blobs. The kernels compute in float32
# whatever x's dtype (float64 reference: measured <= 4e-7); a bfloat16 result is one rounding of that, at most
# 2^-9 = 1.95e-3 relative per element.
LIMIT = {"float32": 2e-6, "bfloat16": 2.5e-3}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens,k", [(1, 4), (3, 2), (4, 8)])
def test_decode_kernel_matches_the_reference(tokens, k, dtype, interpret):
    rng = np.random.default_rng(0)
    lay = Q.layout("int4", H, I)
    pool, slot_of = poisoned_pool(rng, lay, n_experts=10, n_slots=14)
    slots, weight = routes(rng, tokens, k, slot_of)
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    xd = jnp.asarray(x, dtype)
    got = np.asarray(K.experts_decode(lay, jnp.asarray(pool), xd, jnp.asarray(slots), jnp.asarray(weight),
                                      interpret=interpret)).astype(np.float32)
    want = K._reference(lay, pool, np.asarray(xd.astype(jnp.float32)), slots, weight)
    assert np.isfinite(got).all()
    if tokens > 1:
        assert np.all(got[tokens // 2] == 0)                  # every route of this token skipped
    err = rel_err(got, want)
    assert err <= LIMIT[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("block", [1, 4, 64])
def test_other_blocks_match_the_reference(block, interpret):
    """Fewer rows a program (more programs of fewer bytes, for batch 1 on a many-SM GPU), or more (64 rows: the
    gate/up block is capped at I = 128 rows, the down block at H): the same result."""
    rng = np.random.default_rng(0)
    lay = Q.layout("int4", H, I)
    pool, slot_of = poisoned_pool(rng, lay, n_experts=10, n_slots=14)
    slots, weight = routes(rng, 3, 4, slot_of)
    x = rng.standard_normal((3, H)).astype(np.float32)
    got = np.asarray(K.experts_decode(lay, jnp.asarray(pool), jnp.asarray(x), jnp.asarray(slots),
                                      jnp.asarray(weight), interpret=interpret, block=block))
    want = K._reference(lay, pool, x, slots, weight)
    assert np.isfinite(got).all() and np.all(got[1] == 0)    # token 1: every route skipped
    err = rel_err(got, want)
    assert err <= LIMIT["float32"], f"block {block}: relative error {err:.2e}"


def test_a_block_that_is_not_a_power_of_two_is_refused():
    lay = Q.layout("int4", H, I)
    with pytest.raises(ValueError, match="block must be a power of two, not 12"):
        K.experts_decode(lay, jnp.zeros((2, lay.nbytes), jnp.uint8), jnp.zeros((1, H)),
                         jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2)), interpret=True, block=12)


def test_warps_that_are_not_a_power_of_two_are_refused():
    lay = Q.layout("int4", H, I)
    with pytest.raises(ValueError, match="warps must be a power of two, not 6"):
        K.experts_decode(lay, jnp.zeros((2, lay.nbytes), jnp.uint8), jnp.zeros((1, H)),
                         jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2)), interpret=True, warps=6)


def test_formats_and_shapes_it_cannot_read_are_refused():
    for fmt in (f for f in Q.FORMATS if f != "int4"):
        lay = Q.layout(fmt, H, I)
        with pytest.raises(ValueError, match=f"experts_decode reads the formats int4, not '{fmt}'"):
            K.experts_decode(lay, jnp.zeros((2, lay.nbytes), jnp.uint8), jnp.zeros((1, H)),
                             jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2)), interpret=True)
    odd = Q.layout("int4", 96, 32)                            # groups of 96 and 32 columns: not powers of two
    with pytest.raises(ValueError, match="power of two"):
        K.experts_decode(odd, jnp.zeros((2, odd.nbytes), jnp.uint8), jnp.zeros((1, 96)),
                         jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2)), interpret=True)


def test_flash_next_shapes_go_through_xlas_form_on_the_gpu():
    """Qwen3.8-Flash-Next's experts (H 2560, I 640: 20 and 5 int4 groups a row) are no power of two of groups, which
    Triton cannot lower (an H100 run failed there): the kernel refuses them when traced, and the backend's expert op
    then lowers for CUDA without it."""
    from jax import export

    from strata.backend import get_backend
    lay = Q.layout("int4", 2560, 640)
    with pytest.raises(ValueError, match="groups of 128 a row"):
        K.experts_decode(lay, jnp.zeros((2, lay.nbytes), jnp.uint8), jnp.zeros((1, 2560)),
                         jnp.zeros((1, 10), jnp.int32), jnp.zeros((1, 10)), interpret=True)
    be = get_backend("jax", kernels="pallas")
    assert "experts_decode" in be.pallas_ops
    spec = jax.ShapeDtypeStruct
    fn = jax.jit(lambda p, x, s, w: be.experts_pool(x, s, w, p, lay, 10))
    exp = export.export(fn, platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        spec((64, lay.nbytes), jnp.uint8), spec((1, 2560), jnp.bfloat16), spec((1, 10), jnp.int32),
        spec((1, 10), jnp.float32))
    assert exp.mlir_module().count("@__gpu$xla.gpu.triton") == 0


@pytest.mark.parametrize("chunks,dtype", [(1, "float32"), (2, "bfloat16"), (3, "float32")])
def test_pool_at_the_limit_is_read_through_compacted_chunks(chunks, dtype, interpret, monkeypatch, fresh_jit):
    """The limit monkeypatched so that the 14-slot pool is over it and the blobs of the 12 routes (3 tokens x 4: at
    most 12 distinct, the compaction's static size) take 1, 2 or 3 chunks of 12, 6 and 4 blobs: the result equals
    the reference on the whole pool, and every kernel reads a compact pool under the limit."""
    rng = np.random.default_rng(0)
    lay = Q.layout("int4", H, I)
    pool, slot_of = poisoned_pool(rng, lay, n_experts=10, n_slots=14)
    slots, weight = routes(rng, 3, 4, slot_of)
    per = {1: 12, 2: 6, 3: 4}[chunks]
    limit = per * lay.nbytes + 1
    assert pool.size >= limit
    monkeypatch.setattr(K, "MAX_KERNEL_POOL_BYTES", limit)
    x = jnp.asarray(rng.standard_normal((3, H)).astype(np.float32), dtype)
    args = (jnp.asarray(pool), x, jnp.asarray(slots), jnp.asarray(weight))

    def fn(*a):
        return K.experts_decode(lay, *a, interpret=interpret)

    pools = pool_operands(fn, *args)
    assert len(pools) == 2 * chunks and all(p.shape == (per, lay.nbytes) and p.size < limit for p in pools)
    got = np.asarray(fn(*args)).astype(np.float32)
    want = K._reference(lay, pool, np.asarray(x.astype(jnp.float32)), slots, weight)
    assert np.isfinite(got).all() and np.all(got[1] == 0)    # token 1: every route skipped
    err = rel_err(got, want)
    assert err <= LIMIT[dtype], f"{chunks} chunks: relative error {err:.2e}"


def test_engine_sized_pools_reach_the_kernels_directly_or_as_the_routes_blobs():
    """Traced at Qwen3-Next-80B shapes: a 26 GB int4 pool (16,384 slots, where the Triton lowering offsets in 64 bits)
    reaches the kernels as it is; a 3 GiB one (2,000 slots: int32 offsets would overflow) as a compact pool of the 160
    routes' blobs (16 tokens x 10), under 2^31 bytes."""
    lay = Q.layout("int4", 2048, 512)
    spec = jax.ShapeDtypeStruct
    args = (spec((16, 2048), jnp.bfloat16), spec((16, 10), jnp.int32), spec((16, 10), jnp.float32))
    pools = pool_operands(lambda *a: K.experts_decode(lay, *a), spec((16384, lay.nbytes), jnp.uint8), *args)
    assert len(pools) == 2 and all(p.shape == (16384, lay.nbytes) for p in pools)
    pools = pool_operands(lambda *a: K.experts_decode(lay, *a), spec((2000, lay.nbytes), jnp.uint8), *args)
    assert len(pools) == 2 and all(p.shape == (160, lay.nbytes) and p.size < 2**31 for p in pools)


@pytest.mark.parametrize("block,warps", [(K.BLOCK_ROWS, K.WARPS), (32, 8)])
def test_kernels_lower_for_cuda_at_real_shapes(block, warps):
    """Qwen3-Next-80B shapes, 1 token x 10 routes over a 16,384-slot pool: the Pallas-to-Triton lowering (no GPU
    needed) takes the two kernels of a call (each program's rows whole in one load), at the default rows and warps
    and at more of both."""
    from jax import export
    lay = Q.layout("int4", 2048, 512)
    spec = jax.ShapeDtypeStruct
    fn = jax.jit(lambda p, x, s, w: K.experts_decode(lay, p, x, s, w, block=block, warps=warps))
    exp = export.export(fn, platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        spec((16384, lay.nbytes), jnp.uint8), spec((1, 2048), jnp.bfloat16), spec((1, 10), jnp.int32),
        spec((1, 10), jnp.float32))
    mod = exp.mlir_module()
    assert mod.count("@__gpu$xla.gpu.triton") == 2 and mod.count(f"num_warps = {warps} : i32") == 2
