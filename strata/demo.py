"""The built-in `demo` model: a tiny Qwen3-Next-architecture MoE with an MTP head, a byte-level tokenizer and a chat
template, written as an ordinary Hugging Face checkpoint directory on first use; `demo-flash` likewise at
Qwen3.8-Flash-Next's architecture (qwen4_exp, in its published image-text layout, with a small vision tower).

Its weights are RANDOM (seeded, so the same bytes every time): it exercises every code path of the real model with no
download, and its text is gibberish by design.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

DEMO_NAME = "demo"
DEMO_NOTE = "the demo model has random weights: its text is gibberish by design"

DEMO_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 624,
    "hidden_size": 96,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "intermediate_size": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "num_nextn_predict_layers": 1,
}


DEMO_FLASH_NAME = "demo-flash"
DEMO_FLASH_NOTE = "the demo-flash model has random weights: its text is gibberish by design"
# qwen4_exp's published form: the language model in text_config, weights under model.language_model.; four streams,
# a PLE layer whose table (8 heads of ~1000 rows) is stored in shards, QSA keeping 16 blocks of 4 (64 tokens)
DEMO_FLASH_TEXT = {
    "model_type": "qwen4_exp_text", "vocab_size": 624, "hidden_size": 96, "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4, "output_gate_type": "sigmoid", "num_experts": 16, "num_experts_per_tok": 4,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "hc_count": 4, "hc_lowrank": 32,
    "ple_layer_ids": [2], "ple_embed_dim": 96, "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 4,
    "ngram_vocab_size_base": 1000, "make_ngram_vocab_size_divisible_by": 128, "split_ngram_parts": 4,
    "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 64,
    "indexer_compress_ratio": 4, "eos_token_id": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "hidden_act": "silu", "max_position_embeddings": 262144,
}
# its vision tower: Qwen3-VL's form at a demo's size (16-pixel patches merged 2 x 2, a 48 x 48 position grid)
DEMO_FLASH_VISION = {"model_type": "qwen4_exp_vision", "depth": 2, "hidden_size": 32, "intermediate_size": 64,
                     "num_heads": 2, "out_hidden_size": 96, "patch_size": 16, "temporal_patch_size": 2,
                     "spatial_merge_size": 2, "num_position_embeddings": 2304, "in_channels": 3,
                     "hidden_act": "gelu_pytorch_tanh"}
DEMO_FLASH_CONFIG = {
    "architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp", "text_config": DEMO_FLASH_TEXT,
    "vision_config": DEMO_FLASH_VISION, "tie_word_embeddings": False,
}

# Qwen3-Next-80B-A3B's shapes (its config.json's values that matter to Strata)
QWEN3_NEXT_80B = {
    "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
    "intermediate_size": 5120, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "full_attention_interval": 4,
    "num_hidden_layers": 48, "max_position_embeddings": 262144, "architectures": ["Qwen3NextForCausalLM"],
}
# Qwen3.8-Flash-Next's text model (its release's text_config, docs/qwen4-exp.md; the vision tower left out)
QWEN38_FLASH_NEXT = {
    "model_type": "qwen4_exp_text", "architectures": ["Qwen4ExpForCausalLM"], "vocab_size": 248320,
    "hidden_size": 2560, "num_hidden_layers": 48,
    "layer_types": ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(48)],
    "num_attention_heads": 24, "num_key_value_heads": 2, "head_dim": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "output_gate_type": "sigmoid", "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 640, "shared_expert_intermediate_size": 640, "hc_count": 4,
    "hc_lowrank": 320, "ple_layer_ids": [2], "ple_embed_dim": 2560, "ple_conv_kernel_size": 4, "ngram_size": 3,
    "heads_per_ngram": 8, "ngram_vocab_size_base": 20000000, "make_ngram_vocab_size_divisible_by": 128,
    "split_ngram_parts": 128, "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128,
    "indexer_budget": 2048, "indexer_compress_ratio": 4, "eos_token_id": 248044, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "hidden_act": "silu", "max_position_embeddings": 262144,
}
# the `random:<name>` models: random weights at these shapes (strata/builtin.py)
RANDOM_SHAPES = {"qwen3-next-80b-a3b": QWEN3_NEXT_80B, "qwen3.8-flash-next": QWEN38_FLASH_NEXT}


def cache_root() -> Path:
    return Path(os.environ.get("STRATA_CACHE_DIR") or Path.home() / ".cache" / "strata")


def demo_fingerprint() -> str:
    """Changes whenever the code that writes the demo changes, so a cached copy is never stale."""
    from strata import demo_tokenizer
    h = hashlib.sha256()
    for module in (__file__, demo_tokenizer.__file__):
        h.update(Path(module).read_bytes())
    return h.hexdigest()[:12]


def _written_once(name: str, write) -> Path:
    """The cached directory `name` (fingerprinted), written by write(dir) on first use, atomically: concurrent first
    uses are safe."""
    target = cache_root() / f"{name}-{demo_fingerprint()}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        write(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process got there first; theirs is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def demo_model_dir() -> Path:
    """The demo checkpoint directory, written on first use."""
    return _written_once(DEMO_NAME, write_demo_model)


def demo_flash_model_dir() -> Path:
    """The demo-flash checkpoint directory, written on first use."""
    return _written_once(DEMO_FLASH_NAME, write_demo_flash_model)


def random_model_dir(shape: str) -> Path:
    """A directory holding the config and tokenizer of the random-weights model at RANDOM_SHAPES[shape] (no weights:
    Engine.load draws them on the device), written on first use."""
    from strata.demo_tokenizer import write_filler_tokenizer
    cfg = RANDOM_SHAPES[shape]

    def write(out: Path) -> None:
        write_filler_tokenizer(out, cfg["vocab_size"])
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return _written_once(f"random-{shape}", write)


def write_demo_model(out: Path) -> None:
    from safetensors.numpy import save_file

    from strata.demo_tokenizer import write_demo_tokenizer
    vocab = write_demo_tokenizer(out)
    cfg = dict(DEMO_CONFIG, vocab_size=vocab)
    tensors = demo_tensors(cfg, seed=20261130)
    # one metadata key: safetensors writes its metadata map in no fixed order, and the files must be byte-identical
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "README.txt").write_text(f"Strata's built-in demo model: {DEMO_NOTE}.\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def write_demo_flash_model(out: Path) -> None:
    from safetensors.numpy import save_file

    from strata.demo_tokenizer import ENDOFTEXT_ID, IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID, write_vision_tokenizer
    vocab = write_vision_tokenizer(out)
    text = dict(DEMO_FLASH_TEXT, vocab_size=vocab, eos_token_id=ENDOFTEXT_ID)
    cfg = dict(DEMO_FLASH_CONFIG, text_config=text, image_token_id=IMAGE_PAD_ID, vision_start_token_id=VISION_START_ID,
               vision_end_token_id=VISION_END_ID)
    tensors = {**demo_flash_tensors(text, seed=20261207), **demo_vision_tensors(DEMO_FLASH_VISION, seed=20261208)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "README.txt").write_text(f"Strata's built-in demo-flash model: {DEMO_FLASH_NOTE}.\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


class _Draw:
    """Random tensors in Hugging Face names and layout for a config dict, drawn in call order from one seeded
    generator (so a writer's order fixes its bytes): the pieces the demo models share."""

    def __init__(self, cfg: dict, seed: int):
        self.cfg, self.rng, self.t = cfg, np.random.default_rng(seed), {}

    def mat(self, name, out_dim, in_dim):
        self.t[name] = (self.rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(self, name, dim, base=0.0):
        self.t[name] = (base + 0.1 * self.rng.standard_normal(dim)).astype(np.float32)

    def embed(self, name):
        c = self.cfg
        self.t[name] = self.rng.standard_normal((c["vocab_size"], c["hidden_size"])).astype(np.float32)

    def delta(self, a, joined: bool):
        """A Gated DeltaNet mixer under prefix a: Qwen3-Next's joined in_proj_qkvz/ba, or Qwen3.5's four matrices."""
        c, H = self.cfg, self.cfg["hidden_size"]
        hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv, K = c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
        if joined:
            self.mat(a + "in_proj_qkvz.weight", 2 * hk * dk + 2 * hv * dv, H)
            self.mat(a + "in_proj_ba.weight", 2 * hv, H)
        else:
            self.mat(a + "in_proj_qkv.weight", 2 * hk * dk + hv * dv, H)
            self.mat(a + "in_proj_z.weight", hv * dv, H)
            self.mat(a + "in_proj_b.weight", hv, H)
            self.mat(a + "in_proj_a.weight", hv, H)
        self.t[a + "conv1d.weight"] = (self.rng.standard_normal((2 * hk * dk + hv * dv, 1, K)) / np.sqrt(K)).astype(
            np.float32)
        self.t[a + "dt_bias"] = np.ones(hv, np.float32)
        self.t[a + "A_log"] = np.log(self.rng.uniform(1.0, 16.0, hv)).astype(np.float32)
        self.norm(a + "norm.weight", dv, base=1.0)
        self.mat(a + "out_proj.weight", H, hv * dv)

    def attention(self, a):
        """Gated attention under prefix a (q_proj holds each head's query and gate)."""
        c, H = self.cfg, self.cfg["hidden_size"]
        hd, hq, hkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
        self.mat(a + "q_proj.weight", hq * hd * 2, H)
        self.mat(a + "k_proj.weight", hkv * hd, H)
        self.mat(a + "v_proj.weight", hkv * hd, H)
        self.mat(a + "o_proj.weight", H, hq * hd)
        self.norm(a + "q_norm.weight", hd)
        self.norm(a + "k_norm.weight", hd)

    def moe(self, q):
        """Routed experts (one tensor per expert and matrix) and the gated shared expert under prefix q."""
        c, H = self.cfg, self.cfg["hidden_size"]
        E, I, Is = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
        self.mat(q + "gate.weight", E, H)
        for e in range(E):
            self.mat(f"{q}experts.{e}.gate_proj.weight", I, H)
            self.mat(f"{q}experts.{e}.up_proj.weight", I, H)
            self.mat(f"{q}experts.{e}.down_proj.weight", H, I)
        self.mat(q + "shared_expert.gate_proj.weight", Is, H)
        self.mat(q + "shared_expert.up_proj.weight", Is, H)
        self.mat(q + "shared_expert.down_proj.weight", H, Is)
        self.mat(q + "shared_expert_gate.weight", 1, H)


def demo_vision_tensors(v: dict, seed: int) -> dict[str, np.ndarray]:
    """Random tensors of a Qwen3-VL vision tower (model.visual.*) for a vision_config dict."""
    d = _Draw(v, seed)
    E, F, m = v["hidden_size"], v["intermediate_size"], v["spatial_merge_size"] ** 2
    p = "model.visual."
    patch = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    d.mat(p + "patch_embed.proj.weight", E, patch)
    d.t[p + "patch_embed.proj.weight"] = d.t[p + "patch_embed.proj.weight"].reshape(
        E, v["in_channels"], v["temporal_patch_size"], v["patch_size"], v["patch_size"])
    d.norm(p + "patch_embed.proj.bias", E)
    d.t[p + "pos_embed.weight"] = (0.5 * d.rng.standard_normal((v["num_position_embeddings"], E))).astype(np.float32)

    def linear(name, out_dim, in_dim):
        d.mat(name + ".weight", out_dim, in_dim)
        d.norm(name + ".bias", out_dim)

    def layer_norm(name, dim):
        d.norm(name + ".weight", dim, base=1.0)
        d.norm(name + ".bias", dim)
    for i in range(v["depth"]):
        b = f"{p}blocks.{i}."
        layer_norm(b + "norm1", E)
        layer_norm(b + "norm2", E)
        linear(b + "attn.qkv", 3 * E, E)
        linear(b + "attn.proj", E, E)
        linear(b + "mlp.linear_fc1", F, E)
        linear(b + "mlp.linear_fc2", E, F)
    layer_norm(p + "merger.norm", E)
    linear(p + "merger.linear_fc1", E * m, E * m)
    linear(p + "merger.linear_fc2", v["out_hidden_size"], E * m)
    return d.t


def demo_flash_tensors(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Random tensors of a qwen4_exp text model in the published names and layout (model.language_model.*, the PLE
    table in split_ngram_parts shards, the MTP head under mtp.), drawn in a fixed order from one seeded generator."""
    from strata.ngram import ngram_spec
    d = _Draw(cfg, seed)
    H, V, n = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_count"]
    R, D = cfg["hc_lowrank"], cfg["ple_embed_dim"]

    def hyper(p, inject=True):
        d.norm(p + "hc_norm.weight", n * H)
        d.mat(p + "input_mix_weight_down.weight", R, n * H)
        d.mat(p + "input_mix_weight_up.weight", n * H, R)
        if inject:
            d.mat(p + "block_inject_weight.weight", n, n * H)

    def qsa(a):
        d.attention(a)
        di = cfg["indexer_head_dim"]
        d.mat(a + "indexer.index_qk_proj.weight", (cfg["indexer_n_heads"] + 1) * di, H)
        d.norm(a + "indexer.q_layernorm.weight", di)
        d.norm(a + "indexer.k_layernorm.weight", di)

    m = "model.language_model."
    d.embed(m + "embed_tokens.weight")
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"{m}layers.{i}."
        hyper(p + "attn_hyper_connection.")
        hyper(p + "mlp_hyper_connection.")
        if kind == "linear_attention":
            d.delta(p + "linear_attn.", joined=False)
        else:
            qsa(p + "self_attn.")
        if i + 1 in cfg["ple_layer_ids"]:
            e = p + "ple."
            spec = ngram_spec(V, cfg["ngram_size"], cfg["heads_per_ngram"], cfg["ngram_vocab_size_base"],
                              cfg["make_ngram_vocab_size_divisible_by"], 1234, cfg["ple_layer_ids"].index(i + 1),
                              cfg["eos_token_id"])
            table = d.rng.standard_normal((spec.table_rows, D // spec.heads)).astype(np.float32)
            for j, shard in enumerate(np.split(table, cfg["split_ngram_parts"])):
                d.t[f"{e}ple_embedding.ngram_embedding.shard_{j}.weight"] = shard
            d.mat(e + "key_proj.weight", n * H, D)
            d.mat(e + "value_proj.weight", H, D)
            for k in ("norm_key", "norm_query", "norm_conv"):
                d.norm(f"{e}{k}.weight", n * H)
            d.t[e + "conv1d.weight"] = (d.rng.standard_normal((n * H, 1, cfg["ple_conv_kernel_size"])) / 2).astype(
                np.float32)
        d.moe(p + "mlp.")
    hyper(m + "hyper_connection_mixer.", inject=False)
    d.mat("lm_head.weight", V, H)
    # the MTP head: per-stream projections, one QSA layer with its hyper-connections, a mixer of its own
    d.norm("mtp.pre_fc_norm_embedding.weight", H)
    d.norm("mtp.pre_fc_norm_hidden.weight", n * H)
    d.mat("mtp.fc_embedding.weight", H, H)
    d.mat("mtp.fc_hidden.weight", H, H)
    hyper("mtp.layers.0.attn_hyper_connection.")
    hyper("mtp.layers.0.mlp_hyper_connection.")
    qsa("mtp.layers.0.self_attn.")
    d.moe("mtp.layers.0.mlp.")
    hyper("mtp.hyper_connection_mixer.", inject=False)
    return d.t


def demo_tensors(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Random tensors in Hugging Face names and layout, drawn in a fixed order from one seeded generator."""
    d = _Draw(cfg, seed)
    H = cfg["hidden_size"]

    def layer(p, kind):
        d.norm(p + "input_layernorm.weight", H)
        d.norm(p + "post_attention_layernorm.weight", H)
        if kind == "linear_attention":
            d.delta(p + "linear_attn.", joined=True)
        else:
            d.attention(p + "self_attn.")
        d.moe(p + "mlp.")

    d.embed("model.embed_tokens.weight")
    for i, kind in enumerate(cfg["layer_types"]):
        layer(f"model.layers.{i}.", kind)
    d.norm("model.norm.weight", H)
    d.mat("lm_head.weight", cfg["vocab_size"], H)
    d.mat("mtp.fc.weight", H, 2 * H)
    d.norm("mtp.pre_fc_norm_embedding.weight", H)
    d.norm("mtp.pre_fc_norm_hidden.weight", H)
    d.norm("mtp.norm.weight", H)
    layer("mtp.layers.0.", "full_attention")
    return d.t
