"""kernels/decode_attention: the split-K decode attention kernel and its plain-XLA form against the float64 numpy
reference, over ragged rows (positions 0 .. Cap - Q) whose unused cache rows are poisoned (NaN, inf, huge values,
NaN/inf scales), GQA groups of 2 and 8, decode (Q = 1) and verify (Q = 3) queries, int8/bfloat16/float32 caches and
bfloat16/float32 queries; on the CPU in Pallas interpret mode, on the GPU compiled (STRATA_TEST_DEVICE=gpu)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from strata.jax_backend.kernels import decode_attention as K

# Relative error (2-norm over the whole output) against the reference, by q's (= the output's) dtype. float32: a row
# goes through ~hd + Cap float32 roundings (2^-24 each) in its dot products, exp and sums: at most ~1e-5 here.
# bfloat16: the result is float32-accurate before one rounding to bfloat16 (8 significant bits: |round(x) - x| <=
# 2^-8 |x| per element); and so it is the reference rounded to bfloat16 in all but the rare elements whose float32
# error straddles a rounding midpoint (none in these tests; probabilities in two bfloat16 terms left up to 1.6% off,
# in one, as a plain bf16 P.V dot has them, ~30%).
# For int8 caches the reference reads the same int8 values and scales, so these bound the arithmetic, not the
# quantisation.
F32_LIMIT = 1e-5
LIMIT = {"float32": F32_LIMIT, "bfloat16": 2.0 ** -8 * (1 + F32_LIMIT) + F32_LIMIT}
BF16_OFF_MAX = 0.01      # fraction of bfloat16 outputs allowed to differ from the rounded reference

# (S, Q, Hq, Hkv, hd, Cap, block_k, n_splits, pos): several key blocks per row and several splits each (3 splits
# of 4 blocks leave the last split short, 4 of 8 even); rows at 0 (one block: the other splits empty), at Cap - Q
# (every key visible, no garbage) and in between off block boundaries.
SHAPES = [
    (1, 1, 4, 2, 32, 64, 16, 3, [63]),
    (3, 3, 8, 1, 64, 128, 16, 4, [0, 125, 77]),
    (3, 1, 4, 2, 64, 64, 16, 2, [37, 0, 63]),
    (1, 3, 8, 1, 32, 128, 32, 3, [50]),
]


def rel_err(got, want):
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def make_inputs(rng, s, nq, hq, hkv, hd, cap, pos, kv_dtype, q_dtype):
    """q and a cache whose keys past each row's last query position (pos + Q - 1) are garbage: for float caches a
    cycle of NaN, inf, -inf and 1e38 in K and V; for int8 caches extreme codes with NaN, inf and 1e38 scales."""
    q = jnp.asarray(rng.standard_normal((s, nq, hq, hd)), q_dtype)
    shape = (s, cap, hkv, hd)
    if kv_dtype == "int8":
        kc = rng.integers(-127, 128, shape).astype(np.int8)
        vc = rng.integers(-127, 128, shape).astype(np.int8)
        ks = (0.01 + 0.02 * rng.random(shape[:3])).astype(np.float32)    # dequantized keys ~ N(0, ~1.5)
        vs = (0.01 + 0.02 * rng.random(shape[:3])).astype(np.float32)
    else:
        kc = rng.standard_normal(shape).astype(np.float32)
        vc = rng.standard_normal(shape).astype(np.float32)
        ks = vs = None
    junk = np.array([np.nan, np.inf, -np.inf, 1e38], np.float32)
    for i in range(s):
        n = pos[i] + nq
        if n >= cap:
            continue
        cyc = np.resize(junk, (cap - n) * hkv * hd).reshape(cap - n, hkv, hd)
        if kv_dtype == "int8":
            kc[i, n:] = np.where(cyc > 0, 127, -128)
            vc[i, n:] = np.where(cyc > 0, -128, 127)
            ks[i, n:] = cyc[..., 0]
            vs[i, n:] = cyc[..., 1 % hd]
        else:
            kc[i, n:] = cyc
            vc[i, n:] = np.roll(cyc, 1)
    kc, vc = (jnp.asarray(x, kv_dtype) for x in (kc, vc))
    if ks is not None:
        ks, vs = jnp.asarray(ks), jnp.asarray(vs)
    return q, kc, vc, ks, vs, jnp.asarray(pos, jnp.int32)


@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda sh: "S{}Q{}H{}-{}d{}C{}bk{}x{}".format(*sh[:8]))
def test_kernel_and_xla_match_the_reference(shape, kv_dtype, q_dtype, interpret):
    s, nq, hq, hkv, hd, cap, block_k, n_splits, pos = shape
    rng = np.random.default_rng(list(shape[:8]) + [len(kv_dtype), len(q_dtype)])
    args = make_inputs(rng, s, nq, hq, hkv, hd, cap, pos, kv_dtype, q_dtype)
    scale = hd ** -0.5
    want = K._reference(*args, scale)
    assert np.isfinite(want).all()
    got = K.decode_attention(*args, scale=scale, interpret=interpret, block_k=block_k, n_splits=n_splits)
    xla = K.decode_attention_xla(*args, scale=scale)
    for name, out in (("kernel", got), ("xla", xla)):
        assert_matches(out, want, (s, nq, hq, hd), q_dtype, f"{name}, {kv_dtype} cache")


def in_bank(x, rows, size):
    """x [S, ...] placed at rows of a bank of `size` rows whose other rows are junk (x's rows reversed, rolled)."""
    x = np.asarray(x)
    bank = np.roll(np.concatenate([x[::-1]] * (size // len(x) + 1))[:size], 1, axis=1)
    bank[rows] = x
    return jnp.asarray(bank)


@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16", "float32"])
def test_rows_read_their_bank_rows(kv_dtype, interpret):
    """Caches that are banks with more rows than the batch (a decode window of fewer rows than slots): row s reads
    bank row rows[s], and the bank rows no batch row names never reach the result."""
    s, nq, hq, hkv, hd, cap, block_k, n_splits, pos = SHAPES[2]
    q_dtype = "bfloat16" if kv_dtype != "float32" else "float32"
    rng = np.random.default_rng(len(kv_dtype))
    q, kc, vc, ks, vs, p = make_inputs(rng, s, nq, hq, hkv, hd, cap, pos, kv_dtype, q_dtype)
    want = K._reference(q, kc, vc, ks, vs, p, hd ** -0.5)
    rows = [4, 0, 2]
    banks = [None if x is None else in_bank(x, rows, 6) for x in (kc, vc, ks, vs)]
    got = K.decode_attention(q, *banks, p, jnp.asarray(rows, jnp.int32), scale=hd ** -0.5, interpret=interpret,
                             block_k=block_k, n_splits=n_splits)
    assert_matches(got, want, (s, nq, hq, hd), q_dtype, f"banked, {kv_dtype} cache")


def assert_rounded_from_float32(got, want, name):
    """got (bfloat16 values) is want rounded to bfloat16 but for a few elements near a rounding midpoint: what
    bfloat16 arithmetic inside (probabilities rounded to bfloat16) would not give."""
    rounded = np.asarray(jnp.asarray(want, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    off = float(np.mean(got != rounded))
    assert off <= BF16_OFF_MAX, f"{name}: {off:.2%} of outputs are not the float32 result rounded to bfloat16"


def assert_matches(got, want, shape, q_dtype, name):
    """got (the kernel's output) has this shape and q's dtype, no garbage key reached it, and it is the float64
    reference within LIMIT (bfloat16: the float32 result rounded, but for midpoints)."""
    assert got.shape == shape and got.dtype == jnp.dtype(q_dtype)
    got = np.asarray(got.astype(jnp.float32))
    assert np.isfinite(got).all(), f"{name}: garbage keys reached the result"
    err = rel_err(got, want)
    assert err <= LIMIT[q_dtype], f"{name}, q {q_dtype}: relative error {err:.2e}"
    if q_dtype == "bfloat16":
        assert_rounded_from_float32(got, want, name)


def test_default_blocks_and_splits(interpret):
    """The public call with the module's block and split choices (2 blocks of 64 keys, 2 splits here)."""
    rng = np.random.default_rng(7)
    s, nq, hq, hkv, hd, cap, pos = 3, 1, 4, 2, 32, 128, [100, 0, 127]
    args = make_inputs(rng, s, nq, hq, hkv, hd, cap, pos, "int8", "bfloat16")
    assert K._check(*args, None, None) == (64, 2)
    # real shapes at S = 1: 64 keys per block (32 for a float32 cache, whose tiles are twice bf16's); splits fill
    # whole waves of the 132 SMs with the shortest walk: 64 (one per block) for 64 blocks, 66 x Hkv 2 for 128 blocks
    q, pos1 = jnp.zeros((1, 1, 16, 256), jnp.bfloat16), jnp.zeros((1,), jnp.int32)
    for dt, scales, bk, splits in (("int8", jnp.zeros((1, 4096, 2)), 64, 64), ("bfloat16", None, 64, 64),
                                   ("float32", None, 32, 66)):
        kv = jnp.zeros((1, 4096, 2, 256), dt)
        assert K._check(q, kv, kv, scales, scales, pos1, None, None) == (bk, splits)
    # a wave's worth: 16 rows x 2 kv heads take 33 splits (8 full waves), not 9 (3 waves, the last 24 programs)
    assert K._splits(32, 128) == 33 and K._splits(2, 128) == 66 and K._splits(2, 1) == 1
    got = np.asarray(K.decode_attention(*args, scale=0.2, interpret=interpret).astype(jnp.float32))
    want = K._reference(*args, 0.2)
    assert rel_err(got, want) <= LIMIT["bfloat16"]
    assert_rounded_from_float32(got, want, "kernel")


@pytest.mark.parametrize("block_k", [16, 64])
@pytest.mark.parametrize("n_splits", [1, 2, 3, 5, 64])
def test_splits_read_each_visible_block_once_and_none_past_the_row(block_k, n_splits):
    cap = 4096
    for n in range(1, cap + 1, 37):
        ranges = [tuple(int(x) for x in K._split_blocks(n, j, block_k, n_splits)) for j in range(n_splits)]
        read = [b for lo, hi in ranges for b in range(lo, hi)]
        assert read == list(range(-(-n // block_k))), (n, ranges)    # in order, each once, the last holds key n-1


def test_shapes_it_cannot_handle_are_refused():
    q = jnp.zeros((1, 1, 4, 32), jnp.bfloat16)
    kv = jnp.zeros((1, 64, 2, 32), jnp.bfloat16)
    pos = jnp.zeros((1,), jnp.int32)
    call = lambda q, k, ks=None, vs=None, **kw: K.decode_attention(  # noqa: E731
        q, k, k, ks, vs, pos, scale=1.0, interpret=True, **kw)
    with pytest.raises(ValueError, match="power of two"):
        call(jnp.zeros((1, 1, 4, 48), jnp.bfloat16), jnp.zeros((1, 64, 2, 48), jnp.bfloat16))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        call(jnp.zeros((1, 1, 6, 32), jnp.bfloat16), jnp.zeros((1, 64, 4, 32), jnp.bfloat16))
    with pytest.raises(ValueError, match="Cap=40 must be a multiple of 16"):
        call(q, jnp.zeros((1, 40, 2, 32), jnp.bfloat16))
    with pytest.raises(ValueError, match="block_k=24 must be a power of two"):
        call(q, kv, block_k=24)
    with pytest.raises(ValueError, match="k_scale"):
        call(q, kv.astype(jnp.int8))
    with pytest.raises(ValueError, match="no scales"):
        call(q, kv, jnp.ones((1, 64, 2)), jnp.ones((1, 64, 2)))


# --- the prompt form: one sequence's prompt part of T queries (real rows at start .., padded rows at position 0)

# (T, n_valid, Hq, Hkv, hd, Cap, start, block_q, block_k): several query blocks and key blocks; a part at 0, one
# after earlier context off block boundaries with padded rows, one whose last query sees every key (no garbage)
PROMPT_SHAPES = [
    (16, 16, 4, 2, 32, 128, 0, 8, 16),
    (32, 29, 8, 1, 64, 128, 37, 2, 16),
    (16, 16, 4, 1, 32, 64, 48, 4, 32),
    (64, 50, 4, 2, 32, 128, 5, None, None),
]


def prompt_inputs(rng, t, n_valid, hq, hkv, hd, cap, start, kv_dtype, q_dtype):
    """q [T, Hq, hd], a cache [Cap, Hkv, hd] whose keys past the part's last real position are garbage (as
    make_inputs), and q_pos: start + i for the n_valid real rows, 0 for the padded ones."""
    q, kc, vc, ks, vs, _ = make_inputs(rng, 1, 1, hq, hkv, hd, cap, [start + n_valid - 1], kv_dtype, q_dtype)
    q = jnp.asarray(rng.standard_normal((t, hq, hd)), q_dtype)
    q_pos = np.where(np.arange(t) < n_valid, start + np.arange(t), 0).astype(np.int32)
    first = lambda x: None if x is None else x[0]          # noqa: E731
    return q, kc[0], vc[0], first(ks), first(vs), jnp.asarray(q_pos)


@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", PROMPT_SHAPES, ids=lambda sh: "T{}n{}H{}-{}d{}C{}s{}bq{}bk{}".format(*sh))
def test_prompt_kernel_matches_the_reference(shape, kv_dtype, q_dtype, interpret):
    t, n_valid, hq, hkv, hd, cap, start, block_q, block_k = shape
    rng = np.random.default_rng([t, n_valid, hq, cap, start, len(kv_dtype), len(q_dtype)])
    args = prompt_inputs(rng, t, n_valid, hq, hkv, hd, cap, start, kv_dtype, q_dtype)
    scale = hd ** -0.5
    want = K._reference_prompt(*args, scale)
    assert np.isfinite(want).all()
    got = K.prompt_attention(*args, scale=scale, interpret=interpret, block_q=block_q, block_k=block_k)
    assert_matches(got, want, (t, hq, hd), q_dtype, f"prompt kernel, {kv_dtype} cache")


def test_prompt_kernel_is_the_backends_attention(interpret):
    """The backend's attention for a prompt part (more than ATTN_ONE_PASS_ROWS rows) with the kernel chosen gives
    its XLA form's result: the same float32 arithmetic but for summation order, one rounding to bfloat16. (The
    cache past the part is zeros, as the engine's: the XLA form reads the whole last key block and does not mask
    garbage there.)"""
    from strata.jax_backend.backend import JaxBackend
    rng = np.random.default_rng(11)
    q, kc, vc, ks, vs, q_pos = prompt_inputs(rng, 64, 60, 4, 2, 32, 128, 30, "int8", "bfloat16")
    n = 30 + 60
    kc, vc, ks, vs = (x.at[n:].set(0) for x in (kc, vc, ks, vs))
    args = q, kc, vc, ks, vs, q_pos
    ops = JaxBackend(kernels="pallas")
    got = np.asarray(ops.attention(q, kc, vc, q_pos, 32 ** -0.5, ks, vs).astype(jnp.float32))
    xla = np.asarray(JaxBackend.attention_xla(q, kc, vc, q_pos, 32 ** -0.5, ks, vs).astype(jnp.float32))
    want = K._reference_prompt(*args, 32 ** -0.5)
    assert rel_err(got, want) <= LIMIT["bfloat16"] and rel_err(xla, want) <= LIMIT["bfloat16"]
    assert float(np.mean(got != xla)) <= BF16_OFF_MAX


def test_the_backend_reads_prompt_block_k_from_its_kernel_config(interpret, monkeypatch):
    """KernelConfig.prompt_block_k (here 16 keys a step, over a bf16 cache) reaches the prompt kernel, whose result
    is the reference's; 0 leaves the kernel its own."""
    from strata.jax_backend.backend import JaxBackend
    from strata.jax_backend.kernel_config import KernelConfig
    seen, real = [], K.prompt_attention
    monkeypatch.setattr(K, "prompt_attention", lambda *a, **kw: (seen.append(kw["block_k"]), real(*a, **kw))[1])
    rng = np.random.default_rng(12)
    q, kc, vc, ks, vs, q_pos = prompt_inputs(rng, 32, 29, 8, 1, 64, 128, 37, "bfloat16", "bfloat16")
    want = K._reference_prompt(q, kc, vc, ks, vs, q_pos, 64 ** -0.5)
    for cfg, block_k in ((KernelConfig(prompt_block_k=16), 16), (KernelConfig(), None)):
        ops = JaxBackend(kernels="pallas", kernel_config=cfg)
        got = ops.attention(q, kc, vc, q_pos, 64 ** -0.5)
        assert seen[-1] == block_k
        assert_matches(got, want, (32, 8, 64), "bfloat16", f"prompt_block_k {block_k}")


def test_prompt_shapes_it_cannot_handle_are_refused():
    kv = jnp.zeros((64, 2, 32), jnp.bfloat16)
    call = lambda q, k=kv, **kw: K.prompt_attention(  # noqa: E731
        q, k, k, None, None, jnp.zeros((q.shape[0],), jnp.int32), scale=1.0, interpret=True, **kw)
    with pytest.raises(ValueError, match="multiple of block_q"):
        call(jnp.zeros((12, 4, 32), jnp.bfloat16), block_q=8)
    with pytest.raises(ValueError, match="power of two"):
        call(jnp.zeros((12, 4, 32), jnp.bfloat16), block_q=6)
    with pytest.raises(ValueError, match=r"q_pos must be \[T\]"):
        K.prompt_attention(jnp.zeros((16, 4, 32), jnp.bfloat16), kv, kv, None, None, jnp.zeros((8,), jnp.int32),
                           scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="Cap=40 must be a multiple of 16"):
        call(jnp.zeros((16, 4, 32), jnp.bfloat16), jnp.zeros((40, 2, 32), jnp.bfloat16))
    assert not K.prompt_supported(jnp.zeros((12, 4, 32), jnp.bfloat16), kv, kv, None, None,
                                  jnp.zeros((12,), jnp.int32))


# (S, Q, Hq, Hkv, hd, Cap, pos, n_host): a row with no host keys, one whose host part ends inside a key block, one
# whose device part holds only the query's own key(s); Cap of each tier a multiple of 16
TIERED = [
    (3, 1, 4, 2, 32, 128, [100, 40, 127], [0, 37, 127]),
    (2, 3, 8, 1, 64, 96, [93, 20], [64, 5]),
]


@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", TIERED, ids=lambda sh: "S{}Q{}H{}-{}d{}C{}".format(*sh[:6]))
def test_tiered_rows_equal_one_cache(shape, kv_dtype, interpret):
    """A row's keys split at n_host between a host tier (every key seen by every query) and the device cache (key i
    at position n_host + i) give the reference over the one cache they came from; whatever lies past either tier's
    part (poisoned: NaN, inf) never reaches the result."""
    out, want, q_dtype = tiered_case(shape, kv_dtype, interpret)
    assert rel_err(out, want) <= LIMIT[q_dtype]
    if q_dtype == "bfloat16":
        assert_rounded_from_float32(out, want, "tiered")


@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16"])
def test_tiered_rows_read_their_bank_rows(kv_dtype, interpret):
    """Host tiers as banks with more rows than the batch (parked conversations' rows among them): row s reads bank
    row rows[s], and the rows no batch row names (junk) never reach the result."""
    out, want, q_dtype = tiered_case(TIERED[0], kv_dtype, interpret, bank_rows=[4, 0, 2])
    assert rel_err(out, want) <= LIMIT[q_dtype]


@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16"])
def test_tiered_rows_read_their_device_bank_rows(kv_dtype, interpret):
    """The device tier as a bank too (a decode window of fewer rows than slots): row s's device keys at dev_rows[s],
    its host keys at its own host bank row."""
    out, want, q_dtype = tiered_case(TIERED[0], kv_dtype, interpret, bank_rows=[4, 0, 2], dev_rows=[1, 3, 0])
    assert rel_err(out, want) <= LIMIT[q_dtype]


def tiered_case(shape, kv_dtype, interpret, dev_cap=None, bank_rows=None, dev_rows=None):
    """tiered_decode_attention on a TIERED case (the device tier dev_cap keys, default Cap; bank_rows: the host
    tiers are banks of max(bank_rows) + 1 rows, row s's at bank_rows[s], the others junk; dev_rows: the device
    tiers banks the same way) -> (output as float32 numpy, the reference over the one cache, q's dtype); asserts the
    output's shape and that it is finite."""
    s, nq, hq, hkv, hd, cap, pos, n_host = shape
    q_dtype = "bfloat16" if kv_dtype != "float32" else "float32"
    rng = np.random.default_rng(list(shape[:6]) + [len(kv_dtype)])
    q, kc, vc, ks, vs, p = make_inputs(rng, s, nq, hq, hkv, hd, cap, pos, kv_dtype, q_dtype)
    want = K._reference(q, kc, vc, ks, vs, p, hd ** -0.5)
    host_cap, dev_cap = cap, dev_cap or cap            # each tier poisoned past its part: rolled copies of the junk
    junk = lambda x: np.roll(np.asarray(x), 1, axis=1)            # noqa: E731 - row i's junk from the last rows
    hosts, devs = [], []
    for full in (kc, vc) + ((ks, vs) if ks is not None else ()):
        a = np.asarray(full)
        h, d = junk(a)[:, :host_cap].copy(), junk(a)[:, :dev_cap].copy()
        for i, nh in enumerate(n_host):
            h[i, :nh] = a[i, :nh]
            live = pos[i] + nq - nh                      # device keys of row i: positions nh .. pos + Q - 1
            d[i, :live] = a[i, nh:nh + live]
            d[i, live:] = a[i, -1:] if kv_dtype != "int8" else d[i, live:]
        hosts.append(jnp.asarray(h))
        devs.append(jnp.asarray(d))
    if bank_rows is not None:               # each row moved to its bank row; the rest of the bank is junk
        banks = []
        for h in hosts:
            bank = np.concatenate([np.asarray(h)[::-1]] * (max(bank_rows) // s + 1))[:max(bank_rows) + 1]
            bank[bank_rows] = np.asarray(h)
            banks.append(jnp.asarray(bank))
        hosts = banks
    if dev_rows is not None:
        devs = [in_bank(d, dev_rows, max(dev_rows) + 2) for d in devs]
    if ks is None:
        hosts[2:], devs[2:] = [None, None], [None, None]
    n = jnp.asarray(n_host, jnp.int32)
    rows, dev = (None if r is None else jnp.asarray(r, jnp.int32) for r in (bank_rows, dev_rows))
    got = K.tiered_decode_attention(q, devs[0], devs[1], devs[2], devs[3], p - n, hosts[0], hosts[1], hosts[2],
                                    hosts[3], n, rows, dev, scale=hd ** -0.5, interpret=interpret)
    out = np.asarray(got.astype(jnp.float32))
    assert out.shape == (s, nq, hq, hd) and np.isfinite(out).all()
    return out, want, q_dtype
