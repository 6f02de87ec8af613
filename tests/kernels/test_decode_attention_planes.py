"""kernels/decode_attention's plane form (an int8 cache read as int32 words, 4 byte planes unpacked in the kernel:
JAX's Triton lowering offsets an int8 ref of 2^31 .. 2^32 bytes in int32 elements, which overflow): forced on small
shapes it gives the float64 reference within the int8 tests' limits, in decode, prompt and tiered calls (one tier in
each form); the form follows the byte rule, checked on the traced program at real sizes without allocating them,
and lowers for CUDA there."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jaxprs import walk
from test_decode_attention import (LIMIT, TIERED, assert_matches, assert_rounded_from_float32, make_inputs,
                                   prompt_inputs, rel_err, tiered_case)

from strata.jax_backend.kernels import decode_attention as K
from strata.jax_backend.kernels import int32_offsets_overflow

REAL = (16, 262208, 2, 256)       # Qwen3-Next's int8 caches at 16 slots of 262,208 positions: 2,148,532,224 bytes
QUERY_HEADS = 16

# (S, Q, Hq, Hkv, hd, Cap, block_k, n_splits, pos) as test_decode_attention's SHAPES, head dims the plane form takes
SHAPES = [
    (3, 3, 8, 1, 64, 128, 16, 4, [0, 125, 77]),
    (3, 1, 4, 2, 64, 64, 16, 2, [37, 0, 63]),
    (2, 1, 16, 2, 128, 128, 32, 3, [127, 50]),
]
# (T, n_valid, Hq, Hkv, hd, Cap, start, block_q, block_k) as PROMPT_SHAPES
PROMPT_SHAPES = [
    (32, 29, 8, 1, 64, 128, 37, 2, 16),
    (16, 16, 8, 2, 128, 64, 48, 4, 32),
]


@pytest.fixture
def fresh_attention_jit():
    """Drop the compiled calls before and after a test that monkeypatches the form's rule (read when traced)."""
    fns = (K.decode_attention, K.tiered_decode_attention, K.prompt_attention)
    for f in fns:
        f.clear_cache()
    yield
    for f in fns:
        f.clear_cache()


def test_the_form_follows_the_byte_rule():
    """int8 caches of 2^31 - 1 .. 2^32 bytes take the plane form; smaller ones (int32 offsets fit) and larger ones
    (the lowering offsets in 64 bits) the int8 form; a cache in the range whose head dim is under 64 is refused."""
    assert K.int8_planes_needed(REAL)
    assert not K.int8_planes_needed((4,) + REAL[1:]) and not K.int8_planes_needed((8,) + REAL[1:])
    assert not K.int8_planes_needed((33,) + REAL[1:])                      # 4.4e9 bytes: 64-bit offsets
    assert K.int8_planes_needed((2**31 - 1,)) and K.int8_planes_needed((2**32,))
    assert not K.int8_planes_needed((2**31 - 2,)) and not K.int8_planes_needed((2**32 + 1,))
    assert not int32_offsets_overflow(REAL, 2)                             # bfloat16: 2^32 bytes needs 2^31 elements
    sds = jax.ShapeDtypeStruct
    q, pos = sds((16, 1, QUERY_HEADS, 256), jnp.bfloat16), sds((16,), jnp.int32)
    cache, scales = sds(REAL, jnp.int8), sds(REAL[:3], jnp.float32)
    assert K.supported(q, cache, cache, scales, scales, pos)
    thin = sds((16, REAL[1] * 8, 2, 32), jnp.int8)                         # the same bytes, hd 32
    thin_q, thin_scales = sds((16, 1, QUERY_HEADS, 32), jnp.bfloat16), sds(thin.shape[:3], jnp.float32)
    assert not K.supported(thin_q, thin, thin, thin_scales, thin_scales, pos)
    with pytest.raises(ValueError, match="hd >= 64"):
        K._check(thin_q, thin, thin, thin_scales, thin_scales, pos, None, None)


def _kernel_caches(fn, *args):
    """The cache operands (inputs 3 and 4) of every pallas_call in fn's traced program, as abstract values."""
    calls = [e for e in walk(jax.make_jaxpr(fn)(*args).jaxpr) if e.primitive.name == "pallas_call"]
    for eqn in calls:                       # no kernel operand at all whose int32 offsets overflow
        assert not any(int32_offsets_overflow(v.aval.shape, v.aval.dtype.itemsize) for v in eqn.invars)
    return [tuple(v.aval for v in eqn.invars[2:4]) for eqn in calls]


@pytest.mark.parametrize("slots", [4, 16])
def test_real_sizes_reach_the_kernel_as_words_only_in_the_range(slots):
    """Traced (not run) at Qwen3-Next's sizes: the [16, 262208, 2, 256] int8 caches reach the decode kernel as int32
    [.., 64] words, [4, ...] ones as int8; a prompt part's [4194368, 2, 256] cache (2^22 + 64 keys) as words."""
    sds = jax.ShapeDtypeStruct
    shape = (slots,) + REAL[1:]
    cache, scales = sds(shape, jnp.int8), sds(shape[:3], jnp.float32)
    q, pos = sds((slots, 1, QUERY_HEADS, 256), jnp.bfloat16), sds((slots,), jnp.int32)
    (k, v), = _kernel_caches(lambda *a: K.decode_attention(*a, scale=0.0625, interpret=True),
                             q, cache, cache, scales, scales, pos)
    want = (shape[:3] + (64,), jnp.int32) if slots == 16 else (shape, jnp.int8)
    assert (k.shape, k.dtype) == want and (v.shape, v.dtype) == want
    one, one_scales = sds((2**22 + 64, 2, 256), jnp.int8), sds((2**22 + 64, 2), jnp.float32)
    qp, q_pos = sds((64, QUERY_HEADS, 256), jnp.bfloat16), sds((64,), jnp.int32)
    (k, v), = _kernel_caches(lambda *a: K.prompt_attention(*a, scale=0.0625, interpret=True),
                             qp, one, one, one_scales, one_scales, q_pos)
    assert k.shape == v.shape == (2**22 + 64, 2, 64) and k.dtype == v.dtype == jnp.int32


def test_plane_form_lowers_for_cuda_at_real_sizes():
    """Exported for CUDA (Pallas lowered to Triton IR; compiling that needs a GPU): one Triton call each for decode
    and prompt, the caches handed to it through a bitcast (the int32 view, not a copy)."""
    sds = jax.ShapeDtypeStruct
    targets = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")          # JAX <= 0.10.2; later versions
    one = (2**22 + 64, 2, 256)
    for fn, args in ((K.decode_attention, (sds((16, 1, QUERY_HEADS, 256), jnp.bfloat16), sds(REAL, jnp.int8),
                                           sds(REAL, jnp.int8), sds(REAL[:3], jnp.float32),
                                           sds(REAL[:3], jnp.float32), sds((16,), jnp.int32))),
                     (K.prompt_attention, (sds((64, QUERY_HEADS, 256), jnp.bfloat16), sds(one, jnp.int8),
                                           sds(one, jnp.int8), sds(one[:2], jnp.float32), sds(one[:2], jnp.float32),
                                           sds((64,), jnp.int32)))):
        exp = export.export(jax.jit(lambda *a, fn=fn: fn(*a, scale=0.0625)), platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call(c) for c in targets])(*args)
        text = exp.mlir_module()
        calls = sum(text.count(f"custom_call @{c}(") + text.count(f'custom_call @"{c}"(') for c in targets)
        assert calls == 1, f"{fn.__name__}: {calls} Triton calls"
        assert text.count("stablehlo.bitcast_convert") == 2, f"{fn.__name__}: the caches' int32 view"


@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda sh: "S{}Q{}H{}-{}d{}C{}bk{}x{}".format(*sh[:8]))
def test_plane_form_matches_the_reference(shape, q_dtype, interpret):
    s, nq, hq, hkv, hd, cap, block_k, n_splits, pos = shape
    rng = np.random.default_rng(list(shape[:8]) + [len(q_dtype)])
    args = make_inputs(rng, s, nq, hq, hkv, hd, cap, pos, "int8", q_dtype)    # garbage past each row: extreme codes
    scale = hd ** -0.5
    want = K._reference(*args, scale)
    got = K.decode_attention(*args, scale=scale, interpret=interpret, block_k=block_k, n_splits=n_splits,
                             planes=True)
    assert_matches(got, want, (s, nq, hq, hd), q_dtype, "plane form")


@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", PROMPT_SHAPES, ids=lambda sh: "T{}n{}H{}-{}d{}C{}s{}bq{}bk{}".format(*sh))
def test_prompt_plane_form_matches_the_reference(shape, q_dtype, interpret):
    t, n_valid, hq, hkv, hd, cap, start, block_q, block_k = shape
    rng = np.random.default_rng([t, n_valid, hq, cap, start, len(q_dtype)])
    args = prompt_inputs(rng, t, n_valid, hq, hkv, hd, cap, start, "int8", q_dtype)
    scale = hd ** -0.5
    want = K._reference_prompt(*args, scale)
    got = K.prompt_attention(*args, scale=scale, interpret=interpret, block_q=block_q, block_k=block_k, planes=True)
    assert_matches(got, want, (t, hq, hd), q_dtype, "prompt plane form")


@pytest.mark.parametrize("planes_tier", ["device", "host"])
def test_tiers_in_different_forms_combine(planes_tier, interpret, monkeypatch, fresh_attention_jit):
    """A device tier of 64 keys and a host tier of 96, one of them read in the plane form (the rule patched to pick
    it by its key count): the splits of both combine to the reference over the one cache."""
    shape = TIERED[1]                                                       # hd 64, Cap 96
    dev_cap = 64
    picked = dev_cap if planes_tier == "device" else shape[5]
    monkeypatch.setattr(K, "int8_planes_needed", lambda sh: sh[1] == picked)
    out, want, q_dtype = tiered_case(shape, "int8", interpret, dev_cap=dev_cap)
    assert rel_err(out, want) <= LIMIT[q_dtype]
    assert_rounded_from_float32(out, want, f"tiered, {planes_tier} tier in planes")
