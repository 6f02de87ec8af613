"""kernels/gated_delta (the gated delta rule: decode with the state in place, speculative verify with the state after
every position, chunked prompt parts) against the float64 references built on strata.reference.gated_delta;
fresh random model-like inputs each run (l2-normed q and k, g = -exp(A_log) softplus(.), beta = sigmoid(.)); on the
CPU in Pallas interpret mode, on the GPU compiled (STRATA_TEST_DEVICE=gpu). Interpret mode fills the outputs of a
pallas_call with NaN before the kernel runs, so an element a kernel fails to write fails the finiteness checks.
Both variants of each kernel that has them (K.VARIANTS: v2 the default, v1 kept for timing) run against the same
references; the chunked form also on aligned keys (A's entries near 1, where a power-series inverse would fail).
The last tests export each kernel for CUDA at Qwen3-Next-80B shapes (on the CPU too): the Triton lowering refuses
loads and stores that are not powers of two, which interpret mode accepts, and the grid and warps are checked."""
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
# - states: relative Frobenius error. Measured over 8 seeds x every case here, both variants (and 60 more chunked
#   draws of each variant and input kind at Hv = 2, T = 130): decode <= 6.0e-8, verify <= 9.3e-8, chunked <= 2.5e-7
#   (v1) / 2.3e-7 (v2), aligned keys <= 5.2e-7 (v1) / 4.4e-7 (v2; 4.1e-7, 5.0e-7 with 16- and 64-row blocks, as the
#   XLA form's 4.9e-7: the fp32 rounding that a state with no decay keeps, not the inverse). The block inverse alone
#   (test_block_inverse_by_doubling, 40 seeds): <= 1.1e-7.
# - o = S^T q: error relative to the size of the terms it sums, || |S_t|^T |q_t| || (S_t the reference state after
#   token t). Measured: decode <= 5.8e-8, verify <= 5.4e-8, chunked <= 7.3e-8, aligned <= 1.7e-7 (earlier runs of v1:
#   decode <= 1.1e-7, chunked <= 1.2e-7). Relative to ||o|| itself the error
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

@pytest.mark.parametrize("variant", K.VARIANTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hv,dk,dv,block", SHAPES + [(32, 16, 64, None)])
@pytest.mark.parametrize("n", [1, 4])
def test_decode_matches_the_reference(n, hv, dk, dv, block, dtype, variant, interpret):
    """The last shape is where the two variants' blocks differ: at n = 4 (128 head-rows) v2 takes all 64 columns
    of a head per program (v1: 32); at n = 1 it splits them to 32 (_decode_shape)."""
    rng = np.random.default_rng()
    q, k, v, g, beta = rule_inputs(rng, (n,), hv, dk, dv, dtype)
    state = state_like(rng, (n,), hv, dk, dv)
    if n > 1:
        g[1], beta[1] = 0.0, 0.0                              # a padding row: its state must stay as it was
    o, new = K.gated_delta_decode(q, k, v, g, beta, jnp.asarray(state), interpret=interpret, block_v=block,
                                  variant=variant)
    o, new = np.asarray(o), np.asarray(new)
    want_o, want_s = K._reference_decode(q, k, v, g, beta, state)
    assert o.dtype == new.dtype == np.float32
    assert np.isfinite(o).all() and np.isfinite(new).all()
    assert o_err(o, want_o, q, want_s) <= LIMIT, f"o: error {o_err(o, want_o, q, want_s):.2e}"
    assert rel_err(new, want_s) <= LIMIT, f"state: relative error {rel_err(new, want_s):.2e}"
    if n > 1:
        np.testing.assert_array_equal(new[1], state[1])      # exp(0) S + k (0 (v - S^T k)) = S exactly


@pytest.mark.parametrize("variant", K.VARIANTS)
def test_decode_updates_a_donated_state_in_place(variant, interpret):
    """Under jit with the state donated the new state lands in the state's own buffer (the kernel's
    input_output_aliases; the lowering test below checks the alias is declared to XLA)."""
    rng = np.random.default_rng()
    hv, dk, dv = 4, 32, 32
    q, k, v, g, beta = rule_inputs(rng, (3,), hv, dk, dv, "bfloat16")
    host = state_like(rng, (3,), hv, dk, dv)
    block = 16 if variant == "v1" else None                  # v2: its own shape (32 columns here)
    step = jax.jit(functools.partial(K.gated_delta_decode, interpret=interpret, block_v=block, variant=variant),
                   donate_argnums=5)
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


def test_decode_shapes_at_real_dims():
    """v1: 32 columns, 4 warps at every batch. v2 at Hv = 32, dk = dv = 128: the widest block that leaves >= 128
    programs (about one per SM), with the warps for 64 state elements per thread (256 B of the state each)."""
    real = lambda n, **kw: K._decode_shape(n, 32, 128, 128, kw.get("block_v"), kw.get("variant", "v2"))  # noqa: E731
    assert [real(n, variant="v1") for n in (1, 4, 16)] == [(32, 4)] * 3
    assert [real(n) for n in (1, 2, 4, 16, 64)] == [(32, 2), (64, 4), (128, 8), (128, 8), (128, 8)]
    assert real(16, block_v=32) == (32, 2)
    with pytest.raises(ValueError, match="variant"):
        real(1, variant="v3")


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

def check_chunked(run, q, k, v, g, beta, state):
    """run(q, k, v, g, beta, state) -> (o, final state) against the float64 reference."""
    t, hv, dk = k.shape
    dv = v.shape[-1]
    o, final = (np.asarray(x) for x in run(q, k, v, g, beta, jnp.asarray(state)))
    want_o, want_s = K._reference_chunked(q, k, v, g, beta, state)
    _, states = K._reference_verify(*(x[None] for x in (q, k, v, g, beta, state)))   # S after each token
    assert o.shape == (t, hv, dv) and final.shape == (hv, dk, dv)
    assert np.isfinite(o).all() and np.isfinite(final).all()
    assert o_err(o, want_o, q, states[0]) <= LIMIT, f"o: error {o_err(o, want_o, q, states[0]):.2e}"
    assert rel_err(final, want_s) <= LIMIT, f"state: relative error {rel_err(final, want_s):.2e}"


@pytest.mark.parametrize("variant,dtype", [("v2", "float32"), ("v2", "bfloat16"), ("v1", "bfloat16"),
                                           ("xla_intra", "float32"), ("xla_intra", "bfloat16")])
@pytest.mark.parametrize("hv,dk,dv,block", SHAPES)
@pytest.mark.parametrize("t", [1, 37, 130])
def test_chunked_matches_the_reference(t, hv, dk, dv, block, dtype, variant, interpret):
    """T = 1 and 37: one chunk, mostly padding; 130: three chunks, the state carried across two boundaries. (v1,
    kept for timing, runs the model's bf16 inputs only: the dtype changes nothing but the loads, and interpret-mode
    compiles are most of this file's time.)"""
    rng = np.random.default_rng()
    check_chunked(functools.partial(K.gated_delta_chunked, interpret=interpret, block_v=block, variant=variant),
                  *rule_inputs(rng, (t,), hv, dk, dv, dtype), state_like(rng, (), hv, dk, dv))


def aligned_inputs(rng, t, hv, dk, dv):
    """Keys near one direction per head (cosines ~0.9), beta in [0.9, 1], almost no decay: A's entries near 1, the
    inputs under which a power-series inverse ((I - A)(I + A^2)(I + A^4)...) cancels binomially large terms (its
    fp32 error measured ~1e6 relative at C = 64, against ~1e-7 for substitution and doubling)."""
    q, k, v, g, beta = (np.array(x, np.float32) for x in rule_inputs(rng, (t,), hv, dk, dv, "bfloat16"))
    u = rng.standard_normal((hv, dk))
    k = u + 0.3 * rng.standard_normal((t, hv, dk)) * np.linalg.norm(u, axis=-1, keepdims=True) / np.sqrt(dk)
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32)
    g = (-0.002 * rng.uniform(size=(t, hv))).astype(np.float32)
    beta = rng.uniform(0.9, 1.0, (t, hv)).astype(np.float32)
    return q, k, v, g, beta


@pytest.mark.parametrize("variant", K.CHUNKED_VARIANTS)
def test_chunked_with_aligned_keys(variant, interpret):
    rng = np.random.default_rng()
    check_chunked(functools.partial(K.gated_delta_chunked, interpret=interpret, variant=variant),
                  *aligned_inputs(rng, 130, 2, 32, 32), state_like(rng, (), 2, 32, 32))


@pytest.mark.parametrize("variant", ["v2", "xla_intra"])
@pytest.mark.parametrize("dots,stages", [("bf16x6", 1), ("tf32x3", 1), ("tf32x3", 2), ("ieee", 2)])
def test_chunked_with_dots_on_the_tensor_cores(dots, stages, variant, interpret):
    """The v2 kernels' data dots split over the tensor cores (tf32x3, bf16x6) keep the IEEE limits: random and
    aligned keys, three chunks. tf32x3 needs a GPU: in interpret mode it is refused, by name. Interpret mode runs a
    bf16x6 dot as XLA's CPU does, in plain fp32, so the split's accuracy is checked by the compiled run (67 passed
    on the H200 at a112ed3)."""
    rng = np.random.default_rng()
    run = functools.partial(K.gated_delta_chunked, interpret=interpret, variant=variant, dots=dots, stages=stages)
    if interpret and dots == "tf32x3":
        with pytest.raises(ValueError, match="'tf32x3' needs a GPU"):
            run(*rule_inputs(rng, (70,), 2, 32, 32, "bfloat16"), jnp.asarray(state_like(rng, (), 2, 32, 32)))
        return
    check_chunked(run, *rule_inputs(rng, (130,), 2, 32, 32, "bfloat16"), state_like(rng, (), 2, 32, 32))
    check_chunked(run, *aligned_inputs(rng, 130, 2, 32, 32), state_like(rng, (), 2, 32, 32))


def test_chunked_options_it_cannot_run_are_refused():
    z = jnp.zeros
    args = (z((5, 2, 16)), z((5, 2, 16)), z((5, 2, 16)), z((5, 2)), z((5, 2)), z((2, 16, 16)))
    with pytest.raises(ValueError, match="dots must be one of"):
        K.gated_delta_chunked(*args, interpret=True, dots="fp8")
    with pytest.raises(ValueError, match="v1 runs IEEE dots only"):
        K.gated_delta_chunked(*args, interpret=True, variant="v1", dots="bf16x6")
    with pytest.raises(ValueError, match="stages must be 1, 2 or 3"):
        K.gated_delta_chunked(*args, interpret=True, stages=4)


@pytest.mark.parametrize("sub", [16, 64])
def test_chunked_v2_at_other_block_rows(sub, interpret):
    """The v2 intra kernel at 4 row blocks (16 rows: the sums of whole blocks between two tokens are not empty)
    and at 1 (the whole chunk inverted by doubling); the default is SUB = 32 (2 blocks)."""
    def run(q, k, v, g, beta, state):
        t = k.shape[0]
        q, k, v, g_h, beta_h = K._pad_part(q, k, v, g, beta)
        w, u, attn, eq, ek = K._chunked_intra_v2(q, k, v, g_h, beta_h, interpret=interpret, sub=sub)
        o, state = K._chunked_recurrence(q, k, (eq, ek), w, u, attn, state, interpret=interpret)
        return o[:t], state

    rng = np.random.default_rng()
    check_chunked(run, *rule_inputs(rng, (130,), 2, 16, 32), state_like(rng, (), 2, 16, 32))    # f32, as aligned
    check_chunked(run, *aligned_inputs(rng, 130, 2, 16, 32), state_like(rng, (), 2, 16, 32))


@pytest.mark.parametrize("b", [16, 32, 64])
def test_block_inverse_by_doubling(b):
    """_unit_lower_inverse (plain JAX here, fp32 dots at HIGHEST) against float64 on the kernels' A blocks: the
    tests' random keys (|A| < ~0.1) and aligned keys (|A| up to ~0.97). Measured <= 1.1e-7 relative."""
    rng = np.random.default_rng()
    row = jax.lax.broadcasted_iota(jnp.int32, (b, b), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (b, b), 1)
    for q, k, v, g, beta in (rule_inputs(rng, (b,), 1, 128, 16), aligned_inputs(rng, b, 1, 128, 16)):
        k, g, beta = np.asarray(k[:, 0], np.float64), g[:, 0].astype(np.float64), beta[:, 0].astype(np.float64)
        G = np.cumsum(g)
        a = np.tril(beta[:, None] * (k @ k.T) * np.exp(np.minimum(G[:, None] - G[None, :], 0)), -1).astype(np.float32)
        want = np.linalg.inv(np.eye(b) + a.astype(np.float64))
        got = np.asarray(K._unit_lower_inverse(jnp.asarray(a), row, col))
        assert rel_err(got, want) <= LIMIT, f"relative error {rel_err(got, want):.2e} (max |A| {np.abs(a).max():.2f})"


@pytest.mark.parametrize("variant", K.CHUNKED_VARIANTS)
def test_chunked_padding_rows_leave_the_state_unchanged(variant, interpret):
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
    o, final = K.gated_delta_chunked(q, k, v, g, beta, jnp.asarray(state), interpret=interpret, variant=variant)
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


@pytest.mark.parametrize("variant", K.VARIANTS)
def test_kernels_lower_to_triton_at_real_shapes(variant):
    f32, bf16 = jnp.float32, jnp.bfloat16
    sds = jax.ShapeDtypeStruct
    hv, dk, dv, s, nq, t = (REAL[x] for x in ("hv", "dk", "dv", "s", "q", "t"))
    decode = functools.partial(K.gated_delta_decode, variant=variant)
    for n in (1, 4, s):                                       # v2's block and warps change with the batch
        mod = _export_for_cuda(decode, sds((n, hv, dk), bf16), sds((n, hv, dk), bf16), sds((n, hv, dv), bf16),
                               sds((n, hv), f32), sds((n, hv), f32), sds((n, hv, dk, dv), f32), donate=5)
        assert mod.count("@__gpu$xla.gpu.triton") == 1
        assert "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [1], " \
               "operand_index = 5" in mod                     # the new state is written over the state operand
        assert "tf.aliasing_output = 1" in mod                # and the donated argument is that buffer
        bv, warps = K._decode_shape(n, hv, dk, dv, None, variant)
        assert f"grid_x = {n} : i32, grid_y = {hv} : i32, grid_z = {dv // bv} : i32" in mod
        assert f"num_warps = {warps} : i32" in mod
    verify = _export_for_cuda(K.gated_delta_verify, *[sds((s, nq, hv, d), bf16) for d in (dk, dk, dv)],
                              sds((s, nq, hv), f32), sds((s, nq, hv), f32), sds((s, hv, dk, dv), f32))
    assert verify.count("@__gpu$xla.gpu.triton") == 1
    chunked = _export_for_cuda(functools.partial(K.gated_delta_chunked, variant=variant),
                               *[sds((t, hv, d), bf16) for d in (dk, dk, dv)],
                               sds((t, hv), f32), sds((t, hv), f32), sds((hv, dk, dv), f32))
    assert chunked.count("@__gpu$xla.gpu.triton") == 2        # the intra-chunk kernel and the recurrence
    xla_intra = _export_for_cuda(functools.partial(K.gated_delta_chunked, variant="xla_intra"),
                                 *[sds((t, hv, d), bf16) for d in (dk, dk, dv)],
                                 sds((t, hv), f32), sds((t, hv), f32), sds((hv, dk, dv), f32))
    assert xla_intra.count("@__gpu$xla.gpu.triton") == 1      # the recurrence only
    for dots in ("tf32x3", "bf16x6") if variant == "v2" else ():   # the tensor-core dots lower for CUDA
        fast = _export_for_cuda(functools.partial(K.gated_delta_chunked, variant="v2", dots=dots, stages=2),
                                *[sds((t, hv, d), bf16) for d in (dk, dk, dv)],
                                sds((t, hv), f32), sds((t, hv), f32), sds((hv, dk, dv), f32))
        assert fast.count("@__gpu$xla.gpu.triton") == 2
    if variant == "v2":                                       # and the other row blocks of the v2 intra kernel
        tp = t + (-t) % K.CHUNK
        for sub in (16, 64):
            intra = _export_for_cuda(functools.partial(K._chunked_intra_v2, sub=sub),
                                     *[sds((tp, hv, d), bf16) for d in (dk, dk, dv)],
                                     sds((hv, tp), f32), sds((hv, tp), f32))
            assert intra.count("@__gpu$xla.gpu.triton") == 1


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


# --- the backend's XLA form (every device's default for prompt parts): the kernels' limits

@pytest.mark.parametrize("chunk", [64, 128])
@pytest.mark.parametrize("t,hv,dk,dv", [(1, 4, 32, 32), (130, 4, 32, 32), (1100, 2, 16, 16)])
def test_xla_chunked_form_matches_the_reference(t, hv, dk, dv, chunk):
    """At chunk 64, 130 tokens are 3 chunks (one per scan iteration); 1100 tokens 18 (blocks of 2, as
    GDN_SCAN_BLOCK = 16 does not divide 18); test_xla_chunked_form_in_full_blocks takes blocks of GDN_SCAN_BLOCK.
    Chunk 128: half the sequential steps, twice the intra-chunk span."""
    from strata.jax_backend.backend import JaxBackend
    rng = np.random.default_rng()
    check_chunked(functools.partial(JaxBackend.gated_delta_chunked_xla, chunk=chunk),
                  *rule_inputs(rng, (t,), hv, dk, dv, "float32"), state_like(rng, (), hv, dk, dv))


@pytest.mark.parametrize("chunk", [64, 128])
def test_xla_chunked_form_with_aligned_keys(chunk):
    from strata.jax_backend.backend import JaxBackend
    rng = np.random.default_rng()
    check_chunked(functools.partial(JaxBackend.gated_delta_chunked_xla, chunk=chunk),
                  *aligned_inputs(rng, 300, 2, 32, 32), state_like(rng, (), 2, 32, 32))


@pytest.mark.parametrize("dots", ["bf16x6", "tf32x3"])
def test_xla_chunked_form_with_dots_on_the_tensor_cores(dots, interpret):
    """The XLA form's fp32 matmuls split over the tensor cores keep the IEEE limits (random and aligned keys, 1100
    and 300 tokens). tf32x3 compiles on a GPU only: on the CPU XLA refuses it, by name. XLA's CPU runs a bf16x6
    dot as plain fp32 (the same error as HIGHEST, measured), so there this checks the plumbing and the split's
    accuracy is checked by the GPU run (STRATA_TEST_DEVICE=gpu)."""
    from strata.jax_backend.backend import JaxBackend
    run = functools.partial(JaxBackend.gated_delta_chunked_xla, dots=dots)
    rng = np.random.default_rng()
    if dots == "tf32x3" and interpret:                       # on the CPU
        with pytest.raises(Exception, match="TF32_TF32_F32_X3"):
            run(*rule_inputs(rng, (70,), 2, 16, 16, "float32"), jnp.asarray(state_like(rng, (), 2, 16, 16)))
        return
    check_chunked(run, *rule_inputs(rng, (1100,), 2, 16, 16, "float32"), state_like(rng, (), 2, 16, 16))
    check_chunked(run, *aligned_inputs(rng, 300, 2, 32, 32), state_like(rng, (), 2, 32, 32))


def test_xla_chunked_form_in_full_blocks():
    """2048 tokens: 32 chunks, two scan iterations of GDN_SCAN_BLOCK chunks each."""
    from strata.jax_backend.backend import GDN_SCAN_BLOCK, JaxBackend
    assert 2048 // K.CHUNK == 2 * GDN_SCAN_BLOCK
    rng = np.random.default_rng()
    check_chunked(JaxBackend.gated_delta_chunked_xla, *rule_inputs(rng, (2048,), 2, 16, 16, "float32"),
                  state_like(rng, (), 2, 16, 16))
