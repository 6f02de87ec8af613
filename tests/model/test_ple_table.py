"""The PLE table's formats and places (strata/model/ple_table.py): conversions equal their numpy definitions, a host
gather over row blocks equals indexing the whole table, the plan puts the table where its rule says and refuses what
cannot hold it, and a model whose table is in host RAM or read from its files gives exactly the device table's
logits and text, in every format; a checkpoint's float8 table (shards with their scales) equals its dequantized
float table loaded as is."""
from __future__ import annotations

import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from safetensors_writer import save

from strata import Engine
from strata.demo import write_demo_flash_model
from strata.errors import ConfigError, ModelLoadError
from strata.experts.planner import GIB, place_ple_table
from strata.host_rows import HostRows
from strata.model.ple_table import FP8_VALUES, mapped_table, stored_table, table_bytes

PLE = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding."
PROMPT = [5, 80, 256, 17, 300, 42, 42, 9, 256, 256, 12, 99] * 3


def _blocks(rng, rows=(40, 40, 17), dim=6):
    return [rng.standard_normal((r, dim)).astype(np.float32) for r in rows]


def test_int8_rows_are_the_rounded_values_over_each_rows_largest_magnitude():
    blocks = _blocks(np.random.default_rng(0))
    values, scale = stored_table(blocks, None, "int8", np.float32)
    x = np.concatenate(blocks)
    want_scale = (np.abs(x).max(axis=1) / 127).astype(np.float32)
    assert values.dtype == np.int8 and np.array_equal(scale, want_scale)
    assert np.array_equal(values, np.clip(np.rint(x / want_scale[:, None]), -127, 127).astype(np.int8))
    assert np.abs(values * scale[:, None] - x).max() <= want_scale.max() / 2 + 1e-6


def test_float8_is_e4m3_of_the_values_over_one_scale_for_the_table():
    blocks = _blocks(np.random.default_rng(1))
    values, scale = stored_table(blocks, None, "float8", np.float32)
    x = np.concatenate(blocks)
    s = np.float32(np.abs(x).max() / 448.0)
    assert scale.shape == (1,) and scale[0] == s
    assert np.array_equal(values, (x / s).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    assert np.array_equal(FP8_VALUES[values], values.view(ml_dtypes.float8_e4m3fn).astype(np.float32))


def test_a_float8_checkpoint_table_keeps_its_bytes_and_a_scale_per_shard():
    rng = np.random.default_rng(2)
    blocks = [b.astype(ml_dtypes.float8_e4m3fn) for b in _blocks(rng, (32, 32, 32))]
    scales = [np.array([0.5], np.float32), np.array([2.0], np.float32), np.array([0.25], np.float32)]
    values, scale = stored_table(blocks, scales, "auto", np.float32)
    assert np.array_equal(values, np.concatenate(blocks).view(np.uint8))
    assert np.array_equal(scale, [0.5, 2.0, 0.25])            # one per group of 32 rows
    as_int8, _ = stored_table(blocks, scales, "int8", np.float32)     # converted from the dequantized values
    as_float, _ = stored_table(blocks, scales, "bfloat16", np.float32)
    deq = np.concatenate([b.astype(np.float32) * s for b, s in zip(blocks, scales)])
    assert as_float.dtype == ml_dtypes.bfloat16 and np.array_equal(as_float, deq.astype(ml_dtypes.bfloat16))
    assert as_int8.shape == deq.shape


def test_a_host_gather_over_uneven_blocks_equals_indexing_the_whole_table():
    rng = np.random.default_rng(3)
    blocks = [b.astype(np.int8) for b in _blocks(rng, (16, 16, 5))]
    scale = rng.random(37).astype(np.float32)                  # a scale a row
    table = HostRows(blocks, scale, "host")
    ids = rng.integers(0, 37, (3, 2, 8)).astype(np.int32)
    values, scales = table.gather(ids)
    whole = np.concatenate(blocks)
    assert values.shape == (3, 2, 8, 6) and np.array_equal(values, whole[ids]) and np.array_equal(scales, scale[ids])


def test_disk_reads_the_table_as_stored_and_refuses_a_conversion():
    blocks = [b.astype(ml_dtypes.float8_e4m3fn) for b in _blocks(np.random.default_rng(4), (8, 8))]
    table = mapped_table(blocks, [np.ones(1, np.float32)] * 2, "float8")
    assert table.place == "disk" and table.dtype == np.uint8 and table.rows == 16
    with pytest.raises(ConfigError, match="ple_format to auto or float8"):
        mapped_table(blocks, None, "int8")


@pytest.mark.parametrize("setting, device_free, ram, place", [
    ("auto", None, None, "device"),                      # the device does not say: as before, on it
    ("auto", 80 * GIB, 100 * GIB, "device"),             # 10 GiB: within a quarter of the device
    ("auto", 30 * GIB, 100 * GIB, "host"),
    ("auto", 30 * GIB, 15 * GIB, "disk"),
    ("host", 80 * GIB, 100 * GIB, "host"),               # the setting overrides the rule
])
def test_the_plan_places_the_table_by_its_rule_or_the_setting(setting, device_free, ram, place):
    assert place_ple_table(10 * GIB, setting, device_free, ram, from_file=True)[0] == place


@pytest.mark.parametrize("setting, device_free, ram, from_file, words", [
    ("host", 80 * GIB, 8 * GIB, True, "more than the 8.00 GiB of RAM available"),
    ("device", 8 * GIB, 100 * GIB, True, "more than the 8.00 GiB free on the device"),
    ("disk", 80 * GIB, 100 * GIB, False, "weights are drawn at load"),
])
def test_a_place_that_cannot_hold_the_table_is_refused_naming_both_figures(setting, device_free, ram, from_file,
                                                                          words):
    with pytest.raises(ConfigError, match=words):
        place_ple_table(10 * GIB, setting, device_free, ram, from_file=from_file)


def test_the_release_tables_bytes():
    rows = 320_001_536
    assert table_bytes(rows, 160, "float8", np.float32) / GIB == pytest.approx(47.68, abs=0.01)
    assert table_bytes(rows, 160, "bfloat16", np.float32) / GIB == pytest.approx(95.37, abs=0.01)


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    path = tmp_path_factory.mktemp("flash")
    write_demo_flash_model(path)
    return path


def _run(path, **settings):
    lines = []
    engine = Engine.load(path, max_context=128, say=lines.append, **settings)
    plan = next(line for line in lines if "PLE table" in line)
    return engine.logits(PROMPT), engine.generate(PROMPT[:9], 10), plan


@pytest.mark.parametrize("fmt", ["auto", "float8", "int8"])
def test_host_and_disk_tables_give_the_device_tables_logits_and_text(flash, fmt):
    logits, text, plan = _run(flash, ple_table="device", ple_format=fmt)
    assert "in cpu" in plan and np.isfinite(logits).all()
    for place, where in (("host", "host RAM"), ("disk", "checkpoint's files")):
        if place == "disk" and fmt != "auto":
            continue                                   # disk serves the stored format (refused above)
        other, other_text, other_plan = _run(flash, ple_table=place, ple_format=fmt)
        assert where in other_plan
        assert np.array_equal(other, logits) and other_text == text


def test_a_float8_checkpoint_equals_its_dequantized_table(flash, tmp_path):
    as_fp8, as_float = shutil.copytree(flash, tmp_path / "fp8"), shutil.copytree(flash, tmp_path / "deq")
    tensors = dict(load_file(str(flash / "model.safetensors")))
    shards = sorted(n for n in tensors if n.startswith(PLE + "shard_"))
    fp8, deq = dict(tensors), dict(tensors)
    for i, name in enumerate(shards):
        scale = np.float32(np.abs(tensors[name]).max() / 448.0 * (i + 1))  # a scale of its own per shard
        q = (tensors[name] / scale).astype(ml_dtypes.float8_e4m3fn)
        fp8[name] = q
        fp8[name.removesuffix("weight") + "weight_scale_inv"] = np.array([scale], np.float32)
        deq[name] = q.astype(np.float32) * scale
    save_file(deq, str(as_float / "model.safetensors"), metadata={"format": "pt"})
    save(fp8, as_fp8 / "model.safetensors")
    want, text, _ = _run(as_float)
    got, got_text, plan = _run(as_fp8)
    assert "float8" in plan and np.array_equal(got, want) and got_text == text
    got, got_text, _ = _run(as_fp8, ple_table="disk")
    assert np.array_equal(got, want) and got_text == text


def test_a_float8_table_without_its_scale_names_the_tensor(flash, tmp_path):
    path = shutil.copytree(flash, tmp_path / "noscale")
    tensors = dict(load_file(str(flash / "model.safetensors")))
    shards = sorted(n for n in tensors if n.startswith(PLE + "shard_"))
    for name in shards:
        tensors[name] = tensors[name].astype(ml_dtypes.float8_e4m3fn)
    save(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"shard_0.weight in .* is float8 but has no scale"):
        Engine.load(path, max_context=128)
