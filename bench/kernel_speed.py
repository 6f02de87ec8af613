"""Per-kernel speed against its floor (issue 4): time, bytes moved, FLOPs, and the fraction of the H200's measured
HBM rate (3.6 TB/s read+write, ../shared/notes/pallas-gpu.md) or bf16 matmul rate each kernel reaches, beside the XLA
op it replaces. Each kernel's output is checked against that XLA op (and the XLA op against the float64 reference
where one is cheap) on the same inputs before it is timed.

    python bench/kernel_speed.py            # GPU: Qwen3-Next-80B-A3B shapes
    python bench/kernel_speed.py --smoke    # the same code on a CPU in Pallas interpret mode, tiny shapes

Kernels (strata/jax_backend/kernels/):
- expert_decode: the decode expert op over int4 blobs (dequantized in the kernel) at 1, 2, 4 and 16 tokens of 10
  routes, over rows and warps a program, against experts.experts_from_pool's gather form;
- expert_grouped: the prompt-part expert op (a grouped GEMM over routes sorted by expert, weights dequantized in the
  kernel) at 512 and 4096 tokens, int4 and bf16 blobs, against experts_from_pool's grouped form;
- decode_attention: attention of 1 (decode) or 4 (verify) query positions per row over int8 and bf16 KV caches at
  4K and 32K context, batch 1, 4 and 16, against decode_attention_xla;
- prompt_attention: the flash kernel for a prompt part of 4096 tokens over an int8 cache, in several block / warp /
  P-term configurations, against the backend's XLA form;
- expert_grouped_blocks: the grouped int4 v2 op at 4096 tokens with 64 and 128 rows per block;
- route: the router's softmax, top-k and renormalisation in one kernel at 1, 16 and 4096 rows, against the composition.
And the backend's XLA form of the gated delta rule for a prompt part (gated_delta_chunked: 4096 tokens) at other
chunks and matmul precisions than its defaults, against those.

Times are device time per call: the call runs `LOOP` times inside one jitted loop (each iteration's input depends on
the last output, so nothing is hoisted), so dispatch does not hide a kernel of a few microseconds.
"""
from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402
from strata.experts.synthetic import SyntheticStore  # noqa: E402

HBM_BYTES_PER_S = 3.6e12      # measured on the H200 this project uses (read + write)
BF16_FLOPS = 790e12           # the H200's dense bf16 rate (the device README)
LOOP = 20
CHUNKED_LOOP = 3


def device_seconds(fn, args: tuple, dep: int, repeat: int, carry=None, loop: int = LOOP, indexed: bool = False) -> float:
    """Seconds per call of fn(*args), from `loop` chained calls inside one jitted function, written out (a while loop
    would read its predicate back to the host every iteration). Call i + 1 takes carry(output of call i) as
    args[dep]; by default args[dep] + 0 * (the output's first element), for a float args[dep]. A call that returns
    a new state (the gated delta rule's) passes carry = that state, so the chain runs the recurrence on. indexed:
    fn(i, *args) for call i (a case that reads different data each call, so that its bytes come from HBM, not from
    the 50 MB L2 the previous call filled)."""
    import jax
    run = chained(fn, dep, carry, loop, indexed)
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)) / loop


def chained(fn, dep: int, carry=None, loop: int = LOOP, indexed: bool = False):
    """The jitted function of device_seconds: `loop` calls of fn written out, each taking the previous one's output
    through args[dep] (carry, or args[dep] + 0 * its first element)."""
    import jax
    import jax.numpy as jnp

    def chain(out, a_dep):
        first = jax.tree_util.tree_leaves(out)[0].reshape(-1)[0].astype(jnp.float32)
        return a_dep + (first * 0).astype(a_dep.dtype)

    def looped(*a):
        a_dep = a[dep]
        for i in range(loop):
            out = (fn(i, *a[:dep], a_dep, *a[dep + 1:]) if indexed else fn(*a[:dep], a_dep, *a[dep + 1:]))
            a_dep = carry(out) if carry is not None else chain(out, a_dep)
        return a_dep

    return jax.jit(looped)


def kernel_trace(fn, args: tuple) -> dict:
    """fn(i, *args)'s LOOP chained calls (device_seconds' chain, args[0] carried) run under the profiler: per
    thread of the trace, its kernels by count and total time (trace_summary), printed."""
    import jax
    from trace_summary import print_summary, trace_summary
    run = chained(fn, 0, indexed=True)
    summary = trace_summary(lambda: jax.block_until_ready(run(*args)), top=8)
    print_summary(summary, min_span_ms=0.0)
    return summary


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def row(name: str, t_ker: float, t_xla: float, nbytes: float, flops: float, err: float, **extra) -> dict:
    r = {"case": name, **extra, "kernel_us": 1e6 * t_ker, "xla_us": 1e6 * t_xla, "bytes": nbytes, "flops": flops,
         "floor_us": 1e6 * max(nbytes / HBM_BYTES_PER_S, flops / BF16_FLOPS),
         "kernel_fraction_of_hbm": nbytes / t_ker / HBM_BYTES_PER_S, "kernel_tflops": flops / t_ker / 1e12,
         "kernel_fraction_of_bf16": flops / t_ker / BF16_FLOPS, "speedup_vs_xla": t_xla / t_ker,
         "kernel_vs_xla_rel_err": err}
    bound = "HBM" if nbytes / HBM_BYTES_PER_S >= flops / BF16_FLOPS else "bf16 rate"
    frac = r["kernel_fraction_of_hbm"] if bound == "HBM" else r["kernel_fraction_of_bf16"]
    r["bound"], r["fraction_of_bound"] = bound, frac
    print(f"{name}: kernel {r['kernel_us']:.1f} us, XLA {r['xla_us']:.1f} us ({r['speedup_vs_xla']:.1f}x), floor "
          f"{r['floor_us']:.1f} us ({nbytes / 1e6:.1f} MB, {flops / 1e9:.2f} GFLOP): {100 * frac:.0f}% of the "
          f"{bound} bound; kernel vs XLA relative error {err:.1e}", flush=True)
    return r


def expert_decode(hidden, inter, n_slots, tokens, k, repeat, interpret, cases=None, trace=()):
    """int4 over (rows, warps) a program; the pool capped under 2^31 bytes (a larger one is read through compacted
    copies, timed elsewhere). cases: the (block, warps) list instead of the default. trace: (block, warps) cases
    whose chained calls are also run under the profiler, with XLA's form: each kernel's count and time
    (trace_summary)."""
    import jax
    import jax.numpy as jnp

    from strata.jax_backend.kernels.expert_decode import MAX_KERNEL_POOL_BYTES, experts_decode
    from strata.jax_backend.kernels.experts import experts_from_pool
    rows, traced = [], {}
    store = SyntheticStore("int4", hidden, inter, 1, n_slots, distinct=min(64, n_slots))
    lay = store.layout
    n = min(n_slots, MAX_KERNEL_POOL_BYTES // lay.nbytes)
    pool = jax.device_put(np.stack([store.blob(0, e) for e in range(n)]))
    cases = cases or [(4, 4), (8, 4), (16, 4), (8, 8), (16, 8), (32, 8)]
    rng = np.random.default_rng(0)
    for t in tokens:
        # call i of the chain reads routes_i: LOOP draws, so that the blobs come from HBM as in an engine's window
        # (48 layers, different experts each), not from the L2 the previous call filled
        slots_all = [jnp.asarray(np.stack([rng.choice(n, k, replace=False) for _ in range(t)]).astype(np.int32))
                     for _ in range(LOOP)]
        slots = slots_all[0]
        weight = jnp.asarray(rng.random((t, k)).astype(np.float32))
        x = jnp.asarray(rng.standard_normal((t, hidden)).astype(np.float32), jnp.bfloat16)
        def call_i(op):         # call i of a chain: op over routes_i
            return lambda i, x, p: op(p, x, slots_all[i], weight)
        xla = partial(experts_from_pool, lay, max_distinct=n)
        t_xla = device_seconds(call_i(xla), (x, pool), 0, repeat, indexed=True)
        want = xla(pool, x, slots, weight).astype(jnp.float32)
        distinct = np.mean([len(np.unique(np.asarray(s))) for s in slots_all])
        if trace:
            traced[f"xla, {t} token(s)"] = kernel_trace(call_i(xla), (x, pool))
        for block, warps in cases:
            ker = partial(experts_decode, lay, interpret=interpret, block=block, warps=warps)
            err = rel_err(ker(pool, x, slots, weight).astype(jnp.float32), want)
            t_ker = device_seconds(call_i(ker), (x, pool), 0, repeat, indexed=True)
            if (block, warps) in trace:
                traced[f"block {block} warps {warps}, {t} token(s)"] = kernel_trace(call_i(ker), (x, pool))
            rows.append(row(f"expert decode int4 block {block} warps {warps}, {t} token(s) x {k} routes", t_ker,
                            t_xla, distinct * lay.nbytes, 2 * 3 * t * k * hidden * inter, err, fmt="int4", tokens=t,
                            routes=t * k, distinct_experts=distinct, block=block, warps=warps,
                            routes_vary_per_call=True))
    return {"cases": rows, "traces": traced} if trace else rows


def expert_grouped(hidden, inter, n_experts, tokens, k, repeat, interpret,
                   cases=(("int4", "v1"), ("int4", "v2"), ("bf16", "v1"))):
    import jax
    import jax.numpy as jnp

    from strata.jax_backend.kernels import expert_grouped as K
    from strata.jax_backend.kernels.experts import experts_from_pool
    rows, rng = [], np.random.default_rng(1)
    for case in cases:                         # (format, variant) or (format, variant, block_m)
        fmt, variant = case[:2]
        block_m = case[2] if len(case) > 2 else K.BLOCK_M
        store = SyntheticStore(fmt, hidden, inter, 1, n_experts, distinct=min(64, n_experts))
        lay = store.layout
        pool = jax.device_put(np.stack([store.blob(0, e) for e in range(n_experts)]))
        for t in tokens:
            slots = jnp.asarray(np.stack([rng.choice(n_experts, k, replace=False) for _ in range(t)]).astype(np.int32))
            weight = jnp.asarray(rng.random((t, k)).astype(np.float32))
            x = jnp.asarray(rng.standard_normal((t, hidden)).astype(np.float32), jnp.bfloat16)
            ker = partial(K.experts_grouped, lay, interpret=interpret, max_distinct=n_experts, variant=variant,
                          block_m=block_m)
            xla = partial(experts_from_pool, lay, max_distinct=n_experts)
            err = rel_err(ker(pool, x, slots, weight).astype(jnp.float32),
                          xla(pool, x, slots, weight).astype(jnp.float32))
            t_ker = device_seconds(lambda x, p: ker(p, x, slots, weight), (x, pool), 0, repeat)
            t_xla = device_seconds(lambda x, p: xla(p, x, slots, weight), (x, pool), 0, repeat)
            distinct = len(np.unique(np.asarray(slots)))
            nbytes = distinct * lay.nbytes + 2 * t * hidden * 2            # active blobs + x in and y out (bf16)
            compacted = pool.size >= K.MAX_KERNEL_POOL_BYTES
            rows.append(row(f"expert grouped {fmt} {variant}, block_m {block_m}, {t} tokens x {k} routes"
                            + (" (pool over 2 GiB: compacted)" if compacted else ""), t_ker, t_xla, nbytes,
                            2 * 3 * t * k * hidden * inter, err, fmt=fmt, variant=variant, tokens=t,
                            distinct_experts=distinct, pool_bytes=int(pool.size), compacted=compacted,
                            block_m=block_m))
        del pool
    return rows


def pool_over_4gib(hidden, inter, n_experts, tokens, k, repeat, interpret):
    """Whether the kernels read a pool over 4 GiB directly (they do not compact it): JAX's Triton lowering computes a
    ref's offsets in 64 bits above 2^32 bytes, in int32 below (so 2^31 .. 2^32 is the range that needs compaction)."""
    import jax
    import jax.numpy as jnp

    from strata.jax_backend.kernels import expert_grouped as K
    from strata.jax_backend.kernels.expert_decode import experts_decode
    from strata.jax_backend.kernels.experts import experts_from_pool
    store = SyntheticStore("int4", hidden, inter, 1, 64)
    lay = store.layout
    n = (4 << 30) // lay.nbytes + 64                                           # just over 4 GiB of int4 blobs
    pool = jax.device_put(np.concatenate([np.stack([store.blob(0, e) for e in range(64)])] * (-(-n // 64)))[:n])
    assert not K.needs_compaction(pool.size)
    rng = np.random.default_rng(5)
    out = {"pool_bytes": int(pool.size)}
    for t in tokens:
        # slots near the end of the pool: offsets past 2^32 bytes
        slots = jnp.asarray(np.stack([rng.choice(np.arange(n - 512, n), k, replace=False)
                                      for _ in range(t)]).astype(np.int32))
        weight = jnp.asarray(rng.random((t, k)).astype(np.float32))
        x = jnp.asarray(rng.standard_normal((t, hidden)).astype(np.float32), jnp.bfloat16)
        ref = experts_from_pool(lay, pool, x, slots, weight, 512).astype(jnp.float32)
        fn = (partial(experts_decode, lay, interpret=interpret) if t * k <= 64 else
              partial(K.experts_grouped, lay, interpret=interpret, max_distinct=512))
        err = rel_err(fn(pool, x, slots, weight).astype(jnp.float32), ref)
        out[f"{t}_tokens_rel_err"] = err
        print(f"pool of {pool.size / 2 ** 30:.2f} GiB read directly, {t} tokens: kernel vs XLA relative error "
              f"{err:.1e}", flush=True)
    return out


def decode_attention(hq, hkv, hd, contexts, batches, queries, repeat, interpret, splits=(None,), kvs=("int8", "bf16")):
    """The split-K kernel against XLA's form; splits: n_splits values to time (None: the module's choice)."""
    import jax
    import jax.numpy as jnp

    from strata.jax_backend.kernels.decode_attention import decode_attention as ker, decode_attention_xla as xla
    from strata.backend import quantize_kv
    rows, rng = [], np.random.default_rng(2)
    for kv in kvs:
        for ctx in contexts:
            for s in batches:
                for nq in queries:
                    cap = ctx + 64
                    key = jax.random.key(ctx + 7 * s + nq)            # on the device: GBs of random keys fast
                    k = jax.random.normal(key, (s, cap, hkv, hd), jnp.float32)
                    v = jax.random.normal(jax.random.fold_in(key, 1), (s, cap, hkv, hd), jnp.float32)
                    if kv == "int8":
                        (kc, ks), (vc, vs) = quantize_kv(jnp, k), quantize_kv(jnp, v)
                        per_token = 2 * hkv * (hd + 4)
                    else:
                        kc, vc = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
                        ks = vs = None
                        per_token = 2 * hkv * hd * 2
                    del k, v
                    q = jnp.asarray(rng.standard_normal((s, nq, hq, hd)).astype(np.float32), jnp.bfloat16)
                    pos = jnp.asarray(np.full(s, ctx - nq, np.int32))
                    f_xla = partial(xla, scale=hd ** -0.5)
                    want = f_xla(q, kc, vc, ks, vs, pos).astype(jnp.float32)
                    t_xla = device_seconds(lambda q: f_xla(q, kc, vc, ks, vs, pos), (q,), 0, repeat)
                    nbytes = s * ctx * per_token + 2 * q.size * 2
                    flops = 4 * s * nq * hq * hd * ctx
                    for n in splits:
                        f_ker = partial(ker, scale=hd ** -0.5, interpret=interpret, n_splits=n)
                        err = rel_err(f_ker(q, kc, vc, ks, vs, pos).astype(jnp.float32), want)
                        t_ker = device_seconds(lambda q: f_ker(q, kc, vc, ks, vs, pos), (q,), 0, repeat)
                        rows.append(row(f"decode attention {kv} KV, {ctx} context, batch {s}, {nq} quer"
                                        f"{'y' if nq == 1 else 'ies'}, {n or 'default'} splits", t_ker, t_xla,
                                        nbytes, flops, err, kv=kv, context=ctx, batch=s, queries=nq, n_splits=n))
    return rows


def prompt_attention(hq, hkv, hd, tokens, configs, repeat, interpret, offsets=(0,)):
    """A prompt part of T tokens at position `offset` (causal: query t sees keys 0..offset + t; a follow-up turn or
    a long prompt's later part) over an int8 cache, by the flash kernel in each config (block_q, num_warps,
    p_terms) against the backend's XLA form. FLOPs are QK and PV over the visible keys (the kernel's masked
    diagonal blocks and extra P.V terms not counted); bytes, the cache read once."""
    import jax
    import jax.numpy as jnp

    from strata.jax_backend.backend import JaxBackend
    from strata.jax_backend.kernels.decode_attention import prompt_attention as ker
    from strata.backend import quantize_kv
    rows, rng = [], np.random.default_rng(4)
    for t, offset in ((t, o) for t in tokens for o in offsets):
        cap = offset + t + 64
        key = jax.random.key(t)
        (kc, ks), (vc, vs) = (quantize_kv(jnp, jax.random.normal(jax.random.fold_in(key, i), (cap, hkv, hd)))
                              for i in (0, 1))
        q = jnp.asarray(rng.standard_normal((t, hq, hd)).astype(np.float32), jnp.bfloat16)
        q_pos = offset + jnp.arange(t, dtype=jnp.int32)
        f_xla = jax.jit(lambda q: JaxBackend.attention_xla(q, kc, vc, q_pos, hd ** -0.5, ks, vs))
        want = f_xla(q).astype(jnp.float32)
        t_xla = device_seconds(f_xla, (q,), 0, repeat, loop=CHUNKED_LOOP)
        flops = 2 * 2 * (t * offset + t * (t + 1) / 2) * hq * hd
        nbytes = 2 * q.size * 2 + 2 * (offset + t) * hkv * (hd + 4)
        for block_q, warps, terms in configs:
            f_ker = jax.jit(partial(ker, scale=hd ** -0.5, interpret=interpret, block_q=block_q, num_warps=warps,
                                    p_terms=terms))
            call = lambda q: f_ker(q, kc, vc, ks, vs, q_pos)              # noqa: E731
            err = rel_err(call(q).astype(jnp.float32), want)
            t_ker = device_seconds(call, (q,), 0, repeat, loop=CHUNKED_LOOP)
            rows.append(row(f"prompt attention int8 KV, {t} tokens at {offset}, block_q {block_q}, {warps} warps, "
                            f"{terms} P terms", t_ker, t_xla, nbytes, flops, err, tokens=t, offset=offset,
                            block_q=block_q, num_warps=warps, p_terms=terms))
    return rows


def rule_inputs(hv, dk, dv, prompt):
    """Model-like inputs of the gated delta rule for a prompt part (l2-normed q, k; g <= 0; beta in (0, 1)) and a
    state, on the device."""
    import jax.numpy as jnp
    rng = np.random.default_rng(3)
    n = lambda *s: rng.standard_normal((prompt,) + s).astype(np.float32)  # noqa: E731
    q, k = n(hv, dk), n(hv, dk)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = -np.exp(np.log(rng.uniform(1, 16, hv))) * np.log1p(np.exp(n(hv)))
    beta = 1 / (1 + np.exp(-n(hv)))
    st = (rng.standard_normal((hv, dk, dv)) * 0.1).astype(np.float32)
    return tuple(jnp.asarray(a) for a in (q, k, n(hv, dv), g.astype(np.float32), beta.astype(np.float32), st))


# the XLA chunked form's chunks, each timed against the default (64)
CHUNKED_CASES = (128,)


def gated_delta_chunked(hv, dk, dv, prompt, repeat, interpret, cases=CHUNKED_CASES):
    """The backend's chunked gated delta rule (XLA's form) over a prompt part of one sequence, with each chunk case
    as its KernelConfig's gdn_chunk, against the default. FLOPs: the intra-chunk products and the recurrence; bytes:
    q, k, v, o in fp32 and the state read and written."""
    from strata.jax_backend.backend import JaxBackend
    from strata.jax_backend.kernel_config import KernelConfig
    q, k, v, g, beta, st = rule_inputs(hv, dk, dv, prompt)
    xla_chunked = JaxBackend(kernels="xla").gated_delta_chunked
    # a chunked call takes milliseconds: CHUNKED_LOOP calls in a row hide dispatch, and LOOP written-out scans of
    # 64 chunks each kept XLA compiling past a 200 s run
    t_xla = device_seconds(lambda st: xla_chunked(q, k, v, g, beta, st), (st,), 0, repeat, carry=lambda out: out[1],
                           loop=CHUNKED_LOOP)
    c = 64
    flops = prompt * hv * (4 * c * dk + 2 * c * dv + 8 * dk * dv) * 2     # intra-chunk products + the recurrence
    nbytes = prompt * hv * (2 * dk + 2 * dv) * 4 + 2 * hv * dk * dv * 4
    rows = []
    for chunk in cases:
        ker = JaxBackend(kernels="xla", kernel_config=KernelConfig(gdn_chunk=chunk)).gated_delta_chunked
        err = rel_err(ker(q, k, v, g, beta, st)[1], xla_chunked(q, k, v, g, beta, st)[1])
        t_ker = device_seconds(lambda st: ker(q, k, v, g, beta, st), (st,), 0, repeat, carry=lambda out: out[1],
                               loop=CHUNKED_LOOP)
        rows.append(row(f"gated delta chunked XLA, chunk {chunk}, {prompt} tokens", t_ker, t_xla, nbytes,
                        flops, err, form="chunked", tokens=prompt, chunk=chunk))
    return rows


def route(experts, k, tokens, repeat, interpret):
    """The router's softmax + top-k + renormalisation as one kernel (kernels/route.py) against the composition
    (ComposedOps.route on XLA). Bytes: the logits read, the weights and ids written."""
    import jax.numpy as jnp

    from strata.jax_backend.backend import JaxBackend
    from strata.jax_backend.kernels.route import route as kernel
    ops = JaxBackend(kernels="xla")
    rng = np.random.default_rng(6)
    rows = []
    for t in tokens:
        x = jnp.asarray((rng.standard_normal((t, experts)) * 2).astype(np.float32))
        ker = partial(kernel, k=k, renormalize=True, interpret=interpret)
        err = rel_err(ker(x)[0], ops.route(x, k, True)[0])
        t_ker = device_seconds(lambda x: ker(x), (x,), 0, repeat)
        t_xla = device_seconds(lambda x: ops.route(x, k, True), (x,), 0, repeat)
        rows.append(row(f"route (softmax, top {k} of {experts}, renormalised), {t} row(s)", t_ker, t_xla,
                        t * (experts + 2 * k) * 4, 0, err, tokens=t))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on a CPU, kernels interpreted")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--only", default="expert_decode,expert_grouped,decode_attention")
    ap.add_argument("--out", default=None)
    ap.add_argument("--decode-cases", default=None,
                    help="expert_decode's cases instead of its default: block:warps, comma-separated")
    ap.add_argument("--attention-splits", default=None,
                    help="decode_attention: n_splits values to time (0: the module's choice), bf16, one query, at "
                         "--attention-contexts and --attention-batches")
    ap.add_argument("--attention-contexts", default="131072")
    ap.add_argument("--attention-batches", default="1,4,16")
    ap.add_argument("--prompt-offsets", default=None,
                    help="prompt_attention: the parts' positions (comma-separated) instead of 0 alone")
    ap.add_argument("--prompt-configs", default=None,
                    help="prompt_attention: block_q:warps:p_terms cases (comma-separated) instead of its default")
    ap.add_argument("--trace-decode", default=None,
                    help="expert_decode: also trace these cases (block:warps, comma-separated) and XLA's form")
    args = ap.parse_args()
    import jax
    interpret = jax.devices()[0].platform != "gpu"
    if args.smoke:
        shapes = {
            "expert_decode": dict(hidden=256, inter=128, n_slots=16, tokens=[1, 2], k=4),
            "expert_grouped": dict(hidden=256, inter=128, n_experts=16, tokens=[40], k=4),
            "pool_over_4gib": None,
            "decode_attention": dict(hq=4, hkv=2, hd=32, contexts=[128], batches=[1, 2], queries=[1, 3]),
            "gated_delta_chunked": dict(hv=2, dk=16, dv=16, prompt=70),
            "prompt_attention": dict(hq=4, hkv=2, hd=32, tokens=[64], configs=[(8, 4, 3), (8, 4, 1)],
                                     offsets=[0, 192]),
            "route": dict(experts=16, k=4, tokens=[1, 8]),
            "expert_grouped_blocks": dict(hidden=256, inter=128, n_experts=16, tokens=[40], k=4,
                                          cases=(("int4", "v2", 64), ("int4", "v2", 128))),
        }
        repeat = 1
    else:
        shapes = {
            "expert_decode": dict(hidden=2048, inter=512, n_slots=512, tokens=[1, 2, 4, 16], k=10),
            "expert_grouped": dict(hidden=2048, inter=512, n_experts=512, tokens=[512, 4096], k=10),
            "pool_over_4gib": dict(hidden=2048, inter=512, n_experts=512, tokens=[1, 512], k=10),
            "decode_attention": dict(hq=16, hkv=2, hd=256, contexts=[4096, 32768], batches=[1, 16],
                                     queries=[1, 4]),
            "gated_delta_chunked": dict(hv=32, dk=128, dv=128, prompt=4096),
            "expert_grouped_blocks": dict(hidden=2048, inter=512, n_experts=512, tokens=[4096], k=10,
                                          cases=(("int4", "v2", 64), ("int4", "v2", 128))),
            "route": dict(experts=512, k=10, tokens=[1, 16, 4096]),
            "prompt_attention": dict(hq=16, hkv=2, hd=256, tokens=[4096],
                                     configs=[(8, 4, 3), (8, 8, 3), (16, 8, 3), (8, 4, 1), (16, 8, 1)]),
        }
        repeat = args.repeat
    def decode_cases(text):
        return [(int(b), int(w)) for b, w in (c.split(":") for c in text.split(","))]

    if args.attention_splits:
        shapes["decode_attention"] = dict(shapes["decode_attention"], queries=[1], kvs=("bf16",),
                                          contexts=[int(c) for c in args.attention_contexts.split(",")],
                                          batches=[int(b) for b in args.attention_batches.split(",")],
                                          splits=[int(n) or None for n in args.attention_splits.split(",")])
    if args.prompt_offsets:
        shapes["prompt_attention"] = dict(shapes["prompt_attention"],
                                          offsets=[int(o) for o in args.prompt_offsets.split(",")])
    if args.prompt_configs:
        shapes["prompt_attention"] = dict(shapes["prompt_attention"], configs=[
            tuple(int(x) for x in c.split(":")) for c in args.prompt_configs.split(",")])
    if args.decode_cases:
        shapes["expert_decode"] = dict(shapes["expert_decode"], cases=decode_cases(args.decode_cases))
    if args.trace_decode:
        shapes["expert_decode"] = dict(shapes["expert_decode"], trace=decode_cases(args.trace_decode))
    fns = {"expert_decode": expert_decode, "expert_grouped": expert_grouped, "decode_attention": decode_attention,
           "gated_delta_chunked": gated_delta_chunked,
           "pool_over_4gib": pool_over_4gib,
           "prompt_attention": prompt_attention, "route": route,
           "expert_grouped_blocks": expert_grouped}
    result = {"bench": "kernel_speed", **results_file.stamp(), "interpret": interpret,
              "hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_flops": BF16_FLOPS, "loop": LOOP, "shapes": shapes}
    unknown = [n for n in args.only.split(",") if n not in fns]
    if unknown:
        ap.error(f"--only: unknown kernel families {unknown}; allowed: {', '.join(fns)}")
    out_name = "kernel_speed_smoke" if args.smoke else f"kernel_speed_{jax.devices()[0].platform}"
    for name in args.only.split(","):
        if shapes.get(name) is None:
            continue                                       # not in this mode (the 4 GiB pool: the GPU only)
        try:
            result[name] = fns[name](**shapes[name], repeat=repeat, interpret=interpret)
        except Exception as e:  # noqa: BLE001 - one kernel failing to compile must not lose the others' figures
            print(f"{name}: FAILED: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:4000]}"}
        results_file.write(result, args.out, out_name)     # after each family: a run cut short keeps its figures
    return 0


if __name__ == "__main__":
    sys.exit(main())
