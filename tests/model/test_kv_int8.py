"""The int8 KV cache: its quantiser in the forward pass against the numpy reference (bit for bit), the JAX attention
over int8 caches against float64 attention over the dequantised caches (decode and prompt-part forms), and an int8
engine against the float32 one on the demo model."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from strata import Engine
from strata.errors import ConfigError
from strata.jax_backend.backend import JaxBackend
from strata import backend
from strata.reference import dequantize_kv, quantize_kv
from strata.sycl_backend.kernels.attention import attention_reference

ATT_REL = 2e-6      # fp32 attention over the same int8 values and scales (sums of a few hundred terms)
# int8 KV against a float32 cache, of the logit range: a stored row is within scale / 2 = amax / 254 of itself; over
# the demo model and the tiny models of the parity suite the worst measured is ~9e-4 (tests/model/test_parity.py)
INT8_LOGITS = 5e-3


def test_quantizer_matches_the_reference_bit_for_bit():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((7, 3, 64)) * rng.uniform(0.01, 50, (7, 3, 1))).astype(np.float32)
    x[2, 1] = 0.0                                   # a zero row: scale 0, codes 0
    x[4, 0, :5] = [127.0, -127.0, 63.5, -0.5, 0.5]  # exact halves round to even
    x[4, 0, 5:] = 0.0
    q, s = backend.quantize_kv(jnp, jnp.asarray(x))
    q0, s0 = quantize_kv(x)
    assert q.dtype == jnp.int8 and s.dtype == jnp.float32
    assert (np.asarray(q) == q0).all() and (np.asarray(s) == s0).all()
    assert (q0[2, 1] == 0).all() and s0[2, 1] == 0
    err = np.abs(dequantize_kv(q0, s0) - x).max(axis=-1)
    assert (err <= s0 / 2 * (1 + 1e-6)).all()        # every value within half a step


def test_a_non_finite_row_has_a_non_finite_scale():
    x = np.ones((2, 1, 8), np.float32)
    x[1, 0, 3] = np.nan
    _, s = backend.quantize_kv(jnp, jnp.asarray(x))
    s = np.asarray(s)
    assert np.isfinite(s[0]).all() and not np.isfinite(s[1]).all()


@pytest.mark.parametrize("t", [1, 3, 20])           # up to ATTN_ONE_PASS_ROWS: one pass; beyond: key blocks
def test_jax_attention_over_int8_caches(t):
    rng = np.random.default_rng(t)
    cap, hq, hkv, hd = 600, 4, 2, 16                  # more keys than one block of the prompt-part form
    q = rng.standard_normal((t, hq, hd)).astype(np.float32)
    kq, ks = quantize_kv(rng.standard_normal((cap, hkv, hd)).astype(np.float32) * 3)
    vq, vs = quantize_kv(rng.standard_normal((cap, hkv, hd)).astype(np.float32))
    pos = rng.integers(0, cap, t).astype(np.int32)
    got = np.asarray(JaxBackend.attention_xla(jnp.asarray(q), jnp.asarray(kq), jnp.asarray(vq), jnp.asarray(pos),
                                          hd ** -0.5, jnp.asarray(ks), jnp.asarray(vs)))
    want = attention_reference(q, kq, vq, pos, hd ** -0.5, ks, vs)
    assert np.abs(got - want).max() <= ATT_REL * np.abs(want).max()


def test_int8_engine_near_the_float32_one_and_a_quarter_of_its_kv_bytes():
    ids = list(range(3, 90))
    f32 = Engine.load("demo", max_context=256, prefill=16)
    i8 = Engine.load("demo", max_context=256, prefill=16, kv="int8")
    ref, got = f32.logits(ids), i8.logits(ids)
    assert np.isfinite(got).all()
    span = ref.max() - ref.min()
    assert np.abs(got - ref).max() <= INT8_LOGITS * span
    kv_bytes = lambda e: sum(a.nbytes for layer in e.init_state() for n, a in layer.items() if n in  # noqa: E731
                             ("k", "v", "k_scale", "v_scale"))
    hd = f32.cfg.head_dim
    assert kv_bytes(i8) * 4 * hd == kv_bytes(f32) * (hd + 4)       # int8 values + one fp32 scale per row of hd
    assert "k_scale" in i8.init_state()[i8.cfg.layer_types.index("full_attention")]


def test_a_bad_kv_format_names_the_allowed_ones():
    with pytest.raises(ConfigError, match=r'kv = "int4" \(a string\) is not allowed; kv must be one of auto, int8, '
                                          r'bfloat16, float32'):
        Engine.load("demo", kv="int4")
