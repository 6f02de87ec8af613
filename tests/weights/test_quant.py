"""Expert blob formats (strata/weights/quant.py): layouts, round-trip error on fresh gaussian weights, the exactness
properties of each format, and the errors a bad format or bad dimensions give."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from strata.errors import ConfigError, ModelLoadError
from strata.weights import quant as Q

SHAPES = [(96, 32), (256, 128)]   # (hidden, inter): the demo model's, and one with full int4 groups


def fresh_rng():
    """A generator on a fresh seed, and the seed (for the failure message)."""
    seed = int(np.random.SeedSequence().entropy % 2**63)
    return np.random.default_rng(seed), seed


def gaussian_expert(rng, lay, scale=0.02):
    return [(rng.standard_normal(lay.shape_of(m)) * scale).astype(np.float32) for m in Q.MATRICES]


@pytest.mark.parametrize("fmt", Q.FORMATS)
@pytest.mark.parametrize("hidden,inter", SHAPES)
def test_layout_alignment_and_padding(fmt, hidden, inter):
    lay = Q.layout(fmt, hidden, inter)
    assert lay.nbytes % Q.BLOB_ALIGN == 0 and lay.nbytes >= lay.fields[-1].end
    ends = 0
    for f in lay.fields:
        assert f.offset % Q.FIELD_ALIGN == 0, f
        assert f.offset >= ends, "fields overlap"
        ends = f.end
    hash(lay)                                                   # a static argument of jitted functions
    assert Q.layout(fmt, hidden, inter) == lay
    rng, _ = fresh_rng()
    blob = Q.encode_expert(lay, *gaussian_expert(rng, lay))
    assert blob.dtype == np.uint8 and blob.shape == (lay.nbytes,)
    used = np.zeros(lay.nbytes, bool)
    for f in lay.fields:
        used[f.offset:f.end] = True
    assert not blob[~used].any(), "padding bytes must be zero"


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_field_names(fmt):
    lay = Q.layout(fmt, 96, 32)
    names = {f.name for f in lay.fields}
    if fmt in ("f32", "bf16"):
        assert names == {"gate", "up", "down"}
    else:
        parts = ("q", "s", "z") if fmt == "int4" else ("q", "s")
        want = {f"{m}.{p}" for m in Q.MATRICES for p in parts} | ({"tail"} if fmt == "nvfp4" else set())
        assert names == want
    with pytest.raises(KeyError):
        lay.field("nope")


@pytest.mark.parametrize("fmt", Q.FORMATS)
@pytest.mark.parametrize("hidden,inter", SHAPES)
def test_describe_round_trips_through_json(fmt, hidden, inter):
    lay = Q.layout(fmt, hidden, inter)
    assert Q.BlobLayout.from_dict(json.loads(json.dumps(lay.describe()))) == lay


def test_from_dict_rejects_a_layout_that_differs():
    d = Q.layout("int4", 256, 128).describe()
    d["fields"][1]["offset"] += 64
    with pytest.raises(ModelLoadError, match="differs"):
        Q.BlobLayout.from_dict(d)
    with pytest.raises(ModelLoadError):
        Q.BlobLayout.from_dict({"fmt": "int4"})
    with pytest.raises(ModelLoadError, match="allowed"):
        Q.BlobLayout.from_dict(dict(Q.layout("f32", 96, 32).describe(), fmt="fp8"))


@pytest.mark.parametrize("fmt", Q.FORMATS)
@pytest.mark.parametrize("hidden,inter", SHAPES)
def test_round_trip_error_within_stated_bound(fmt, hidden, inter):
    lay = Q.layout(fmt, hidden, inter)
    rng, seed = fresh_rng()
    for _ in range(3):
        ws = gaussian_expert(rng, lay, scale=float(rng.uniform(0.005, 2.0)))
        for m, w, d in zip(Q.MATRICES, ws, Q.decode_expert(lay, Q.encode_expert(lay, *ws))):
            assert d.dtype == np.float32 and d.shape == w.shape
            err = np.linalg.norm(d - w) / np.linalg.norm(w)
            assert err <= Q.REL_ERROR[fmt], f"{fmt} {m}: relative error {err:.5f} > {Q.REL_ERROR[fmt]} (seed {seed})"


def test_f32_is_exact_and_bf16_rounds_like_ml_dtypes():
    rng, seed = fresh_rng()
    for fmt in ("f32", "bf16"):
        lay = Q.layout(fmt, 96, 32)
        ws = gaussian_expert(rng, lay, scale=1.0)
        ws[0][0, :4] = [0.0, -0.0, 1e-40, 3.0e38]                  # zero, negative zero, subnormal, near max
        for w, d in zip(ws, Q.decode_expert(lay, Q.encode_expert(lay, *ws))):
            want = w if fmt == "f32" else w.astype(ml_dtypes.bfloat16).astype(np.float32)
            assert np.array_equal(d.view(np.uint32), want.view(np.uint32)), f"{fmt} (seed {seed})"


def test_int8_rows_zero_rows_and_step():
    lay = Q.layout("int8", 256, 128)
    rng, seed = fresh_rng()
    ws = gaussian_expert(rng, lay)
    ws[0][3] = 0.0
    ws[2][:2] = 0.0
    blob = Q.encode_expert(lay, *ws)
    dec = Q.decode_expert(lay, blob)
    for m, w, d in zip(Q.MATRICES, ws, dec):
        q = Q._get(blob, lay.field(f"{m}.q"))
        s = Q._get(blob, lay.field(f"{m}.s"))
        zero = ~w.any(axis=1)
        assert np.all(s[zero] == 0) and np.all(q[zero] == 0)
        assert np.array_equal(d[zero], np.zeros_like(d[zero])) and not np.signbit(d[zero]).any()
        assert np.abs(q).max() <= 127
        # symmetric round-to-nearest: every value within half a step; each row's largest value at +-127 steps
        # (plus the float32 rounding of w / s and of q * s)
        assert np.all(np.abs(d - w) <= 0.5 * s[:, None] + 2.0 ** -21 * np.abs(w)), f"seed {seed}"
        amax_q = np.abs(q[~zero]).max(axis=1)
        assert np.all(amax_q == 127)
        np.testing.assert_allclose(np.abs(d).max(axis=1), np.abs(w).max(axis=1), rtol=1e-6)


@pytest.mark.parametrize("hidden,inter", SHAPES)
def test_int4_groups_zero_points_and_extremes(hidden, inter):
    lay = Q.layout("int4", hidden, inter)
    rng, seed = fresh_rng()
    ws = gaussian_expert(rng, lay)
    ws[1][0] = 0.0                                               # an all-zero row: every group of it is zero
    ws[2][1] = np.abs(ws[2][1]) + 0.01                           # an all-positive row: its range is widened to 0
    blob = Q.encode_expert(lay, *ws)
    for m, w, d in zip(Q.MATRICES, ws, Q.decode_expert(lay, blob)):
        rows, cols = lay.shape_of(m)
        g = lay.group_of(m)
        assert g == min(Q.INT4_GROUP, cols) and cols % g == 0
        s = Q._get(blob, lay.field(f"{m}.s")).astype(np.float32)          # [rows, cols/g]
        z = Q._get(blob, lay.field(f"{m}.z"))
        assert s.shape == (rows, cols // g) and z.max() <= 15
        # round to nearest on a grid whose ends sit within s/2 (+ float16 rounding of s) of the group's min and max
        # (the float16 rounding of s moves the grid's far end by up to 15 * s * 2^-11)
        half = (0.5 + 16 * 2.0 ** -11) * s + 1e-9
        bound = np.repeat(half, g, axis=1)
        assert np.all(np.abs(d - w) <= bound), f"{m} (seed {seed})"
        wg, dg = w.reshape(rows, -1, g), d.reshape(rows, -1, g)
        for ext in (np.argmin, np.argmax):
            i = ext(wg, axis=-1)[..., None]
            err = np.abs(np.take_along_axis(dg, i, -1) - np.take_along_axis(wg, i, -1))[..., 0]
            assert np.all(err <= half), f"{m} extremes (seed {seed})"
        zero = ~wg.any(axis=-1)
        assert np.all(s[zero] == 0) and np.all(dg[zero] == 0)
    d_down = Q.decode_expert(lay, blob)[2]
    assert np.all(d_down[1] >= 0)                                 # no negative values invented in a positive row


def test_int4_packs_low_nibble_first():
    lay = Q.layout("int4", 96, 32)
    gate = np.tile(np.arange(16, dtype=np.float32), (32, 6))      # [32, 96]: 0..15 repeated: s = 1, z = 0
    zeros_up, zeros_down = np.zeros((32, 96), np.float32), np.zeros((96, 32), np.float32)
    blob = Q.encode_expert(lay, gate, zeros_up, zeros_down)
    q = Q._get(blob, lay.field("gate.q"))
    assert q[0, 0] == 0x10 and q[0, 1] == 0x32                    # columns (0, 1) and (2, 3)
    assert np.array_equal(Q.decode_expert(lay, blob)[0], gate)


@pytest.mark.parametrize("hidden,inter", SHAPES)
def test_nvfp4_values_on_the_e2m1_grid(hidden, inter):
    lay = Q.layout("nvfp4", hidden, inter)
    rng, seed = fresh_rng()
    ws = gaussian_expert(rng, lay)
    ws[0][2, :16] = 0.0                                           # a zero block
    blob = Q.encode_expert(lay, *ws)
    tail = Q._get(blob, lay.field("tail"))
    assert tail[3] == 0
    grid = np.unique(Q.E2M1_LUT)
    for i, (m, w, d) in enumerate(zip(Q.MATRICES, ws, Q.decode_expert(lay, blob))):
        rows, cols = lay.shape_of(m)
        gs = tail[i]
        assert gs == np.float32(np.abs(w).max() / np.float32(6 * 448))
        bs = Q._get(blob, lay.field(f"{m}.s")).astype(np.float32)         # [rows, cols/16]
        assert bs.shape == (rows, cols // 16) and bs.max() <= 448
        scale = bs * gs                                                    # [rows, cols/16]
        nz = scale > 0
        dv = d.reshape(rows, -1, 16)[nz]
        v = grid[np.abs(dv / scale[nz][:, None] - grid[:, None, None]).argmin(axis=0)]   # nearest grid value
        rebuilt = (v * bs[nz][:, None]) * gs
        assert np.array_equal(rebuilt, dv), f"{m}: values off the e2m1 grid (seed {seed})"
        # each value is the grid point nearest to w / scale (saturating at +-6)
        target = w.reshape(rows, -1, 16)[nz] / scale[nz][:, None]
        best = np.abs(np.clip(target, -6, 6)[..., None] - grid).min(axis=-1)
        assert np.all(np.abs(np.clip(target, -6, 6) - v) <= best + 1e-6 * np.abs(target) + 1e-12), f"seed {seed}"
        assert np.all(d.reshape(rows, -1, 16)[~nz] == 0)
    assert np.all(Q.decode_expert(lay, blob)[0][2, :16] == 0)


def test_nvfp4_rounds_ties_to_even():
    v = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -5.0, -0.1], np.float32)
    codes = Q._e2m1_codes(v)
    assert list(Q.E2M1_LUT[codes]) == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.0, -4.0, 0.0]
    assert codes[-1] == 0 and codes[-3] == 0                      # zero is stored without its sign


def test_bad_format_and_bad_dimensions_are_config_errors():
    with pytest.raises(ConfigError, match=r"unknown expert format 'fp8'.*f32, bf16, int8, int4, nvfp4"):
        Q.layout("fp8", 96, 32)
    with pytest.raises(ConfigError, match=r"int4.*hidden.*multiple of 128"):
        Q.layout("int4", 200, 128)
    with pytest.raises(ConfigError, match=r"int4.*inter.*even"):
        Q.layout("int4", 256, 33)
    with pytest.raises(ConfigError, match=r"nvfp4.*hidden.*multiple of 16"):
        Q.layout("nvfp4", 72, 32)
    with pytest.raises(ConfigError, match=r"nvfp4.*inter.*multiple of 16"):
        Q.layout("nvfp4", 96, 40)
    with pytest.raises(ConfigError, match="positive integer"):
        Q.layout("f32", 0, 32)
    for fmt in ("f32", "bf16", "int8"):
        Q.layout(fmt, 72, 33)                                     # any size works for the ungrouped formats


def test_encode_rejects_wrong_shapes_and_non_finite_weights():
    lay = Q.layout("int8", 96, 32)
    w = np.zeros((32, 96), np.float32)
    with pytest.raises(ValueError, match="shape"):
        Q.encode_expert(lay, w, w, w)
    bad = w.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        Q.encode_expert(lay, bad, w, w.T)


def test_expert_reference_matches_direct_formula_and_skips():
    lay = Q.layout("f32", 96, 32)
    rng, seed = fresh_rng()
    experts = [gaussian_expert(rng, lay, scale=0.2) for _ in range(3)]
    pool = np.stack([Q.encode_expert(lay, *e) for e in experts])
    x = rng.standard_normal((4, 96)).astype(np.float32)
    slots = np.array([[0, 2], [1, -1], [-1, -1], [2, 2]])
    weight = rng.random((4, 2)).astype(np.float32)
    got = Q.expert_reference(lay, pool, x, slots, weight)
    want = np.zeros((4, 96))
    for t in range(4):
        for j in range(2):
            if slots[t, j] >= 0:
                g, u, d = (m.astype(np.float64) for m in experts[slots[t, j]])
                h = g @ x[t]
                want[t] += weight[t, j] * (d @ (h / (1 + np.exp(-h)) * (u @ x[t])))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=f"seed {seed}")
    assert np.all(got[2] == 0)
