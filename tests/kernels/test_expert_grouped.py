"""kernels/expert_grouped.experts_grouped (the prompt form of the expert op: grouped GEMMs dequantising the blobs in
the kernel) against the numpy reference on the same blobs, in every format and both x dtypes, and for int4 both
kernel variants (v2: even/odd columns, two dots per group; v1: the first design): a poisoned pool (garbage and NaN
bytes in unused slots), skipped routes with NaN weights, one token with every route skipped, groups of several
blocks; pools read through compacted sub-pools of 1, 2 and 3 chunks (the kernels' pool limit monkeypatched small);
on the CPU in Pallas interpret mode, on the GPU compiled (STRATA_TEST_DEVICE=gpu). And static checks of what
interpret mode does not catch, at Qwen3-Next-80B shapes: the Triton limits of the traced kernels, the pool operand
of every kernel below 2^31 bytes, and the Pallas-to-Triton lowering for CUDA (jax.export, no GPU needed)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jaxprs import pool_operands, walk
from test_expert_op import LIMIT, poisoned_pool, rel_err, routes

from strata.jax_backend.kernels import expert_grouped as K
from strata.weights import quant as Q

# LIMIT (test_expert_op) bounds the XLA op against the reference on the same blobs; it fits these kernels: float32 x
# runs float32 dots at HIGHEST precision (measured ~3e-7), bfloat16 x rounds fewer things than the XLA op does
# (weights exact in bfloat16 except f32 blobs', float32 accumulators, h and each route's row rounded once).
REAL = dict(hidden=2048, inter=512, tokens=4096, k=10, n_slots=512)      # Qwen3-Next-80B, a 4096-token prompt part
CASES = [(f, "v2") for f in K.FORMATS] + [("int4", "v1")]              # v2 reads int4; the others run v1's kernels


def _run(fmt, hidden, inter, tokens, k, dtype, interpret, rng, **kw):
    lay = Q.layout(fmt, hidden, inter)
    pool, slot_of = poisoned_pool(rng, lay)                   # 8 experts in 12 slots, slots 0 and 11 all 0xFF
    slots, weight = routes(rng, tokens, k, slot_of)           # ~20% skipped with NaN weights; token T//2 all skipped
    xd = jnp.asarray(rng.standard_normal((tokens, hidden)).astype(np.float32)).astype(dtype)
    got = K.experts_grouped(lay, jnp.asarray(pool), xd, jnp.asarray(slots), jnp.asarray(weight),
                            interpret=interpret, **kw)
    assert got.dtype == xd.dtype and got.shape == (tokens, hidden)
    want = K._reference(lay, pool, np.asarray(xd.astype(jnp.float32)), slots, weight)
    return np.asarray(got.astype(jnp.float32)), want, slots


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hidden,inter,tokens,k", [(256, 128, 70, 4), (128, 256, 5, 2)])
@pytest.mark.parametrize("fmt,variant", CASES)
def test_grouped_kernels_match_the_reference(fmt, variant, hidden, inter, tokens, k, dtype, interpret):
    want_kernels = "v2" if (fmt, variant) == ("int4", "v2") else "v1"
    assert K.kernel_variant(Q.layout(fmt, hidden, inter), dtype, variant) == want_kernels
    got, want, slots = _run(fmt, hidden, inter, tokens, k, dtype, interpret, np.random.default_rng(0), variant=variant)
    assert np.isfinite(got).all(), "garbage from an unused slot or a skipped route leaked into the result"
    assert np.all(got[np.all(slots < 0, axis=1)] == 0)        # token T//2: every route skipped
    err = rel_err(got, want)
    assert err <= LIMIT[dtype][fmt], f"{fmt} {variant} {dtype} H={hidden} I={inter} T={tokens}: rel. error {err:.2e}"


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_demo_shape_with_k_steps_inside_an_int4_group(fmt, interpret):
    """H=96, I=32 (the demo model): blocks of 32 columns, int4 gate/up groups of 96 read in three K steps. A group
    of 96 is no power of two: v2 does not apply and the default runs v1."""
    lay = Q.layout(fmt, 96, 32)
    got, want, _ = _run(fmt, 96, 32, 70, 4, "bfloat16", interpret, np.random.default_rng(0))
    assert K.plan(lay, jnp.bfloat16) == K.Plan(bm=64, bi=32, bh=32, bk1=32, bk2=32)
    assert K.plan_v2(lay, jnp.bfloat16) is None and K.kernel_variant(lay, jnp.bfloat16) == "v1"
    assert np.isfinite(got).all() and rel_err(got, want) <= LIMIT["bfloat16"][fmt]


@pytest.mark.parametrize("fmt,dtype,block_m,variant", [
    ("int4", "bfloat16", 32, "v2"), ("int4", "float32", 128, "v2"), ("int4", "bfloat16", 32, "v1"),
    ("nvfp4", "float32", 128, "v2")])
def test_groups_of_several_blocks_and_the_large_block(fmt, dtype, block_m, variant, interpret):
    """Three experts, one taking every token: with block_m 32 its group spans three blocks; block_m 128 is the other
    block the GPU may run. max_distinct = 3 sizes the grid exactly."""
    rng = np.random.default_rng(0)
    lay = Q.layout(fmt, 128, 128)
    pool, slot_of = poisoned_pool(rng, lay, n_experts=3, n_slots=6)
    tokens, k = 70, 2
    idx = np.stack([[0, rng.choice([1, 2], p=[0.75, 0.25])] for _ in range(tokens)])   # expert 0 in every token
    slots = slot_of[idx].astype(np.int32)
    slots[::7, 1] = -1
    weight = rng.random((tokens, k)).astype(np.float32)
    weight[slots < 0] = np.nan
    if block_m == 32:
        assert np.bincount(slots[slots >= 0]).max() > 2 * block_m
    x = jnp.asarray(rng.standard_normal((tokens, 128)).astype(np.float32)).astype(dtype)
    got = np.asarray(K.experts_grouped(lay, jnp.asarray(pool), x, jnp.asarray(slots), jnp.asarray(weight),
                                       interpret=interpret, max_distinct=3, block_m=block_m,
                                       variant=variant).astype(jnp.float32))
    want = K._reference(lay, pool, np.asarray(x.astype(jnp.float32)), slots, weight)
    assert np.isfinite(got).all()
    err = rel_err(got, want)
    assert err <= LIMIT[dtype][fmt], f"{fmt} {variant} {dtype} block_m={block_m}: relative error {err:.2e}"


@pytest.mark.parametrize("variant", K.VARIANTS)
def test_all_routes_skipped_gives_exact_zeros(variant, interpret):
    lay = Q.layout("int4", 128, 256)
    rng = np.random.default_rng(1)
    pool, _ = poisoned_pool(rng, lay)
    y = K.experts_grouped(lay, jnp.asarray(pool), jnp.asarray(rng.standard_normal((5, 128)).astype(np.float32)),
                          -jnp.ones((5, 2), jnp.int32), jnp.full((5, 2), jnp.nan, jnp.float32), interpret=interpret,
                          variant=variant)
    assert np.array_equal(np.asarray(y), np.zeros((5, 128), np.float32))


def test_even_odd_permutation_and_its_inverse():
    """v2's layouts: x's columns per group of g (even then odd), and the h column each kernel-1 position holds."""
    g = 8
    a = np.arange(3 * 2 * g).reshape(3, 2 * g)
    got = np.asarray(K._even_odd_columns(jnp.asarray(a), g))
    assert np.array_equal(got[0], [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15])
    src = np.asarray(K._even_odd_source(jnp.arange(2 * g, dtype=jnp.int32), g))
    assert np.array_equal(got, a[:, src])


@pytest.mark.parametrize("block_m", [16, 64])
def test_routes_are_laid_out_in_blocks_of_the_used_slots_only(block_m):
    """The XLA sort: one run of blocks per used slot (ceil(routes / block_m) of them, in slot order), then blocks of
    slot -1 (no pool read); each route's padded row holds its token and weight; pad rows weigh 0."""
    rng = np.random.default_rng(0)
    tokens, k, n_slots = 70, 4, 12
    slots, weight = routes(rng, tokens, k, rng.choice(n_slots, 8, replace=False))
    sort = jax.jit(K._sort_routes, static_argnums=(2, 3, 4, 5))
    row_tok, row_w, block_slot, pos = (np.asarray(a) for a in sort(jnp.asarray(slots.reshape(-1)),
                                                                  jnp.asarray(weight.reshape(-1)),
                                                                  n_slots, k, block_m, 8))
    used, count = np.unique(slots[slots >= 0], return_counts=True)
    want = np.repeat(used, -(-count // block_m))
    assert np.array_equal(block_slot[:len(want)], want) and np.all(block_slot[len(want):] == -1)
    flat = slots.reshape(-1)
    ok = flat >= 0
    assert np.all(pos[~ok] == len(row_tok)) and len(set(pos[ok])) == ok.sum()
    assert np.array_equal(block_slot[pos[ok] // block_m], flat[ok])
    assert np.array_equal(row_tok[pos[ok]], np.nonzero(ok)[0] // k)
    assert np.array_equal(row_w[pos[ok]], weight.reshape(-1)[ok])
    pad = np.ones(len(row_w), bool)
    pad[pos[ok]] = False
    assert np.all(row_w[pad] == 0)


def test_what_it_cannot_read_is_refused():
    assert set(K.FORMATS) == set(Q.FORMATS)                   # every format is read: none to refuse
    lay = Q.layout("int4", 128, 128)
    args = (jnp.zeros((2, lay.nbytes), jnp.uint8), jnp.zeros((1, 128), jnp.float16), jnp.zeros((1, 2), jnp.int32),
            jnp.zeros((1, 2)))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        K.experts_grouped(lay, *args, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        K.experts_grouped(lay, args[0], args[1].astype(jnp.float32), *args[2:], interpret=True, block_m=48)
    with pytest.raises(ValueError, match="variant"):
        K.experts_grouped(lay, args[0], args[1].astype(jnp.float32), *args[2:], interpret=True, variant="v3")
    small = Q.layout("f32", 40, 24)                           # no power-of-two block of >= 16 columns divides them
    with pytest.raises(ValueError, match="multiples of 16"):
        K.experts_grouped(small, jnp.zeros((2, small.nbytes), jnp.uint8), jnp.zeros((1, 40)),
                          jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2)), interpret=True)


# --- pools of any size: compacted sub-pools

@pytest.mark.parametrize("fmt,variant,chunks,wide", [("int4", "v2", 1, True), ("int4", "v2", 2, False),
                                                     ("int4", "v2", 3, False), ("int4", "v1", 2, False),
                                                     ("bf16", "v2", 1, False), ("bf16", "v2", 3, True)])
def test_pool_at_the_limit_is_read_through_compacted_chunks(fmt, variant, chunks, wide, interpret, monkeypatch,
                                                            fresh_jit):
    """The limit monkeypatched so that the 12-slot pool is over it and its used blobs (max_distinct 8: the 8 experts)
    take 1, 2 or 3 chunks (3 chunks of 3: the last padded). The result equals the reference on the whole pool;
    every kernel reads a compact pool under the limit; a pool wider than the blob (garbage past nbytes) is sliced."""
    rng = np.random.default_rng(0)
    lay = Q.layout(fmt, 256, 128)
    pool, slot_of = poisoned_pool(rng, lay)
    if wide:
        pool = np.concatenate([pool, np.full((pool.shape[0], 4096), 0xFF, np.uint8)], axis=1)
    per = {1: 8, 2: 4, 3: 3}[chunks]
    limit = per * lay.nbytes + 1
    assert pool.size >= limit
    monkeypatch.setattr(K, "MAX_KERNEL_POOL_BYTES", limit)
    slots, weight = routes(rng, 70, 4, slot_of)
    x = jnp.asarray(rng.standard_normal((70, 256)).astype(np.float32)).astype(jnp.bfloat16)
    args = (jnp.asarray(pool), x, jnp.asarray(slots), jnp.asarray(weight))

    def fn(*a):
        return K.experts_grouped(lay, *a, interpret=interpret, max_distinct=8, variant=variant)

    pools = pool_operands(fn, *args)
    assert len(pools) == 2 * chunks and all(p.shape == (per, lay.nbytes) and p.size < limit for p in pools)
    got = np.asarray(fn(*args).astype(jnp.float32))
    want = K._reference(lay, pool, np.asarray(x.astype(jnp.float32)), slots, weight)
    assert np.isfinite(got).all() and np.all(got[np.all(slots < 0, axis=1)] == 0)
    err = rel_err(got, want)
    assert err <= LIMIT["bfloat16"][fmt], f"{fmt} {variant} {chunks} chunks: relative error {err:.2e}"


def test_compaction_drops_the_slots_past_max_distinct_like_the_direct_path(interpret, monkeypatch, fresh_jit):
    """max_distinct 5 of the 8 used slots: both paths compute the routes of the 5 smallest slots only."""
    rng = np.random.default_rng(0)
    lay = Q.layout("int4", 128, 128)
    pool, slot_of = poisoned_pool(rng, lay)
    slots, weight = routes(rng, 40, 4, slot_of)
    x = rng.standard_normal((40, 128)).astype(np.float32)
    kept = np.unique(slots[slots >= 0])[:5]
    want = K._reference(lay, pool, x, np.where(np.isin(slots, kept), slots, -1), weight)
    args = (jnp.asarray(pool), jnp.asarray(x), jnp.asarray(slots), jnp.asarray(weight))
    direct = np.asarray(K.experts_grouped(lay, *args, interpret=interpret, max_distinct=5))
    monkeypatch.setattr(K, "MAX_KERNEL_POOL_BYTES", 2 * lay.nbytes + 1)   # 3 chunks of 2 (5 + 1 padding entry)
    K.experts_grouped.clear_cache()
    compact = np.asarray(K.experts_grouped(lay, *args, interpret=interpret, max_distinct=5))
    for got in (direct, compact):
        assert rel_err(got, want) <= LIMIT["float32"]["int4"]


@pytest.mark.parametrize("fmt,chunks", [("bf16", 2), ("f32", 0), ("int4", 0)])
def test_real_pools_over_2_gib_reach_the_kernels_in_chunks_under_it(fmt, chunks):
    """Traced at real shapes (512 experts: bf16 3.2 GB, f32 6.4 GB, int4 0.84 GB): a pool of 2^31 .. 2^32 bytes (bf16)
    reaches the kernels as compact pools of fewer than 2^31 bytes (2 chunks); below it (int4) and above it (f32, where
    the Triton lowering offsets in 64 bits) the pool goes directly."""
    lay = Q.layout(fmt, REAL["hidden"], REAL["inter"])
    spec = jax.ShapeDtypeStruct
    n, t, k = REAL["n_slots"], REAL["tokens"], REAL["k"]
    pools = pool_operands(lambda *a: K.experts_grouped(lay, *a, max_distinct=n),
                           spec((n, lay.nbytes), jnp.uint8), spec((t, REAL["hidden"]), jnp.bfloat16),
                           spec((t, k), jnp.int32), spec((t, k), jnp.float32))
    assert len(pools) == 2 * max(chunks, 1)
    assert all(p.size < 2**31 or p.size > 2**32 for p in pools)
    if chunks == 0:
        assert pools[0].shape == (n, lay.nbytes)
    else:
        assert n * lay.nbytes >= 2**31 and sum(p.shape[0] for p in pools) == 2 * n


# --- static checks of the compiled form (interpret mode cannot see these)

def _kernel_eqns(jaxpr):
    """Every pallas_call eqn in `jaxpr` (recursively)."""
    return [eqn for eqn in walk(jaxpr) if eqn.primitive.name == "pallas_call"]


def _pow2(n):
    return n >= 1 and n & (n - 1) == 0


def _num_stages(eqn):
    params = eqn.params["compiler_params"]
    params = params.get("triton", params) if isinstance(params, dict) else params
    return params.num_stages


def _nbytes(aval):
    return math.prod(aval.shape) * aval.dtype.itemsize


def _smem_estimate(kern, stages: int, v2: bool) -> int:
    """Shared memory of one program, estimated from its traced kernel. v1 kernels: their distinct dot operand tiles
    times the stages (the first design's estimate). v2 kernels, as Triton lays them out when compiled for sm_90
    (checked with the Triton compiler on the CPU; see the module docstring): the tiles loaded inside the K loop
    (x / h halves, packed bytes) times the stages, plus one buffer of each decoded weight operand (computed in
    registers, stored to shared memory for the dot)."""
    dots = [eqn for eqn in walk(kern) if eqn.primitive.name == "dot_general"]
    operands = {id(v): v.aval for eqn in dots for v in eqn.invars}
    if not v2:
        return sum(_nbytes(a) for a in operands.values()) * stages
    loaded = {}
    for eqn in walk(kern):
        if eqn.primitive.name == "scan":
            for inner in walk(eqn.params["jaxpr"].jaxpr):
                if inner.primitive.name == "get" and len(inner.outvars[0].aval.shape) >= 2:
                    loaded[id(inner.outvars[0])] = inner.outvars[0].aval
    decoded = {k: a for k, a in operands.items() if k not in loaded}
    return sum(_nbytes(a) for a in loaded.values()) * stages + sum(_nbytes(a) for a in decoded.values())


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt,variant", CASES)
def test_kernels_at_real_shapes_keep_the_triton_limits(fmt, variant, dtype, block_m):
    """Traced (not run) at Qwen3-Next-80B shapes, compiled-mode parameters: every primitive in the kernels has a
    Triton lowering, every array value inside them has power-of-two dimensions (interpret mode accepts others, the
    GPU does not), every dot has equal, non-unsigned operand dtypes, dimensions >= 16 and HIGHEST precision in
    float32, and the estimated shared memory per program fits the H200's per block (an estimate: what Triton
    allocates is known only by compiling)."""
    from jax._src.pallas.triton.lowering import triton_lowering_rules
    hidden, inter, tokens, k, n_slots = REAL["hidden"], REAL["inter"], REAL["tokens"], REAL["k"], REAL["n_slots"]
    lay = Q.layout(fmt, hidden, inter)
    v2 = K.kernel_variant(lay, dtype, variant, block_m) == "v2"
    assert v2 == ((fmt, variant) == ("int4", "v2"))
    spec = jax.ShapeDtypeStruct
    closed = jax.make_jaxpr(lambda *a: K.experts_grouped(lay, *a, interpret=False, block_m=block_m,
                                                         variant=variant))(
        spec((n_slots, lay.nbytes), jnp.uint8), spec((tokens, hidden), jnp.dtype(dtype)),
        spec((tokens, k), jnp.int32), spec((tokens, k), jnp.float32))
    eqns = _kernel_eqns(closed.jaxpr)
    assert len(eqns) % 2 == 0 and eqns                        # two kernels per chunk
    names = {eqn.params["jaxpr"].debug_info.func_name for eqn in eqns}
    assert names == ({"_gate_up_int4_kernel", "_down_int4_kernel"} if v2 else {"_gate_up_kernel", "_down_kernel"})
    for eqn in eqns:
        kern = eqn.params["jaxpr"]
        for e in walk(kern):
            assert e.primitive in triton_lowering_rules, f"{fmt} {dtype}: no Triton lowering of {e.primitive}"
            for v in e.outvars:
                shape = getattr(v.aval, "shape", None)
                if shape is not None and not hasattr(v.aval, "inner_aval"):      # values, not refs
                    assert all(_pow2(d) for d in shape), f"{fmt} {dtype}: {e.primitive} gives {v.aval}"
            if e.primitive.name == "dot_general":
                a, b = (x.aval for x in e.invars)
                assert a.dtype == b.dtype and not jnp.issubdtype(a.dtype, jnp.unsignedinteger), (a, b)
                assert min(a.shape + b.shape) >= K.MIN_DOT, (a, b)
                if a.dtype == jnp.float32:
                    assert e.params["precision"] == (jax.lax.Precision.HIGHEST,) * 2
        smem = _smem_estimate(kern, _num_stages(eqn), v2)
        assert 0 < smem <= K.SMEM_BYTES, f"{fmt} {variant} {dtype}: ~{smem} B of shared memory per program"


@pytest.mark.parametrize("fmt,variant", [("int4", "v2"), ("int4", "v1"), ("bf16", "v2")])
def test_kernels_lower_to_triton_for_cuda_at_real_shapes(fmt, variant):
    """jax.export for the "cuda" platform runs Pallas' Triton lowering on this (CPU) machine: every kernel becomes a
    Triton custom call (the compatibility check of the custom call's target is what export must be told to skip:
    Triton calls carry no stability guarantee). bf16's 3.2 GB pool lowers as two chunks."""
    lay = Q.layout(fmt, REAL["hidden"], REAL["inter"])
    spec = jax.ShapeDtypeStruct
    n, t, k = REAL["n_slots"], REAL["tokens"], REAL["k"]
    targets = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")          # JAX <= 0.10.2; later versions
    exp = export.export(jax.jit(lambda *a: K.experts_grouped(lay, *a, max_distinct=n, variant=variant)),
                        platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(c) for c in targets])(
        spec((n, lay.nbytes), jnp.uint8), spec((t, REAL["hidden"]), jnp.bfloat16), spec((t, k), jnp.int32),
        spec((t, k), jnp.float32))
    text = exp.mlir_module()
    calls = sum(text.count(f"custom_call @{c}(") + text.count(f'custom_call @"{c}"(') for c in targets)
    assert calls == (4 if fmt == "bf16" else 2), f"{calls} Triton calls"
