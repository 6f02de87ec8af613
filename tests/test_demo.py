"""The built-in demo model: deterministic files, a real Qwen3-Next MoE with an MTP head, loadable by name."""
from __future__ import annotations

import json

from strata import Engine
from strata.demo import demo_fingerprint, write_demo_model
from strata.model.config import ModelConfig


def test_demo_files_are_identical_on_every_write(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_demo_model(a)
    write_demo_model(b)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def test_demo_is_a_sparse_qwen3_next_with_both_layer_kinds(tmp_path):
    write_demo_model(tmp_path)
    cfg = ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert cfg.model_type == "qwen3_next"
    assert set(cfg.layer_types) == {"linear_attention", "full_attention"}
    assert all(cfg.is_sparse_layer(i) for i in range(cfg.num_layers)) and cfg.num_experts > cfg.num_experts_per_tok


def test_demo_loads_by_name_and_greedy_is_repeatable(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    engine = Engine.load("demo")
    assert (tmp_path / f"demo-{demo_fingerprint()}" / "config.json").exists()
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]))
    first = engine.generate(ids, 12)
    assert len(first) >= 1 and all(0 <= t < engine.cfg.vocab_size for t in first)
    assert Engine.load("demo").generate(ids, 12) == first
