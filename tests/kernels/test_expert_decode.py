"""kernels/expert_decode.experts_decode_int4 (the decode form of the expert op, dequantizing int4 in the kernel)
against the numpy reference on the same blobs: a poisoned pool (garbage and NaN bytes in unused slots), skipped
routes with NaN weights, one token with every route skipped; on the CPU in Pallas interpret mode, on the GPU
compiled (STRATA_TEST_DEVICE=gpu)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_expert_op import LIMIT, poisoned_pool, rel_err, routes

from strata.jax_backend.kernels import expert_decode as K
from strata.weights import quant as Q

H, I = 256, 128          # one int4 group of 128 columns or two, per matrix


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens,k", [(1, 4), (3, 2), (4, 8)])
def test_decode_kernel_matches_the_reference(tokens, k, dtype, interpret):
    rng = np.random.default_rng()
    lay = Q.layout("int4", H, I)
    pool, slot_of = poisoned_pool(rng, lay, n_experts=10, n_slots=14)
    slots, weight = routes(rng, tokens, k, slot_of)
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    xd = jnp.asarray(x, dtype)
    got = np.asarray(K.experts_decode_int4(lay, jnp.asarray(pool), xd, jnp.asarray(slots), jnp.asarray(weight),
                                           interpret=interpret)).astype(np.float32)
    want = K._reference(lay, pool, np.asarray(xd.astype(jnp.float32)), slots, weight)
    assert np.isfinite(got).all()
    if tokens > 1:
        assert np.all(got[tokens // 2] == 0)                  # every route of this token skipped
    # the kernel computes in float32 whatever x's dtype; bfloat16 output is one rounding of it
    err = rel_err(got, want)
    assert err <= LIMIT["float32" if dtype == "float32" else "bfloat16"]["int4"], f"relative error {err:.2e}"


def test_formats_and_shapes_it_cannot_read_are_refused():
    lay = Q.layout("int8", H, I)
    with pytest.raises(ValueError, match="int4"):
        K.experts_decode_int4(lay, jnp.zeros((2, lay.nbytes), jnp.uint8), jnp.zeros((1, H)),
                              jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2)), interpret=True)
    odd = Q.layout("int4", 96, 32)                            # groups of 96 and 32 columns: not powers of two
    with pytest.raises(ValueError, match="power of two"):
        K.experts_decode_int4(odd, jnp.zeros((2, odd.nbytes), jnp.uint8), jnp.zeros((1, 96)),
                              jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2)), interpret=True)
