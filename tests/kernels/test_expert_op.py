"""The JAX expert op over a pool of packed expert blobs (strata/jax_backend/kernels/experts.py) against the numpy
reference on the same blobs, in every format and both forms, with skipped routes and a poisoned pool; and, in the
f32 format, against the backend's former expert op over stacked weights (kept below) on the same weights."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax import lax

from strata.jax_backend.kernels import experts as K
from strata.jax_backend.kernels.host_rows import copy_host_rows
from strata.weights import quant as Q

EXPERTS = jax.jit(K.experts_from_pool, static_argnames=("layout", "max_distinct"))
DECODE = jax.jit(K.decode_blobs, static_argnames=("layout", "dtype"))
H, I, E, SLOTS = 96, 32, 8, 12   # the demo model's expert shape; 8 experts in a pool of 12 slots

# Relative Frobenius error limit of the op against quant.expert_reference on the SAME blobs (so quantisation error
# is not in it: only float arithmetic). float32 x: f32 math at HIGHEST precision vs float64 (measured <= 5e-7 in
# every format). bfloat16 x: the grouped form (and the gather form of f32 and bf16 blobs) rounds the decoded weights,
# the matmul outputs and the activations to bfloat16 (the weights are already exact in bfloat16 for the bf16
# format), so the limit is a few bfloat16 epsilons (2^-8 = 0.0039): measured <= 1.04e-2 over 40 seeds at T=1
# (fewest outputs: the most spread), <= 6.7e-3 at T=70. The gather form of quantised blobs rounds its output alone
# (test_quantised_decode_rows_round_once).
LIMIT = {
    "float32": {"f32": 5e-6, "bf16": 5e-6, "int8": 5e-6, "int4": 5e-6, "nvfp4": 5e-6},
    "bfloat16": {"f32": 2e-2, "bf16": 2e-2, "int8": 2e-2, "int4": 2e-2, "nvfp4": 2e-2},
}


def poisoned_pool(rng, lay, n_experts=E, n_slots=SLOTS):
    """A pool whose unused slots hold garbage: slot 0 and the last all 0xFF bytes (NaN in every float field),
    the others random bytes. The experts sit at random slots in between. Returns (pool, slot of each expert)."""
    pool = rng.integers(0, 256, (n_slots, lay.nbytes), dtype=np.uint8)
    pool[0] = 0xFF
    pool[-1] = 0xFF
    slot_of = rng.choice(np.arange(1, n_slots - 1), n_experts, replace=False)
    for e in range(n_experts):
        ws = [(rng.standard_normal(lay.shape_of(m)) / np.sqrt(lay.shape_of(m)[1])).astype(np.float32)
              for m in Q.MATRICES]
        pool[slot_of[e]] = Q.encode_expert(lay, *ws)
    return pool, slot_of


def routes(rng, tokens, k, slot_of, skip=0.2):
    """Router-like routes (k distinct experts per token) mapped to slots, about `skip` of them skipped (-1, with a
    NaN weight that must not matter), and one token whose routes are all skipped."""
    idx = np.stack([rng.choice(len(slot_of), k, replace=False) for _ in range(tokens)])
    slots = slot_of[idx].astype(np.int32)
    slots[rng.random(slots.shape) < skip] = -1
    slots[:, 0] = slot_of[idx[:, 0]]      # every other token keeps a route (all skipped by chance: a zero reference)
    if tokens > 1:
        slots[tokens // 2] = -1
    weight = rng.random((tokens, k)).astype(np.float32)
    weight[slots < 0] = np.nan
    return slots, weight


def rel_err(got, want):
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_decode_blobs_equals_numpy_decode_bit_for_bit(fmt):
    rng = np.random.default_rng(0)
    for hidden, inter in ((256, 128),):                  # several int4 groups per row in gate and up
        lay = Q.layout(fmt, hidden, inter)
        blobs = np.stack([Q.encode_expert(lay, *[(rng.standard_normal(lay.shape_of(m)) * s).astype(np.float32)
                                                 for m in Q.MATRICES]) for s in (0.02, 1.0, 30.0)])
        got = DECODE(layout=lay, blobs=jnp.asarray(blobs), dtype=jnp.float32)
        for r in range(len(blobs)):
            for g, want in zip(got, Q.decode_expert(lay, blobs[r])):
                assert np.array_equal(np.asarray(g[r]).view(np.uint32), want.view(np.uint32)), (fmt, hidden, r)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens,k", [(1, 4), (70, 4)], ids=["gather", "grouped"])
@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_op_matches_reference_on_the_same_blobs(fmt, tokens, k, dtype):
    rng = np.random.default_rng(0)
    lay = Q.layout(fmt, H, I)
    pool, slot_of = poisoned_pool(rng, lay)
    slots, weight = routes(rng, tokens, k, slot_of, skip=0.2 if tokens > 1 else 0.0)
    if tokens == 1:
        slots[0, 1] = -1                                   # one route skipped, three computed
        weight[0, 1] = np.nan
    x = jnp.asarray(rng.standard_normal((tokens, H)).astype(np.float32)).astype(dtype)
    got = EXPERTS(layout=lay, pool=jnp.asarray(pool), x=x, slots=jnp.asarray(slots), weight=jnp.asarray(weight),
                  max_distinct=E)
    assert got.dtype == x.dtype and got.shape == (tokens, H)
    got = np.asarray(got.astype(jnp.float32))
    want = K._reference(lay, pool, x, slots, weight)
    assert np.isfinite(got).all(), "garbage from an unused slot or a skipped route leaked into the result"
    assert np.all(got[np.all(slots < 0, axis=1)] == 0)
    err = rel_err(got, want)
    assert err <= LIMIT[dtype][fmt], f"{fmt} {dtype} T={tokens} k={k}: relative error {err:.2e}"


@pytest.mark.parametrize("fmt", ["int8", "int4", "nvfp4"])
def test_blob_matvec_is_the_decoded_matrix_times_the_vector(fmt):
    """blob_matvec (decoding inside the product, each byte's two columns at once) against decode_blobs' float32
    weights times v in float64, for every matrix: several groups a row, blobs of three scales."""
    rng = np.random.default_rng(0)
    lay = Q.layout(fmt, 256, 128)
    blobs = np.stack([Q.encode_expert(lay, *[(rng.standard_normal(lay.shape_of(m)) * s).astype(np.float32)
                                             for m in Q.MATRICES]) for s in (0.02, 1.0, 30.0)])
    weights = DECODE(layout=lay, blobs=jnp.asarray(blobs), dtype=jnp.float32)
    for m, w in zip(Q.MATRICES, weights):
        v = rng.standard_normal((len(blobs), lay.shape_of(m)[1])).astype(np.float32)
        got = np.asarray(jax.jit(K.blob_matvec, static_argnums=(0, 2))(lay, jnp.asarray(blobs), m, jnp.asarray(v)))
        want = np.einsum("rij,rj->ri", np.asarray(w, np.float64), v.astype(np.float64))
        assert rel_err(got, want) <= 1e-6, (fmt, m)


@pytest.mark.parametrize("fmt", ["int8", "int4", "nvfp4"])
def test_quantised_decode_rows_round_once(fmt):
    """The gather form of a quantised format computes in float32 from bfloat16 x and rounds only its output to
    bfloat16 (no rounded weights or activations in between): each output within one rounding of the reference
    (2^-8 of itself: bfloat16 keeps 8 significant bits) plus float32's own error. A Frobenius bound of 2^-9 is only
    typical of one rounding, not a bound: 96 outputs exceed it at some seeds."""
    rng = np.random.default_rng(0)
    lay = Q.layout(fmt, H, I)
    pool, slot_of = poisoned_pool(rng, lay)
    slots, weight = routes(rng, 2, 4, slot_of, skip=0.0)
    x = jnp.asarray(rng.standard_normal((2, H)).astype(np.float32)).astype(jnp.bfloat16)
    got = np.asarray(EXPERTS(layout=lay, pool=jnp.asarray(pool), x=x, slots=jnp.asarray(slots),
                             weight=jnp.asarray(weight), max_distinct=E).astype(jnp.float32))
    want = K._reference(lay, pool, x, slots, weight)
    err = np.abs(got - want)
    assert np.all(err <= 2.0 ** -8 * np.abs(want) + 1e-6 * np.abs(want).max()), float(np.max(err / np.abs(want)))


def test_all_routes_skipped_gives_exact_zeros():
    lay = Q.layout("int4", H, I)
    rng = np.random.default_rng(1)
    pool, _ = poisoned_pool(rng, lay)
    x = jnp.asarray(rng.standard_normal((70, H)).astype(np.float32))
    for tokens in (1, 70):
        slots = -np.ones((tokens, 4), np.int32)
        y = EXPERTS(layout=lay, pool=jnp.asarray(pool), x=x[:tokens], slots=jnp.asarray(slots),
                    weight=jnp.ones((tokens, 4), jnp.float32), max_distinct=E)
        assert np.array_equal(np.asarray(y), np.zeros((tokens, H), np.float32))


def test_grouped_form_with_few_distinct_slots_and_multi_block_groups():
    """max_distinct below the expert count bounds the blocks; one slot holds several blocks of routes."""
    lay = Q.layout("nvfp4", H, I)
    rng = np.random.default_rng(0)
    pool, slot_of = poisoned_pool(rng, lay, n_experts=3)
    tokens, k = 100, 2
    p = np.array([0.8, 0.15, 0.05])
    idx = np.stack([rng.choice(3, k, replace=False, p=p) for _ in range(tokens)])
    slots = slot_of[idx].astype(np.int32)
    slots[::7, 1] = -1
    weight = rng.random((tokens, k)).astype(np.float32)
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    got = np.asarray(EXPERTS(layout=lay, pool=jnp.asarray(pool), x=jnp.asarray(x), slots=jnp.asarray(slots),
                             weight=jnp.asarray(weight), max_distinct=3))
    assert rel_err(got, K._reference(lay, pool, x, slots, weight)) <= LIMIT["float32"]["nvfp4"]


def dense_experts(x, idx, weight, gate, up, down):
    """The JAX backend's expert op before the pool (JaxBackend.experts, as it was): stacked gate, up [E, I, H] and
    down [E, H, I], experts named by id. Kept verbatim as the arithmetic the pool op reproduces."""
    t, kk = idx.shape
    hi = lax.Precision.HIGHEST
    if t * kk <= K.GATHER_ROUTES_MAX:
        g = jnp.einsum("th,tkih->tki", x, gate[idx].astype(x.dtype), precision=hi)
        u = jnp.einsum("th,tkih->tki", x, up[idx].astype(x.dtype), precision=hi)
        y = jnp.einsum("tki,tkhi->tkh", jax.nn.silu(g) * u, down[idx].astype(x.dtype), precision=hi)
        return jnp.einsum("tkh,tk->th", y, weight.astype(x.dtype), precision=hi)
    e_count = gate.shape[0]
    rows = t * kk
    bsz = K.EXPERT_BLOCK
    n_blocks = -(-rows // bsz) + e_count
    flat_e = idx.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    sorted_e = flat_e[order]
    sizes = jnp.bincount(flat_e, length=e_count)
    padded = (sizes + bsz - 1) // bsz * bsz
    pad_start = jnp.cumsum(padded) - padded
    start = jnp.cumsum(sizes) - sizes
    dest = pad_start[sorted_e] + (jnp.arange(rows) - start[sorted_e])
    tok = order // kk
    xb = jnp.zeros((n_blocks * bsz, x.shape[1]), x.dtype).at[dest].set(x[tok])
    xb = xb.reshape(n_blocks, bsz, -1)
    block_e = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(n_blocks) * bsz, side="right")
    block_e = jnp.minimum(block_e, e_count - 1)
    g = jnp.einsum("nbh,nih->nbi", xb, gate[block_e].astype(x.dtype), precision=hi)
    u = jnp.einsum("nbh,nih->nbi", xb, up[block_e].astype(x.dtype), precision=hi)
    y = jnp.einsum("nbi,nhi->nbh", jax.nn.silu(g) * u, down[block_e].astype(x.dtype), precision=hi)
    y = y.reshape(n_blocks * bsz, -1)[dest] * weight.reshape(-1)[order][:, None].astype(x.dtype)
    return jnp.zeros_like(x).at[tok].add(y)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens,k", [(1, 4), (70, 4)], ids=["gather", "grouped"])
def test_f32_format_matches_the_backend_expert_op(tokens, k, dtype):
    """Same weights, expert e in slot e: the pool op gives the backend's numbers (the same arithmetic)."""
    rng = np.random.default_rng(0)
    lay = Q.layout("f32", H, I)
    gate = (rng.standard_normal((E, I, H)) / np.sqrt(H)).astype(np.float32)
    up = (rng.standard_normal((E, I, H)) / np.sqrt(H)).astype(np.float32)
    down = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    pool = np.zeros((SLOTS, lay.nbytes), np.uint8)      # the main test's pool shape: its compilation is reused
    for e in range(E):
        pool[e] = Q.encode_expert(lay, gate[e], up[e], down[e])
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((tokens, H)).astype(np.float32)).astype(dtype)
    weight = jnp.asarray(rng.random((tokens, k)).astype(np.float32))   # both ops cast it to x's dtype
    want = np.asarray(jax.jit(dense_experts)(x, idx, weight, gate, up, down).astype(jnp.float32))
    got = np.asarray(EXPERTS(layout=lay, pool=jnp.asarray(pool), x=x, slots=jnp.asarray(idx), weight=weight,
                             max_distinct=E).astype(jnp.float32))
    if jax.default_backend() == "cpu":
        assert np.array_equal(got, want)         # identical: the same ops in the same order
    else:
        # on GPU, scatter-add (the grouped form's sum over a token's routes) runs on atomics in no fixed order, and
        # fusion may differ: run to run, either op rounds differently (f32: ~1e-7; bfloat16: a bfloat16 ulp)
        assert rel_err(got, want) <= (1e-6 if dtype == "float32" else 1e-2)


@pytest.mark.parametrize("copy", ["loop", "kernel"])
@pytest.mark.parametrize("tokens", [1, 4, 20], ids=["gather-1", "gather-4", "grouped-20"])
@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_fetching_form_copies_the_misses_from_host_chunks(fmt, tokens, copy, interpret):
    """experts_fetching: hits read from a poisoned pool, misses copied by the compiled function from host chunks
    (pinned host memory, three chunks of consecutive experts) and computed with the hits in one op over the pool and
    the staging rows laid end to end (both forms of the op); equal to the reference over the true experts, and the
    number of experts it copied is the number of distinct misses of the valid rows. The copies are made by XLA's loop
    and by the host_rows kernel (what a GPU uses)."""
    rng = np.random.default_rng(0)
    lay = Q.layout(fmt, H, I)
    pool, slot_of = poisoned_pool(rng, lay)
    every = pool[slot_of]                                          # [E, nbytes]: expert e's blob
    resident = rng.random(E) < 0.5
    table = np.where(resident, slot_of, -1).astype(np.int32)
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    starts = (0, 3, 6)
    chunks = [jax.device_put(every[a:b], pinned) for a, b in zip(starts, starts[1:] + (E,))]
    k = 4
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weight = rng.random((tokens, k)).astype(np.float32)
    valid = np.arange(tokens) < max(1, tokens - 1)                 # the last of several rows is padding
    copy_rows = K.copy_rows_loop if copy == "loop" else partial(copy_host_rows, interpret=interpret)
    fn = jax.jit(lambda *a: K.experts_fetching(lay, *a[:3], starts, *a[3:], copy_rows=copy_rows))
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    y, copied = fn(jnp.asarray(pool), jnp.asarray(table), chunks, jnp.asarray(x), jnp.asarray(ids),
                   jnp.asarray(weight), jnp.asarray(valid))
    routed = np.where(valid[:, None], ids, -1)
    want = K._reference(lay, every, x, routed, weight)
    got = np.asarray(y)
    assert np.isfinite(got).all() and np.all(got[~valid] == 0)
    err = rel_err(got, want)
    assert err <= LIMIT["float32"][fmt], f"{fmt} T={tokens}: relative error {err:.2e}"
    assert int(copied) == len({int(e) for e in routed[routed >= 0] if table[e] < 0})
