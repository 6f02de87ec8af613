"""kernels/route (the router's softmax + top-k + renormalisation as one kernel) against its float64 reference and the
composition it replaces (ComposedOps.route on the XLA backend): the same expert ids, weights within fp32
rounding; ties to the lower id; a row with a NaN logit gives non-finite weights and ids in range. On the CPU in
Pallas interpret mode, on the GPU compiled (STRATA_TEST_DEVICE=gpu); exported for CUDA at Qwen3-Next-80B shapes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from strata.jax_backend.backend import JaxBackend
from strata.jax_backend.kernels import route as K

LIMIT = 1e-6      # relative error of the weights: a softmax and a division in fp32 (measured <= 4.3e-7, 600 draws)


def separated_logits(rng, t, e, k):
    """Router-like logits whose k-th and (k+1)-th largest differ clearly in every row, so that fp32 rounding cannot
    reorder the top k between the kernel and a float64 reference (near-ties are tested apart, exactly)."""
    while True:
        x = (rng.standard_normal((t, e)) * 2).astype(np.float32)
        s = -np.sort(-x.astype(np.float64), axis=-1)
        if k == e or np.all(np.diff(-s[:, :k + 1], axis=-1) > 1e-4):
            return x


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("t,e,k", [(1, 16, 4), (5, 64, 10), (3, 512, 10), (2, 8, 8), (4, 32, 1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_the_reference(t, e, k, renormalize, dtype, interpret):
    rng = np.random.default_rng(0)
    x = jnp.asarray(separated_logits(rng, t, e, k), dtype)
    w, idx = K.route(x, k=k, renormalize=renormalize, interpret=interpret)
    w_ref, idx_ref = K._reference(np.asarray(x.astype(jnp.float32)), k, renormalize)
    assert w.shape == (t, k) and idx.shape == (t, k) and w.dtype == jnp.float32 and idx.dtype == jnp.int32
    assert np.array_equal(np.asarray(idx), idx_ref)
    err = np.abs(np.asarray(w, np.float64) - w_ref).max() / np.abs(w_ref).max()
    assert err <= LIMIT, f"weights: {err:.2e}"
    w0, idx0 = JaxBackend(kernels="xla").route(x, k, renormalize)          # the composition it replaces
    assert np.array_equal(np.asarray(idx), np.asarray(idx0))
    assert np.abs(np.asarray(w) - np.asarray(w0)).max() <= LIMIT * np.abs(np.asarray(w0)).max()


def test_ties_go_to_the_lower_id(interpret):
    x = jnp.asarray(np.array([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0, 2.0, -1.0]], np.float32))
    w, idx = K.route(x, k=5, renormalize=False, interpret=interpret)
    assert np.asarray(idx).tolist() == [[1, 2, 4, 5, 6]]
    _, idx0 = JaxBackend(kernels="xla").route(x, 5, False)
    assert np.asarray(idx0).tolist() == [[1, 2, 4, 5, 6]]                   # lax.top_k's order, the same


def test_a_nan_row_gives_non_finite_weights_and_ids_in_range(interpret):
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    x[1, 5] = np.nan
    w, idx = K.route(jnp.asarray(x), k=4, renormalize=True, interpret=interpret)
    w, idx = np.asarray(w), np.asarray(idx)
    assert not np.isfinite(w[1]).any() and np.isfinite(w[[0, 2]]).all()
    assert ((idx >= 0) & (idx < 16)).all()


def test_shapes_it_cannot_take_are_refused():
    with pytest.raises(ValueError, match="power-of-two expert count and 1 <= k <= E, got E = 12, k = 4"):
        K.route(jnp.zeros((1, 12)), k=4, renormalize=True, interpret=True)
    with pytest.raises(ValueError, match="got E = 16, k = 17"):
        K.route(jnp.zeros((1, 16)), k=17, renormalize=True, interpret=True)


def test_lowers_for_cuda_at_real_shapes():
    """Qwen3-Next-80B's router (512 experts, top 10), a decode window and a prompt part: one Triton kernel each."""
    for t in (1, 4096):
        fn = jax.jit(lambda x: K.route(x, k=10, renormalize=True))
        exp = export.export(fn, platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            jax.ShapeDtypeStruct((t, 512), jnp.float32))
        assert exp.mlir_module().count("@__gpu$xla.gpu.triton") == 1
