"""Loading qwen4_exp checkpoints (the published image-text layout, written by the demo-flash writer): the PLE table
whole or in shards gives the same logits, and a bad checkpoint or config is one clear error naming what is wrong,
raised before the engine takes any device memory."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors_writer import edit_tensors

from strata import Engine
from strata.demo import write_demo_flash_model
from strata.errors import ModelLoadError

PLE = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding."
PROMPT = [5, 80, 256, 17, 300, 42, 42, 9, 256, 256, 12, 99] * 3


@pytest.fixture(scope="module")
def flash(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("flash")
    write_demo_flash_model(path)
    return path


def _edit_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _load_error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as ei:
        Engine.load(path, max_context=128)
    return str(ei.value)


def test_the_table_whole_or_in_shards_gives_the_same_logits(flash, tmp_path):
    whole = shutil.copytree(flash, tmp_path / "whole")

    def join(t):
        names = sorted((n for n in t if n.startswith(PLE + "shard_")), key=lambda n: int(n.split("_")[-1][:-7]))
        assert len(names) == 4
        t[PLE + "weight"] = np.concatenate([t.pop(n) for n in names])
    edit_tensors(whole, join)
    a = Engine.load(flash, max_context=128).logits(PROMPT)
    b = Engine.load(whole, max_context=128).logits(PROMPT)
    assert np.isfinite(a).all() and np.array_equal(a, b)


def test_a_missing_shard_names_the_table_and_both_row_counts(flash, tmp_path):
    path = shutil.copytree(flash, tmp_path / "m")
    edit_tensors(path, lambda t: t.pop(PLE + "shard_3.weight"))
    msg = _load_error(path)
    assert PLE + "shard_0..2" in msg and str(path / "model.safetensors") in msg
    assert "rows, expected" in msg and "a shard is missing or truncated" in msg


def test_a_shard_of_the_wrong_width_names_it_and_the_width(flash, tmp_path):
    path = shutil.copytree(flash, tmp_path / "m")

    def widen(t):
        t[PLE + "shard_1.weight"] = np.zeros((t[PLE + "shard_1.weight"].shape[0], 13), np.float32)
    edit_tensors(path, widen)
    msg = _load_error(path)
    assert PLE + "shard_1.weight" in msg and ", 13]" in msg and "expected [rows, 12]" in msg


def test_a_missing_table_names_it(flash, tmp_path):
    path = shutil.copytree(flash, tmp_path / "m")
    edit_tensors(path, lambda t: [t.pop(n) for n in list(t) if n.startswith(PLE)])
    msg = _load_error(path)
    assert PLE + "weight" in msg and "missing" in msg


def test_a_config_for_another_table_size_is_caught_by_the_table(flash, tmp_path):
    path = shutil.copytree(flash, tmp_path / "m")
    _edit_config(path, lambda c: c["text_config"].update(ngram_vocab_size_base=2000))
    assert "ngram_vocab_size_base 2000" in _load_error(path)


@pytest.mark.parametrize("edit, words", [
    (lambda c: c.pop("text_config"), ["'text_config'"]),
    (lambda c: c["text_config"].pop("eos_token_id"), ["eos_token_id", "PLE"]),
    (lambda c: c["text_config"].update(ple_layer_ids=[4]), ["PLE layers", "linear_attention"]),
    (lambda c: c["text_config"].update(ple_layer_ids=[9]), ["ple_layer_ids", "1..4", "[9]"]),
    (lambda c: c["text_config"].pop("indexer_budget"), ["indexer_budget", "missing"]),
    (lambda c: c["text_config"].update(indexer_budget=30), ["indexer_budget (30)", "indexer_compress_ratio (4)"]),
    (lambda c: c["text_config"].update(hc_count=1), ["hc_count must be >= 2"]),
    (lambda c: c["text_config"].update(output_gate_type="relu"), ["output_gate_type 'relu'", "sigmoid"]),
    (lambda c: c["text_config"].update(ple_embed_dim=100), ["ple_embed_dim (100)", "(8)"]),
])
def test_a_bad_config_is_one_clear_error(flash, tmp_path, edit, words):
    path = shutil.copytree(flash, tmp_path / "m")
    _edit_config(path, edit)
    msg = _load_error(path)
    assert str(path) in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize("setting, words", [(dict(kv_resident=1024), "kv_resident")])
def test_settings_it_cannot_run_with_yet_are_refused_by_name(flash, setting, words):
    from strata.errors import ConfigError
    with pytest.raises(ConfigError) as ei:
        Engine.load(flash, max_context=4096, **setting)
    assert words in str(ei.value) and "qwen4_exp" in str(ei.value) and "docs/qwen4-exp.md" in str(ei.value)
