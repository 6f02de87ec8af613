"""GGUF reader: a llama.cpp-style GGUF of a tiny random transformers model reads back as its HF checkpoint.

The oracle is what transformers' save_pretrained writes (per-expert safetensors names, config.json); the GGUF is
written by tests/gguf_writer.py, which mirrors llama.cpp's converter (names, metadata keys, value transforms).
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_writer import write_gguf  # tests/gguf_writer.py (tests/conftest.py puts tests/ on sys.path)
from safetensors.numpy import load_file

from strata.errors import ModelLoadError
from strata.model.config import ModelConfig
from strata.weights import gguf_reader
from strata.weights.gguf_reader import read_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The converter's own arithmetic rounds these in float32: norms stored as 1 + w (|error| <= ulp(1)/2 = 6e-8) and
# ssm_a = -exp(A_log). Every other tensor must come back bit for bit from an F32 file.
_ROUNDED = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
            ".q_norm.weight", ".k_norm.weight", ".A_log")

_COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
               moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6)


def _save(model, tmp: Path) -> tuple[dict[str, np.ndarray], dict, object]:
    """Re-randomise every parameter (norm weights default to 0 or 1 and would hide a wrong +-1), save, and return
    (safetensors as written, config.json, config object)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.1)
    model.save_pretrained(tmp)
    return load_file(str(tmp / "model.safetensors")), json.loads((tmp / "config.json").read_text()), model.config


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    cfg = transformers.Qwen3MoeConfig(num_hidden_layers=2, head_dim=32, norm_topk_prob=True, **_COMMON)
    return _save(transformers.Qwen3MoeForCausalLM(cfg), tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    # layer 1 dense (mlp_only_layers) to cover the dense-FFN names; layers 0-2 linear, 3 full attention
    cfg = transformers.Qwen3NextConfig(
        num_hidden_layers=4, head_dim=16, shared_expert_intermediate_size=64, mlp_only_layers=[1],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, **_COMMON)
    return _save(transformers.Qwen3NextForCausalLM(cfg), tmp_path_factory.mktemp("qwen3_next"))


@pytest.fixture(scope="module")
def qwen3_next_tied(tmp_path_factory):
    # tied embeddings, all-MoE, 2 layers [linear, full]; value heads = key heads * 2 with other head dims
    cfg = transformers.Qwen3NextConfig(
        num_hidden_layers=2, head_dim=32, shared_expert_intermediate_size=32, tie_word_embeddings=True,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=1, linear_num_value_heads=2,
        linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=3, **_COMMON)
    return _save(transformers.Qwen3NextForCausalLM(cfg), tmp_path_factory.mktemp("qwen3_next_tied"))


def _assert_f32_round_trip(sd: dict[str, np.ndarray], src) -> None:
    assert sorted(src.names()) == sorted(sd)
    for name, want in sd.items():
        got = src.get(name)
        assert got.dtype == np.float32 and got.shape == want.shape, name
        if name.endswith(_ROUNDED):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)


def _assert_config_matches(cfg: dict, hf_json: dict, hf_config) -> None:
    # the engine's view of both configs is identical ...
    assert ModelConfig.from_hf(cfg, "gguf") == ModelConfig.from_hf(hf_json, "config.json")
    # ... and transformers builds the same model configuration from the GGUF dict
    rebuilt = type(hf_config)(**cfg)
    keys = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
            "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "rms_norm_eps", "tie_word_embeddings",
            "max_position_embeddings"]
    if hf_config.model_type == "qwen3_next":
        keys += ["shared_expert_intermediate_size", "layer_types", "linear_num_key_heads", "linear_num_value_heads",
                 "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"]
    for key in keys:
        assert getattr(rebuilt, key) == getattr(hf_config, key), key
    assert rebuilt.rope_parameters == hf_config.rope_parameters


@pytest.mark.parametrize("model", ["qwen3_moe", "qwen3_next", "qwen3_next_tied"])
def test_f32_round_trip_is_exact(model, request, tmp_path):
    sd, hf_json, hf_config = request.getfixturevalue(model)
    cfg, src = read_gguf(write_gguf(sd, hf_json, tmp_path / "m.gguf", quant="F32"))
    _assert_config_matches(cfg, hf_json, hf_config)
    _assert_f32_round_trip(sd, src)
    assert src.where(next(iter(src.names()))) == str(tmp_path / "m.gguf")
    with pytest.raises(KeyError):
        src.get("model.layers.0.no_such.weight")


@pytest.mark.parametrize("model", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_fused_layouts(model, quant, request, tmp_path):
    # --fuse-gate-up-exps stacks [E, 2I, H] with gate first; attention q/k/v fused into attn_qkv; old qwen3next
    # files keep in_proj_qkvz whole as ssm_in
    sd, hf_json, _ = request.getfixturevalue(model)
    path = write_gguf(sd, hf_json, tmp_path / "m.gguf", quant=quant, fuse_gate_up_exps=True,
                      legacy_ssm_in=True, fuse_attention_qkv=True)
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    full = len(hf_json["layer_types"]) - 1 if model == "qwen3_next" else 0
    assert {"blk.0.ffn_gate_up_exps.weight", f"blk.{full}.attn_qkv.weight"} <= names
    assert not {"blk.0.ffn_gate_exps.weight", f"blk.{full}.attn_q.weight", "blk.0.attn_gate.weight"} & names
    if model == "qwen3_next":
        assert "blk.0.ssm_in.weight" in names
    if quant == "F32":
        _assert_f32_round_trip(sd, read_gguf(path)[1])
        return
    # the split must slice exactly what the unfused Q8_0 file holds (same quantized rows)
    plain = read_gguf(write_gguf(sd, hf_json, tmp_path / "plain.gguf", quant=quant))[1]
    fused = read_gguf(path)[1]
    for name in sd:
        np.testing.assert_array_equal(fused.get(name), plain.get(name), err_msg=name)


@pytest.mark.parametrize("model", ["qwen3_moe", "qwen3_next"])
def test_q8_0_within_quantization_error(model, request, tmp_path):
    sd, hf_json, hf_config = request.getfixturevalue(model)
    path = write_gguf(sd, hf_json, tmp_path / "m.gguf", quant="Q8_0")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    q8 = gguf.GGMLQuantizationType.Q8_0
    assert types["token_embd.weight"] == q8 and types["blk.0.ffn_down_exps.weight"] == q8
    assert types["blk.0.ffn_gate_inp.weight"] == gguf.GGMLQuantizationType.F32  # converter keeps the router F32
    cfg, src = read_gguf(path)
    _assert_config_matches(cfg, hf_json, hf_config)
    assert sorted(src.names()) == sorted(sd)
    for name, want in sd.items():
        got = src.get(name)
        assert got.shape == want.shape, name
        if want.shape[-1] % 32:
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-7, err_msg=name)  # stored F32
            continue
        # Q8_0: each run of 32 along the last dim shares one scale d = max|x|/127 (stored as fp16); rounding to
        # the nearest step is off by <= d/2, plus the fp16 rounding of d times |q| <= 127
        blocks = want.reshape(-1, 32)
        bound = np.abs(blocks).max(axis=1, keepdims=True) / 127 * 0.6 + 1e-7
        err = np.abs(got.reshape(-1, 32) - blocks)
        assert (err <= bound).all(), f"{name}: max err {err.max()} over Q8_0 bound"


def test_expert_is_dequantized_alone_and_only_on_get(qwen3_moe, tmp_path, monkeypatch):
    sd, hf_json, _ = qwen3_moe
    path = write_gguf(sd, hf_json, tmp_path / "m.gguf", quant="Q8_0")
    calls = []
    real = gguf_reader.dequantize
    monkeypatch.setattr(gguf_reader, "dequantize", lambda data, qtype: calls.append(data.shape) or real(data, qtype))
    _, src = read_gguf(path)
    assert calls == []
    got = src.get("model.layers.1.mlp.experts.5.down_proj.weight")   # [H, I] = [64, 32]
    assert len(calls) == 1 and calls[0][0] == 64                      # one expert's rows, not the [E, H, I] stack
    np.testing.assert_allclose(got, sd["model.layers.1.mlp.experts.5.down_proj.weight"], atol=2e-3)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ModelLoadError, match=r"architecture 'llama' is not supported; supported: qwen3moe, qwen3next"):
        read_gguf(path)


@pytest.mark.parametrize("model,key", [("qwen3_moe", "qwen3moe.attention.head_count"),
                                       ("qwen3_moe", "qwen3moe.expert_count"),
                                       ("qwen3_next", "qwen3next.ssm.time_step_rank")])
def test_missing_metadata_key(model, key, request, tmp_path):
    sd, hf_json, _ = request.getfixturevalue(model)
    path = write_gguf(sd, hf_json, tmp_path / "m.gguf", quant="F32", omit_keys=(key,))
    with pytest.raises(ModelLoadError, match=f"metadata key '{key}' is missing"):
        read_gguf(path)


@pytest.mark.parametrize("keep", [0.5, 24])  # cut in the tensor data; cut inside the header
def test_truncated_file(keep, qwen3_moe, tmp_path):
    sd, hf_json, _ = qwen3_moe
    path = write_gguf(sd, hf_json, tmp_path / "m.gguf", quant="F32")
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(ModelLoadError, match="truncated") as e:
        read_gguf(path)
    assert str(path) in str(e.value)


def test_not_a_gguf_file_and_missing_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 4)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        read_gguf(path)
    with pytest.raises(ModelLoadError, match="not found"):
        read_gguf(tmp_path / "absent.gguf")


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next", "qwen3_5_moe"])
def test_engine_logits_from_gguf_match_checkpoint(arch, tmp_path):
    """Engine.load(file.gguf) computes the same logits as Engine.load(hf_dir) (F32 file: same weights up to the
    converter's float32 rounding of 1 + w and -exp(A_log))."""
    from oracle import build_hf_model, save_hf_model

    from strata import Engine
    # llama.cpp always renormalises the top-k router weights (the GGUF has no key for it), so the checkpoint must too
    overrides = {"norm_topk_prob": True} if arch == "qwen3_moe" else {}
    hf_dir = save_hf_model(build_hf_model(arch, seed=3, **overrides), tmp_path / "hf")
    sd = load_file(str(hf_dir / "model.safetensors"))
    path = write_gguf(sd, json.loads((hf_dir / "config.json").read_text()), tmp_path / "m.gguf", quant="F32")
    ids = [1, 5, 9, 33, 2, 77, 100, 3, 64, 12]
    want = Engine.load(str(hf_dir), dtype="float32").logits(ids)
    got = Engine.load(str(path), dtype="float32").logits(ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))


def _q8_round_trip(name: str, w: np.ndarray) -> np.ndarray:
    """What a Q8_0 GGUF holds for an HF tensor: blocks of 32 along the last (input) axis, as the writer chose them
    (matrices quantized; norms, the router and the conv kernel left in F32)."""
    if w.ndim < 2 or w.shape[-1] % 32 or name.endswith("mlp.gate.weight"):
        return w
    q = gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    return gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(w.shape).astype(np.float32)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_engine_logits_from_q8_0_gguf_differ_only_by_quantization(arch, tmp_path):
    """A Q8_0 GGUF through the engine equals transformers run on the same weights rounded through Q8_0 by gguf's
    own quantize/dequantize (float32, within 1e-4 of the logit range): the only difference from the checkpoint is
    the quantization error, and it is applied once, to the right tensors, along the right axis."""
    from oracle import build_hf_model, save_hf_model
    from safetensors.numpy import save_file

    from strata import Engine
    overrides = {"norm_topk_prob": True} if arch == "qwen3_moe" else {}
    hf_dir = save_hf_model(build_hf_model(arch, seed=5, **overrides), tmp_path / "hf")
    sd = load_file(str(hf_dir / "model.safetensors"))
    hf_json = json.loads((hf_dir / "config.json").read_text())
    gguf_path = write_gguf(sd, hf_json, tmp_path / "m.gguf", quant="Q8_0")
    rounded_dir = tmp_path / "rounded"
    rounded_dir.mkdir()
    save_file({n: _q8_round_trip(n, w) for n, w in sd.items()}, str(rounded_dir / "model.safetensors"))
    (rounded_dir / "config.json").write_text(json.dumps(hf_json))
    oracle = transformers.AutoModelForCausalLM.from_pretrained(rounded_dir, dtype=torch.float32).eval()
    ids = [1, 5, 9, 33, 2, 77, 100, 3, 64, 12, 90, 4]
    with torch.no_grad():
        want = oracle(torch.tensor(ids)[None]).logits[0].numpy()
    got = Engine.load(str(gguf_path), dtype="float32").logits(ids)
    span = float(want.max() - want.min())
    assert np.abs(got - want).max() <= 1e-4 * span
    # and the quantization did change the model (the test would pass vacuously on an F32 file otherwise)
    exact = Engine.load(str(hf_dir), dtype="float32").logits(ids)
    assert np.abs(exact - got).max() > 1e-3 * span


def test_qwen35moe_reads_back_as_its_checkpoint(tmp_path):
    """A qwen35moe file (Qwen3.5-MoE): every tensor is the checkpoint's (the fused experts per expert, the value heads
    in grouped order again), up to the converter's float32 rounding, and the config is the engine's view of it."""
    from oracle import build_hf_model, save_hf_model
    hf_dir = save_hf_model(build_hf_model("qwen3_5_moe", seed=3, linear_num_value_heads=6), tmp_path / "hf")
    sd = load_file(str(hf_dir / "model.safetensors"))
    hf_json = json.loads((hf_dir / "config.json").read_text())
    cfg, src = read_gguf(write_gguf(sd, hf_json, tmp_path / "m.gguf", quant="F32"))
    assert ModelConfig.from_hf(cfg, "gguf") == ModelConfig.from_hf(hf_json, "config.json")
    want = {}
    for name, w in sd.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            half = w.shape[1] // 2
            for e in range(w.shape[0]):
                want[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = w[e, :half]
                want[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = w[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(w.shape[0]):
                want[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = w[e]
        else:
            want[name] = w
    assert sorted(src.names()) == sorted(want)
    for name, w in want.items():
        if name.endswith(_ROUNDED):
            np.testing.assert_allclose(src.get(name), w, rtol=0, atol=1e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(src.get(name), w, err_msg=name)
