"""The vision tower (strata/model/vision.py) of both image-text families against transformers' own on small random
configs: the tower's output for images of several grids (square, wide, tall; grids other than the learned position
grid, so the bilinear resampling runs), the erf the merger's GELU uses, and the (t, h, w) positions of a prompt with
images against get_rope_index."""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from strata.errors import StrataError  # noqa: E402
from strata.jax_backend.backend import JaxBackend  # noqa: E402
from strata.model.params import TensorReader  # noqa: E402
from strata.model.vision import VisionConfig, _erf, grid_inputs, image_tokens, mrope_positions, tower, vision_params  # noqa: E402,E501

VISION = dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=36)
GRIDS = [(1, 4, 4), (1, 6, 10), (1, 12, 2)]


class _Tensors:
    def __init__(self, d):
        self.d = d

    def names(self):
        return self.d.keys()

    def get(self, name):
        return self.d[name]

    def where(self, name):
        return "test tensors"


def _hf_tower(family: str, seed: int):
    import transformers
    cls = {"qwen3_5_moe": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration),
           "qwen4_exp": (transformers.Qwen4ExpConfig, transformers.Qwen4ExpForConditionalGeneration)}[family]
    torch.manual_seed(seed)
    cfg = cls[0](vision_config=VISION).vision_config
    model = transformers.AutoModel.from_config(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():      # O(1) activations everywhere, norms away from 1
            if p.ndim == 1:
                p.copy_((1.0 if "norm" in name and name.endswith("weight") else 0.0)
                        + torch.randn(p.shape, generator=gen) * 0.3)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p[0].numel()) * 1.5)
    return model


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen4_exp"])
def test_the_tower_gives_transformers_embeddings(family):
    hf = _hf_tower(family, 5)
    vc = VisionConfig.from_config({"model_type": family, "vision_config": VISION}, "test")
    tensors = {"model.visual." + k: v.detach().numpy() for k, v in hf.state_dict().items()}
    params = vision_params(vc, TensorReader(_Tensors(tensors), np.float32))
    ops = JaxBackend()
    rng = np.random.default_rng(5)
    for grid in GRIDS:
        n = int(np.prod(grid))
        patches = rng.standard_normal((n, vc.patch_features)).astype(np.float32)
        with torch.no_grad():
            want = hf(torch.tensor(patches), grid_thw=torch.tensor([grid])).pooler_output.numpy()
        got = np.asarray(tower(ops, vc, params, patches, grid_inputs(vc, grid), frame=grid[1] * grid[2]))
        assert got.shape == want.shape == (image_tokens(vc, grid), VISION["out_hidden_size"])
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=0, atol=5e-6 * scale, err_msg=str(grid))
        # the queries a block at a time (a large image's scores would not fit at once): the same rows
        blocks = np.asarray(tower(ops, vc, params, patches, grid_inputs(vc, grid), frame=grid[1] * grid[2],
                                  query_block=7))
        np.testing.assert_allclose(blocks, got, rtol=0, atol=1e-6 * scale, err_msg=str(grid))


def test_the_merger_erf_is_float32_exact_to_a_few_units():
    x = np.linspace(-6, 6, 20001).astype(np.float32)
    want = np.array([math.erf(float(v)) for v in x])
    assert np.abs(_erf(np, x) - want).max() < 5e-7         # 4 units in the last place of 1.0 at most


def test_positions_of_a_prompt_with_images_equal_get_rope_index():
    import transformers
    from oracle import HYBRID
    text = dict(HYBRID, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                         "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    cfg = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=VISION, image_token_id=150,
                                        vision_start_token_id=151, vision_end_token_id=152)
    model = transformers.Qwen3_5MoeModel(cfg)
    vc = VisionConfig.from_config(cfg.to_dict(), "test")
    grids = [(1, 6, 10), (1, 4, 4), (1, 12, 2)]
    ids = [5, 6, 7, 151] + [150] * image_tokens(vc, grids[0]) + [152, 8, 9, 151] + [150] * image_tokens(vc, grids[1]) \
        + [152, 151] + [150] * image_tokens(vc, grids[2]) + [152] + list(range(10, 20))
    ids_t = torch.tensor([ids])
    want, delta = model.get_rope_index(ids_t, (ids_t == 150).int(), image_grid_thw=torch.tensor(grids))
    got, following = mrope_positions(vc, ids, grids)
    np.testing.assert_array_equal(got, want[:, 0].numpy())
    assert following - len(ids) == int(delta[0, 0])
    split = len(ids) // 2        # read in two parts: the second starts where the first's positions end
    first, after = mrope_positions(vc, ids[:split], grids[:1])
    second, end = mrope_positions(vc, ids[split:], grids[1:], after)
    np.testing.assert_array_equal(np.concatenate([first, second], axis=1), got)
    assert end == following
    with pytest.raises(ValueError, match="takes 15 image tokens; the prompt has 14"):
        mrope_positions(vc, [5] + [150] * 14 + [5], [(1, 6, 10)])
    with pytest.raises(ValueError, match="more images"):
        mrope_positions(vc, [5, 150, 150], [])
    with pytest.raises(ValueError, match="beyond the prompt's image tokens"):
        mrope_positions(vc, [5, 6], [(1, 2, 2)])


def _hf_image_text_model(tmp_path, family: str = "qwen3_5_moe"):
    """An image-text checkpoint: the oracle's random text model, a random tower (out_hidden_size = its hidden size)."""
    import transformers
    from oracle import build_hf_model
    text = build_hf_model(family, 3)
    config, cls = {"qwen3_5_moe": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration),
                   "qwen4_exp": (transformers.Qwen4ExpConfig, transformers.Qwen4ExpForConditionalGeneration)}[family]
    cfg = config(text_config=text.config.to_dict(), image_token_id=150, vision_start_token_id=151,
                 vision_end_token_id=152, vision_config=dict(VISION, out_hidden_size=text.config.hidden_size))
    model = cls(cfg).eval()
    assert not model.model.language_model.load_state_dict(text.model.state_dict(), strict=True).missing_keys
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    tower_hf = _hf_tower(family, 7)
    with torch.no_grad():
        tower_hf.merger.linear_fc2.weight.data = torch.randn(cfg.text_config.hidden_size,
                                                             tower_hf.merger.linear_fc2.weight.shape[1]) * 0.1
        tower_hf.merger.linear_fc2.bias.data = torch.randn(cfg.text_config.hidden_size) * 0.1
    model.model.visual.load_state_dict(tower_hf.state_dict())
    model.save_pretrained(tmp_path)
    return model


def _prompt(vc, grids, rng):
    ids = [5, 6, 7]
    for g in grids:
        ids += [vc.vision_start_token_id] + [vc.image_token_id] * image_tokens(vc, g) + [vc.vision_end_token_id] \
            + rng.integers(0, 140, 3).tolist()
    patches = [rng.standard_normal((int(np.prod(g)), vc.patch_features)).astype(np.float32) for g in grids]
    return ids, patches


@pytest.mark.parametrize("family, backend", [("qwen3_5_moe", "jax"), ("qwen3_5_moe", "sycl"), ("qwen4_exp", "jax")])
def test_a_prompt_with_images_gives_transformers_logits_whole_in_parts_and_decoded(tmp_path, family, backend):
    """qwen4_exp: QSA past its budget of 8 tokens, so block keys at image tokens' rotary positions are chosen."""
    from strata import Engine
    from strata.engine.images import Image
    hf = _hf_image_text_model(tmp_path, family)
    engine = Engine.load(tmp_path, max_context=256, backend=backend)
    vc = engine.images.vc
    grids = [(1, 6, 10), (1, 4, 4)]
    ids, patches = _prompt(vc, grids, np.random.default_rng(11))
    ids_t = torch.tensor([ids])
    hf_inputs = dict(pixel_values=torch.tensor(np.concatenate(patches)), image_grid_thw=torch.tensor(grids),
                     mm_token_type_ids=(ids_t == vc.image_token_id).int())
    with torch.no_grad():
        want = hf(ids_t, **hf_inputs).logits[0].numpy()
    images = [Image(p, g) for p, g in zip(patches, grids)]
    span = float(want.max() - want.min())
    for part in (None, 7):
        got = engine.logits(ids, part_size=part, images=images)
        assert np.abs(got - want).max() <= 1e-4 * span, part
    # the text after the images decodes at its rotary positions, not its cache positions
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(ids_t, max_new_tokens=8, do_sample=False, **hf_inputs)[0, len(ids):].tolist()
    assert engine.generate(ids, 8, images=images) == out
    # images without keys are encoded at every read; the prompt's image tokens must match the images given
    assert engine.images.encoded == 2 * 3
    with pytest.raises(StrataError, match="more images"):
        engine.logits(ids, images=images[:1])
    with pytest.raises(StrataError, match="4 x 4 patches takes 4 image tokens; the prompt has 15 at 4"):
        engine.logits(ids, images=images[::-1])


def test_the_vision_setting(tmp_path):
    """auto loads a checkpoint's tower; on refuses a checkpoint without one; off leaves it unread, and images are then
    refused naming why."""
    from strata import Engine
    from strata.errors import ConfigError
    from strata.engine.images import Image
    with pytest.raises(ConfigError, match="vision = on, but demo has no vision tower"):
        Engine.load("demo", max_context=64, vision="on")
    _hf_image_text_model(tmp_path)
    off = Engine.load(tmp_path, max_context=64, vision="off")
    assert off.images is None
    vc = VisionConfig.from_config({"model_type": "qwen3_5_moe", "vision_config": VISION}, "test")
    with pytest.raises(StrataError, match="this model takes no images"):
        off.logits([5, 151, 150, 150, 150, 150, 152], images=[Image(np.zeros((16, vc.patch_features), np.float32),
                                                                    (1, 4, 4))])
