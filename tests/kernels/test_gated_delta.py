"""kernels/gated_delta (the gated delta rule: decode with the state in place, speculative verify with the state after
every position, chunked prompt parts) against the float64 references built on strata.model.reference.gated_delta;
fresh random model-like inputs each run (l2-normed q and k, g = -exp(A_log) softplus(.), beta = sigmoid(.)); on the
CPU in Pallas interpret mode, on the GPU compiled (STRATA_TEST_DEVICE=gpu). Interpret mode fills the outputs of a
pallas_call with NaN before the kernel runs, so an element a kernel fails to write fails the finiteness checks.
The last tests export each kernel for CUDA at Qwen3-Next-80B shapes (on the CPU too): the Triton lowering refuses
loads and stores that are not powers of two, which interpret mode accepts."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from strata.jax_backend.kernels import gated_delta as K

# Error limit against the float64 references, on the same (bf16-rounded where bf16) inputs. The kernels compute in
# fp32 throughout (dots at HIGHEST, IEEE fp32), so the limit is a few fp32 epsilons (2^-23 = 1.2e-7); a TF32 dot
# (precision lost on the GPU) would be off by ~1e-3.
# - states: relative Frobenius error. Measured over 8 seeds x every case here (and 190 more chunked draws at Hv = 2):
#   decode <= 6.9e-8, verify <= 9.0e-8, chunked <= 2.4e-7.
# - o = S^T q: error relative to the size of the terms it sums, || |S_t|^T |q_t| || (S_t the reference state after
#   token t). Measured: decode <= 1.1e-7, verify <= 5.6e-8, chunked <= 1.2e-7. Relative to ||o|| itself the error
#   has a tail from cancellation in S^T q, not from the kernels: over 400 single-token draws at Hv = 2 it reached
#   2.1e-6 in the draw where || |S|^T |q| || / ||o|| = 178 (the XLA step and chunked forms have the same tail).
LIMIT = 1e-6
SHAPES = [(2, 16, 32, None), (4, 32, 16, None), (4, 32, 32, 16)]   # (Hv, dk, dv, dv block): the last has two blocks


def rel_err(got, want):
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def o_err(got, want, q, states):
    """||o - o_ref|| / || |S_t|^T |q_t| || over all tokens and heads; q [..., Hv, dk], states [..., Hv, dk, dv]."""
    terms = np.einsum("...hde,...hd->...he", np.abs(states), np.abs(np.asarray(q, np.float64)))
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(terms))


def l2norm(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def rule_inputs(rng, lead, hv, dk, dv, dtype="float32"):
    """q, k, v, g, beta for the leading dims `lead` (e.g. (T,), (S, Q)) as the model forms them: q, k l2-normed
    (q / sqrt(dk)), beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) with A_log = log(U(0, 16)) per head
    (transformers' initialisation: some heads forget within a token, some barely decay). q, k, v in `dtype`."""
    q = l2norm(rng.standard_normal(lead + (hv, dk))) / np.sqrt(dk)
    k = l2norm(rng.standard_normal(lead + (hv, dk)))
    v = rng.standard_normal(lead + (hv, dv))
    a_log = np.log(rng.uniform(0, 16, hv))
    g = -np.exp(a_log) * np.logaddexp(rng.standard_normal(lead + (hv,)) + rng.standard_normal(hv), 0.0)
    beta = 1 / (1 + np.exp(-rng.standard_normal(lead + (hv,))))
    qkv = [jnp.asarray(x.astype(np.float32), dtype) for x in (q, k, v)]
    return qkv + [g.astype(np.float32), beta.astype(np.float32)]


def state_like(rng, lead, hv, dk, dv):
    return rng.standard_normal(lead + (hv, dk, dv)).astype(np.float32)


# --- decode

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hv,dk,dv,block", SHAPES)
@pytest.mark.parametrize("n", [1, 3])
def test_decode_matches_the_reference(n, hv, dk, dv, block, dtype, interpret):
    rng = np.random.default_rng()
    q, k, v, g, beta = rule_inputs(rng, (n,), hv, dk, dv, dtype)
    state = state_like(rng, (n,), hv, dk, dv)
    if n > 1:
        g[1], beta[1] = 0.0, 0.0                              # a padding row: its state must stay as it was
    o, new = K.gated_delta_decode(q, k, v, g, beta, jnp.asarray(state), interpret=interpret, block_v=block)
    o, new = np.asarray(o), np.asarray(new)
    want_o, want_s = K._reference_decode(q, k, v, g, beta, state)
    assert o.dtype == new.dtype == np.float32
    assert np.isfinite(o).all() and np.isfinite(new).all()
    assert o_err(o, want_o, q, want_s) <= LIMIT, f"o: error {o_err(o, want_o, q, want_s):.2e}"
    assert rel_err(new, want_s) <= LIMIT, f"state: relative error {rel_err(new, want_s):.2e}"
    if n > 1:
        np.testing.assert_array_equal(new[1], state[1])      # exp(0) S + k (0 (v - S^T k)) = S exactly


def test_decode_updates_a_donated_state_in_place(interpret):
    """Under jit with the state donated the new state lands in the state's own buffer (the kernel's
    input_output_aliases; the lowering test below checks the alias is declared to XLA)."""
    rng = np.random.default_rng()
    hv, dk, dv = 4, 32, 32
    q, k, v, g, beta = rule_inputs(rng, (3,), hv, dk, dv, "bfloat16")
    host = state_like(rng, (3,), hv, dk, dv)
    step = jax.jit(functools.partial(K.gated_delta_decode, interpret=interpret, block_v=16), donate_argnums=5)
    state = jnp.asarray(host)
    where = state.unsafe_buffer_pointer()
    o, new = step(q, k, v, g, beta, state)
    assert state.is_deleted()
    assert new.unsafe_buffer_pointer() == where
    want_o, want_s = K._reference_decode(q, k, v, g, beta, host)
    assert o_err(o, want_o, q, want_s) <= LIMIT and rel_err(new, want_s) <= LIMIT
    o2, newer = step(q, k, v, g, beta, new)                  # and again on the updated buffer
    assert newer.unsafe_buffer_pointer() == where
    want_o2, want_s2 = K._reference_decode(q, k, v, g, beta, want_s)
    assert o_err(o2, want_o2, q, want_s2) <= LIMIT and rel_err(newer, want_s2) <= LIMIT


# --- verify

@pytest.mark.parametrize("hv,dk,dv,block", SHAPES[::2])
@pytest.mark.parametrize("n,nq", [(1, 1), (1, 3), (3, 3)])
def test_verify_matches_the_reference_at_every_position(n, nq, hv, dk, dv, block, interpret):
    rng = np.random.default_rng()
    q, k, v, g, beta = rule_inputs(rng, (n, nq), hv, dk, dv, "bfloat16")
    host = state_like(rng, (n,), hv, dk, dv)
    state = jnp.asarray(host)
    o, states = K.gated_delta_verify(q, k, v, g, beta, state, interpret=interpret, block_v=block)
    o, states = np.asarray(o), np.asarray(states)
    want_o, want_states = K._reference_verify(q, k, v, g, beta, host)
    assert o.shape == (n, nq, hv, dv) and states.shape == (n, nq, hv, dk, dv)
    assert np.isfinite(o).all() and np.isfinite(states).all()
    for t in range(nq):                                       # each position is a rollback point
        err = o_err(o[:, t], want_o[:, t], q[:, t], want_states[:, t])
        assert err <= LIMIT, f"o at position {t}: error {err:.2e}"
        err = rel_err(states[:, t], want_states[:, t])
        assert err <= LIMIT, f"state after position {t}: relative error {err:.2e}"
    np.testing.assert_array_equal(np.asarray(state), host)   # the input state is not modified


# --- chunked

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hv,dk,dv,block", SHAPES)
@pytest.mark.parametrize("t", [1, 37, 130])
def test_chunked_matches_the_reference(t, hv, dk, dv, block, dtype, interpret):
    """T = 1 and 37: one chunk, mostly padding; 130: three chunks, the state carried across two boundaries."""
    rng = np.random.default_rng()
    q, k, v, g, beta = rule_inputs(rng, (t,), hv, dk, dv, dtype)
    state = state_like(rng, (), hv, dk, dv)
    o, final = K.gated_delta_chunked(q, k, v, g, beta, jnp.asarray(state), interpret=interpret, block_v=block)
    o, final = np.asarray(o), np.asarray(final)
    want_o, want_s = K._reference_chunked(q, k, v, g, beta, state)
    _, states = K._reference_verify(*(x[None] for x in (q, k, v, g, beta, state)))   # S after each token
    assert o.shape == (t, hv, dv) and final.shape == (hv, dk, dv)
    assert np.isfinite(o).all() and np.isfinite(final).all()
    assert o_err(o, want_o, q, states[0]) <= LIMIT, f"o: error {o_err(o, want_o, q, states[0]):.2e}"
    assert rel_err(final, want_s) <= LIMIT, f"state: relative error {rel_err(final, want_s):.2e}"


def test_chunked_padding_rows_leave_the_state_unchanged(interpret):
    """A part of 100 tokens padded by the caller to 130 (a bucket): the 30 padding rows have g = beta = 0 and garbage
    (finite, unnormalised) q, k, v; the final state is the state after the 100 real tokens, their o is unchanged, and
    the padding rows' o is S^T q as the reference computes it."""
    rng = np.random.default_rng()
    hv, dk, dv, real, t = 4, 32, 32, 100, 130
    q, k, v, g, beta = (np.array(x, np.float32) for x in rule_inputs(rng, (t,), hv, dk, dv))
    for x in (q, k, v):
        x[real:] = 10 * rng.standard_normal(x[real:].shape)
    g[real:], beta[real:] = 0.0, 0.0
    state = state_like(rng, (), hv, dk, dv)
    o, final = K.gated_delta_chunked(q, k, v, g, beta, jnp.asarray(state), interpret=interpret)
    o, final = np.asarray(o), np.asarray(final)
    want_o, states = K._reference_verify(*(x[None, :real] for x in (q, k, v, g, beta)), state[None])
    want_o, states, want_s = want_o[0], states[0], states[0, -1]
    assert np.isfinite(o).all() and np.isfinite(final).all()
    assert rel_err(final, want_s) <= LIMIT, f"state: relative error {rel_err(final, want_s):.2e}"
    err = o_err(o[:real], want_o, q[:real], states)
    assert err <= LIMIT, f"o: error {err:.2e}"
    held = np.broadcast_to(want_s, (t - real,) + want_s.shape)                     # the state through the padding
    want_pad = np.einsum("thde,thd->the", held, q[real:].astype(np.float64))
    assert o_err(o[real:], want_pad, q[real:], held) <= LIMIT


# --- the Triton lowering at real shapes, and the shapes it cannot block

REAL = dict(hv=32, dk=128, dv=128, s=16, q=4, t=4000)       # Qwen3-Next-80B; T = 4000 exercises the padding


def _export_for_cuda(fn, *args, donate=()):
    """StableHLO of fn for CUDA (no GPU needed: the Pallas Triton lowering runs at export time)."""
    jitted = jax.jit(functools.partial(fn, interpret=False), donate_argnums=donate)
    exp = export.export(jitted, platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    return exp.mlir_module()


def test_kernels_lower_to_triton_at_real_shapes():
    f32, bf16 = jnp.float32, jnp.bfloat16
    sds = jax.ShapeDtypeStruct
    hv, dk, dv, s, nq, t = (REAL[x] for x in ("hv", "dk", "dv", "s", "q", "t"))
    decode = _export_for_cuda(K.gated_delta_decode, sds((s, hv, dk), bf16), sds((s, hv, dk), bf16),
                              sds((s, hv, dv), bf16), sds((s, hv), f32), sds((s, hv), f32),
                              sds((s, hv, dk, dv), f32), donate=5)
    assert decode.count("@__gpu$xla.gpu.triton") == 1
    assert "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [1], " \
           "operand_index = 5" in decode                      # the new state is written over the state operand
    assert "tf.aliasing_output = 1" in decode                 # and the donated argument is that buffer
    verify = _export_for_cuda(K.gated_delta_verify, *[sds((s, nq, hv, d), bf16) for d in (dk, dk, dv)],
                              sds((s, nq, hv), f32), sds((s, nq, hv), f32), sds((s, hv, dk, dv), f32))
    assert verify.count("@__gpu$xla.gpu.triton") == 1
    chunked = _export_for_cuda(K.gated_delta_chunked, *[sds((t, hv, d), bf16) for d in (dk, dk, dv)],
                               sds((t, hv), f32), sds((t, hv), f32), sds((hv, dk, dv), f32))
    assert chunked.count("@__gpu$xla.gpu.triton") == 2        # the intra-chunk kernel and the recurrence


def test_shapes_it_cannot_block_are_refused():
    z = jnp.zeros
    with pytest.raises(ValueError, match="power of two"):     # dv = 48
        K.gated_delta_decode(z((1, 2, 16)), z((1, 2, 16)), z((1, 2, 48)), z((1, 2)), z((1, 2)), z((1, 2, 16, 48)),
                             interpret=True)
    with pytest.raises(ValueError, match="does not divide"):
        K.gated_delta_verify(z((1, 1, 2, 16)), z((1, 1, 2, 16)), z((1, 1, 2, 16)), z((1, 1, 2)), z((1, 1, 2)),
                             z((1, 2, 16, 16)), interpret=True, block_v=32)
    with pytest.raises(ValueError, match=">= 16"):            # chunked dots need dims >= 16
        K.gated_delta_chunked(z((5, 2, 8)), z((5, 2, 8)), z((5, 2, 16)), z((5, 2)), z((5, 2)), z((2, 8, 16)),
                              interpret=True)
    with pytest.raises(ValueError, match="float32"):
        K.gated_delta_decode(z((1, 2, 16)), z((1, 2, 16)), z((1, 2, 16)), z((1, 2)), z((1, 2)),
                             z((1, 2, 16, 16), jnp.bfloat16), interpret=True)
