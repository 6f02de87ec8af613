"""The `random:<shape>` models (strata/builtin.py, strata/demo.py): random weights drawn on the device at a real
model's shapes, int4 synthetic experts and a tokenizer whose every id decodes visibly. Checked here at a small shape
registered the same way (the real one is 80B: the H200 runs it, bench/serve_load.py): the load, the plan's int4
experts, the text of generated ids, and the same weights on a second load."""
from __future__ import annotations

import pytest

from strata import Engine, builtin, demo

SMALL = dict(demo.QWEN3_NEXT_80B, vocab_size=1024, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
             head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
             linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=32, intermediate_size=128, num_hidden_layers=4)


@pytest.fixture()
def small(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(demo.RANDOM_SHAPES, "small", SMALL)
    monkeypatch.setitem(builtin.BUILTIN_MODELS, "random:small", builtin._random("small"))
    return "random:small"


def test_a_random_model_loads_generates_visible_text_and_is_the_same_twice(small):
    assert builtin.is_random(small) and not builtin.is_random("demo")
    lines = []
    engine = Engine.load(small, max_context=256, say=lines.append)
    assert engine.cfg.num_layers == 4 and engine.cfg.vocab_size == 1024
    assert engine.experts.store.layout.fmt == "int4"
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]))
    ids = engine.generate(prompt, 8)
    text = engine.tokenizer.decode(ids)
    assert len(ids) == 8 and all(engine.tokenizer.decode([i]) for i in ids if i >= 261), (ids, text)
    assert Engine.load(small, max_context=256, say=lines.append).generate(prompt, 8) == ids


def test_a_random_model_needs_the_jax_backend(small):
    with pytest.raises(Exception, match="draws its weights with JAX"):
        Engine.load(small, max_context=256, backend="sycl")


SMALL_FLASH = dict(demo.QWEN38_FLASH_NEXT, vocab_size=1024, hidden_size=64, num_hidden_layers=4,
                   layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
                   linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32, shared_expert_intermediate_size=32, hc_lowrank=16, ple_embed_dim=64,
                   heads_per_ngram=4, ngram_vocab_size_base=500, indexer_n_heads=2, indexer_head_dim=16,
                   indexer_budget=32, eos_token_id=1000)


def test_the_flash_next_shape_keeps_its_ple_table_as_shipped_in_host_ram(monkeypatch, tmp_path):
    """random:qwen3.8-flash-next's form at a small shape: the table drawn in float8 on the host and gathered from
    there (as the plan puts the real one: 47.7 GiB), the same text twice, and the release's figures in its config."""
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(demo.RANDOM_SHAPES, "small-flash", SMALL_FLASH)
    monkeypatch.setitem(builtin.BUILTIN_MODELS, "random:small-flash", builtin._random("small-flash"))
    assert builtin.is_random("random:qwen3.8-flash-next")
    lines = []
    engine = Engine.load("random:small-flash", max_context=256, ple_table="host", say=lines.append)
    assert engine.cfg.hyper and engine.cfg.ple is not None and engine.cfg.qsa is not None
    assert any("PLE table" in line and "float8" in line and "host RAM" in line for line in lines), lines
    prompt = list(range(261, 300))
    ids = engine.generate(prompt, 8)
    assert len(ids) == 8
    assert Engine.load("random:small-flash", max_context=256, ple_table="host", say=lines.append).generate(
        prompt, 8) == ids
    from strata.model.config import ModelConfig
    from strata.model.params import ngram_spec_for
    real = ModelConfig.from_hf(demo.QWEN38_FLASH_NEXT, source="release")
    assert ngram_spec_for(real, 0).table_rows == 320_001_536 and real.num_layers == 48
