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
