"""RoPE scaling against transformers' Qwen3-Next (float32, CPU): YaRN x2 and x4, linear and dynamic NTK, at positions
past the original window, read in one pass and in parts plus decode; the Hub's `rope_scaling` form and the
rope_scaling / rope_scale settings over a checkpoint without scaling; the errors for bad settings.

The tiny model has a 32-position window (max_position_embeddings) and a 64-wide head, so the partial rotary
dimension (a quarter) has 8 frequency pairs for YaRN's ramp to cross. A model whose oracle run has a router near-tie
is rejected and the next seed drawn, as in test_parity.py.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from oracle import build_hf_model  # noqa: E402
from strata import Engine  # noqa: E402
from strata.errors import ConfigError, ModelLoadError  # noqa: E402
from strata.model.config import ModelConfig  # noqa: E402

TOL = 1e-4           # of the logit range, float32 (test_parity.py's)
NEAR_TIE = 1e-4
WINDOW = 32
SHAPE = dict(hidden_size=64, head_dim=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=WINDOW,
             layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])

# name: (rope parameters beyond theta and the partial factor, tokens read: past the window, within the scaled one)
CASES = {
    "yarn-x2": ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": WINDOW}, 64),
    "yarn-x4": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW}, 120),
    "yarn-x4-mscale": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW,
                        "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "truncate": False}, 100),
    "linear-x2": ({"rope_type": "linear", "factor": 2.0}, 60),
    "dynamic-x4": ({"rope_type": "dynamic", "factor": 4.0}, 96),
}


def _rope_parameters(extra: dict) -> dict:
    return {"rope_theta": 500.0, "partial_rotary_factor": 0.25, **extra}


def _oracle(extra: dict, n: int):
    """A tie-free tiny model with these rope parameters, a prompt of n tokens and transformers' logits over it."""
    rejected = []
    for seed in range(20):
        model = build_hf_model("qwen3_next", seed, rope_parameters=_rope_parameters(extra), **SHAPE)
        prompt = np.random.default_rng(seed).integers(0, model.config.vocab_size, n).tolist()
        with torch.no_grad():
            out = model(torch.tensor(prompt)[None], output_router_logits=True)
        k = model.config.num_experts_per_tok
        tops = [-np.sort(-torch.softmax(r.float(), dim=-1).numpy(), axis=-1) for r in out.router_logits]
        if all((top[:, k - 1] - top[:, k]).min() >= NEAR_TIE for top in tops):
            return model, prompt, out.logits[0].numpy()
        rejected.append(seed)
    pytest.fail(f"no tie-free model in 20 seeds ({rejected})")


def _assert_close(ours, ref, what):
    span = float(ref.max() - ref.min())
    err = float(np.abs(ours - ref).max())
    assert np.isfinite(ours).all(), f"{what}: non-finite logits"
    assert err <= TOL * span, f"{what}: max |diff| {err:.3e} > {TOL} x logit range {span:.3f}"


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    extra, n = CASES[request.param]
    model, prompt, logits = _oracle(extra, n)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return dict(name=request.param, path=path, prompt=prompt, logits=logits, model=model, extra=extra)


def logits_in_parts(engine, prompt, part=7, decoded=8):
    """The prompt read in parts, its last `decoded` tokens one at a time (the decode form)."""
    seq = engine.sequence()
    head = prompt[:-decoded]
    return np.concatenate([seq.read(head, part_size=part, all_logits=True)] +
                          [seq.read([t], all_logits=True) for t in prompt[-decoded:]])


def check_scaled(case, backend="jax", **options):
    """One pass and parts + decode, with the checkpoint's own scaling, against transformers."""
    engine = Engine.load(case["path"], max_context=len(case["prompt"]), backend=backend, **options)
    assert engine.cfg.rope_scaling is not None and engine.cfg.rope_scaling.kind == case["extra"]["rope_type"]
    _assert_close(engine.logits(case["prompt"]), case["logits"], f"{case['name']} one pass ({backend})")
    _assert_close(logits_in_parts(engine, case["prompt"]), case["logits"], f"{case['name']} parts + decode ({backend})")


def test_scaled_rope_matches_transformers(case):
    check_scaled(case)


def test_without_scaling_the_logits_differ(case):
    """The check above has teeth: the same weights read with the scaling turned off give other logits."""
    engine = Engine.load(case["path"], max_context=WINDOW, rope_scaling="none")
    ours, ref = engine.logits(case["prompt"][:WINDOW]), case["logits"][:WINDOW]
    assert np.abs(ours - ref).max() > 100 * TOL * float(ref.max() - ref.min())


def _hub_form(path, extra: dict) -> dict:
    """config.json as the Hub writes it: top-level rope_theta and partial_rotary_factor, rope_scaling."""
    d = json.loads((path / "config.json").read_text())
    rp = d.pop("rope_parameters")
    d["rope_theta"], d["partial_rotary_factor"] = rp["rope_theta"], rp["partial_rotary_factor"]
    d["rope_scaling"] = dict(extra)
    return d


def test_hub_rope_scaling_form_reads_as_rope_parameters(case):
    saved = json.loads((case["path"] / "config.json").read_text())
    assert ModelConfig.from_hf(_hub_form(case["path"], case["extra"])) == ModelConfig.from_hf(saved)


@pytest.mark.parametrize("kind,factor", [("yarn", 2.0), ("yarn", 4.0), ("linear", 2.0), ("dynamic", 4.0)])
def test_settings_turn_scaling_on_for_a_checkpoint_without(tmp_path, kind, factor):
    """--rope-scaling K --rope-scale F over a checkpoint with plain RoPE equals transformers with that rope_scaling
    over max_position_embeddings (as the model card's block sets it)."""
    extra = {"rope_type": kind, "factor": factor}
    model, prompt, logits = _oracle(extra, int(WINDOW * factor) - 4)
    model.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d["rope_parameters"] = _rope_parameters({"rope_type": "default"})
    (tmp_path / "config.json").write_text(json.dumps(d))
    plain = Engine.load(tmp_path, max_context=len(prompt), rope_scaling=kind, rope_scale=factor)
    _assert_close(plain.logits(prompt), logits, f"{kind} x{factor} from the settings")


def test_max_context_auto_is_the_scaled_window_and_said_in_a_plan_line(tmp_path):
    model = build_hf_model("qwen3_next", 0, rope_parameters=_rope_parameters(CASES["yarn-x4"][0]), **SHAPE)
    model.save_pretrained(tmp_path)
    lines = []
    e = Engine.load(tmp_path, say=lines.append)
    assert e.settings.model.max_context == 4 * WINDOW == e.cfg.max_positions
    assert [ln for ln in lines if ln.startswith("strata plan: max_context 128 (auto)")], lines
    lines.clear()
    e = Engine.load(tmp_path, rope_scaling="none", say=lines.append)
    assert e.settings.model.max_context == WINDOW
    assert Engine.load(tmp_path, rope_scale=2.0).settings.model.max_context == 2 * WINDOW


def test_bad_rope_settings_are_refused(tmp_path):
    model = build_hf_model("qwen3_next", 0, rope_parameters=_rope_parameters({"rope_type": "default"}), **SHAPE)
    model.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"rope_scale = 0.5 \(a float\) is not allowed; rope_scale must be a number "
                                          r"in \[1, 1024\]"):
        Engine.load(tmp_path, rope_scaling="yarn", rope_scale=0.5)
    with pytest.raises(ConfigError, match=r"max_context 64 is beyond the 32 positions this model supports; rope "
                                          r"scaling \(--rope-scaling yarn --rope-scale F\) extends it F times: set "
                                          r"max_context to at most 32"):
        Engine.load(tmp_path, max_context=64)
    with pytest.raises(ConfigError, match=r"max_context 200 is beyond the 128 positions this model supports with "
                                          r"rope scaling yarn x4 over 32 positions: set max_context to at most 128"):
        Engine.load(tmp_path, max_context=200, rope_scaling="yarn", rope_scale=4)
    with pytest.raises(ConfigError, match="rope_scaling yarn needs rope_scale"):
        Engine.load(tmp_path, rope_scaling="yarn")
    with pytest.raises(ConfigError, match="rope_scale = 2 needs a rope_scaling form"):
        Engine.load(tmp_path, rope_scale=2.0)
    with pytest.raises(ConfigError, match="rope_scaling = \"ntk\" \\(a string\\) is not allowed; rope_scaling must "
                                          "be one of auto, none, linear, dynamic, yarn"):
        Engine.load(tmp_path, rope_scaling="ntk")


@pytest.mark.parametrize("rope,message", [
    ({"rope_type": "longrope", "factor": 2.0}, "rope_type 'longrope' is not supported; supported: default, linear, "
                                               "dynamic, yarn"),
    ({"rope_type": "linear"}, "rope_type 'linear' needs a 'factor'"),
    ({"rope_type": "yarn", "factor": 0.5}, "rope scaling factor must be >= 1, found 0.5"),
    ({"rope_type": "yarn", "factor": "big"}, "rope scaling key 'factor' must be a number, found 'big'"),
])
def test_bad_checkpoint_rope_scaling_is_refused(rope, message):
    d = {"model_type": "qwen3_next", "vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 1,
         "num_attention_heads": 1, "head_dim": 8, "layer_types": ["full_attention"], "num_experts": 0,
         "intermediate_size": 8, "max_position_embeddings": 32, "rope_scaling": rope}
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_hf(d, source="x/config.json")
