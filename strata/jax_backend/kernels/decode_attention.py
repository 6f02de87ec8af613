"""Attention as Pallas kernels (Triton backend): decode_attention, a split-K (flash-decoding) kernel over a ragged
batch of rows, each with its own KV cache and position (GQA; Q query positions a row for speculative verify); and
prompt_attention, flash attention for the T queries of one sequence's prompt part over its cache. Caches are int8
with per-token-per-head float32 scales, or bfloat16/float32. A row reads only the key blocks its queries can see
(cost follows its length, not the capacity), in int8 when the cache is int8, with the scales folded into the
logits (k) and the probabilities (v); whatever lies past a row's length never reaches the result. An int8 cache of
2^31 .. 2^32 bytes, whose int8 offsets overflow JAX's Triton lowering's int32, is read as int32 words (a bitcast)
and unpacked in the kernel into 4 byte planes of the head dim (the plane form: int8_planes_needed, _attend).

Floor (H200 HBM at 3.6 TB/s, Qwen3-Next-80B: Hq = 16, Hkv = 2, hd = 256; per row and full-attention layer): int8
1040 B a token, 4K context 1.18 us, 32K 9.5 us; bf16 2048 B a token, 4K 2.33 us, 32K 18.6 us. Memory-bound.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from strata.jax_backend.kernels import int32_offsets_overflow, triton_params

BLOCK_K = 64             # keys per loop step (a power of two >= 16; the largest one dividing Cap up to this is used)
TILE_BYTES = 32 << 10    # ... and a K (or V) tile at most this: K + V x 2 stages <= 128 KB of the ~227 KB of shared
MIN_ROWS = 16            # query rows per program: the Triton dot needs M >= 16
SMS = 132                # the H200's SMs: one program of K + V tiles x 2 stages (<= 128 KB of shared memory) fits
                         # a SM at a time, so programs run in waves of SMS
MAX_SPLITS = 128         # bounds the partials' bytes, S x Hkv x splits x R x (hd + 2) x 4 B, written and read once
NUM_WARPS, NUM_STAGES = 4, 2
PROMPT_ROWS = 64         # prompt form: query rows (queries x the kv head's group) per program
PROMPT_WARPS = 4
_F32_MIN = float(jnp.finfo(jnp.float32).min)  # m of a row that has seen no key (exp(m - m') is then 0, not NaN)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _split_blocks(n, j, block_k: int, n_splits: int):
    """Key blocks [lo, hi) of split j for a row with n visible keys: cdiv(n, block_k) blocks cut into n_splits equal
    ranges (the last ones may be short or empty). Works on Python/numpy ints and on traced int32 scalars."""
    nblk = (n + block_k - 1) // block_k
    per = (nblk + n_splits - 1) // n_splits
    lo = jnp.minimum(j * per, nblk)
    return lo, jnp.minimum(lo + per, nblk)


def _tiles(ref, start, block_k: int, planes: bool) -> tuple:
    """Keys start .. start + block_k - 1 of a cache ref [Cap, hd] as one tile, or with planes (the int8 cache viewed
    as int32 [Cap, hd/4], 4 bytes a word, little-endian) as 4 int32 tiles [BK, hd/4] of the signed bytes: plane j
    holds head-dim columns j, j + 4, ... (word byte j, sign-extended by an arithmetic shift)."""
    x = ref[pl.ds(start, block_k), :]
    if not planes:
        return (x,)
    return tuple(lax.shift_right_arithmetic(lax.shift_left(x, 24 - 8 * j) if j < 3 else x, 24) for j in range(4))


def _attend(qs, k_ref, v_ref, ks_ref, vs_ref, last, n, lo, hi, *, scale: float, block_k: int, quantized: bool,
            bf16: bool, planes: bool = False, p_terms: int = 3):
    """The online softmax of query rows qs over key blocks lo .. hi-1 of k_ref, v_ref [Cap, hd] (scales
    ks_ref, vs_ref [Cap] when quantized): row r sees keys 0 .. last[r]; keys n.. may hold anything.
    qs: the rows [R, hd] as one piece, or with planes (k_ref, v_ref the int8 cache as int32 [Cap, hd/4]) as 4 pieces
    [R, hd/4], piece j the head-dim columns j, j + 4, ... (_tiles): q.k is the sum of the pieces' dots.
    -> (accs, m [R], l [R]): accs one [R, hd] or 4 [R, hd/4] pieces (as qs), m the running max of the scaled
    logits, l = sum exp(logit - m), acc = sum exp(logit - m) v. p_terms: bfloat16 terms the probabilities are split
    into for P.V (bf16 only).

    Arithmetic (float32 throughout): with q bfloat16 and a bfloat16 or int8 cache (int8 -> bf16 is exact) the dots
    run in bf16 on the tensor cores with float32 accumulation: q.k products are exact, and the probabilities (times
    the v scales) split into p_terms bfloat16 terms for P.V make it float32-accurate at 3 (~1e-7 relative; 2 terms
    ~2e-6; 1, a plain bf16 P, errors the size of the output's rounding). Otherwise (q or the cache float32) both
    dots are float32 at precision HIGHEST (IEEE, not TF32). Logits are masked with where(-inf) per query row before
    the softmax (after the k scale too, so a NaN scale is dropped), and V rows and v scales past the row's length
    are selected to 0 before the P.V product."""
    rows = qs[0].shape[0]
    cdt = jnp.bfloat16 if bf16 else jnp.float32
    prec = None if bf16 else lax.Precision.HIGHEST
    dims_t = (((1,), (1,)), ((), ()))                   # a [M, d] . b [N, d]^T
    dims = (((1,), (0,)), ((), ()))                     # a [M, c] . b [c, N]
    qs = tuple(q.astype(cdt) for q in qs)
    kidx = lax.broadcasted_iota(jnp.int32, (block_k,), 0)

    def body(b, carry):
        accs, m, l = carry
        start = pl.multiple_of(b * block_k, block_k)
        t = start + kidx                                                           # [BK] key positions
        live = t < n                                                               # real keys of the rows
        logit = None
        for q, k in zip(qs, _tiles(k_ref, start, block_k, planes)):                # [BK, hd] (planes: 4 x hd/4)
            part = lax.dot_general(q, k.astype(cdt), dims_t, precision=prec, preferred_element_type=jnp.float32)
            logit = part if logit is None else logit + part
        logit = logit * scale
        if quantized:
            logit = logit * ks_ref[pl.ds(start, block_k)][None, :]
        logit = jnp.where(t[None, :] <= last[:, None], logit, -jnp.inf)           # [R, BK]
        m_new = jnp.maximum(m, jnp.max(logit, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(logit - m_new[:, None])
        l = alpha * l + jnp.sum(p, axis=1)
        if quantized:
            p = p * jnp.where(live, vs_ref[pl.ds(start, block_k)], 0.0)[None, :]
        terms = [p]
        if bf16:                                        # p = pa + pb + pc in bfloat16 terms (float32-accurate)
            terms, res = [p.astype(jnp.bfloat16)], p
            for _ in range(p_terms - 1):                # each term the bfloat16 of what the last ones left
                res = res - terms[-1].astype(jnp.float32)
                terms.append(res.astype(jnp.bfloat16))
        new = []
        for acc, v in zip(accs, _tiles(v_ref, start, block_k, planes)):
            v = jnp.where(live[:, None], v, 0).astype(cdt)
            pv = lax.dot_general(terms[-1], v, dims, precision=prec, preferred_element_type=jnp.float32)
            for term in reversed(terms[:-1]):           # the smallest term first
                pv = pv + lax.dot_general(term, v, dims, preferred_element_type=jnp.float32)
            new.append(alpha[:, None] * acc + pv)
        return tuple(new), m_new, l

    init = (tuple(jnp.zeros(q.shape, jnp.float32) for q in qs), jnp.full((rows,), _F32_MIN, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    return lax.fori_loop(lo, hi, body, init)


def _pieces(ref, planes: bool) -> tuple:
    """The rows of a [R, hd] ref as _attend's query pieces: the whole, or its 4 planes' column ranges (the caller put
    head-dim column 4c + j at j * hd/4 + c: _to_planes)."""
    if not planes:
        return (ref[...],)
    d = ref.shape[1] // 4
    return tuple(ref[:, pl.ds(j * d, d)] for j in range(4))


def _store(ref, accs) -> None:
    """_attend's acc pieces into a [R, hd] ref (planes: plane j at columns j * hd/4 .., as _pieces)."""
    if len(accs) == 1:
        ref[...] = accs[0].astype(ref.dtype)
        return
    d = accs[0].shape[1]
    for j, acc in enumerate(accs):
        ref[:, pl.ds(j * d, d)] = acc.astype(ref.dtype)


def _to_planes(x):
    """[..., hd] -> [..., hd] with column 4c + j moved to j * hd/4 + c (the planes' order; _from_planes undoes it)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // 4, 4).swapaxes(-1, -2).reshape(x.shape)


def _from_planes(x):
    return x.reshape(*x.shape[:-1], 4, x.shape[-1] // 4).swapaxes(-1, -2).reshape(x.shape)


def _packed(cache):
    """An int8 cache [..., hd] viewed as int32 [..., hd/4] (4 head-dim columns a word; a bitcast, not a copy)."""
    return lax.bitcast_convert_type(cache.reshape(*cache.shape[:-1], cache.shape[-1] // 4, 4), jnp.int32)


def int8_planes_needed(shape) -> bool:
    """Whether an int8 cache of this shape must reach the kernels as int32 words (the plane form): read as int8, its
    element offsets overflow the int32 that JAX's Triton lowering uses for it (int32_offsets_overflow)."""
    return int32_offsets_overflow(shape, 1)


def _use_planes(k_cache, planes: bool | None) -> bool:
    """The form to read the caches in: planes None follows int8_planes_needed; raises ValueError if the plane form is
    asked for (or needed) where it cannot run."""
    if planes is None:
        planes = k_cache.dtype == jnp.int8 and int8_planes_needed(k_cache.shape)
    hd = k_cache.shape[-1]
    if planes and (k_cache.dtype != jnp.int8 or hd < 64):
        raise ValueError(f"the plane form (int8 caches of 2^31 .. 2^32 bytes, whose int8 offsets overflow int32) "
                         f"needs an int8 cache with hd >= 64 (hd/4 >= 16 for the dots), got {k_cache.dtype} "
                         f"{k_cache.shape}")
    return planes


def _kernel(pos_ref, q_ref, k_ref, v_ref, *rest, scale: float, block_k: int, n_splits: int, n_q: int, group: int,
            quantized: bool, bf16: bool, all_visible: bool = False, planes: bool = False):
    """Program (s, g, j) of grid (S, Hkv, n_splits): q_ref [R, hd], all Hq/Hkv query heads x Q positions of kv head
    g as R rows (padded with zeros to a power of two >= 16, the Triton dot's minimum), row r = position r // group;
    k_ref, v_ref [Cap, hd] (row s, kv head g); with int8, ks_ref, vs_ref [Cap]. Row s's keys 0 .. n-1,
    n = min(pos[s] + Q, Cap), are cut into blocks of block_k and the blocks into n_splits equal ranges (they divide
    the row's length, not Cap: every split of a long row has work, a short row's blocks past its end are never
    read); program j walks its range (a dynamically bounded loop) and writes its split's acc [R, hd], m [R], l [R]
    (_attend); an XLA epilogue combines the splits. all_visible (a host tier's part, every key older than every
    query): row s's keys are 0 .. pos[s] - 1, all of them seen by every query (none when pos[s] = 0). planes: the
    caches are int32 [Cap, hd/4] words and q's and acc's columns in the planes' order (_attend)."""
    if quantized:
        ks_ref, vs_ref, acc_ref, m_ref, l_ref = rest
    else:
        (acc_ref, m_ref, l_ref), ks_ref, vs_ref = rest, None, None
    s, j = pl.program_id(0), pl.program_id(2)
    cap = k_ref.shape[0]
    rows = q_ref.shape[0]
    first = pos_ref[s]                                  # position of the row's query 0 (all_visible: its key count)
    r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    if all_visible:
        n = jnp.minimum(first, cap)
        last = jnp.full((rows,), n - 1, jnp.int32)
    else:
        n = jnp.minimum(first + n_q, cap)                  # keys the row's last query sees
        last = first + jnp.minimum(r // group, n_q - 1)   # [R]: the last key each row sees (padding: as the last)
    lo, hi = _split_blocks(n, j, block_k, n_splits)
    accs, m, l = _attend(_pieces(q_ref, planes), k_ref, v_ref, ks_ref, vs_ref, last, n, lo, hi, scale=scale,
                         block_k=block_k, quantized=quantized, bf16=bf16, planes=planes)
    _store(acc_ref, accs)
    m_ref[...] = m
    l_ref[...] = l


def _splits(rows: int, most: int) -> int:
    """Splits per (row, kv head) for `rows` of them: the fewest that leave a row's keys the shortest walk, its keys
    over n splits taking ceil(rows x n / SMS) waves of programs, each 1/n of the keys (one split a row left half the
    SMs idle at batch 1; splits that spill a few programs into an extra wave cost a whole wave)."""
    cost = {n: -(-rows * n // SMS) / n for n in range(1, max(1, most) + 1)}
    return min(cost, key=lambda n: (cost[n], n))


def _takes(check, *args, blocks=(None, None)) -> bool:
    """Whether check(*args, *blocks) (a form's checks; None: a default block) accepts the arguments."""
    try:
        check(*args, *blocks)
    except ValueError:
        return False
    return True


def supported(q, k_cache, v_cache, k_scale, v_scale, pos, banked: bool = False) -> bool:
    """Whether decode_attention takes these shapes and dtypes (with its default blocks, splits and form; banked:
    with rows given)."""
    return _takes(functools.partial(_check, banked=banked), q, k_cache, v_cache, k_scale, v_scale, pos)


def _check(q, k_cache, v_cache, k_scale, v_scale, pos, block_k, n_splits, planes=None, banked=False):
    """Shapes and dtypes the kernel handles (in the form planes asks for: _use_planes; banked: caches of any number
    of rows B, which rows of them to read given apart); -> (block_k, n_splits) to use. Raises ValueError naming the
    constraint."""
    if q.ndim != 4 or k_cache.ndim != 4:
        raise ValueError(f"q must be [S, Q, Hq, hd] and the caches [S, Cap, Hkv, hd], got {q.shape}, {k_cache.shape}")
    s, nq, hq, hd = q.shape
    b, cap, hkv, _ = k_cache.shape
    if (b != s and not banked) or k_cache.shape[3] != hd or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {k_cache.shape}, {v_cache.shape} must both be [S, Cap, Hkv, hd] for q {q.shape}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k and v caches must have one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    if pos.shape != (s,):
        raise ValueError(f"pos must be [S] = [{s}], got {pos.shape}")
    if hq % hkv:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    if not _pow2(hd) or hd < 16:
        raise ValueError(f"head dim hd={hd} must be a power of two >= 16 (Triton block shapes and dots)")
    if q.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"q must be bfloat16 or float32, not {q.dtype}")
    if k_cache.dtype == jnp.int8:
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is None or sc.shape != (b, cap, hkv) or sc.dtype != jnp.float32:
                raise ValueError(f"an int8 cache needs {name} float32 [S, Cap, Hkv] = [{b}, {cap}, {hkv}], got "
                                 f"{None if sc is None else (sc.shape, sc.dtype)}")
    elif k_cache.dtype in (jnp.bfloat16, jnp.float32):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"a {k_cache.dtype} cache takes no scales (k_scale = v_scale = None)")
    else:
        raise ValueError(f"the cache must be int8, bfloat16 or float32, not {k_cache.dtype}")
    _use_planes(k_cache, planes)
    if block_k is None:                                 # a K or V tile of at most TILE_BYTES (f32 at hd 256: 32 keys)
        most = max(16, min(BLOCK_K, TILE_BYTES // (hd * k_cache.dtype.itemsize)))
        block_k = next((b for b in (64, 32, 16) if b <= most and cap % b == 0), None)
        if block_k is None:
            raise ValueError(f"Cap={cap} must be a multiple of 16 (key blocks are powers of two >= 16)")
    if not _pow2(block_k) or block_k < 16 or cap % block_k:
        raise ValueError(f"block_k={block_k} must be a power of two >= 16 dividing Cap={cap}")
    if n_splits is None:
        n_splits = _splits(s * hkv, min(cap // block_k, MAX_SPLITS))
    if n_splits < 1:
        raise ValueError(f"n_splits={n_splits} must be >= 1")
    return block_k, n_splits


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_k", "n_splits", "planes"))
def decode_attention(q, k_cache, v_cache, k_scale, v_scale, pos, rows=None, *, scale: float, interpret: bool = False,
                     block_k: int | None = None, n_splits: int | None = None, planes: bool | None = None):
    """softmax(scale q.k) v for each row's queries over its visible keys, by the split-K kernel.

    q [S, Q, Hq, hd] bfloat16/float32 (Q = 1 decode, k+1 verify); k_cache, v_cache [S, Cap, Hkv, hd]: int8 with
    k_scale, v_scale float32 [S, Cap, Hkv] (the stored key is k_cache * k_scale[..., None]), or bfloat16/float32 with
    k_scale = v_scale = None; pos int32 [S] (>= 0): query j of row s sits at pos[s] + j and sees keys
    0 .. min(pos[s] + j, Cap - 1); keys past pos[s] + Q - 1 may hold anything. Query head h reads kv head
    h // (Hq // Hkv). -> [S, Q, Hq, hd] in q.dtype, computed in float32. block_k (keys per step) and n_splits (splits
    per row) default to the module's choices; planes (an int8 cache read as int32 words, _attend) defaults to where
    int8 offsets would overflow (int8_planes_needed). rows [S] (optional): the caches are banks [B, Cap, ...] and
    row s reads bank row rows[s]."""
    part = _partials(q, k_cache, v_cache, k_scale, v_scale, pos, scale, interpret, block_k, n_splits, False, planes,
                     rows)
    return _combine(q, k_cache.shape[2], [part])


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def tiered_decode_attention(q, k_cache, v_cache, k_scale, v_scale, pos, k_host, v_host, ks_host, vs_host, n_host,
                            rows=None, dev_rows=None, *, scale: float, interpret: bool = False):
    """decode_attention over a row's keys in two tiers: the oldest n_host[s] in the host caches (k_host, v_host
    [B, Cap_h, Hkv, hd], scales [B, Cap_h, Hkv] with int8; pinned host memory on a GPU, which the kernel reads in
    place; row s's are row rows[s] of them, or row s when rows is None), every one of them seen by every query, and
    the rest in the device caches, where device key i is position n_host[s] + i and pos[s] is query 0's position
    counted the same way (absolute position - n_host[s]); dev_rows [S] (optional): the device caches are banks and
    row s's is dev_rows[s]. The two parts' partial sums are merged by log-sum-exp with the splits'. -> [S, Q, Hq,
    hd] in q.dtype."""
    dev = _partials(q, k_cache, v_cache, k_scale, v_scale, pos, scale, interpret, None, None, False, None, dev_rows)
    host = _partials(q, k_host, v_host, ks_host, vs_host, n_host, scale, interpret, None, None, True, None, rows)
    return _combine(q, k_cache.shape[2], [dev, host])


class _BankRow:
    """Row `row`, kv head g of a bank ref [B, Cap, Hkv(, hd)] indexed as the [Cap(, hd)] block a BlockSpec would
    give (one indexer per read: JAX's Triton lowering takes no chained views)."""

    def __init__(self, ref, row, g):
        self.ref, self.row, self.g = ref, row, g
        self.shape = (ref.shape[1],) + tuple(ref.shape[3:])

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        return self.ref[(self.row, idx[0], self.g) + idx[1:]]


def _bank_kernel(pos_ref, rows_ref, q_ref, *refs, quantized: bool, **kw):
    """_kernel on caches that are banks: program (s, g, j) reads bank row rows[s]."""
    n = 4 if quantized else 2
    row, g = rows_ref[pl.program_id(0)], pl.program_id(1)
    caches = [_BankRow(r, row, g) for r in refs[:n]]
    _kernel(pos_ref, q_ref, *caches, *refs[n:], quantized=quantized, **kw)


def _partials(q, k_cache, v_cache, k_scale, v_scale, pos, scale, interpret, block_k, n_splits, all_visible, planes,
              bank_rows=None):
    """The kernel's per-split partial sums (acc [S, Hkv, P, R, hd], m, l [S, Hkv, P, R]) of decode_attention's
    rows (all_visible: _kernel's host-tier form; planes: _use_planes, acc's columns put back in order here so that
    parts in either form combine; bank_rows [S]: the caches are banks [B, ...] and row s reads row bank_rows[s])."""
    banked = bank_rows is not None
    block_k, n_splits = _check(q, k_cache, v_cache, k_scale, v_scale, pos, block_k, n_splits, planes, banked)
    planes = _use_planes(k_cache, planes)
    s, nq, hq, hd = q.shape
    _, cap, hkv, _ = k_cache.shape
    group = hq // hkv
    real = nq * group
    rows = max(MIN_ROWS, 1 << (real - 1).bit_length())
    quantized = k_cache.dtype == jnp.int8
    bf16 = q.dtype == jnp.bfloat16 and k_cache.dtype != jnp.float32

    # [S, Q, Hkv, G, hd] -> [S, Hkv, Q*G (row = position * G + head), hd], zero-padded to `rows`
    qg = q.reshape(s, nq, hkv, group, hd).transpose(0, 2, 1, 3, 4).reshape(s, hkv, real, hd)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - real), (0, 0)))
    if planes:
        qg, k_cache, v_cache = _to_planes(qg), _packed(k_cache), _packed(v_cache)
    cache_spec = pl.BlockSpec((None, cap, None, k_cache.shape[3]), lambda i, g, j: (i, 0, g, 0))
    scale_spec = pl.BlockSpec((None, cap, None), lambda i, g, j: (i, 0, g))
    if banked:                                          # whole banks: the kernel picks each row's (_BankRow)
        cache_spec = scale_spec = pl.no_block_spec
    args = ([pos.astype(jnp.int32)] + ([bank_rows.astype(jnp.int32)] if banked else []) + [qg, k_cache, v_cache]
            + ([k_scale, v_scale] if quantized else []))
    in_specs = ([pl.no_block_spec] * (2 if banked else 1)
                + [pl.BlockSpec((None, None, rows, hd), lambda i, g, j: (i, g, 0, 0)), cache_spec, cache_spec]
                + ([scale_spec, scale_spec] if quantized else []))
    kernel = functools.partial(_bank_kernel if banked else _kernel, scale=float(scale), block_k=block_k,
                               n_splits=n_splits, n_q=nq, group=group, quantized=quantized, bf16=bf16,
                               all_visible=all_visible, planes=planes)
    part = jax.ShapeDtypeStruct((s, hkv, n_splits, rows), jnp.float32)
    acc, m, l = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((s, hkv, n_splits, rows, hd), jnp.float32), part, part),
        grid=(s, hkv, n_splits),
        in_specs=in_specs,
        out_specs=(pl.BlockSpec((None, None, None, rows, hd), lambda i, g, j: (i, g, j, 0, 0)),
                   pl.BlockSpec((None, None, None, rows), lambda i, g, j: (i, g, j, 0)),
                   pl.BlockSpec((None, None, None, rows), lambda i, g, j: (i, g, j, 0))),
        interpret=interpret, **triton_params(interpret, num_warps=NUM_WARPS, num_stages=NUM_STAGES),
    )(*args)
    return (_from_planes(acc) if planes else acc), m, l


def _combine(q, hkv: int, parts: list):
    """decode_attention's result from partial sums over splits (of one or more parts of each row's keys): a split
    that saw no key has m = float32 min, l = 0, acc = 0 and weight exp(m - M) = 0; every row's device part holds its
    query's own key, so l_total > 0 for every real row."""
    s, nq, hq, hd = q.shape
    group = hq // hkv
    real = nq * group
    acc = jnp.concatenate([p[0] for p in parts], axis=2)                          # [S, Hkv, splits, R, hd]
    m = jnp.concatenate([p[1] for p in parts], axis=2)
    l = jnp.concatenate([p[2] for p in parts], axis=2)
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_all)                                                         # [S, Hkv, splits, R]
    l_all = jnp.sum(w * l, axis=2)                                                 # [S, Hkv, R]
    out = jnp.sum(w[..., None] * acc, axis=2)[:, :, :real] / l_all[:, :, :real, None]
    out = out.reshape(s, hkv, nq, group, hd).transpose(0, 2, 1, 3, 4).reshape(s, nq, hq, hd)
    return out.astype(q.dtype)


def _prompt_kernel(last_ref, q_ref, k_ref, v_ref, *rest, scale: float, block_k: int, quantized: bool, bf16: bool,
                   p_terms: int, planes: bool):
    """Program (i, g): q_ref [R, hd], the rows of a block of a prompt part's queries under kv head g (row =
    query * group + head); last_ref [R] the last key each row sees; k_ref, v_ref [Cap, hd] (ks_ref, vs_ref [Cap]
    with int8; planes: int32 [Cap, hd/4] words, q's and o's columns in the planes' order, as _kernel's). Writes
    o [R, hd] = acc / l over key blocks 0 .. the block's furthest key."""
    if quantized:
        ks_ref, vs_ref, o_ref = rest
    else:
        (o_ref,), ks_ref, vs_ref = rest, None, None
    last = last_ref[...]
    n = jnp.max(last) + 1                               # keys the block's furthest row sees (<= Cap: checked)
    accs, _, l = _attend(_pieces(q_ref, planes), k_ref, v_ref, ks_ref, vs_ref, last, n, 0,
                         (n + block_k - 1) // block_k, scale=scale, block_k=block_k, quantized=quantized, bf16=bf16,
                         planes=planes, p_terms=p_terms)
    _store(o_ref, [acc / l[:, None] for acc in accs])    # every row sees key 0, so l > 0


def prompt_supported(q, k_cache, v_cache, k_scale, v_scale, q_pos, block_k: int | None = None) -> bool:
    """Whether prompt_attention takes these shapes and dtypes (with its default query block and form, and block_k
    keys a step: None, its default)."""
    return _takes(_check_prompt, q, k_cache, v_cache, k_scale, v_scale, q_pos, blocks=(None, block_k))


def _check_prompt(q, k_cache, v_cache, k_scale, v_scale, q_pos, block_q, block_k, planes=None):
    """-> (block_q, block_k) for prompt_attention; raises ValueError naming the constraint. The cache checks are
    decode_attention's, on the one sequence as a batch of one."""
    if q.ndim != 3 or k_cache.ndim != 3:
        raise ValueError(f"q must be [T, Hq, hd] and the caches [Cap, Hkv, hd], got {q.shape}, {k_cache.shape}")
    t, hq, hd = q.shape
    cap, hkv, _ = k_cache.shape
    if q_pos.shape != (t,):
        raise ValueError(f"q_pos must be [T] = [{t}], got {q_pos.shape}")
    one = lambda x: None if x is None else x[None]       # noqa: E731
    block_k, _ = _check(q[None, :1], k_cache[None], v_cache[None], one(k_scale), one(v_scale),
                        jnp.zeros((1,), jnp.int32), block_k, 1, planes)
    group = hq // hkv
    if block_q is None:                                 # rows per program: PROMPT_ROWS, at least one query
        block_q = max(1, PROMPT_ROWS // group)
    rows = block_q * group
    if not _pow2(rows) or rows < MIN_ROWS:
        raise ValueError(f"block_q={block_q} queries x {group} heads per kv head = {rows} rows must be a power of "
                         f"two >= {MIN_ROWS}")
    if t % block_q:
        raise ValueError(f"T={t} query rows must be a multiple of block_q={block_q}")
    return block_q, block_k


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_q", "block_k", "num_warps", "p_terms",
                                             "planes"))
def prompt_attention(q, k_cache, v_cache, k_scale, v_scale, q_pos, *, scale: float, interpret: bool = False,
                     block_q: int | None = None, block_k: int | None = None, num_warps: int = PROMPT_WARPS,
                     p_terms: int = 3, planes: bool | None = None):
    """softmax(scale q.k) v for the T queries of one sequence's prompt part over its cache, by the flash-attention
    kernel: query t sees keys 0 .. q_pos[t] (q_pos int32 [T], each in 0 .. Cap - 1; keys past max(q_pos) may hold
    anything). q [T, Hq, hd] bfloat16/float32; caches [Cap, Hkv, hd] as decode_attention's, scales [Cap, Hkv].
    -> [T, Hq, hd] in q.dtype, computed in float32 (bf16: the probabilities in p_terms bfloat16 terms, 3 =
    float32-accurate as decode_attention). Program (query block, kv head) takes block_q queries x the group's heads as
    rows; grid order puts the longest (last) query blocks first. planes: as decode_attention's."""
    block_q, block_k = _check_prompt(q, k_cache, v_cache, k_scale, v_scale, q_pos, block_q, block_k, planes)
    planes = _use_planes(k_cache, planes)
    t, hq, hd = q.shape
    cap, hkv, _ = k_cache.shape
    group = hq // hkv
    rows = block_q * group
    nb = t // block_q
    quantized = k_cache.dtype == jnp.int8
    bf16 = q.dtype == jnp.bfloat16 and k_cache.dtype != jnp.float32
    # [T, Hkv, G, hd] -> [Hkv, T * G (row = query * G + head), hd]; each row's last key
    qg = q.reshape(t, hkv, group, hd).transpose(1, 0, 2, 3).reshape(hkv, t * group, hd)
    last = jnp.repeat(jnp.clip(q_pos.astype(jnp.int32), 0, cap - 1), group)
    if planes:
        qg, k_cache, v_cache = _to_planes(qg), _packed(k_cache), _packed(v_cache)
    rev = lambda i: nb - 1 - i                           # noqa: E731 - the longest blocks first
    cache_spec = pl.BlockSpec((cap, None, k_cache.shape[2]), lambda i, g: (0, g, 0))
    scale_spec = pl.BlockSpec((cap, None), lambda i, g: (0, g))
    row_spec = pl.BlockSpec((None, rows, hd), lambda i, g: (g, rev(i), 0))
    args = [last, qg, k_cache, v_cache] + ([k_scale, v_scale] if quantized else [])
    in_specs = ([pl.BlockSpec((rows,), lambda i, g: (rev(i),)), row_spec, cache_spec, cache_spec]
                + ([scale_spec, scale_spec] if quantized else []))
    kernel = functools.partial(_prompt_kernel, scale=float(scale), block_k=block_k, quantized=quantized, bf16=bf16,
                               p_terms=p_terms, planes=planes)
    o = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((hkv, t * group, hd), q.dtype),
        grid=(nb, hkv),
        in_specs=in_specs,
        out_specs=row_spec,
        interpret=interpret, **triton_params(interpret, num_warps=num_warps, num_stages=NUM_STAGES),
    )(*args)
    if planes:
        o = _from_planes(o)
    return o.reshape(hkv, t, group, hd).transpose(1, 0, 2, 3).reshape(t, hq, hd)


def _reference_prompt(q, k_cache, v_cache, k_scale, v_scale, q_pos, scale):
    """numpy (float64) for prompt_attention: the decode reference with the T queries as T rows of one query, each
    at its own position over the same cache. -> float64 [T, Hq, hd]."""
    t = q.shape[0]
    rep = lambda x: None if x is None else jnp.broadcast_to(jnp.asarray(x)[None], (t,) + x.shape)  # noqa: E731
    return _reference(jnp.asarray(q)[:, None], rep(k_cache), rep(v_cache), rep(k_scale), rep(v_scale),
                      np.asarray(q_pos), scale)[:, 0]


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def decode_attention_xla(q, k_cache, v_cache, k_scale, v_scale, pos, *, scale: float, interpret: bool = False):
    """decode_attention's contract in plain XLA (the baseline and fallback; `interpret` is accepted and unused). It
    reads the whole capacity (cost follows Cap), but only visible keys reach the result: logits are masked with -inf
    per query and K, V rows (and their scales) past a row's length are selected to 0 before any product."""
    del interpret
    s, nq, hq, hd = q.shape
    _, cap, hkv, _ = k_cache.shape
    f32, hi = jnp.float32, lax.Precision.HIGHEST
    t = jnp.arange(cap, dtype=jnp.int32)
    qpos = pos.astype(jnp.int32)[:, None] + jnp.arange(nq, dtype=jnp.int32)[None, :]   # [S, Q]
    sees = t[None, None, :] <= qpos[:, :, None]                                         # [S, Q, Cap]
    live = (t[None, :] < (pos.astype(jnp.int32) + nq)[:, None])[:, :, None, None]      # [S, Cap, 1, 1]

    def visible(cache, sc):
        x = cache.astype(f32)
        if sc is not None:
            x = x * sc[..., None]
        return jnp.where(live, x, 0.0)

    k, v = visible(k_cache, k_scale), visible(v_cache, v_scale)
    qg = q.astype(f32).reshape(s, nq, hkv, hq // hkv, hd)
    logit = jnp.einsum("sqgrd,scgd->sqgrc", qg, k, precision=hi) * scale
    p = jax.nn.softmax(jnp.where(sees[:, :, None, None, :], logit, -jnp.inf), axis=-1)
    out = jnp.einsum("sqgrc,scgd->sqgrd", p, v, precision=hi)
    return out.reshape(s, nq, hq, hd).astype(q.dtype)


def _reference(q, k_cache, v_cache, k_scale, v_scale, pos, scale):
    """numpy (float64 arithmetic) over each query's visible keys only: float64 [S, Q, Hq, hd]."""
    q = np.asarray(jnp.asarray(q).astype(jnp.float32), np.float64)
    kc = np.asarray(jnp.asarray(k_cache).astype(jnp.float32), np.float64)
    vc = np.asarray(jnp.asarray(v_cache).astype(jnp.float32), np.float64)
    pos = np.asarray(pos)
    s, nq, hq, hd = q.shape
    cap, hkv = kc.shape[1], kc.shape[2]
    group = hq // hkv
    out = np.zeros((s, nq, hq, hd))
    for i in range(s):
        for j in range(nq):
            n = min(int(pos[i]) + j, cap - 1) + 1
            k, v = kc[i, :n], vc[i, :n]                                            # [n, Hkv, hd]
            if k_scale is not None:
                k = k * np.asarray(k_scale, np.float64)[i, :n, :, None]
                v = v * np.asarray(v_scale, np.float64)[i, :n, :, None]
            for h in range(hq):
                logit = scale * (k[:, h // group] @ q[i, j, h])
                p = np.exp(logit - logit.max())
                out[i, j, h] = (p / p.sum()) @ v[:, h // group]
    return out
