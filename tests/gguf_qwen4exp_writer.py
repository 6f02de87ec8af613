"""Test utility: write a qwen4_exp text checkpoint (Hugging Face names) as llama.cpp's converter writes a `qwen4exp`
GGUF (conversion/qwen4exp.py over its Qwen3-Next / Qwen3.5 bases, PR 27742's layout): its metadata keys, tensor names
and value changes. Independent of strata.weights.gguf_qwen4exp on purpose, so a round trip tests the reader against
the converter's behaviour: norms stored as 1 + w (all but the delta rule's gated norm), A_log as -exp(A_log),
squeezed conv kernels, the indexer's q|k projection split, experts stacked per matrix, the delta rule's value heads
tiled (checkpoint head k * r + j at j * n_key_heads + k), the PLE table joined from its shards, PLE layers 0-based.
`shards` > 1 writes a gguf-split set (NAME-0000i-of-0000N.gguf, metadata in the first, the PLE table alone in the
last, as published files keep it). `mtp` writes the MTP head as PR 28243's converter does (published files carry
none): block n_layer, its decoder layer named as a trunk layer's, nextn.eh_proj = [fc_embedding | fc_hidden]
(columns), nextn.enorm / hnorm, its final mixer as nextn.hc_head_*.
"""
from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
from gguf import GGUFValueType
from gguf_writer import _tiled_value_heads      # Qwen3.5's value-head order, as the converter's Qwen3.5 class has it

A = "qwen4exp"
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_NAMES = {
    "attn_hyper_connection.hc_norm.weight": "hc_attn_norm.weight",
    "attn_hyper_connection.input_mix_weight_down.weight": "hc_attn_down.weight",
    "attn_hyper_connection.input_mix_weight_up.weight": "hc_attn_up.weight",
    "attn_hyper_connection.block_inject_weight.weight": "hc_attn_inject.weight",
    "mlp_hyper_connection.hc_norm.weight": "hc_ffn_norm.weight",
    "mlp_hyper_connection.input_mix_weight_down.weight": "hc_ffn_down.weight",
    "mlp_hyper_connection.input_mix_weight_up.weight": "hc_ffn_up.weight",
    "mlp_hyper_connection.block_inject_weight.weight": "hc_ffn_inject.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.indexer.q_layernorm.weight": "indexer.q_norm.weight",
    "self_attn.indexer.k_layernorm.weight": "indexer.k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "ple.key_proj.weight": "ple_key.weight", "ple.value_proj.weight": "ple_value.weight",
    "ple.norm_key.weight": "ple_norm_key.weight", "ple.norm_query.weight": "ple_norm_query.weight",
    "ple.norm_conv.weight": "ple_norm_conv.weight", "ple.conv1d.weight": "ple_conv1d.weight",
}


def gguf_tensors(cfg: dict, hf: dict[str, np.ndarray], mtp: bool = False) -> dict[str, np.ndarray]:
    """GGUF name -> array (numpy order) of a checkpoint's text model (prefix model.language_model. or model.), and
    its MTP head (mtp.*) with mtp."""
    di, nh = cfg["indexer_head_dim"], cfg["indexer_n_heads"]
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple, dict] = {}
    shards: dict[int, np.ndarray] = {}
    n = cfg["num_hidden_layers"]
    if mtp:
        out[f"blk.{n}.nextn.eh_proj.weight"] = np.concatenate([hf["mtp.fc_embedding.weight"],
                                                             hf["mtp.fc_hidden.weight"]], axis=1)
        for src, dst in (("pre_fc_norm_embedding", "enorm"), ("pre_fc_norm_hidden", "hnorm")):
            out[f"blk.{n}.nextn.{dst}.weight"] = hf[f"mtp.{src}.weight"] + np.float32(1.0)
        for src, dst in (("hc_norm", "norm"), ("input_mix_weight_down", "down"), ("input_mix_weight_up", "up")):
            w = hf[f"mtp.hyper_connection_mixer.{src}.weight"]
            out[f"blk.{n}.nextn.hc_head_{dst}.weight"] = w + np.float32(1.0) if dst == "norm" else w
    for name, w in hf.items():
        if name.startswith("model.visual.") or (name.startswith("mtp.") and not name.startswith("mtp.layers.0.")):
            continue
        if name.startswith("mtp.layers.0."):
            if not mtp:
                continue
            name = name.replace("mtp.layers.0.", f"model.layers.{n}.")
        w = np.asarray(w, np.float32)
        short = re.sub(r"^model\.(language_model\.)?", "", name)
        if short == "embed_tokens.weight":
            out["token_embd.weight"] = w
            continue
        if name == "lm_head.weight":
            out["output.weight"] = w
            continue
        if short.startswith("hyper_connection_mixer."):
            part = {"hc_norm": "norm", "input_mix_weight_down": "down",
                    "input_mix_weight_up": "up"}[short.split(".")[1]]
            out[f"output_hc_{part}.weight"] = w + np.float32(1.0) if part == "norm" else w
            continue
        if (m := _EXPERT.match(short)) is not None:
            experts.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = w
            continue
        m = re.match(r"^layers\.(\d+)\.(.+)$", short)
        layer, rest = int(m.group(1)), m.group(2)
        if rest.startswith("ple.ple_embedding.ngram_embedding.shard_"):
            shards[int(rest.rsplit("_", 1)[1].split(".")[0])] = w
            continue
        b = f"blk.{layer}."
        if rest == "self_attn.indexer.index_qk_proj.weight":
            out[b + "indexer.q_proj.weight"], out[b + "indexer.k_proj.weight"] = w[:nh * di], w[nh * di:]
            continue
        if (rest.endswith("norm.weight") and rest != "linear_attn.norm.weight") or rest.startswith("ple.norm_"):
            w = w + np.float32(1.0)              # the converter's Qwen3-Next fold, and its own for the PLE norms
        if rest == "linear_attn.A_log":
            w = -np.exp(w)
        if rest.endswith("conv1d.weight"):
            w = w[:, 0, :]
        if rest == "mlp.shared_expert_gate.weight":
            w = w.reshape(-1)
        out[b + _NAMES[rest]] = _tiled_value_heads(rest, w, cfg)
    for (layer, part), by_e in experts.items():
        out[f"blk.{layer}.ffn_{part}_exps.weight"] = np.stack([by_e[e] for e in sorted(by_e)])
    if shards:
        out["per_layer_token_embd.weight"] = np.concatenate([shards[j] for j in sorted(shards)])
    return out


def write_qwen4exp_gguf(path: Path, cfg: dict, hf: dict[str, np.ndarray], shards: int = 1,
                        metadata: dict | None = None, table_dtype=np.float32, mtp: bool = False) -> list[Path]:
    """Write cfg (a qwen4_exp text config) and its checkpoint hf; metadata: keys (without the arch prefix) set or,
    with value None, left out; table_dtype: the PLE table's (float16: an F16 tensor, which a reader dequantizes as it
    reads rows, as it does a quantized one). -> the files written (the first names the set)."""
    from strata.ngram import ngram_spec
    tensors = gguf_tensors(cfg, hf, mtp)
    if "per_layer_token_embd.weight" in tensors:
        tensors["per_layer_token_embd.weight"] = tensors["per_layer_token_embd.weight"].astype(table_dtype)
    n = cfg["num_hidden_layers"]
    rope = cfg["rope_parameters"]
    full = [kind != "linear_attention" for kind in cfg["layer_types"]]
    keys = {"block_count": (n + mtp, GGUFValueType.UINT32), "context_length": (cfg["max_position_embeddings"], "u32"),
            "embedding_length": (cfg["hidden_size"], "u32"),
            "attention.head_count": (cfg["num_attention_heads"], "u32"),
            "attention.head_count_kv": (cfg["num_key_value_heads"], "u32"),
            "attention.key_length": (cfg["head_dim"], "u32"), "attention.value_length": (cfg["head_dim"], "u32"),
            "attention.layer_norm_rms_epsilon": (cfg["rms_norm_eps"], "f32"),
            "rope.freq_base": (rope["rope_theta"], "f32"),
            "rope.dimension_count": (int(cfg["head_dim"] * rope["partial_rotary_factor"]), "u32"),
            "rope.dimension_sections": (list(rope["mrope_section"]) + [0], "i32[]"),
            "expert_count": (cfg["num_experts"], "u32"), "expert_used_count": (cfg["num_experts_per_tok"], "u32"),
            "expert_feed_forward_length": (cfg["moe_intermediate_size"], "u32"),
            "expert_shared_feed_forward_length": (cfg["shared_expert_intermediate_size"], "u32"),
            "ssm.conv_kernel": (cfg["linear_conv_kernel_dim"], "u32"),
            "ssm.state_size": (cfg["linear_key_head_dim"], "u32"),
            "ssm.group_count": (cfg["linear_num_key_heads"], "u32"),
            "ssm.time_step_rank": (cfg["linear_num_value_heads"], "u32"),
            "ssm.inner_size": (cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"], "u32"),
            "full_attention_interval": (4, "u32"),
            "hyper_connection.count": (cfg["hc_count"], "u32"), "hyper_connection.low_rank": (cfg["hc_lowrank"], "u32"),
            "attention.indexer.head_count": (cfg["indexer_n_heads"], "u32"),
            "attention.indexer.key_length": (cfg["indexer_head_dim"], "u32"),
            "attention.indexer.top_k": (cfg["indexer_budget"], "u32"),
            "attention.compress_ratios": ([cfg["indexer_compress_ratio"] if f else 0 for f in full] + [0] * mtp,
                                          "i32[]")}
    if mtp:
        keys["nextn_predict_layers"] = (1, "u32")
    if cfg.get("ple_layer_ids"):
        heads = (cfg["ngram_size"] - 1) * cfg["heads_per_ngram"]
        spec = ngram_spec(cfg["vocab_size"], cfg["ngram_size"], cfg["heads_per_ngram"], cfg["ngram_vocab_size_base"],
                          cfg["make_ngram_vocab_size_divisible_by"], 1234, 0, cfg["eos_token_id"])
        keys.update({"ple.layers": ([i - 1 for i in cfg["ple_layer_ids"]], "i32[]"),
                     "ple.ngram_size": (cfg["ngram_size"], "u32"),
                     "ple.heads_per_ngram": (cfg["heads_per_ngram"], "u32"),
                     "ple.conv_kernel": (cfg["ple_conv_kernel_size"], "u32"),
                     "ple.eos_token_id": (cfg["eos_token_id"], "u32"),
                     "embedding_length_per_layer_input": (cfg["ple_embed_dim"] // heads, "u32"),
                     "ple.layer_multipliers": (list(spec.multipliers), "u64[]"),
                     "ple.head_offsets": (list(spec.head_offsets), "u64[]"),
                     "ple.head_vocab_sizes": (list(spec.head_sizes), "u64[]")})
    for key, value in (metadata or {}).items():
        if value is None:
            keys.pop(key, None)
        else:
            keys[key] = value
    names = sorted(tensors)
    groups = [names] if shards == 1 else _split(names, shards)
    paths = [path] if shards == 1 else [path.with_name(f"{path.stem}-{i + 1:05d}-of-{shards:05d}.gguf")
                                        for i in range(shards)]
    for i, (p, group) in enumerate(zip(paths, groups)):
        w = gguf.GGUFWriter(str(p), A)
        if i == 0:
            for key, (value, kind) in keys.items():
                _add(w, f"{A}.{key}", value, kind)
            w.add_uint32("tokenizer.ggml.eos_token_id", cfg["eos_token_id"])
        if shards > 1:
            w.add_uint16("split.no", i)
            w.add_uint16("split.count", shards)
            w.add_int32("split.tensors.count", len(names))
        for name in group:
            w.add_tensor(name, np.ascontiguousarray(tensors[name]))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return paths


def _split(names: list[str], shards: int) -> list[list[str]]:
    """The PLE table alone in the last shard, the other tensors spread over the rest."""
    rest = [n for n in names if n != "per_layer_token_embd.weight"]
    groups = [rest[i::shards - 1] for i in range(shards - 1)]
    return groups + [[n for n in names if n == "per_layer_token_embd.weight"]]


def _add(w, key: str, value, kind) -> None:
    if kind in ("u32", GGUFValueType.UINT32):
        w.add_uint32(key, int(value))
    elif kind == "f32":
        w.add_float32(key, float(value))
    elif kind == "i32[]":
        w.add_array(key, [int(v) for v in value])
    elif kind == "u64[]":
        w.add_key_value(key, [int(v) for v in value], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT64)
    else:
        raise ValueError(f"{key}: kind {kind}")
