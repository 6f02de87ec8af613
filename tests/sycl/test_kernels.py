"""Every OpenCL kernel of the SYCL backend against its numpy reference (kernels/<family>.py), on fresh random inputs,
writing into a poisoned (NaN / sentinel-filled) output buffer so an element the kernel forgets to write shows."""
from __future__ import annotations

import dpnp
import numpy as np
import pytest

from strata.model.rope import RopeScaling, rope_for
from strata.reference import quantize_kv

from strata.sycl_backend.kernels import attention as k_attention
from strata.sycl_backend.kernels import conv as k_conv
from strata.sycl_backend.kernels import experts as k_experts
from strata.sycl_backend.kernels import gated_delta as k_gdn
from strata.sycl_backend.kernels import linear as k_linear
from strata.sycl_backend.kernels import norms as k_norms
from strata.sycl_backend.kernels import pointwise as k_pointwise
from strata.sycl_backend.kernels import rope as k_rope
from strata.sycl_backend.kernels import sample as k_sample
from strata.sycl_backend.kernels import topk as k_topk


def poisoned(ops, shape, dtype=np.float32):
    fill = np.nan if np.dtype(dtype).kind == "f" else -7
    return dpnp.full(shape, fill, dtype=dtype, sycl_queue=ops.queue)


def close(got, want, rel=2e-6, what=""):
    got = dpnp.asnumpy(got) if isinstance(got, dpnp.ndarray) else np.asarray(got)
    assert np.isfinite(got).all(), f"{what}: non-finite output (an element was not written?)"
    err = np.abs(got.astype(np.float64) - want).max()
    scale = max(np.abs(want).max(), 1e-30)
    assert err <= rel * scale, f"{what}: max |diff| {err:.3e} > {rel} x {scale:.3e}"


@pytest.mark.parametrize("rows,d", [(1, 24), (7, 72), (3, 200), (2, 1)])
def test_rms_norm(ops, rng, rows, d):
    x = rng.standard_normal((rows, d)).astype(np.float32) * 3
    scale = rng.random(d).astype(np.float32) + 0.5
    out = poisoned(ops, (rows, d))
    k_norms.rms_norm(ops.kernels, ops.to_device(x), ops.to_device(scale), 1e-6, out=out)
    close(out, k_norms.rms_norm_reference(x, scale, 1e-6), what="rms_norm")


@pytest.mark.parametrize("rows,n", [(1, 8), (5, 160), (2, 1000), (3, 1)])
def test_softmax(ops, rng, rows, n):
    x = rng.standard_normal((rows, n)).astype(np.float32) * 5
    out = poisoned(ops, (rows, n))
    k_norms.softmax(ops.kernels, ops.to_device(x), out=out)
    close(out, k_norms.softmax_reference(x), what="softmax")


@pytest.mark.parametrize("name", k_pointwise.UNARY)
def test_unary(ops, rng, name):
    x = (rng.standard_normal((3, 37)) * 8).astype(np.float32)
    x[0, :4] = [0.0, 30.0, -30.0, 90.0]
    out = poisoned(ops, x.shape)
    k_pointwise.unary(ops.kernels, name, ops.to_device(x), out=out)
    close(out, k_pointwise.unary_reference(name, x), rel=1e-6, what=name)


def test_widen_bf16(ops, rng):
    bits = rng.integers(0, 2 ** 16, (5, 33), dtype=np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] = 0x3F80          # no inf / NaN patterns
    out = poisoned(ops, bits.shape)
    k_pointwise.widen_bf16(ops.kernels, ops.to_device(bits), out=out)
    assert np.array_equal(dpnp.asnumpy(out), k_pointwise.widen_bf16_reference(bits))


@pytest.mark.parametrize("t,heads,hd,rot", [(1, 4, 16, 4), (9, 2, 32, 32), (5, 3, 24, 12)])
@pytest.mark.parametrize("scaling", [None, RopeScaling("yarn", 4.0, 64)])
def test_rope(ops, rng, t, heads, hd, rot, scaling):
    x = rng.standard_normal((t, heads, hd)).astype(np.float32)
    pos = rng.integers(0, 3000, t).astype(np.int64)
    out = poisoned(ops, x.shape)
    rope = rope_for(hd, rot / hd, 10000.0, scaling)
    k_rope.rope(ops.kernels, ops.to_device(x), ops.to_device(pos), ops.to_device(rope.table()), rot, out=out)
    close(out, k_rope.rope_reference(x, pos, rope), rel=2e-5, what="rope")


@pytest.mark.parametrize("t,hq,hkv,hd,cap", [(1, 4, 2, 16, 20), (6, 8, 2, 8, 12), (3, 2, 2, 64, 40)])
def test_attention(ops, rng, t, hq, hkv, hd, cap):
    q = rng.standard_normal((t, hq, hd)).astype(np.float32)
    kc = rng.standard_normal((cap, hkv, hd)).astype(np.float32)
    vc = rng.standard_normal((cap, hkv, hd)).astype(np.float32)
    pos = np.sort(rng.integers(0, cap + 3, t)).astype(np.int64)          # past the cache end: clamped
    out = poisoned(ops, q.shape)
    kv = {"k": ops.to_device(kc), "v": ops.to_device(vc)}
    k_attention.attention(ops.kernels, ops.to_device(q), kv, ops.to_device(pos), hd ** -0.5, out=out)
    close(out, k_attention.attention_reference(q, kc, vc, pos, hd ** -0.5), rel=1e-5, what="attention")
    # the int8 cache: codes and a scale per token and head (strata/reference.py quantize_kv)
    (kq, ks), (vq, vs) = quantize_kv(kc * 4), quantize_kv(vc)
    kv8 = {"k": ops.to_device(kq), "v": ops.to_device(vq), "k_scale": ops.to_device(ks), "v_scale": ops.to_device(vs)}
    out = poisoned(ops, q.shape)
    k_attention.attention(ops.kernels, ops.to_device(q), kv8, ops.to_device(pos), hd ** -0.5, out=out)
    close(out, k_attention.attention_reference(q, kq, vq, pos, hd ** -0.5, ks, vs), rel=1e-5, what="attention int8")


@pytest.mark.parametrize("t,c,kw,n_valid", [(1, 10, 4, 1), (1, 10, 4, 0), (7, 6, 4, 5), (2, 5, 4, 2), (9, 3, 2, 9),
                                             (5, 4, 4, 1), (64, 7, 4, 64)])
def test_causal_conv(ops, rng, t, c, kw, n_valid):
    u = rng.standard_normal((t, c)).astype(np.float32)
    st = rng.standard_normal((kw - 1, c)).astype(np.float32)
    w = rng.standard_normal((c, kw)).astype(np.float32)
    out, state = poisoned(ops, (t, c)), ops.to_device(st)
    _, new_state = k_conv.causal_conv(ops.kernels, ops.to_device(u), state, ops.to_device(w), n_valid, out=out)
    want_y, want_state = k_conv.causal_conv_reference(u, st, w, n_valid)
    close(out, want_y, rel=1e-6, what="conv output")
    assert new_state is state                          # updated in place
    assert np.array_equal(dpnp.asnumpy(state), want_state.astype(np.float32)), "conv state"


@pytest.mark.parametrize("t,hv,dk,dv", [(1, 4, 16, 8), (1, 3, 8, 6), (70, 2, 16, 16), (5, 1, 128, 4)])
def test_gated_delta(ops, rng, t, hv, dk, dv):
    q = rng.standard_normal((t, hv, dk)).astype(np.float32)
    k = rng.standard_normal((t, hv, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
    v = rng.standard_normal((t, hv, dv)).astype(np.float32)
    g = -rng.random((t, hv)).astype(np.float32) * 2
    beta = rng.random((t, hv)).astype(np.float32)
    s0 = rng.standard_normal((hv, dk, dv)).astype(np.float32)
    state = ops.to_device(s0)
    out = poisoned(ops, (t, hv, dv))
    o, s = k_gdn.gated_delta(ops.kernels, *(ops.to_device(a) for a in (q, k, v, g, beta)), state, out=out)
    want_o, want_s = k_gdn.gated_delta_reference(q, k, v, g, beta, s0)
    close(out, want_o, rel=1e-5, what="delta rule output")
    close(s, want_s, rel=1e-5, what="delta rule state")
    assert s is state                                  # updated in place


@pytest.mark.parametrize("rows,n,k", [(1, 16, 4), (9, 8, 2), (4, 64, 10), (3, 5, 5)])
def test_topk(ops, rng, rows, n, k):
    x = rng.random((rows, n)).astype(np.float32)
    x[0, 1] = x[0, 3] = x[0].max() + 1                 # a tie: the lower index first
    vals, idx = poisoned(ops, (rows, k)), poisoned(ops, (rows, k), np.int32)
    k_topk.topk(ops.kernels, ops.to_device(x), k, out_vals=vals, out_idx=idx)
    want_v, want_i = k_topk.topk_reference(x, k)
    assert np.array_equal(dpnp.asnumpy(idx), want_i)
    assert np.array_equal(dpnp.asnumpy(vals), want_v)


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("t,kk,e,h,i", [(1, 4, 16, 24, 40), (1, 10, 64, 32, 8), (8, 8, 16, 20, 12)])
def test_experts_gathered(ops, rng, fmt, t, kk, e, h, i):
    import ml_dtypes
    x = rng.standard_normal((t, h)).astype(np.float32)
    idx = np.stack([rng.choice(e, kk, replace=False) for _ in range(t)]).astype(np.int32)
    weight = rng.random((t, kk)).astype(np.float32)
    gate, up = (rng.standard_normal((e, i, h)).astype(np.float32) / 5 for _ in range(2))
    down = rng.standard_normal((e, h, i)).astype(np.float32) / 6
    if fmt == "bf16":
        stored = [w.astype(ml_dtypes.bfloat16) for w in (gate, up, down)]
        gate, up, down = (w.astype(np.float32) for w in stored)          # what the kernel must compute with
        dev = [ops.to_device(w.view(np.uint16)) for w in stored]
    else:
        dev = [ops.to_device(w) for w in (gate, up, down)]
    out, act = poisoned(ops, (t, h)), poisoned(ops, (t * kk, i))
    k_experts.experts_gathered(ops.kernels, ops.to_device(x), ops.to_device(idx), ops.to_device(weight), *dev, fmt,
                               out=out, act=act)
    close(out, k_experts.experts_reference(x, idx, weight, gate, up, down), rel=2e-6, what=f"experts {fmt}")


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("t,n,o", [(1, 96, 40), (3, 200, 7), (16, 1, 65), (2, 64, 1)])
def test_linear(ops, rng, fmt, t, n, o):
    import ml_dtypes
    x = rng.standard_normal((t, n)).astype(np.float32)
    w = rng.standard_normal((o, n)).astype(np.float32)
    if fmt == "bf16":
        wb = w.astype(ml_dtypes.bfloat16)
        w, dev = wb.astype(np.float32), ops.to_device(wb.view(np.uint16))
    else:
        dev = ops.to_device(w)
    out = poisoned(ops, (t, o))
    k_linear.linear(ops.kernels, ops.to_device(x), dev, fmt, out=out)
    close(out, k_linear.linear_reference(x, w), rel=2e-6, what=f"linear {fmt}")


def test_sample_pick(ops, rng):
    b, v = 24, 50
    logits = rng.standard_normal((b, v)).astype(np.float32) * 2
    order = np.argsort(-logits, axis=-1, kind="stable")
    temperature = rng.choice([0.0, 0.7, 1.0, 1.3], b).astype(np.float32)
    scaled = np.take_along_axis(logits, order, -1) / np.maximum(temperature, 1e-6)[:, None]
    probs = k_norms.softmax_reference(scaled).astype(np.float32)
    cum = np.cumsum(probs, axis=-1, dtype=np.float32)
    greedy = logits.argmax(-1).astype(np.int64)
    top_k = rng.choice([0, 1, 3, 10], b).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5], b).astype(np.float32)
    min_p = rng.choice([0.0, 0.05, 0.3], b).astype(np.float32)
    keys = k_sample.prng_keys_reference(rng.integers(0, 2 ** 32, (b, 2), dtype=np.uint32),
                                        rng.integers(0, 100, b))
    out = poisoned(ops, (b,), np.int32)
    args = (scaled.astype(np.float32), probs, cum, order.astype(np.int64), greedy, temperature, top_k, top_p,
            min_p, keys)
    k_sample.sample_pick(ops.kernels, *(ops.to_device(a) for a in args), out=out)
    assert np.array_equal(dpnp.asnumpy(out), k_sample.sample_pick_reference(*args))


def test_prng_keys_depend_on_seed_and_step_only():
    seeds = np.array([[1, 0], [1, 0], [2, 0], [1, 1]], np.uint32)
    steps = np.array([0, 1, 0, 0])
    keys = k_sample.prng_keys_reference(seeds, steps)
    assert len({tuple(k) for k in keys}) == 4
    assert np.array_equal(k_sample.prng_keys_reference(seeds[1:2], steps[1:2])[0], keys[1])
    u = k_sample.uniform_reference(keys[0], np.arange(100000))
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01


def test_kernel_refuses_an_array_of_another_queue(ops, sycl_device):
    """A foreign-queue (foreign-context) argument cannot reach a kernel: launch refuses it by name."""
    import dpctl
    other = dpctl.SyclQueue(sycl_device)                # a second queue object on the same device
    assert other is not ops.queue
    x = dpnp.ones((2, 8), dtype=dpnp.float32, sycl_queue=other)
    with pytest.raises(ValueError, match="another queue|not on this backend's queue"):
        k_norms.softmax(ops.kernels, x)


def test_spirv_route_builds_and_runs(sycl_queue, monkeypatch, tmp_path, rng):
    """The Level Zero route (SPIR-V from the same OpenCL C, via clang + llvm-spirv), exercised on this device."""
    import shutil

    from strata.sycl_backend.kernels import Kernels
    if not (shutil.which("clang-15") or shutil.which("clang")) or not (shutil.which("llvm-spirv-15")
                                                                        or shutil.which("llvm-spirv")):
        pytest.skip("clang and llvm-spirv are not installed (apt install clang-15 llvm-spirv-15)")
    monkeypatch.setenv("STRATA_SYCL_KERNELS", "spirv")
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    k = Kernels(sycl_queue)                            # a private program, not the queue's shared one
    k.program()
    assert list((tmp_path / "spirv").glob("kernels-*.spv"))
    x = rng.standard_normal((4, 30)).astype(np.float32)
    scale = rng.random(30).astype(np.float32)
    out = dpnp.full((4, 30), np.nan, dtype=np.float32, sycl_queue=sycl_queue)
    k_norms.rms_norm(k, dpnp.asarray(x, sycl_queue=sycl_queue), dpnp.asarray(scale, sycl_queue=sycl_queue), 1e-6,
                     out=out)
    close(out, k_norms.rms_norm_reference(x, scale, 1e-6), what="rms_norm via SPIR-V")


def test_asynchronous_submission_orders_with_dpnp_work(sycl_queue, monkeypatch, rng):
    """The GPU submission path (asynchronous, ordered through dpctl's order manager, arguments kept alive until
    done), exercised on this device: kernels and dpnp ops interleaved on temporaries come out in program order."""
    from strata.sycl_backend.kernels import Kernels
    monkeypatch.setenv("STRATA_SYCL_SUBMIT", "async")
    k = Kernels(sycl_queue)
    assert not k.blocking
    scale = rng.random(300).astype(np.float32)
    xs = [rng.standard_normal((64, 300)).astype(np.float32) for _ in range(6)]
    outs = []
    for x in xs:                          # each result waits on a dpnp op, a kernel, a dpnp op, a kernel, a dpnp op
        d = dpnp.asarray(x, sycl_queue=sycl_queue)
        y = k_norms.rms_norm(k, d * 2.0, dpnp.asarray(scale, sycl_queue=sycl_queue), 1e-6)      # temporaries
        outs.append(k_norms.softmax(k, y + 1.0) * 300.0)
    for x, d in zip(xs, outs):
        want = k_norms.softmax_reference(k_norms.rms_norm_reference(x * 2.0, scale, 1e-6) + 1.0) * 300.0
        close(d, want, rel=1e-5, what="async chain")
