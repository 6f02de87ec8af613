"""The SYCL backend's fused ops (strata/backend.py defines them) against their definition, the composition of
basic ops run on the same device, and their new kernels against numpy references; on fresh random inputs, with
weights stored in fp32 and in bfloat16. Also: how many launches each fused op takes at decode (one row)."""
from __future__ import annotations

import dpnp
import ml_dtypes
import numpy as np
import pytest

from strata.backend import SLOTS, ComposedOps
from strata.model.rope import RopeScaling, rope_for
from strata.reference import quantize_kv
from strata.sycl_backend.kernels import gated_delta as k_gdn
from strata.sycl_backend.kernels import linear as k_linear
from strata.sycl_backend.kernels import norms as k_norms
from strata.sycl_backend.kernels import topk as k_topk

REL = 2e-6      # fp32 sums of up to a few hundred terms, as the kernels' own tests
# delta_block's output: its gated RMSNorm divides each head's o = S^T q by the head's rms, so where S^T q cancels
# (rms 1e-4 against terms of 1e-2 in a draw found among 3000) fp32's rounding of o grows by that ratio; measured
# worst over 3000 draws: 4.9e-6 (the states, not normalised, stay within REL)
REL_NORMED = 2e-5


def close(got, want, what, rel=REL, terms=None):
    """max |got - want| <= rel x max |want|; or, for dot products, |got - want| <= rel x terms elementwise, where
    terms = |a| @ |b| is the sum of the products' magnitudes (a sum's rounding error scales with its terms, not with
    its value: one output that cancels to 5e-3 from terms summing to ~6 is no less exact than one that does not)."""
    got = np.asarray(dpnp.asnumpy(got) if isinstance(got, dpnp.ndarray) else got, np.float64)
    want = np.asarray(dpnp.asnumpy(want) if isinstance(want, dpnp.ndarray) else want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    if terms is not None:
        ratio = (np.abs(got - want) / np.maximum(terms, 1e-30)).max()
        assert ratio <= rel, f"{what}: max |diff| / sum of |terms| {ratio:.3e} > {rel}"
        return
    err = np.abs(got - want).max()
    scale = max(np.abs(want).max(), 1e-30)
    assert err <= rel * scale, f"{what}: max |diff| {err:.3e} > {rel} x {scale:.3e}"


def weight(ops, rng, shape, fmt):
    """(device weight as the backend stores it, its fp32 value on the host)."""
    w = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    if fmt == "bf16":
        wb = w.astype(ml_dtypes.bfloat16)
        return ops.to_device(wb), wb.astype(np.float32)
    return ops.to_device(w), w


def launches(ops, fn) -> int:
    with ops.count_launches() as c:
        fn()
    return c.device_launches


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("t", [1, 3])
def test_norm_linears_linears_and_linear_add(ops, rng, fmt, t):
    n = 96
    x = rng.standard_normal((t, n)).astype(np.float32) * 2
    scale = (rng.random(n) + 0.5).astype(np.float32)
    ws = [weight(ops, rng, (o, n), fmt) for o in (40, 7, 1, 65)]
    dx, dscale, dws = ops.to_device(x), ops.to_device(scale), [w for w, _ in ws]
    h, ys = ops.norm_linears(dx, dscale, 1e-6, dws)
    h0, ys0 = ComposedOps.norm_linears(ops, dx, dscale, 1e-6, dws)
    close(h, h0, "norm_linears h")
    want_h = k_norms.rms_norm_reference(x, scale, 1e-6)
    for i, ((_, w), y, y0) in enumerate(zip(ws, ys, ys0)):
        terms = np.abs(want_h) @ np.abs(w.T.astype(np.float64))             # [t, o]
        close(y, y0, f"norm_linears y{i} vs the composition", terms=terms)
        close(y, want_h @ w.T.astype(np.float64), f"norm_linears y{i} vs numpy", terms=terms)
    for i, (y, y0) in enumerate(zip(ops.linears(dx, dws[:3]), ComposedOps.linears(ops, dx, dws[:3]))):
        close(y, y0, f"linears y{i}", terms=np.abs(x.astype(np.float64)) @ np.abs(ws[i][1].T.astype(np.float64)))
    res = ops.to_device(rng.standard_normal((t, 40)).astype(np.float32))
    close(ops.linear_add(dx, dws[0], res), ComposedOps.linear_add(ops, dx, dws[0], res), "linear_add")
    if t == 1:
        assert launches(ops, lambda: ops.norm_linears(dx, dscale, 1e-6, dws)) == 1
        assert launches(ops, lambda: ops.linear_add(dx, dws[0], res)) == 1


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("terms", ["plain", "gate_and_add"])
def test_swiglu_out(ops, rng, fmt, t, terms):
    n, o = 72, 48
    g, u = (rng.standard_normal((t, n)).astype(np.float32) * 2 for _ in range(2))
    w, wf = weight(ops, rng, (o, n), fmt)
    res = rng.standard_normal((t, o)).astype(np.float32)
    add = rng.standard_normal((t, o)).astype(np.float32) if terms != "plain" else None
    gate = rng.standard_normal((t, 1)).astype(np.float32) * 3 if terms != "plain" else None
    dev = [None if a is None else ops.to_device(a) for a in (g, u, res, add, gate)]
    got = ops.swiglu_out(dev[0], dev[1], w, dev[2], add=dev[3], gate=dev[4])
    close(got, ComposedOps.swiglu_out(ops, dev[0], dev[1], w, dev[2], add=dev[3], gate=dev[4]), "swiglu_out")
    close(got, k_linear.swiglu_down_reference(g, u, wf, res, add, gate), "swiglu_out vs numpy", rel=1e-5)
    if t == 1:
        assert launches(ops, lambda: ops.swiglu_out(dev[0], dev[1], w, dev[2], add=dev[3], gate=dev[4])) == 1


@pytest.mark.parametrize("t,e,k", [(1, 64, 8), (3, 200, 10), (2, 16, 16)])
@pytest.mark.parametrize("renorm", [True, False])
def test_route(ops, rng, t, e, k, renorm):
    logits = rng.standard_normal((t, e)).astype(np.float32) * 3
    d = ops.to_device(logits)
    w, idx = ops.route(d, k, renorm)
    w0, idx0 = ComposedOps.route(ops, d, k, renorm)
    assert (dpnp.asnumpy(idx) == dpnp.asnumpy(idx0)).all()
    close(w, w0, "route weights vs the composition")
    wr, ir = k_topk.route_reference(logits, k, renorm)
    assert (dpnp.asnumpy(idx) == ir).all()
    close(w, wr, "route weights vs numpy")
    if t == 1:
        assert launches(ops, lambda: ops.route(d, k, renorm)) == 1


@pytest.mark.parametrize("t,n_valid", [(1, 1), (5, 3), (4, 0)])
def test_expert_slots(ops, rng, t, n_valid):
    e, k = 32, 6
    table = rng.permutation(100)[:e].astype(np.int32)
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    dt, di = ops.to_device(table), ops.to_device(idx)
    got = dpnp.asnumpy(ops.expert_slots(dt, di, np.int32(n_valid)))
    assert (got == k_topk.expert_slots_reference(table, idx, n_valid)).all()
    assert (got == dpnp.asnumpy(ComposedOps.expert_slots(ops, dt, di, np.int32(n_valid)))).all()


def kv_cache(ops, rng, shape, kv):
    """A layer's cache {"k", "v"} of random contents (int8: codes and scales), as device arrays."""
    k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    if kv == "f32":
        return {"k": ops.to_device(k), "v": ops.to_device(v)}
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    return {n: ops.to_device(a) for n, a in (("k", kq), ("v", vq), ("k_scale", ks), ("v_scale", vs))}


def copy_of(ops, kv):
    return {n: ops.to_device(dpnp.asnumpy(a)) for n, a in kv.items()}


def same_cache(got, want, what):
    """int8 codes equal but for rounding-boundary flips of one step (the kernel divides by the scale in OpenCL's
    single precision), scales and fp32 caches close."""
    for n in want:
        g, w = dpnp.asnumpy(got[n]), dpnp.asnumpy(want[n])
        if g.dtype == np.int8:
            diff = np.abs(g.astype(np.int32) - w)
            assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, f"{what} {n}: codes differ"
        else:
            close(g, w, f"{what} {n}")


ATT = dict(hq=4, hkv=2, hd=32, rot=8, cap=24)
# YaRN x4 over a 16-position window on a quarter of the head: scaled frequencies and a factor on cos and sin
ROPE = rope_for(ATT["hd"], ATT["rot"] / ATT["hd"], 10000.0, RopeScaling("yarn", 4.0, 16))


def attention_inputs(ops, rng, rows: int, gated: bool):
    """attention_block's projections and norms for `rows` rows, as device arrays: q, k, v, gate (None ungated),
    q_norm, k_norm."""
    hq, hkv, hd = ATT["hq"], ATT["hkv"], ATT["hd"]
    q = rng.standard_normal((rows, hq * hd)).astype(np.float32)
    k = rng.standard_normal((rows, hkv * hd)).astype(np.float32)
    v = rng.standard_normal((rows, hkv * hd)).astype(np.float32)
    gate = rng.standard_normal((rows, hq * hd)).astype(np.float32) if gated else None
    qn, kn = ((rng.random(hd) + 0.5).astype(np.float32) for _ in range(2))
    return [ops.to_device(a) if a is not None else None for a in (q, k, v, gate, qn, kn)]


@pytest.mark.parametrize("t,start,n_valid", [(1, 9, 1), (4, 0, 4), (5, 3, 2)])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("kv", ["f32", "int8"])
def test_attention_block(ops, rng, t, start, n_valid, gated, kv):
    args = attention_inputs(ops, rng, t, gated)
    cache = kv_cache(ops, rng, (ATT["cap"], ATT["hkv"], ATT["hd"]), kv)

    def run(fn, *lead):
        return fn(*lead, *args, 1e-6, copy_of(ops, cache), np.int32(start), np.int32(n_valid), ROPE)
    o, kv1 = run(ops.attention_block)
    o0, kv0 = run(ComposedOps.attention_block, ops)
    same_cache(kv1, kv0, "attention_block cache")
    o, o0 = dpnp.asnumpy(o), dpnp.asnumpy(o0)
    close(o[:n_valid], o0[:n_valid], "attention_block output (real rows)")
    if t == 1:
        assert launches(ops, lambda: run(ops.attention_block)) == 2


DELTA = dict(hk=2, hv=4, dk=16, dv=8, kw=4)


def delta_inputs(ops, rng, rows: int, states: tuple):
    """delta_block's inputs for `rows` rows: (device args qkv, z, b, a; device conv_w; device a_log, dt_bias, gnorm;
    host conv and ssm states with leading dims `states`)."""
    hk, hv, dk, dv, kw = (DELTA[n] for n in ("hk", "hv", "dk", "dv", "kw"))
    c = 2 * hk * dk + hv * dv
    qkv = rng.standard_normal((rows, c)).astype(np.float32)
    z = rng.standard_normal((rows, hv * dv)).astype(np.float32)
    b, a = (rng.standard_normal((rows, hv)).astype(np.float32) for _ in range(2))
    conv_w = (rng.standard_normal((c, kw)) * 0.5).astype(np.float32)
    a_log = np.log(rng.uniform(1, 16, hv)).astype(np.float32)
    dt_bias = rng.standard_normal(hv).astype(np.float32)
    gnorm = (rng.random(dv) + 0.5).astype(np.float32)
    conv = rng.standard_normal(states + (kw - 1, c)).astype(np.float32)
    ssm = (rng.standard_normal(states + (hv, dk, dv)) * 0.1).astype(np.float32)
    return ([ops.to_device(x) for x in (qkv, z, b, a)], ops.to_device(conv_w),
            [ops.to_device(x) for x in (a_log, dt_bias, gnorm)], conv, ssm)


@pytest.mark.parametrize("t,start,n_valid", [(1, 5, 1), (6, 0, 6), (7, 2, 4)])
def test_delta_block(ops, rng, t, start, n_valid):
    args, cw, rest, conv, ssm = delta_inputs(ops, rng, t, ())

    def run(fn, *lead):
        return fn(*lead, *args, ops.to_device(conv), cw, ops.to_device(ssm), *rest, 1e-6, np.int32(start),
                  np.int32(n_valid), DELTA["hk"])
    o, conv1, ssm1 = run(ops.delta_block)
    o0, conv0, ssm0 = run(ComposedOps.delta_block, ops)
    close(conv1, conv0, "delta_block conv state")
    close(ssm1, ssm0, "delta_block recurrent state")
    close(dpnp.asnumpy(o)[:n_valid], dpnp.asnumpy(o0)[:n_valid], "delta_block output (real rows)", rel=REL_NORMED)
    if t == 1:
        assert launches(ops, lambda: run(ops.delta_block)) == 3


@pytest.mark.parametrize("t,n_valid", [(1, 1), (5, 3)])
def test_gated_delta_raw_and_gated_rms_norm_kernels(ops, rng, t, n_valid):
    hk, hv, dk, dv = 2, 6, 16, 8
    u = rng.standard_normal((t, 2 * hk * dk + hv * dv)).astype(np.float32)
    b, a = (rng.standard_normal((t, hv)).astype(np.float32) * 4 for _ in range(2))
    a_log = np.log(rng.uniform(1, 16, hv)).astype(np.float32)
    dt_bias = rng.standard_normal(hv).astype(np.float32)
    state = (rng.standard_normal((hv, dk, dv)) * 0.1).astype(np.float32)
    inputs = k_gdn.delta_inputs_reference(u, b, a, a_log, dt_bias, hk, dk, dv, n_valid)
    want_o, want_state = k_gdn.gated_delta_reference(*inputs, state)
    dstate = ops.to_device(state)
    o, dstate = k_gdn.gated_delta_raw(ops.kernels, *(ops.to_device(x) for x in (u, b, a, a_log, dt_bias)), dstate,
                                      hk, dk, dv, n_valid)
    close(o, want_o, "gated_delta_raw output", rel=1e-5)
    close(dstate, want_state, "gated_delta_raw state", rel=1e-5)
    x, z = (rng.standard_normal((t, hv, dv)).astype(np.float32) * 2 for _ in range(2))
    scale = (rng.random(dv) + 0.5).astype(np.float32)
    close(k_norms.gated_rms_norm(ops.kernels, ops.to_device(x), ops.to_device(z), ops.to_device(scale), 1e-6),
          k_norms.gated_rms_norm_reference(x, z, scale, 1e-6), "gated_rms_norm")


# --- rows mode (a decode window: one token of each of S sequences, each on its own state)

def rows_of(rng, s, cap):
    """Positions and active flags of a window of s rows: one row at position 0 (a fresh sequence), one inactive row
    (at the scratch position cap - 1), the rest anywhere."""
    pos = rng.integers(1, cap - 1, s).astype(np.int32)
    active = np.ones(s, np.int32)
    pos[0] = 0
    if s > 1:
        pos[-1], active[-1] = cap - 1, 0
    return pos, active


@pytest.mark.parametrize("s", [1, 3])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("kv", ["f32", "int8"])
def test_attention_block_rows(ops, rng, s, gated, kv):
    args = attention_inputs(ops, rng, s, gated)
    cache = kv_cache(ops, rng, (s, ATT["cap"], ATT["hkv"], ATT["hd"]), kv)
    pos, active = rows_of(rng, s, ATT["cap"])

    def run(fn, *lead):
        return fn(*lead, *args, 1e-6, copy_of(ops, cache), pos, active, ROPE)
    o, kv1 = run(ops.attention_block)
    o0, kv0 = run(ComposedOps.attention_block, ops)         # row by row, through the one-sequence kernels
    same_cache(kv1, kv0, "attention_block rows: caches")
    real = active > 0
    close(dpnp.asnumpy(o)[real], dpnp.asnumpy(o0)[real], "attention_block rows: output (active rows)")
    assert launches(ops, lambda: run(ops.attention_block)) == 2      # the rows were uploaded by the first call


@pytest.mark.parametrize("kv", ["f32", "int8"])
def test_attention_block_rows_on_bank_slots(ops, rng, kv):
    """A window of fewer rows than the bank (SLOTS: row b on bank row slots[b]): the rows' outputs and caches are
    those of the same rows on caches of their own, and the bank's other rows are left as they were."""
    args = attention_inputs(ops, rng, 2, True)
    bank = kv_cache(ops, rng, (4, ATT["cap"], ATT["hkv"], ATT["hd"]), kv)
    slots = np.array([3, 1], np.int32)
    pos, active = np.array([5, 11], np.int32), np.ones(2, np.int32)
    own = {n: ops.take_rows(copy_of(ops, bank)[n], slots) for n in bank}
    o0, kv0 = ops.attention_block(*args, 1e-6, own, pos, active, ROPE)
    o, kv1 = ops.attention_block(*args, 1e-6, {**copy_of(ops, bank), SLOTS: ops.to_device(slots)}, pos, active, ROPE)
    assert SLOTS not in kv1
    close(dpnp.asnumpy(o), dpnp.asnumpy(o0), "attention_block on bank slots: output")
    same_cache({n: ops.take_rows(a, slots) for n, a in kv1.items()}, kv0, "attention_block on bank slots: rows")
    same_cache({n: ops.take_rows(a, np.array([0, 2])) for n, a in kv1.items()},
               {n: ops.take_rows(a, np.array([0, 2])) for n, a in bank.items()}, "the bank's other rows")


@pytest.mark.parametrize("s", [1, 4])
def test_delta_block_rows(ops, rng, s):
    args, cw, rest, conv, ssm = delta_inputs(ops, rng, s, (s,))
    pos, active = rows_of(rng, s, 32)

    def run(fn, *lead):
        return fn(*lead, *args, ops.to_device(conv), cw, ops.to_device(ssm), *rest, 1e-6, pos, active, DELTA["hk"])
    o, conv1, ssm1 = run(ops.delta_block)
    o0, conv0, ssm0 = run(ComposedOps.delta_block, ops)
    close(conv1, conv0, "delta_block rows: conv states")
    close(ssm1, ssm0, "delta_block rows: recurrent states")
    real = active > 0
    close(dpnp.asnumpy(o)[real], dpnp.asnumpy(o0)[real], "delta_block rows: output (active rows)", rel=REL_NORMED)
    if s > 1:   # the inactive row's states are untouched
        assert (dpnp.asnumpy(ssm1)[-1] == ssm[-1]).all() and (dpnp.asnumpy(conv1)[-1] == conv[-1]).all()
    assert launches(ops, lambda: run(ops.delta_block)) == 3          # the rows were uploaded by the first call


def test_expert_slots_rows_and_one_upload_per_window(ops, rng):
    e, k, s = 32, 6, 4
    table = rng.permutation(100)[:e].astype(np.int32)
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(s)]).astype(np.int32)
    active = np.array([1, 0, 1, 1], np.int32)
    dt, di = ops.to_device(table), ops.to_device(idx)
    got = dpnp.asnumpy(ops.expert_slots(dt, di, active))
    want = np.where(active[:, None] > 0, table[idx], -1)
    assert (got == want).all()
    assert (got == dpnp.asnumpy(ComposedOps.expert_slots(ops, dt, di, active))).all()
    # a window's layers pass the same rows: the rows go to the device once, and new values are uploaded again
    pos = np.array([5, 9, 2, 7], np.int32)
    with ops.count_launches() as c:
        r1 = ops._rows(pos, active)
        r2 = ops._rows(pos.copy(), active.copy())
        ops.expert_slots(dt, di, active)
    assert r1 is r2 and c.uploads == 1
    r3 = ops._rows(pos + 1, active)
    assert r3 is not r1 and (dpnp.asnumpy(r3) == np.stack([pos + 1, active])).all()
