"""Loading: bad input is one clear ModelLoadError / ConfigError (never a traceback), config.json in its Hub and
transformers-saved forms, sharded and bf16 checkpoints, engine option checks, and the demo model's MTP weights.

One tiny random Qwen3-Next (a Gated DeltaNet layer and a gated-attention layer, both sparse) is saved once per module;
each test that breaks it works on its own copy.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from oracle import build_hf_model  # noqa: E402
from safetensors_writer import edit_tensors  # noqa: E402
from strata import Engine  # noqa: E402
from strata.errors import ConfigError, ModelLoadError, StrataError  # noqa: E402
from strata.model.config import FULL, LINEAR, ModelConfig  # noqa: E402
from strata.model.params import projections  # noqa: E402

PROMPT = [3, 141, 59, 26, 5, 35, 89, 79, 32, 38, 46]      # < 64 tokens: one prompt-part bucket
TOL = 1e-4                                                # of the logit range, float32
ARCH = dict(num_hidden_layers=2, layer_types=[LINEAR, FULL])
# shapes the tiny model's config implies (oracle defaults: H 64, 2 kv heads x head_dim 16, 8 experts x 32)
K_PROJ_1 = "model.layers.1.self_attn.k_proj.weight"       # [2 * 16, 64]
EXPERT_DOWN = "model.layers.0.mlp.experts.3.down_proj.weight"  # [64, 32]


def _no_chain(err: BaseException) -> None:
    """A user-facing error carries no chained exception (a traceback would print 'During handling of ...')."""
    assert err.__cause__ is None
    assert err.__context__ is None or err.__suppress_context__


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = build_hf_model("qwen3_next", 0, **ARCH)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    assert sorted(p.name for p in path.glob("*.safetensors")) == ["model.safetensors"]
    return model, path


@pytest.fixture(scope="module")
def reference_logits(tiny):
    _, path = tiny
    out = Engine.load(path, max_context=64).logits(PROMPT)
    assert out.shape == (len(PROMPT), 160) and np.isfinite(out).all()
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --- bad input: one clear error


def test_missing_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError) as ei:
        Engine.load(tmp_path)
    msg = str(ei.value)
    assert "config.json" in msg and str(tmp_path) in msg
    assert issubclass(ModelLoadError, StrataError)
    _no_chain(ei.value)


def test_unknown_model_type(tiny, tmp_path):
    path = _copy(tiny[1], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as ei:
        Engine.load(path)
    msg = str(ei.value)
    assert "'llama'" in msg and "qwen3_next, qwen3_moe" in msg
    _no_chain(ei.value)


def test_missing_tensor_names_tensor_file_and_shape(tiny, tmp_path):
    path = _copy(tiny[1], tmp_path / "m")
    edit_tensors(path, lambda t: t.pop(K_PROJ_1))
    with pytest.raises(ModelLoadError) as ei:
        Engine.load(path)
    msg = str(ei.value)
    assert K_PROJ_1 in msg and "missing" in msg
    assert str(path / "model.safetensors") in msg
    assert "[32, 64]" in msg                                 # expected shape
    _no_chain(ei.value)


def test_misshapen_tensor_names_tensor_file_and_both_shapes(tiny, tmp_path):
    path = _copy(tiny[1], tmp_path / "m")

    def transpose(t):
        t[EXPERT_DOWN] = np.ascontiguousarray(t[EXPERT_DOWN].T)
    edit_tensors(path, transpose)
    with pytest.raises(ModelLoadError) as ei:
        Engine.load(path)
    msg = str(ei.value)
    assert EXPERT_DOWN in msg and str(path / "model.safetensors") in msg
    assert "[32, 64]" in msg and "[64, 32]" in msg
    assert msg.index("[32, 64]") < msg.index("expected") < msg.index("[64, 32]")   # found ..., expected ...
    _no_chain(ei.value)


def test_truncated_safetensors(tiny, tmp_path):
    path = _copy(tiny[1], tmp_path / "m")
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelLoadError) as ei:
        Engine.load(path)
    msg = str(ei.value)
    assert "truncated" in msg and str(f) in msg
    _no_chain(ei.value)


def test_truncated_inside_header(tiny, tmp_path):
    path = _copy(tiny[1], tmp_path / "m")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(ModelLoadError) as ei:
        Engine.load(path)
    assert "truncated" in str(ei.value) and str(f) in str(ei.value)
    _no_chain(ei.value)


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError) as ei:
        Engine.load(missing)
    msg = str(ei.value)
    assert str(missing) in msg and "not found" in msg
    assert "checkpoint directory" in msg and ".gguf" in msg and "'demo'" in msg
    _no_chain(ei.value)


def test_cli_bad_model_dir_is_one_line(tmp_path):
    bad = tmp_path / "BADDIR"
    bad.mkdir()
    r = subprocess.run([sys.executable, "-m", "strata.cli", "generate", "--model", str(bad), "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("strata generate: error:")
    assert "config.json" in lines[0] and str(bad) in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""


# --- config.json forms

# A Qwen3-Next config.json as the Hub ships it (Qwen3-Next-80B-A3B's keys): top-level rope_theta and
# partial_rotary_factor, full_attention_interval instead of layer_types.
HUB_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1, "full_attention_interval": 4,
    "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
    "mlp_only_layers": [], "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
    "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 151936,
}


@pytest.mark.parametrize("variant", [{}, {"full_attention_interval": 3, "partial_rotary_factor": 0.5,
                                          "rope_theta": 5000.0, "num_hidden_layers": 7}])
def test_hub_and_transformers_forms_of_qwen3_next_agree(variant):
    hub = dict(HUB_NEXT, **variant)
    saved = transformers.Qwen3NextConfig.from_dict(hub).to_dict()   # what save_pretrained writes
    assert "layer_types" in saved and isinstance(saved.get("rope_parameters"), dict)
    assert saved.get("rope_theta") is None and saved.get("full_attention_interval") is None
    a, b = ModelConfig.from_hf(hub), ModelConfig.from_hf(saved)
    assert a == b
    n = hub["full_attention_interval"]
    assert a.layer_types == tuple(FULL if (i + 1) % n == 0 else LINEAR for i in range(hub["num_hidden_layers"]))
    assert a.rope_theta == hub["rope_theta"] and a.partial_rotary_factor == hub["partial_rotary_factor"]
    assert a.num_experts == 512 and a.eos_token_ids == (151645,)
    assert a.rotary_dim == int(256 * hub["partial_rotary_factor"])


def test_hand_written_transformers_form_of_qwen3_next():
    saved = {k: v for k, v in HUB_NEXT.items()
             if k not in ("rope_theta", "partial_rotary_factor", "full_attention_interval")}
    saved["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
    saved["layer_types"] = [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(48)]
    assert ModelConfig.from_hf(saved) == ModelConfig.from_hf(HUB_NEXT)


def test_qwen3_moe_num_local_experts_or_num_experts():
    base = dict(model_type="qwen3_moe", vocab_size=160, hidden_size=64, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                moe_intermediate_size=32, num_experts_per_tok=2, rope_theta=1e6)
    hub = ModelConfig.from_hf(dict(base, num_experts=8))
    local = ModelConfig.from_hf(dict(base, num_local_experts=8))
    assert hub == local and hub.num_experts == 8
    assert hub.partial_rotary_factor == 1.0 and hub.rope_theta == 1e6
    saved = transformers.Qwen3MoeConfig.from_dict(dict(base, num_experts=8)).to_dict()
    assert saved["num_local_experts"] == 8 and "num_experts" not in saved
    assert ModelConfig.from_hf(saved) == hub


def test_oracle_checkpoint_config_parses(tiny):
    cfg = ModelConfig.from_hf(json.loads((tiny[1] / "config.json").read_text()))
    assert cfg.layer_types == (LINEAR, FULL) and cfg.num_experts == 8 and cfg.partial_rotary_factor == 0.25


@pytest.mark.parametrize("key,value", [("hidden_size", "abc"), ("num_hidden_layers", 2.5),
                                       ("tie_word_embeddings", "yes"), ("num_experts", "many"),
                                       ("rope_theta", "fast"), ("eos_token_id", "eos"),
                                       ("mlp_only_layers", ["first"])])
def test_bad_value_type_names_the_key(key, value):
    with pytest.raises(ModelLoadError) as ei:
        ModelConfig.from_hf(dict(HUB_NEXT, **{key: value}), source="x/config.json")
    msg = str(ei.value)
    assert msg.startswith("x/config.json:") and f"'{key}'" in msg and repr(value) in msg
    _no_chain(ei.value)


def test_zero_full_attention_interval_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="full_attention_interval must be >= 1, found 0"):
        ModelConfig.from_hf(dict(HUB_NEXT, full_attention_interval=0))


def test_bad_value_in_a_checkpoint_dir_names_dir_and_key(tiny, tmp_path):
    path = _copy(tiny[1], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_size"] = "abc"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as ei:
        Engine.load(path)
    assert str(path) in str(ei.value) and "'hidden_size'" in str(ei.value)


# --- sharded checkpoints


def _shard(path: Path, n: int) -> dict[str, str]:
    """Split model.safetensors into n shards + model.safetensors.index.json, as save_pretrained does."""
    single = path / "model.safetensors"
    tensors = load_file(str(single))
    names = sorted(tensors)
    weight_map, total = {}, 0
    for i in range(n):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = {k: tensors[k] for k in names[i::n]}
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
        total += sum(v.nbytes for v in part.values())
    single.unlink()
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return weight_map


def test_sharded_checkpoint_gives_identical_logits(tiny, reference_logits, tmp_path):
    path = _copy(tiny[1], tmp_path / "m")
    weight_map = _shard(path, 3)
    assert len(set(weight_map.values())) == 3 and not (path / "model.safetensors").exists()
    out = Engine.load(path, max_context=64).logits(PROMPT)
    assert np.array_equal(out, reference_logits)


def test_index_listing_a_missing_shard(tiny, tmp_path):
    path = _copy(tiny[1], tmp_path / "m")
    _shard(path, 2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError) as ei:
        Engine.load(path)
    msg = str(ei.value)
    assert "model-00002-of-00002.safetensors" in msg and "model.safetensors.index.json" in msg
    _no_chain(ei.value)


def test_index_pointing_at_the_wrong_shard(tiny, tmp_path):
    path = _copy(tiny[1], tmp_path / "m")
    weight_map = _shard(path, 2)
    moved = next(k for k, f in weight_map.items() if f == "model-00001-of-00002.safetensors" and "layers.1" in k)
    weight_map[moved] = "model-00002-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError) as ei:
        Engine.load(path)
    msg = str(ei.value)
    assert moved in msg and str(path / "model-00002-of-00002.safetensors") in msg


# --- bf16 checkpoints


def test_bf16_checkpoint_loads_as_float32(tiny, tmp_path):
    model = copy.deepcopy(tiny[0]).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    raw = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert raw["model.embed_tokens.weight"].dtype.name == "bfloat16"
    engine = Engine.load(tmp_path / "bf16", dtype="float32", max_context=64)
    embed = np.asarray(engine.params["embed"])
    assert embed.dtype == np.float32
    assert np.array_equal(embed, raw["model.embed_tokens.weight"].astype(np.float32))   # widened exactly
    ours = engine.logits(PROMPT)
    with torch.no_grad():
        ref = model.float()(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.isfinite(ours).all()
    span = float(ref.max() - ref.min())
    err = float(np.abs(ours - ref).max())
    assert err <= TOL * span, f"max |diff| {err:.3e} > {TOL} x logit range {span:.3f}"


# --- engine options and request checks


@pytest.mark.parametrize("options,words", [
    (dict(flavour="x"), ["unknown key 'flavour'", "dtype", "max_context", "prefill", "device"]),
    (dict(dtype="float16"), ['dtype = "float16" (a string) is not allowed', "one of auto, float32, bfloat16"]),
    (dict(max_context=0), ["max_context = 0 is not allowed", "an integer in [16, 4194304]"]),
    (dict(prefill=-3), ["prefill = -3 is not allowed", "an integer in [1, 16384]"]),
    (dict(sequences=2), ["unknown key 'sequences'"]),
])
def test_engine_option_errors(options, words):
    with pytest.raises(ConfigError) as ei:
        Engine.load("demo", **options)
    for w in words:
        assert w in str(ei.value)


@pytest.fixture(scope="module")
def demo_small():
    return Engine.load("demo", max_context=16)


def test_prompt_longer_than_max_context(demo_small):
    with pytest.raises(StrataError) as ei:
        demo_small.logits(list(range(20)))
    assert "20" in str(ei.value) and "16" in str(ei.value) and "max_context" in str(ei.value)
    with pytest.raises(StrataError) as ei:
        demo_small.generate(list(range(10)), 10)
    assert all(w in str(ei.value) for w in ("10", "16", "max_context", "max_tokens"))


@pytest.mark.parametrize("bad", ["vocab", 100000, -1])
def test_token_id_outside_vocab(demo_small, bad):
    vocab = demo_small.cfg.vocab_size
    bad = vocab if bad == "vocab" else bad
    with pytest.raises(StrataError) as ei:
        demo_small.logits([1, 2, bad])
    assert f"token id {bad} " in str(ei.value) and f"0..{vocab - 1}" in str(ei.value)


def test_empty_prompt(demo_small):
    with pytest.raises(StrataError, match="at least one token"):
        demo_small.logits([])


# --- MTP weights


def test_demo_mtp_weights(demo_small):
    cfg, params = demo_small.cfg, demo_small.params
    H = cfg.hidden_size
    mtp = params["mtp"]
    assert tuple(mtp["fc"].shape) == (H, 2 * H)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert tuple(mtp[norm].shape) == (H,)
    layer = mtp["layer"]
    # a full-attention sparse layer: q, k, v and gate joined after the input norm; the router and the shared
    # expert's gate, up and scalar gate after the post-attention norm (params.projections)
    joined = projections(cfg, "full_attention", sparse=True)
    assert [n for n, _ in joined["in_proj"]] == ["q", "k", "v", "gate"]
    assert [n for n, _ in joined["post_proj"]] == ["router", "sh_gate", "sh_up", "sh_router"]
    assert {"in_proj", "post_proj", "o", "q_norm", "k_norm", "sh_down", "in_norm", "post_norm"} == set(layer)
    for name, parts in joined.items():
        assert tuple(layer[name].shape) == (sum(n for _, n in parts), H)
    # routed experts live in the expert pool, not the tree; the MTP layer's are read by prefix
    from strata.weights.source import load_source
    from strata.model.params import read_experts
    _, src, _ = load_source("demo")
    gate, up, down = read_experts(cfg, src, prefix="mtp.layers.0.mlp.")
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    assert gate.shape == up.shape == (E, I, H) and down.shape == (E, H, I)
    # the joined rows are the checkpoint's tensors: the query rows of q_proj (de-interleaved from the gate's per
    # head) first, the router's rows first after the norm
    hq, hd = cfg.num_heads, cfg.head_dim
    q = np.asarray(src.get("mtp.layers.0.self_attn.q_proj.weight"), np.float32).reshape(hq, 2, hd, H)
    np.testing.assert_array_equal(np.asarray(layer["in_proj"][:hq * hd], np.float32), q[:, 0].reshape(-1, H))
    router = np.asarray(src.get("mtp.layers.0.mlp.gate.weight"), np.float32)
    np.testing.assert_array_equal(np.asarray(layer["post_proj"][:cfg.num_experts], np.float32), router)
