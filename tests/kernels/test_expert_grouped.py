"""kernels/expert_grouped.experts_grouped (the prompt form of the expert op: grouped GEMMs dequantising the blobs in
the kernel) against the numpy reference on the same blobs, in every format and both x dtypes: a poisoned pool
(garbage and NaN bytes in unused slots), skipped routes with NaN weights, one token with every route skipped, groups
of several blocks; on the CPU in Pallas interpret mode, on the GPU compiled (STRATA_TEST_DEVICE=gpu). And a static
check of what interpret mode does not catch: the Triton limits of the kernels traced at Qwen3-Next-80B shapes."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr
from test_expert_op import LIMIT, poisoned_pool, rel_err, routes

from strata.jax_backend.kernels import expert_grouped as K
from strata.weights import quant as Q

# LIMIT (test_expert_op) bounds the XLA op against the reference on the same blobs; it fits these kernels: float32 x
# runs float32 dots at HIGHEST precision (measured ~3e-7), bfloat16 x rounds fewer things than the XLA op does
# (weights exact in bfloat16 except f32 blobs', float32 accumulators, h and each route's row rounded once).


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
@pytest.mark.parametrize("fmt", K.FORMATS)
def test_grouped_kernels_match_the_reference(fmt, hidden, inter, tokens, k, dtype, interpret):
    got, want, slots = _run(fmt, hidden, inter, tokens, k, dtype, interpret, np.random.default_rng())
    assert np.isfinite(got).all(), "garbage from an unused slot or a skipped route leaked into the result"
    assert np.all(got[np.all(slots < 0, axis=1)] == 0)        # token T//2: every route skipped
    err = rel_err(got, want)
    assert err <= LIMIT[dtype][fmt], f"{fmt} {dtype} H={hidden} I={inter} T={tokens}: relative error {err:.2e}"


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_demo_shape_with_k_steps_inside_an_int4_group(fmt, interpret):
    """H=96, I=32 (the demo model): blocks of 32 columns, int4 gate/up groups of 96 read in three K steps."""
    got, want, _ = _run(fmt, 96, 32, 70, 4, "bfloat16", interpret, np.random.default_rng())
    assert K.plan(Q.layout(fmt, 96, 32), jnp.bfloat16) == K.Plan(bm=64, bi=32, bh=32, bk1=32, bk2=32)
    assert np.isfinite(got).all() and rel_err(got, want) <= LIMIT["bfloat16"][fmt]


@pytest.mark.parametrize("fmt,dtype,block_m", [("int4", "bfloat16", 32), ("nvfp4", "float32", 128)])
def test_groups_of_several_blocks_and_the_large_block(fmt, dtype, block_m, interpret):
    """Three experts, one taking almost every token: with block_m 32 its group spans three blocks; block_m 128 is
    the other block the GPU may run. max_distinct = 3 sizes the grid exactly."""
    rng = np.random.default_rng()
    lay = Q.layout(fmt, 128, 128)
    pool, slot_of = poisoned_pool(rng, lay, n_experts=3, n_slots=6)
    tokens, k = 70, 2
    idx = np.stack([rng.choice(3, k, replace=False, p=[0.8, 0.15, 0.05]) for _ in range(tokens)])
    slots = slot_of[idx].astype(np.int32)
    slots[::7, 1] = -1
    weight = rng.random((tokens, k)).astype(np.float32)
    weight[slots < 0] = np.nan
    if block_m == 32:
        assert np.bincount(slots[slots >= 0]).max() > 2 * block_m
    x = jnp.asarray(rng.standard_normal((tokens, 128)).astype(np.float32)).astype(dtype)
    got = np.asarray(K.experts_grouped(lay, jnp.asarray(pool), x, jnp.asarray(slots), jnp.asarray(weight),
                                       interpret=interpret, max_distinct=3, block_m=block_m).astype(jnp.float32))
    want = K._reference(lay, pool, np.asarray(x.astype(jnp.float32)), slots, weight)
    assert np.isfinite(got).all()
    err = rel_err(got, want)
    assert err <= LIMIT[dtype][fmt], f"{fmt} {dtype} block_m={block_m}: relative error {err:.2e}"


def test_all_routes_skipped_gives_exact_zeros(interpret):
    lay = Q.layout("int4", 128, 256)
    rng = np.random.default_rng(1)
    pool, _ = poisoned_pool(rng, lay)
    y = K.experts_grouped(lay, jnp.asarray(pool), jnp.asarray(rng.standard_normal((5, 128)).astype(np.float32)),
                          -jnp.ones((5, 2), jnp.int32), jnp.full((5, 2), jnp.nan, jnp.float32), interpret=interpret)
    assert np.array_equal(np.asarray(y), np.zeros((5, 128), np.float32))


@pytest.mark.parametrize("block_m", [16, 64])
def test_routes_are_laid_out_in_blocks_of_the_used_slots_only(block_m):
    """The XLA sort: one run of blocks per used slot (ceil(routes / block_m) of them, in slot order), then blocks of
    slot -1 (no pool read); each route's padded row holds its token and weight; pad rows weigh 0."""
    rng = np.random.default_rng()
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
    small = Q.layout("f32", 40, 24)                           # no power-of-two block of >= 16 columns divides them
    with pytest.raises(ValueError, match="multiples of 16"):
        K.experts_grouped(small, jnp.zeros((2, small.nbytes), jnp.uint8), jnp.zeros((1, 40)),
                          jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2)), interpret=True)


def _kernel_jaxprs(jaxpr):
    """The kernel jaxpr of every pallas_call in `jaxpr` (recursively)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn.params["jaxpr"]
        for sub in _subjaxprs(eqn):
            yield from _kernel_jaxprs(sub)


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for s in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(s, ClosedJaxpr):
                yield s.jaxpr
            elif isinstance(s, Jaxpr):
                yield s


def _walk(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _subjaxprs(eqn):
            yield from _walk(sub)


def _pow2(n):
    return n >= 1 and n & (n - 1) == 0


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", K.FORMATS)
def test_kernels_at_real_shapes_keep_the_triton_limits(fmt, dtype, block_m):
    """Traced (not run) at Qwen3-Next-80B shapes, compiled-mode parameters: every primitive in the kernels has a
    Triton lowering, every array value inside them has power-of-two dimensions (interpret mode accepts others, the
    GPU does not), every dot has equal, non-unsigned operand dtypes, dimensions >= 16 and HIGHEST precision in
    float32, and one K step's distinct dot operand tiles, times the pipeline stages, fit the H200's shared memory
    per block (an estimate: what Triton allocates is known only by compiling)."""
    from jax._src.pallas.triton.lowering import triton_lowering_rules
    hidden, inter, tokens, k, n_slots = 2048, 512, 4096, 10, 512
    lay = Q.layout(fmt, hidden, inter)
    spec = jax.ShapeDtypeStruct
    closed = jax.make_jaxpr(lambda *a: K.experts_grouped(lay, *a, interpret=False, block_m=block_m))(
        spec((n_slots, lay.nbytes), jnp.uint8), spec((tokens, hidden), jnp.dtype(dtype)),
        spec((tokens, k), jnp.int32), spec((tokens, k), jnp.float32))
    kernels = list(_kernel_jaxprs(closed.jaxpr))
    assert len(kernels) == 2
    for kern in kernels:
        operands = {}
        for eqn in _walk(kern):
            assert eqn.primitive in triton_lowering_rules, f"{fmt} {dtype}: no Triton lowering of {eqn.primitive}"
            for v in eqn.outvars:
                shape = getattr(v.aval, "shape", None)
                if shape is not None and not hasattr(v.aval, "inner_aval"):      # values, not refs
                    assert all(_pow2(d) for d in shape), f"{fmt} {dtype}: {eqn.primitive} gives {v.aval}"
            if eqn.primitive.name == "dot_general":
                a, b = (x.aval for x in eqn.invars)
                assert a.dtype == b.dtype and not jnp.issubdtype(a.dtype, jnp.unsignedinteger), (a, b)
                assert min(a.shape + b.shape) >= K.MIN_DOT, (a, b)
                if a.dtype == jnp.float32:
                    assert eqn.params["precision"] == (jax.lax.Precision.HIGHEST,) * 2
                operands.update({id(x): math.prod(x.aval.shape) * x.aval.dtype.itemsize for x in eqn.invars})
        dot_bytes = sum(operands.values())
        assert dot_bytes > 0
        assert dot_bytes * K.NUM_STAGES <= K.SMEM_BYTES, f"{fmt} {dtype}: {dot_bytes} B of dot tiles per K step"
