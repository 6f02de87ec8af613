"""Qwen3.5-MoE (qwen3_5_moe) in its published image-text layout: a Qwen3_5MoeForConditionalGeneration checkpoint
(config text_config beside vision_config, the language model under model.language_model., the tower under
model.visual.) serves its text as transformers computes it; the tower waits for the vision issue. A pack of it gives
its logits. The text model's parity (logits, parts + decode, greedy, int8 KV, both backends):
tests/model/test_parity.py's q35 configs."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from oracle import build_hf_model  # noqa: E402
from strata import Engine  # noqa: E402
from strata.engine.facts import model_facts  # noqa: E402
from strata.config import Settings  # noqa: E402


def test_the_image_text_checkpoint_serves_its_text(tmp_path):
    import transformers
    text = build_hf_model("qwen3_5_moe", 3)
    cfg = transformers.Qwen3_5MoeConfig(text_config=text.config.to_dict(), vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
        num_position_embeddings=64))
    model = transformers.Qwen3_5MoeForConditionalGeneration(cfg).eval()
    missing = model.model.language_model.load_state_dict(text.model.state_dict(), strict=True)
    assert not missing.missing_keys
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "qwen3_5_moe" and "text_config" in saved and "vision_config" in saved
    prompt = np.random.default_rng(3).integers(0, 160, 40).tolist()
    with torch.no_grad():
        want = model(torch.tensor(prompt)[None]).logits[0].float().numpy()
    np.testing.assert_allclose(want, text(torch.tensor(prompt)[None]).logits[0].detach().float().numpy(),
                               rtol=0, atol=1e-5)
    engine = Engine.load(tmp_path, max_context=128)
    got = engine.logits(prompt)
    span = float(want.max() - want.min())
    assert np.abs(got - want).max() <= 1e-4 * span
    facts = model_facts(Settings.build(model=str(tmp_path), max_context=128))
    assert facts.cfg.model_type == "qwen3_5_moe" and facts.cfg.num_layers == 4


def test_a_pack_of_it_gives_its_logits(tmp_path):
    """strata pack of a Qwen3.5-MoE checkpoint (its experts one gate_up_proj and down_proj a layer): f32 experts in
    the pack give the checkpoint's logits exactly."""
    from oracle import save_hf_model

    from strata.experts.pack import write_pack
    hf = save_hf_model(build_hf_model("qwen3_5_moe", 3), tmp_path / "hf")
    pack = write_pack(hf, tmp_path / "pack", "f32")
    ids = [1, 5, 9, 33, 2, 77, 100, 3]
    np.testing.assert_array_equal(Engine.load(pack, max_context=128).logits(ids),
                                  Engine.load(hf, max_context=128).logits(ids))
