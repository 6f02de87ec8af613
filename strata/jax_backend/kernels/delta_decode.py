"""The Gated DeltaNet mixer's decode step as ONE Pallas kernel: from the layer's projections (qkv before the causal
conv, z, b, a) to the gated output before out_proj, for S sequences of one token each, the recurrent state updated
in place. It is strata/backend.py's delta_block in rows mode (the definition), fused.

Why: in a decode window XLA runs that composition as a chain of small kernels per layer: the conv and its state
shift, the l2 norms, the gates, the state's decay, the S^T k and S^T q reductions and the update, the gated RMSNorm.
On the H200 a decode window's layers spent ~40 us each in ~20 kernels of 1-3 us (norms, the causal conv, the delta
rule's step, routing, gates, residuals: bench/results/launch_probe_rows_h200.json), bound by their count, not their
bytes; the delta rule's own floor at batch 1 is its fp32 state read and written, 4.2 MB per layer, 1.2 us. One
kernel for the mixer leaves the projections before it and out_proj after it.

Program (sequence s, value head h) - the head's whole state [dk, dv] in registers (64 KB at dk = dv = 128, 8 warps:
64 fp32 elements a thread, the shape gated_delta.py's v2 decode kernel uses from 4 sequences up), because the gated
RMSNorm at the end needs the head's whole output. Grid S x Hv: 32 programs at batch 1 on an H200's 132 SMs, each
streaming 128 KB (its state in and out); 512 at batch 16. Per program:
- the causal conv (kernel K, its state the last K-1 inputs) + SiLU over the channels this head reads: q and k of its
  key head hk = h // r (r = Hv / Hk value heads share a key head) and v of head h; computed in fp32 and rounded to
  the activation dtype, as the composition's conv runs in it;
- q, k l2-normed (q times dk^-0.5), beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), both 0 on an inactive
  row (which leaves the state unchanged); a row at position 0 starts from empty conv and recurrent states;
- the gated delta rule's step on the state (gated_delta._step, fp32);
- the gated RMSNorm with gnorm and silu(z), rounded to z's dtype where the composition rounds.
The new conv state goes to a separate buffer (not in place): the r programs of a key head read its q/k channels'
old rows, and only the first of them (h % r == 0) writes their new rows, so no program can read a row another has
already overwritten. The recurrent state is updated in place (input_output_aliases; each program owns its head's).

Backend: Pallas' Triton backend (verified on the H200, interpretable on the CPU in every JAX version we run). Every
load and store is a vector of dk, dv or one of the K-1 conv rows' channels (powers of two) or a scalar; dk and dv
must be powers of two (else a ValueError, and the backend runs the composition).

MEASURED on the H200 (bench/kernel_speed.py delta_decode, 35253ad, Qwen3-Next shapes; kernel_speed_decode_h200_
35253ad.json): 18.8 us at 1 row against the XLA composition's 10.9, 22.3 / 12.6 at 4, 48.7 / 18.3 at 16 (39% of
the HBM bound). Predicted ~3-5 us against ~20 us of XLA's small launches: XLA's chain took 11 us, not 20, and each
of this kernel's 32 programs (one per value head) walks the conv, the norms and its 64 KB state alone on an SM, in
series. So kernels "auto" does not take it (PALLAS_AUTO); "pallas" does. What would change that: more programs per
head (split dv across programs, the state read by several SMs at once) and the conv and norms done once per
sequence rather than per value head.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from strata.jax_backend.kernels import triton_params
from strata.jax_backend.kernels.gated_delta import _pow2, _step
from strata.reference import gated_delta as _gated_delta_reference

_F32 = jnp.float32
_PER_THREAD = 64         # fp32 state elements a thread holds (num_warps = dk * dv / (32 * this), at most 8)


def _kernel(start_ref, valid_ref, b_ref, a_ref, alog_ref, dtb_ref, qkv_ref, cs_ref, w_ref, z_ref, gnorm_ref,
            s_in_ref, o_ref, cs_out_ref, s_ref, *, hk: int, dk: int, dv: int, r: int, eps: float):
    s, h = pl.program_id(0), pl.program_id(1)
    kh = h // r
    taps = w_ref.shape[1]                                   # K
    act = qkv_ref.dtype
    fresh = start_ref[s] <= 0                               # a sequence at position 0: empty states
    on = valid_ref[s] > 0                                   # an inactive row leaves every state as it was

    def conv(c0: int | jax.Array, n: int):
        """Channels c0 .. c0 + n - 1: (silu(conv) rounded to the activation dtype, as f32 [n]; the new conv rows)."""
        old = [jnp.where(fresh, jnp.zeros((n,), cs_ref.dtype), cs_ref[s, i, pl.ds(c0, n)])
               for i in range(taps - 1)]                                               # K-1 x [n]
        ext = old + [qkv_ref[s, pl.ds(c0, n)].astype(cs_ref.dtype)]                    # the last K inputs
        y = sum(ext[i].astype(_F32) * w_ref[pl.ds(c0, n), i].astype(_F32) for i in range(taps))
        y = (y * jax.nn.sigmoid(y)).astype(act).astype(_F32)
        new = [jnp.where(on, ext[i + 1], old[i]) for i in range(taps - 1)]
        return y, new

    def store_conv(c0, rows):
        for i, row in enumerate(rows):
            cs_out_ref[s, i, pl.ds(c0, row.shape[0])] = row

    q, q_rows = conv(kh * dk, dk)
    k, k_rows = conv(hk * dk + kh * dk, dk)
    v_c0 = 2 * hk * dk + h * dv
    v, v_rows = conv(v_c0, dv)
    store_conv(v_c0, v_rows)

    @pl.when(h % r == 0)                                    # one writer for the key head's q/k channels
    def _():
        store_conv(kh * dk, q_rows)
        store_conv(hk * dk + kh * dk, k_rows)

    q = q * lax.rsqrt(jnp.sum(q * q) + 1e-6) * (dk ** -0.5)
    k = k * lax.rsqrt(jnp.sum(k * k) + 1e-6)
    b = b_ref[s, h]
    beta = jnp.where(on, jax.nn.sigmoid(b.astype(_F32)).astype(b.dtype).astype(_F32), 0.0)
    x = a_ref[s, h].astype(_F32) + dtb_ref[h]
    softplus = jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))
    g = jnp.where(on, -jnp.exp(alog_ref[h]) * softplus, 0.0)
    state = jnp.where(fresh, jnp.zeros((dk, dv), _F32), s_in_ref[...])
    state, o = _step(state, q, k, v, g, beta)                                          # [dk, dv], [dv]
    s_ref[...] = state
    # gated RMSNorm per head: w * x_hat in the activation dtype, times silu(z) in fp32 (ComposedOps.delta_block)
    zt = z_ref.dtype
    o = o.astype(zt).astype(_F32)
    o = (o * lax.rsqrt(jnp.mean(o * o) + eps) * gnorm_ref[...].astype(_F32)).astype(zt).astype(_F32)
    z = z_ref[...].astype(_F32)
    o_ref[...] = (o * (z * jax.nn.sigmoid(z))).astype(o_ref.dtype)


def check(qkv, conv_state, ssm, n_k_heads: int) -> None:
    """The shapes the kernel takes (a ValueError names what it does not)."""
    n, hv, dk, dv = ssm.shape
    if ssm.dtype != _F32:
        raise ValueError(f"the recurrent state must be float32, not {ssm.dtype}")
    if not (_pow2(dk) and _pow2(dv)):
        raise ValueError(f"dk = {dk} and dv = {dv} must be powers of two: Triton block shapes")
    if hv % n_k_heads:
        raise ValueError(f"{hv} value heads are not a multiple of {n_k_heads} key heads")
    c = 2 * n_k_heads * dk + hv * dv
    if qkv.shape != (n, c) or conv_state.shape[0] != n or conv_state.shape[2] != c:
        raise ValueError(f"qkv [{n}, {c}] and conv_state [{n}, K-1, {c}] expected, got {list(qkv.shape)} and "
                         f"{list(conv_state.shape)}")


@functools.partial(jax.jit, static_argnames=("n_k_heads", "eps", "interpret"))
def delta_decode(qkv, z, b, a, conv_state, conv_w, ssm, a_log, dt_bias, gnorm, start, n_valid, *, n_k_heads: int,
                 eps: float, interpret: bool = False):
    """One decode token of each of S sequences through the Gated DeltaNet mixer (ComposedOps.delta_block, rows mode).

    qkv [S, C] (the projection, before the conv; C = 2 Hk dk + Hv dv), z [S, Hv * dv], b, a [S, Hv] in the
    activation dtype; conv_state [S, K-1, C]; conv_w [C, K]; ssm [S, Hv, dk, dv] float32 (donate it: updated in
    place); a_log, dt_bias [Hv] float32; gnorm [dv]; start, n_valid [S] int32 (position of each row's token; 0: an
    inactive row). -> (o [S, Hv * dv] in z's dtype, conv_state [S, K-1, C], ssm)."""
    check(qkv, conv_state, ssm, n_k_heads)
    n, hv, dk, dv = ssm.shape
    row = lambda d: pl.BlockSpec((None, d), lambda s, h: (s, h))             # noqa: E731  head h's d values of row s
    kernel = functools.partial(_kernel, hk=n_k_heads, dk=dk, dv=dv, r=hv // n_k_heads, eps=eps)
    whole = pl.no_block_spec
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((n, hv * dv), z.dtype), jax.ShapeDtypeStruct(conv_state.shape,
                                                                                       conv_state.dtype),
                   jax.ShapeDtypeStruct(ssm.shape, _F32)),
        grid=(n, hv),
        in_specs=[whole] * 9 + [row(dv), whole,
                                pl.BlockSpec((None, None, dk, dv), lambda s, h: (s, h, 0, 0))],
        out_specs=(row(dv), whole, pl.BlockSpec((None, None, dk, dv), lambda s, h: (s, h, 0, 0))),
        input_output_aliases={11: 2},
        interpret=interpret,
        **triton_params(interpret, num_warps=min(8, max(1, dk * dv // (32 * _PER_THREAD))), num_stages=1),
    )(start.astype(jnp.int32), n_valid.astype(jnp.int32), b, a, a_log.astype(_F32), dt_bias.astype(_F32), qkv,
      conv_state, conv_w, z, gnorm, ssm)


def _round(x, dtype):
    """float64 x rounded to dtype's precision (float32 or bfloat16), back in float64."""
    dt = ml_dtypes.bfloat16 if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16) else np.float32
    return np.asarray(x, np.float64).astype(np.float32).astype(dt).astype(np.float64)


def _reference(qkv, z, b, a, conv_state, conv_w, ssm, a_log, dt_bias, gnorm, start, n_valid, n_k_heads, eps):
    """numpy, float64 between the points where the kernel (and the composition) round to the activation dtype: the
    conv's output, sigmoid(b), o before and after the RMSNorm, the gated output. -> (o [S, Hv * dv] float64,
    conv_state, ssm float64)."""
    act, zt, bt = (np.asarray(x).dtype for x in (qkv, z, b))
    n, hv, dk, dv = ssm.shape
    hk, r = n_k_heads, hv // n_k_heads
    f = lambda x: np.asarray(x, np.float64)                                  # noqa: E731
    qkv, z, b, a, conv_state, conv_w, ssm, a_log, dt_bias, gnorm = map(f, (qkv, z, b, a, conv_state, conv_w, ssm,
                                                                            a_log, dt_bias, gnorm))
    o_all = np.zeros((n, hv * dv))
    cs_all, ssm_all = conv_state.copy(), ssm.copy()
    for s in range(n):
        fresh, on = start[s] <= 0, n_valid[s] > 0
        old = np.zeros_like(conv_state[s]) if fresh else conv_state[s]
        ext = np.concatenate([old, qkv[s][None]])                            # [K, C]
        y = (ext * conv_w.T).sum(0)
        u = _round(y / (1 + np.exp(-y)), act)                                # [C]
        cs_all[s] = ext[1:] if on else old
        q = u[:hk * dk].reshape(hk, dk)
        k = u[hk * dk:2 * hk * dk].reshape(hk, dk)
        v = u[2 * hk * dk:].reshape(hv, dv)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * dk ** -0.5
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        q, k = np.repeat(q, r, axis=0), np.repeat(k, r, axis=0)
        beta = _round(1 / (1 + np.exp(-b[s])), bt) if on else np.zeros(hv)
        g = -np.exp(a_log) * np.logaddexp(a[s] + dt_bias, 0.0) if on else np.zeros(hv)
        o, S = _gated_delta_reference(q[None], k[None], v[None], g[None], beta[None],
                                      np.zeros((hv, dk, dv)) if fresh else ssm[s])
        o = _round(o[0], zt)
        o = _round(o / np.sqrt((o * o).mean(-1, keepdims=True) + eps) * gnorm, zt)
        zs = z[s].reshape(hv, dv)
        o_all[s] = _round(o * zs / (1 + np.exp(-zs)), zt).reshape(-1)
        ssm_all[s] = S
    return o_all, cs_all, ssm_all
