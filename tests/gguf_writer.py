"""Test utility: write a Hugging Face state dict as GGUF the way llama.cpp's convert_hf_to_gguf.py would.

Mirrors the converter's Qwen3MoeModel / Qwen3NextModel (via Qwen2MoeModel and TextModel) and its Qwen3.5-MoE class
(Qwen3-Next's keys and changes, MRoPE's sections, the fused experts split, the value heads tiled): the same metadata
keys, tensor names (taken from gguf-py's own TensorNameMap, the table the converter uses), expert stacking and qwen3next
value transforms, and the converter's choice of which tensors stay F32 when quantizing. Independent of
strata.weights.gguf_reader on purpose, so a round trip tests the reader against the converter's behaviour.

Deviations from the converter, each forced by what the tests need:
- quant="Q8_0" quantizes with gguf.quants (the converter's --outtype q8_0 does the same); a tensor whose rows are
  not a multiple of 32 stays F32 (the converter would fall back to F16).
- Dense MLP layers of qwen3next (mlp_only_layers) have no entry in gguf-py's QWEN3NEXT tensor list, so the real
  converter refuses them; they are written under the generic llama.cpp names blk.N.ffn_{gate,up,down}.weight.
- Keyword options produce the variants a reader must also accept or reject: omitted metadata keys, the converter's
  --fuse-gate-up-exps layout, the legacy qwen3next layout with in_proj_qkvz kept whole as ssm_in, and attention
  q/k/v fused into one attn_qkv (which llama.cpp's qwen3moe / qwen3next loaders accept).
"""
from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

_ARCH = {"qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT,
         "qwen3_5_moe_text": gguf.MODEL_ARCH.QWEN35MOE}
_FUSED_EXPERTS_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_DENSE_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$")
_U32, _F32, _BOOL = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL


def write_gguf(hf_state_dict: dict[str, np.ndarray], hf_config: dict, path, quant: str = "Q8_0", *,
               omit_keys: tuple[str, ...] = (), fuse_gate_up_exps: bool = False,
               legacy_ssm_in: bool = False, fuse_attention_qkv: bool = False) -> Path:
    """Write `path` (a .gguf file) and return it. quant: "Q8_0" or "F32"."""
    if quant not in ("Q8_0", "F32"):
        raise ValueError(f"quant must be Q8_0 or F32, not {quant!r}")
    path = Path(path)
    model_arch = _ARCH[hf_config["model_type"]]
    arch = gguf.MODEL_ARCH_NAMES[model_arch]
    writer = gguf.GGUFWriter(path, arch)
    for key, (value, vtype) in _metadata(hf_config, arch, quant).items():
        if key not in omit_keys:
            writer.add_key_value(key, value, vtype)
    name_map = gguf.get_tensor_name_map(model_arch, hf_config["num_hidden_layers"])
    tensors = _converted_tensors(hf_state_dict, hf_config, name_map, fuse_gate_up_exps, legacy_ssm_in)
    if fuse_attention_qkv:
        tensors = _fuse_attention_qkv(tensors)
    for name, data in tensors:
        qtype = _tensor_type(name, data, quant)
        if qtype == GGMLQuantizationType.Q8_0:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ------------------------------------------------------------------------------------------------------ metadata

def _rope(cfg: dict, key: str, default):
    # transformers 5 nests rope settings in rope_parameters; Hub config.json files keep them top level
    return (cfg.get("rope_parameters") or {}).get(key, cfg.get(key, default))


def _metadata(cfg: dict, arch: str, quant: str) -> dict[str, tuple[object, GGUFValueType]]:
    """key -> (value, type), in the order TextModel / Qwen2MoeModel / Qwen3NextModel.set_gguf_parameters add them."""
    a = lambda k: f"{arch}.{k}"  # noqa: E731
    meta: dict[str, tuple[object, GGUFValueType]] = {a("block_count"): (cfg["num_hidden_layers"], _U32)}
    if cfg.get("max_position_embeddings") is not None:
        meta[a("context_length")] = (cfg["max_position_embeddings"], _U32)
    meta[a("embedding_length")] = (cfg["hidden_size"], _U32)
    if cfg.get("intermediate_size") is not None:
        meta[a("feed_forward_length")] = (cfg["intermediate_size"], _U32)
    meta[a("attention.head_count")] = (cfg["num_attention_heads"], _U32)
    if cfg.get("num_key_value_heads") is not None:
        meta[a("attention.head_count_kv")] = (cfg["num_key_value_heads"], _U32)
    meta[a("rope.freq_base")] = (float(_rope(cfg, "rope_theta", 10000.0)), _F32)
    meta[a("attention.layer_norm_rms_epsilon")] = (float(cfg["rms_norm_eps"]), _F32)
    n_experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    meta[a("expert_count")] = (n_experts, _U32)
    meta[a("expert_used_count")] = (cfg["num_experts_per_tok"], _U32)
    if cfg.get("head_dim") is not None:
        meta[a("attention.key_length")] = (cfg["head_dim"], _U32)
        meta[a("attention.value_length")] = (cfg["head_dim"], _U32)
    file_type = gguf.LlamaFileType.ALL_F32 if quant == "F32" else gguf.LlamaFileType.MOSTLY_Q8_0
    meta["general.file_type"] = (int(file_type), _U32)
    meta[a("expert_feed_forward_length")] = (cfg["moe_intermediate_size"], _U32)
    if cfg.get("shared_expert_intermediate_size") is not None:
        meta[a("expert_shared_feed_forward_length")] = (cfg["shared_expert_intermediate_size"], _U32)
    if arch in ("qwen3next", "qwen35moe"):
        meta[a("ssm.conv_kernel")] = (cfg["linear_conv_kernel_dim"], _U32)
        meta[a("ssm.state_size")] = (cfg["linear_key_head_dim"], _U32)
        meta[a("ssm.group_count")] = (cfg["linear_num_key_heads"], _U32)
        meta[a("ssm.time_step_rank")] = (cfg["linear_num_value_heads"], _U32)
        meta[a("ssm.inner_size")] = (cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"], _U32)
        # the converter writes 4 when config.json has no full_attention_interval, whatever layer_types says
        meta[a("full_attention_interval")] = (cfg.get("full_attention_interval", 4), _U32)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        meta[a("rope.dimension_count")] = (int(head_dim * _rope(cfg, "partial_rotary_factor", 0.25)), _U32)
    if arch == "qwen35moe":             # _Qwen35MRopeMixin: MRoPE's sections and a 0
        sections = list(_rope(cfg, "mrope_section", [11, 11, 10])) + [0]
        meta[a("rope.dimension_sections")] = (sections, GGUFValueType.ARRAY)
    for hf_key, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                        ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if isinstance(cfg.get(hf_key), int):
            meta[key] = (cfg[hf_key], _U32)
    meta["general.quantization_version"] = (gguf.GGML_QUANT_VERSION, _U32)
    return meta


# ------------------------------------------------------------------------------------------------------- tensors

def _converted_tensors(sd: dict[str, np.ndarray], cfg: dict, name_map, fuse_gate_up_exps: bool,
                       legacy_ssm_in: bool):
    """(GGUF name, float32 array in HF dim order) pairs, as the converter's modify_tensors yields them."""
    is_35 = cfg["model_type"] == "qwen3_5_moe_text"
    is_next = cfg["model_type"] == "qwen3_next" or is_35
    n_experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    experts: dict[int, dict[str, np.ndarray]] = {}
    for name, data in sd.items():
        data = np.asarray(data, dtype=np.float32)
        if is_next and name.startswith("mtp."):
            continue  # Qwen3NextModel.filter_tensors drops the MTP head
        if (m := _FUSED_EXPERTS_RE.match(name)) is not None:      # Qwen3.5's [E, 2I, H] gate|up and [E, H, I] down
            if m.group(2) == "down_proj":
                yield f"blk.{m.group(1)}.ffn_down_exps.weight", data
            else:
                half = data.shape[1] // 2
                yield f"blk.{m.group(1)}.ffn_gate_exps.weight", data[:, :half]
                yield f"blk.{m.group(1)}.ffn_up_exps.weight", data[:, half:]
            continue
        if (m := _EXPERT_RE.match(name)) is not None:
            layer = int(m.group(1))
            experts.setdefault(layer, {})[name] = data
            if len(experts[layer]) == 3 * n_experts:
                yield from _stacked_experts(layer, experts.pop(layer), n_experts, name_map, fuse_gate_up_exps)
            continue
        if is_next:
            if name.endswith("linear_attn.in_proj_qkvz.weight") and not legacy_ssm_in:
                yield from _split_qkvz(name, data, cfg)
                continue
            name, data = _qwen3next_value_transform(name, data)
            if is_35:
                data = _tiled_value_heads(name, data, cfg)
        yield _gguf_name(name, name_map), data
    if experts:
        raise ValueError(f"incomplete experts for layers {sorted(experts)}")


def _qwen3next_value_transform(name: str, data: np.ndarray) -> tuple[str, np.ndarray]:
    if name.endswith(".A_log"):
        return name, (-np.exp(data.astype(np.float64))).astype(np.float32)  # ssm_a = -exp(A_log)
    if name.endswith(".dt_bias"):
        return name.removesuffix(".dt_bias") + ".dt_proj.bias", data         # -> blk.N.ssm_dt.bias
    if "conv1d" in name:
        return name, data.squeeze()                                          # [C, 1, K] -> [C, K]
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return name, data + np.float32(1.0)                                  # zero-centred norm -> 1 + w
    return name, data


def _tiled_value_heads(name: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    """Qwen3.5's value-head reorder (_LinearAttentionVReorderBase): checkpoint head k * r + j of key head k goes to
    j * Hk + k, in the value rows of in_proj_qkv and the conv, in_proj_z/b/a, dt_bias, A_log and out_proj's
    columns."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    if hk == hv or "linear_attn." not in name:
        return w
    part = name.split("linear_attn.")[1]
    if part.startswith(("in_proj_qkv", "conv1d")):
        start, block, axis = 2 * hk * dk, dv, 0
    elif part.startswith(("in_proj_z", "out_proj")):
        start, block, axis = 0, dv, 1 if part.startswith("out_proj") else 0
    elif part.startswith(("in_proj_b", "in_proj_a", "A_log", "dt_proj", "dt_bias")):
        start, block, axis = 0, 1, 0
    else:
        return w
    w = np.moveaxis(w, axis, 0)
    v = w[start:start + hv * block]
    v = v.reshape(hk, hv // hk, block, *v.shape[1:]).swapaxes(0, 1).reshape(v.shape)
    return np.ascontiguousarray(np.moveaxis(np.concatenate([w[:start], v, w[start + hv * block:]]), 0, axis))


def _split_qkvz(name: str, w: np.ndarray, cfg: dict):
    """in_proj_qkvz [Hk*(2dk + 2r*dv), H], per key-head group [q|k|v|z] -> attn_qkv [q all; k all; v all] and
    attn_gate [z all], as Qwen3NextModel.modify_tensors does."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    rdv = hv // hk * dv
    groups = w.reshape(hk, 2 * dk + 2 * rdv, w.shape[1])                  # [Hk, 2dk + 2r*dv, H]
    q, k, v, z = np.split(groups, [dk, 2 * dk, 2 * dk + rdv], axis=1)
    h = w.shape[1]
    layer = int(name.split(".")[2])
    yield f"blk.{layer}.attn_qkv.weight", np.concatenate([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)])
    yield f"blk.{layer}.attn_gate.weight", np.ascontiguousarray(z.reshape(-1, h))


def _stacked_experts(layer: int, tensors: dict[str, np.ndarray], n_experts: int, name_map, fuse: bool):
    """Per-expert [I, H] / [H, I] -> one [E, I, H] / [E, H, I] per projection (Qwen2MoeModel.modify_tensors);
    with fuse (--fuse-gate-up-exps) gate and up go out as one [E, 2I, H], gate first."""
    stacks = {w: np.stack([tensors[f"model.layers.{layer}.mlp.experts.{e}.{w}.weight"] for e in range(n_experts)])
              for w in ("down_proj", "gate_proj", "up_proj")}
    yield _gguf_name(f"model.layers.{layer}.mlp.experts.down_proj.weight", name_map), stacks["down_proj"]
    if fuse:
        yield f"blk.{layer}.ffn_gate_up_exps.weight", np.concatenate([stacks["gate_proj"], stacks["up_proj"]], 1)
        return
    for w in ("gate_proj", "up_proj"):
        yield _gguf_name(f"model.layers.{layer}.mlp.experts.{w}.weight", name_map), stacks[w]


def _fuse_attention_qkv(tensors):
    """blk.N.attn_{q,k,v}.weight -> one blk.N.attn_qkv.weight [q rows; k rows; v rows], the fused form llama.cpp's
    loader takes for attention layers."""
    pending: dict[int, dict[str, np.ndarray]] = {}
    for name, data in tensors:
        m = re.match(r"^blk\.(\d+)\.attn_([qkv])\.weight$", name)
        if m is None:
            yield name, data
            continue
        parts = pending.setdefault(int(m.group(1)), {})
        parts[m.group(2)] = data
        if len(parts) == 3:
            yield f"blk.{m.group(1)}.attn_qkv.weight", np.concatenate([parts["q"], parts["k"], parts["v"]])
            del pending[int(m.group(1))]


def _gguf_name(name: str, name_map) -> str:
    mapped = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
    if mapped is not None:
        return mapped
    if (m := _DENSE_RE.match(name)) is not None:
        return f"blk.{m.group(1)}.ffn_{m.group(2)}.weight"  # generic llama.cpp dense FFN names (see module doc)
    raise ValueError(f"cannot map tensor {name!r}")


def _tensor_type(name: str, data: np.ndarray, quant: str) -> GGMLQuantizationType:
    """TextModel.prepare_tensors' choice: 1-D tensors, norms, the router, the conv kernel and non-.weight tensors
    stay F32; the rest is quantized."""
    if quant == "F32" or data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return GGMLQuantizationType.F32
    if re.match(r"^blk\.\d+\.(ffn_gate_inp|ssm_conv1d)\.weight$", name):
        return GGMLQuantizationType.F32
    if data.shape[-1] % 32 != 0:
        return GGMLQuantizationType.F32
    return GGMLQuantizationType.Q8_0


def write_control_vector(path, directions: dict, dtype=np.float32, extra: dict | None = None) -> Path:
    """A control vector file as repeng's export_gguf writes it (architecture "controlvector", one tensor direction.N
    per layer N in directions); extra: more tensors {name: array}, for files a reader must refuse."""
    w = gguf.GGUFWriter(str(path), "controlvector")
    w.add_string("controlvector.model_hint", "test")
    w.add_uint32("controlvector.layer_count", len(directions))
    for n, d in {**{f"direction.{n}": d for n, d in directions.items()}, **(extra or {})}.items():
        w.add_tensor(n, np.asarray(d, dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
