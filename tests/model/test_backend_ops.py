"""The JAX backend's expert op and gated delta rule against plain numpy references, on fresh random inputs."""
from __future__ import annotations

import numpy as np
import pytest

from strata.jax_backend import backend as jb
from strata import reference
from strata.weights import quant

OPS = jb.JaxBackend()


@pytest.mark.parametrize("tokens,k,experts", [(1, 4, 16), (8, 8, 16), (40, 3, 16), (130, 2, 5), (33, 6, 64)])
def test_expert_op_matches_reference(tokens, k, experts):
    """Both forms: gathered weights (few routes) and expert-sorted blocks (many), including experts no route uses
    and experts holding more than one block of routes."""
    rng = np.random.default_rng(tokens * 1000 + k)
    H, I = 24, 40
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    idx = np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weight = rng.random((tokens, k)).astype(np.float32)
    gate, up = (rng.standard_normal((experts, I, H)).astype(np.float32) / 5 for _ in range(2))
    down = rng.standard_normal((experts, H, I)).astype(np.float32) / 6
    # experts in f32 blobs, in a pool twice their number, at shuffled slots (the others hold garbage)
    lay = quant.layout("f32", H, I)
    pool = rng.integers(0, 256, (2 * experts, lay.nbytes), dtype=np.uint8)
    slot_of = rng.permutation(2 * experts)[:experts]
    for e in range(experts):
        pool[slot_of[e]] = quant.encode_expert(lay, gate[e], up[e], down[e])
    got = np.asarray(OPS.experts_pool(x, slot_of[idx].astype(np.int32), weight, pool, lay, experts))
    want = reference.experts(x, idx, weight, gate, up, down)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("length", [1, 5, 64, 100, 130])
def test_gated_delta_rule_chunked_and_step_match_recurrence(length):
    rng = np.random.default_rng(length)
    H, dk, dv = 3, 8, 6
    q = rng.standard_normal((length, H, dk)).astype(np.float32)
    k = rng.standard_normal((length, H, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
    v = rng.standard_normal((length, H, dv)).astype(np.float32)
    g = -rng.random((length, H)).astype(np.float32) * 2
    beta = rng.random((length, H)).astype(np.float32)
    S0 = rng.standard_normal((H, dk, dv)).astype(np.float32)
    want_o, want_S = reference.gated_delta(q, k, v, g, beta, S0)
    o, S = OPS.gated_delta_chunked(q, k, v, g, beta, S0)
    assert np.abs(np.asarray(o) - want_o).max() <= 1e-5 * np.abs(want_o).max()
    assert np.abs(np.asarray(S) - want_S).max() <= 1e-5 * np.abs(want_S).max()
    S = S0
    steps = []
    for t in range(length):
        o_t, S = OPS.gated_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], S)
        steps.append(np.asarray(o_t)[0])
    assert np.abs(np.stack(steps) - want_o).max() <= 1e-5 * np.abs(want_o).max()
    assert np.abs(np.asarray(S) - want_S).max() <= 1e-5 * np.abs(want_S).max()


def test_padded_rows_leave_the_state_unchanged():
    """Rows with g = beta = 0 (bucket padding) must not move the recurrent state."""
    rng = np.random.default_rng(7)
    H, dk, dv, n, pad = 2, 4, 4, 10, 6
    args = [rng.standard_normal((n + pad, H, d)).astype(np.float32) for d in (dk, dk, dv)]
    g = -rng.random((n + pad, H)).astype(np.float32)
    beta = rng.random((n + pad, H)).astype(np.float32)
    g[n:], beta[n:] = 0.0, 0.0
    S0 = rng.standard_normal((H, dk, dv)).astype(np.float32)
    _, S_padded = OPS.gated_delta_chunked(*args, g, beta, S0)
    _, S_real = OPS.gated_delta_chunked(*(a[:n] for a in args), g[:n], beta[:n], S0)
    np.testing.assert_allclose(np.asarray(S_padded), np.asarray(S_real), rtol=0, atol=1e-6)


def test_a_fresh_state_is_zeros_made_on_the_device():
    """Sequence and WindowRunner states come from Backend.zeros_like(init_state()), which makes zeros on the
    device rather than copying init_state from the host: so init_state must be all zeros (every dtype, bf16 and
    int8 KV included), and zeros_like must keep the tree, shapes and dtypes."""
    import jax
    import ml_dtypes

    from strata.demo import DEMO_CONFIG
    from strata.model.config import ModelConfig
    from strata.model.forward import init_state
    cfg = ModelConfig.from_hf(dict(DEMO_CONFIG, vocab_size=512), source="demo config")
    for dtype, kv in ((np.float32, None), (ml_dtypes.bfloat16, np.int8)):
        host = init_state(cfg, 16, dtype, kv)
        assert all(not np.any(a.astype(np.float32)) for layer in host for a in layer.values())
        dev = OPS.zeros_like(host)
        assert jax.tree.structure(dev) == jax.tree.structure(host)
        for d, h in zip(jax.tree.leaves(dev), jax.tree.leaves(host)):
            assert isinstance(d, jax.Array) and d.shape == h.shape and d.dtype == h.dtype
            assert d.devices() == {OPS.device} and not np.any(np.asarray(d).astype(np.float32))


def test_fresh_states_share_no_buffers():
    """zeros_like makes a tree by one compiled call per tree shape: each call's arrays are new buffers, so a state
    donated to (and overwritten by) one sequence's call leaves another sequence's fresh state zeros."""
    import jax
    import jax.numpy as jnp
    host = [{"kv": np.zeros((4, 3), np.float32), "ssm": np.zeros((2, 2), np.int8)}, {"conv": np.zeros(5, np.float32)}]
    a, b = OPS.zeros_like(host), OPS.zeros_like(host)
    fill = jax.jit(lambda t: jax.tree.map(lambda x: jnp.ones_like(x) * 7, t), donate_argnums=0)
    a = fill(a)
    assert all(np.all(np.asarray(x) == 7) for x in jax.tree.leaves(a))
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(b))
    assert jax.tree.structure(OPS.zeros_like(host[1:])) == jax.tree.structure(host[1:])   # another shape, another call
