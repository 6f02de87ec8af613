"""The backend's XLA form of the gated delta rule for prompt parts (JaxBackend.gated_delta_chunked_xla, its intra-chunk
products in kernels/gated_delta.py) against the float64 references built on strata.reference.gated_delta; fresh
random model-like inputs each run (l2-normed q and k, g = -exp(A_log) softplus(.), beta = sigmoid(.)), aligned keys
(A's entries near 1, where a power-series inverse would fail) and strongly decaying runs (where exponents as
differences of prefix sums would), at several chunks and every matmul precision."""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from strata.jax_backend.kernels import gated_delta as K

# Error limit against the float64 references, on the same (bf16-rounded where bf16) inputs: fp32 throughout (matmuls
# at HIGHEST, or split over the tensor cores to the same accuracy), so a few fp32 epsilons (2^-23 = 1.2e-7); a
# single-pass TF32 matmul would be off by ~1e-3.
# - states: relative Frobenius error (aligned keys up to ~5e-7: the fp32 rounding that a state with no decay keeps).
# - o = S^T q: error relative to the size of the terms it sums, || |S_t|^T |q_t| || (S_t the reference state after
#   token t). Relative to ||o|| itself the error has a tail from cancellation in S^T q: over 400 single-token draws
#   at Hv = 2 it reached 2.1e-6 in the draw where || |S|^T |q| || / ||o|| = 178.
LIMIT = 1e-6


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


def aligned_inputs(rng, t, hv, dk, dv):
    """Keys near one direction per head (cosines ~0.9), beta in [0.9, 1], almost no decay: A's entries near 1, the
    inputs under which a power-series inverse ((I - A)(I + A^2)(I + A^4)...) cancels binomially large terms (its
    fp32 error measured ~1e6 relative at C = 64, against ~3e-8 for the XLA form's triangular solve)."""
    q, k, v, g, beta = (np.array(x, np.float32) for x in rule_inputs(rng, (t,), hv, dk, dv, "bfloat16"))
    u = rng.standard_normal((hv, dk))
    k = u + 0.3 * rng.standard_normal((t, hv, dk)) * np.linalg.norm(u, axis=-1, keepdims=True) / np.sqrt(dk)
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32)
    g = (-0.002 * rng.uniform(size=(t, hv))).astype(np.float32)
    beta = rng.uniform(0.9, 1.0, (t, hv)).astype(np.float32)
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk", [64, 128])
@pytest.mark.parametrize("t,hv,dk,dv", [(1, 4, 32, 32), (130, 4, 32, 32), (1100, 2, 16, 16)])
def test_xla_chunked_form_matches_the_reference(t, hv, dk, dv, chunk):
    """At chunk 64, 130 tokens are 3 chunks (one per scan iteration); 1100 tokens 18 (blocks of 2, as
    SCAN_BLOCK = 16 does not divide 18); test_xla_chunked_form_in_full_blocks takes blocks of SCAN_BLOCK.
    Chunk 128: half the sequential steps, twice the intra-chunk span."""
    from strata.jax_backend.backend import JaxBackend
    rng = np.random.default_rng(0)
    check_chunked(functools.partial(JaxBackend.gated_delta_chunked_xla, chunk=chunk),
                  *rule_inputs(rng, (t,), hv, dk, dv, "float32"), state_like(rng, (), hv, dk, dv))


@pytest.mark.parametrize("chunk", [64, 128])
def test_xla_chunked_form_with_aligned_keys(chunk):
    from strata.jax_backend.backend import JaxBackend
    rng = np.random.default_rng(0)
    check_chunked(functools.partial(JaxBackend.gated_delta_chunked_xla, chunk=chunk),
                  *aligned_inputs(rng, 300, 2, 32, 32), state_like(rng, (), 2, 32, 32))


def test_the_backend_runs_its_kernel_configs_chunk(monkeypatch):
    """JaxBackend.gated_delta_chunked (the forward pass's call) computes at KernelConfig's gdn_chunk."""
    from strata.jax_backend.backend import JaxBackend
    from strata.jax_backend.kernel_config import KernelConfig
    seen = []
    real = JaxBackend.gated_delta_chunked_xla

    def spied(*a, **kw):
        seen.append(kw["chunk"])
        return real(*a, **kw)

    monkeypatch.setattr(JaxBackend, "gated_delta_chunked_xla", staticmethod(spied))
    rng = np.random.default_rng(0)
    for cfg, want in ((KernelConfig(), 64), (KernelConfig(gdn_chunk=128), 128)):
        check_chunked(JaxBackend(kernels="xla", kernel_config=cfg).gated_delta_chunked,
                      *rule_inputs(rng, (130,), 2, 16, 16, "float32"), state_like(rng, (), 2, 16, 16))
        assert seen == [want]
        seen.clear()


def test_xla_chunked_form_in_full_blocks():
    """2048 tokens: 32 chunks, two scan iterations of SCAN_BLOCK chunks each."""
    from strata.jax_backend.backend import JaxBackend
    assert 2048 // K.CHUNK == 2 * K.SCAN_BLOCK
    rng = np.random.default_rng(0)
    check_chunked(JaxBackend.gated_delta_chunked_xla, *rule_inputs(rng, (2048,), 2, 16, 16, "float32"),
                  state_like(rng, (), 2, 16, 16))
