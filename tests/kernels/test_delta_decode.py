"""kernels/delta_decode (the Gated DeltaNet mixer's decode step as one kernel) against its float64 reference and
against the definition it fuses, ComposedOps.delta_block in rows mode run by the JAX backend's XLA ops, on fresh random
model-like inputs: rows at position 0 (empty states), inactive rows (states unchanged), one and two value heads per
key head; float32 and bfloat16 activations. On the CPU in Pallas interpret mode, on the GPU compiled
(STRATA_TEST_DEVICE=gpu); and exported for CUDA at Qwen3-Next-80B shapes (the Triton lowering's checks)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import export

from strata.jax_backend.backend import JaxBackend
from strata.jax_backend.kernels import delta_decode as K

EPS = 1e-6
TAPS = 4
# Error limits against the float64 reference, measured worst over 200-300 draws (the shapes below in turn) with
# margin. float32, relative Frobenius: the state 5.1e-8 (the step's fp32 roundings, as gated_delta's decode kernel);
# o 1.2e-6, above the state's because the gated RMSNorm divides each head's o = S^T q by its rms, which grows o's
# relative error where S^T q cancels. bfloat16: the reference rounds where the kernel does (the conv output,
# sigmoid(b), o before and after the RMSNorm, the gated output), but where the kernel's fp32 value and the
# reference's float64 value fall on two sides of a rounding boundary they round one bfloat16 ulp apart, and such a
# flip before the RMSNorm moves its head's rms too. So each element of o is checked in units of 2^-8 (one ulp at
# most, relative) of max(|o_ref|, its head's rms): measured 3.4 over 300 draws (two stacked flips; the Frobenius
# error reached 2.4e-4 where one draw had a flip and 1.5e-5 over 200 that had none); the state 6.8e-8 relative.
LIMIT = {"float32": {"o": 5e-6, "ssm": 2e-7}, "bfloat16": {"o_ulps": 6.0, "ssm": 3e-7}}
SHAPES = [(2, 2, 16, 16), (1, 2, 16, 32), (2, 4, 32, 16)]          # (Hk, Hv, dk, dv)


def inputs(rng, n, hk, hv, dk, dv, dtype, start, n_valid):
    c = 2 * hk * dk + hv * dv
    act = lambda x: jnp.asarray(np.asarray(x, np.float32), dtype)                  # noqa: E731
    return dict(
        qkv=act(rng.standard_normal((n, c))), z=act(rng.standard_normal((n, hv * dv))),
        b=act(rng.standard_normal((n, hv))), a=act(rng.standard_normal((n, hv))),
        conv_state=act(rng.standard_normal((n, TAPS - 1, c))),
        conv_w=act(rng.standard_normal((c, TAPS)) / np.sqrt(TAPS)),
        ssm=jnp.asarray(rng.standard_normal((n, hv, dk, dv)).astype(np.float32)),
        a_log=jnp.asarray(np.log(rng.uniform(0, 16, hv)).astype(np.float32)),
        dt_bias=jnp.asarray(rng.standard_normal(hv).astype(np.float32)),
        gnorm=act(1 + 0.1 * rng.standard_normal(dv)),
        start=jnp.asarray(np.asarray(start, np.int32)), n_valid=jnp.asarray(np.asarray(n_valid, np.int32)))


def rel_err(got, want):
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def run_kernel(d, hk, interpret):
    return K.delta_decode(d["qkv"], d["z"], d["b"], d["a"], d["conv_state"], d["conv_w"], d["ssm"], d["a_log"],
                          d["dt_bias"], d["gnorm"], d["start"], d["n_valid"], n_k_heads=hk, eps=EPS,
                          interpret=interpret)


def reference(d, hk):
    host = {k: np.asarray(v.astype(jnp.float32)) if v.dtype == jnp.bfloat16 else np.asarray(v) for k, v in d.items()}
    for k in ("qkv", "z", "b", "gnorm"):                                 # their dtype sets the rounding points
        if d[k].dtype == jnp.bfloat16:
            host[k] = host[k].astype(ml_dtypes.bfloat16)
    return K._reference(host["qkv"], host["z"], host["b"], host["a"], host["conv_state"], host["conv_w"],
                        host["ssm"], host["a_log"], host["dt_bias"], host["gnorm"], host["start"], host["n_valid"],
                        hk, EPS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hk,hv,dk,dv", SHAPES)
def test_matches_the_reference(hk, hv, dk, dv, dtype, interpret):
    """4 rows: one at position 0 (its states start empty), one inactive (its states unchanged), two decoding."""
    rng = np.random.default_rng()
    d = inputs(rng, 4, hk, hv, dk, dv, dtype, start=[0, 7, 3, 12], n_valid=[1, 1, 0, 1])
    o, conv, ssm = run_kernel(d, hk, interpret)
    o_ref, conv_ref, ssm_ref = reference(d, hk)
    assert np.isfinite(np.asarray(o.astype(jnp.float32))).all() and np.isfinite(np.asarray(ssm)).all()
    assert o.dtype == d["z"].dtype and conv.dtype == d["conv_state"].dtype
    # the conv state is the last K-1 inputs, moved, not computed: exact
    assert np.array_equal(np.asarray(conv.astype(jnp.float32)), conv_ref.astype(np.float32))
    assert np.array_equal(np.asarray(ssm[2]), np.asarray(d["ssm"][2]))      # the inactive row's state: untouched
    lim = LIMIT[dtype]
    got = np.asarray(o.astype(jnp.float32), np.float64)
    if dtype == "float32":
        assert rel_err(got, o_ref) <= lim["o"], f"o: {rel_err(got, o_ref):.2e}"
    else:
        ref, g = o_ref.reshape(4, hv, dv), got.reshape(4, hv, dv)
        unit = np.maximum(np.abs(ref), np.sqrt((ref ** 2).mean(-1, keepdims=True))) * 2.0 ** -8
        ulps = (np.abs(g - ref) / unit).max()
        assert ulps <= lim["o_ulps"], f"o: {ulps:.2f} bfloat16 ulps off"
    assert rel_err(ssm, ssm_ref) <= lim["ssm"], f"state: {rel_err(ssm, ssm_ref):.2e}"


@pytest.mark.parametrize("hk,hv,dk,dv", SHAPES[:2])
def test_matches_the_composition_it_fuses(hk, hv, dk, dv, interpret):
    """The same rows through ComposedOps.delta_block (rows mode) on the XLA backend: the model's definition."""
    rng = np.random.default_rng()
    d = inputs(rng, 3, hk, hv, dk, dv, "float32", start=[0, 5, 9], n_valid=[1, 0, 1])
    o, conv, ssm = run_kernel(d, hk, interpret)
    ops = JaxBackend(kernels="xla")
    o0, conv0, ssm0 = jax.jit(lambda d: ops.delta_block(
        d["qkv"], d["z"], d["b"], d["a"], d["conv_state"], d["conv_w"], d["ssm"], d["a_log"], d["dt_bias"],
        d["gnorm"], EPS, d["start"], d["n_valid"], hk))(d)
    assert np.array_equal(np.asarray(conv), np.asarray(conv0))
    assert rel_err(ssm, np.asarray(ssm0, np.float64)) <= 2 * LIMIT["float32"]["ssm"]       # two fp32 computations
    assert rel_err(o, np.asarray(o0, np.float64)) <= 2 * LIMIT["float32"]["o"]


def test_shapes_it_cannot_take_are_refused():
    rng = np.random.default_rng(0)
    d = inputs(rng, 1, 2, 2, 16, 16, "float32", start=[1], n_valid=[1])
    with pytest.raises(ValueError, match="dk = 24 and dv = 16 must be powers of two"):
        K.check(jnp.zeros((1, 2 * 2 * 24 + 2 * 16)), jnp.zeros((1, 3, 2 * 2 * 24 + 2 * 16)),
                jnp.zeros((1, 2, 24, 16), jnp.float32), 2)
    with pytest.raises(ValueError, match="3 value heads are not a multiple of 2 key heads"):
        K.check(d["qkv"], d["conv_state"], jnp.zeros((1, 3, 16, 16), jnp.float32), 2)
    with pytest.raises(ValueError, match="the recurrent state must be float32"):
        K.check(d["qkv"], d["conv_state"], d["ssm"].astype(jnp.bfloat16), 2)


def test_lowers_for_cuda_at_real_shapes():
    """Qwen3-Next-80B's mixer (Hk 16, Hv 32, dk = dv = 128, conv kernel 4) at batch 1 and 16, bfloat16: the
    Pallas-to-Triton lowering (no GPU needed) takes it as one kernel."""
    spec = jax.ShapeDtypeStruct
    hk, hv, dk, dv = 16, 32, 128, 128
    c = 2 * hk * dk + hv * dv
    bf = jnp.bfloat16
    for n in (1, 16):
        fn = jax.jit(lambda *a: K.delta_decode(*a, n_k_heads=hk, eps=EPS))
        exp = export.export(fn, platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            spec((n, c), bf), spec((n, hv * dv), bf), spec((n, hv), bf), spec((n, hv), bf),
            spec((n, TAPS - 1, c), bf), spec((c, TAPS), bf), spec((n, hv, dk, dv), jnp.float32),
            spec((hv,), jnp.float32), spec((hv,), jnp.float32), spec((dv,), bf), spec((n,), jnp.int32),
            spec((n,), jnp.int32))
        assert exp.mlir_module().count("@__gpu$xla.gpu.triton") == 1
