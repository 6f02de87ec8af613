"""llama.cpp's Qwen3.5-rule GGUFs seen as Hugging Face text checkpoints: `qwen35moe` (Qwen3.5-MoE) and `qwen4exp`.

llama.cpp's converter (conversion/qwen.py's Qwen3.5 classes; conversion/qwen4exp.py over them) stores every
zero-centred norm as 1 + w (not the delta rule's gated norm), A_log as -exp(A_log), squeezed conv kernels, the
experts stacked per matrix, and the delta rule's value heads reordered from grouped (head k * r + j of key head k)
to tiled (j * n_key_heads + k); qwen4exp also the indexer's q|k projection as two tensors, PLE layers 0-based. This
module undoes each and turns the metadata into the text config, checking a PLE table's hash constants against the
ones the config derives. The table stays memory-mapped as stored (a quantized one dequantized as its rows are read).
A qwen4exp MTP block (blk.{n_layer}, nextn_predict_layers 1) is read as the checkpoint's mtp.*.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor

from strata.errors import ModelLoadError
from strata.weights.gguf_reader import (_BLOCK_NAMES, _BLOCK_RE, _EXPERT_STACKS, _QWEN3NEXT_BLOCK_NAMES, _dequant,
                                         _expert_recipes, _Metadata, _plain_recipe, _shape)

ARCHS = ("qwen35moe", "qwen4exp")
PLE_SEED = 1234            # the seed the release's n-gram multipliers come from (the file stores the result)

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
_GLOBAL_OWN = {"qwen35moe": {"output_norm.weight": "model.norm.weight"},
               "qwen4exp": {"output_hc_norm.weight": "model.hyper_connection_mixer.hc_norm.weight",
                            "output_hc_down.weight": "model.hyper_connection_mixer.input_mix_weight_down.weight",
                            "output_hc_up.weight": "model.hyper_connection_mixer.input_mix_weight_up.weight"}}
_HYPER = {"norm": "hc_norm", "down": "input_mix_weight_down", "up": "input_mix_weight_up",
          "inject": "block_inject_weight"}
# names shared with qwen3next (weights/gguf_reader.py's tables), then each arch's own
_COMMON = {**_BLOCK_NAMES, **_QWEN3NEXT_BLOCK_NAMES}
_BLOCK = {k: _COMMON[k] for k in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                                  "attn_q_norm.weight", "attn_k_norm.weight", "ffn_gate_inp.weight",
                                  "ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
                                  "ffn_down_shexp.weight", "ssm_norm.weight")}
_BLOCK_OWN = {"qwen35moe": {k: _COMMON[k] for k in ("attn_norm.weight", "post_attention_norm.weight")}}
_BLOCK_OWN["qwen4exp"] = {
    **{f"hc_{side}_{k}.weight": f"{mod}_hyper_connection.{v}.weight"
       for side, mod in (("attn", "attn"), ("ffn", "mlp")) for k, v in _HYPER.items()},
    "indexer.q_norm.weight": "self_attn.indexer.q_layernorm.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_layernorm.weight",
    "ple_key.weight": "ple.key_proj.weight",
    "ple_value.weight": "ple.value_proj.weight",
    "ple_norm_key.weight": "ple.norm_key.weight",
    "ple_norm_query.weight": "ple.norm_query.weight",
    "ple_norm_conv.weight": "ple.norm_conv.weight",
    "ple_conv1d.weight": "ple.conv1d.weight",
}
# the delta rule's tensors whose value heads the converter tiled: GGUF suffix -> (HF name, axis, rows a head)
_TILED = {"attn_qkv.weight": ("linear_attn.in_proj_qkv.weight", 0, "dv"),
          "attn_gate.weight": ("linear_attn.in_proj_z.weight", 0, "dv"),
          "ssm_beta.weight": ("linear_attn.in_proj_b.weight", 0, 1),
          "ssm_alpha.weight": ("linear_attn.in_proj_a.weight", 0, 1),
          "ssm_conv1d.weight": ("linear_attn.conv1d.weight", 0, "dv"),
          "ssm_dt.bias": ("linear_attn.dt_bias", 0, 1),
          "ssm_a": ("linear_attn.A_log", 0, 1),
          "ssm_out.weight": ("linear_attn.out_proj.weight", 1, "dv")}
# the MTP block's own tensors (blk.{n_layer}.nextn.*; its decoder layer's are named as a trunk layer's)
_NEXTN = {"nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
          "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
          **{f"nextn.hc_head_{k}.weight": f"mtp.hyper_connection_mixer.{v}.weight"
             for k, v in _HYPER.items() if k != "inject"}}
_TABLE_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.BF16: ml_dtypes.bfloat16}


def qwen35_config(arch: str, meta: _Metadata, tensors: dict[str, ReaderTensor], path: Path) -> dict:
    """The text config (config.json keys: qwen3_5_moe_text or qwen4_exp_text) of a qwen35moe / qwen4exp GGUF's
    metadata and tensors."""
    k = lambda name: f"{arch}.{name}"  # noqa: E731
    nextn = int(meta.get(k("nextn_predict_layers"), 0) or 0)
    if nextn > 1:
        raise ModelLoadError(f"{path}: {k('nextn_predict_layers')} is {nextn}; one MTP layer is supported")
    n_layers = int(meta.require(k("block_count"))) - nextn
    hidden, heads = int(meta.require(k("embedding_length"))), int(meta.require(k("attention.head_count")))
    head_dim = int(meta.get(k("attention.key_length"), hidden // heads))
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: tensor token_embd.weight is missing (a file of its own joins the model's "
                             f"through gguf_parts)")
    layer_types = []
    for i in range(n_layers):
        if f"blk.{i}.ssm_a" in tensors:
            layer_types.append("linear_attention")
        elif f"blk.{i}.attn_q.weight" in tensors:
            layer_types.append("full_attention")
        else:
            raise ModelLoadError(f"{path}: block {i} has neither attention (blk.{i}.attn_q.weight) nor linear-"
                                 f"attention (blk.{i}.ssm_a) tensors")
    n_v = int(meta.require(k("ssm.time_step_rank")))
    sections = [int(x) for x in meta.get(k("rope.dimension_sections"), [])][:3]    # MRoPE's t, h, w (then a 0)
    rope = {"rope_type": "default", "rope_theta": float(meta.get(k("rope.freq_base"), 10000.0)),
            "partial_rotary_factor": int(meta.require(k("rope.dimension_count"))) / head_dim,
            "mrope_section": sections, "mrope_interleaved": True}
    cfg = {
        "vocab_size": int(_shape(tensors["token_embd.weight"])[0]), "hidden_size": hidden,
        "num_hidden_layers": n_layers, "layer_types": layer_types, "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(k("attention.head_count_kv"), heads)), "head_dim": head_dim,
        "rope_parameters": rope,
        "linear_num_key_heads": int(meta.require(k("ssm.group_count"))), "linear_num_value_heads": n_v,
        "linear_key_head_dim": int(meta.require(k("ssm.state_size"))),
        "linear_value_head_dim": int(meta.require(k("ssm.inner_size"))) // n_v,
        "linear_conv_kernel_dim": int(meta.require(k("ssm.conv_kernel"))),
        "num_experts": int(meta.require(k("expert_count"))),
        "num_experts_per_tok": int(meta.require(k("expert_used_count"))),
        "moe_intermediate_size": int(meta.require(k("expert_feed_forward_length"))),
        "shared_expert_intermediate_size": int(meta.require(k("expert_shared_feed_forward_length"))),
        "norm_topk_prob": True,              # the graph always renormalises the top-k weights
        "rms_norm_eps": float(meta.require(k("attention.layer_norm_rms_epsilon"))),
        "tie_word_embeddings": "output.weight" not in tensors, "hidden_act": "silu",
        "max_position_embeddings": int(meta.get(k("context_length"), 262144)), "mtp_num_hidden_layers": nextn,
    }
    eos = meta.get(k("ple.eos_token_id"), meta.get("tokenizer.ggml.eos_token_id"))
    if eos is not None:
        cfg["eos_token_id"] = int(eos)
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        cfg["bos_token_id"] = int(meta.get("tokenizer.ggml.bos_token_id"))
    if arch == "qwen35moe":
        return {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", **cfg}
    cfg = {"architectures": ["Qwen4ExpForCausalLM"], "model_type": "qwen4_exp_text", **cfg,
           "output_gate_type": "sigmoid",       # llama.cpp's graph gates the delta rule's output by a sigmoid
           "hc_count": int(meta.require(k("hyper_connection.count"))),
           "hc_lowrank": int(meta.require(k("hyper_connection.low_rank"))), **_indexer(meta, layer_types, path)}
    if meta.get(k("ple.layers")):
        cfg.update(_ple_config(meta, tensors, cfg, path))
    return cfg


def _indexer(meta: _Metadata, layer_types: list[str], path: Path) -> dict:
    k = lambda name: f"qwen4exp.attention.{name}"  # noqa: E731
    ratios = [int(x) for x in meta.get(k("compress_ratios"), [])]
    full = [r for r, kind in zip(ratios, layer_types) if kind == "full_attention"]
    if not full or set(full) == {0} or len(set(full)) != 1:
        raise ModelLoadError(f"{path}: qwen4exp.attention.compress_ratios gives the attention layers {full or 'none'}; "
                             f"Strata needs one positive indexer compress ratio for all of them (a file whose "
                             f"ratios are all 0 lost them at conversion: convert it again)")
    return {"indexer_n_heads": int(meta.require(k("indexer.head_count"))), "indexer_kv_heads": 1,
            "indexer_head_dim": int(meta.require(k("indexer.key_length"))),
            "indexer_budget": int(meta.require(k("indexer.top_k"))), "indexer_compress_ratio": full[0]}


def _ple_config(meta: _Metadata, tensors: dict[str, ReaderTensor], cfg: dict, path: Path) -> dict:
    """The PLE keys of the config, checked against the hash constants and the table the file holds."""
    from strata.ngram import ngram_spec
    k = lambda name: f"qwen4exp.ple.{name}"  # noqa: E731
    layers = [int(x) for x in meta.get(k("layers"))]
    if len(layers) != 1:
        raise ModelLoadError(f"{path}: {k('layers')} lists {layers}; one PLE layer is supported (as llama.cpp's)")
    n, per = int(meta.require(k("ngram_size"))), int(meta.require(k("heads_per_ngram")))
    width = int(meta.require("qwen4exp.embedding_length_per_layer_input"))
    sizes = [int(x) for x in meta.require(k("head_vocab_sizes"))]
    out = {"ple_layer_ids": [layers[0] + 1], "ple_embed_dim": width * (n - 1) * per,
           "ple_conv_kernel_size": int(meta.require(k("conv_kernel"))), "ngram_size": n, "heads_per_ngram": per,
           "ngram_vocab_size_base": sizes[0], "make_ngram_vocab_size_divisible_by": 128, "seed": PLE_SEED}
    if "eos_token_id" not in cfg:
        raise ModelLoadError(f"{path}: {k('eos_token_id')} is missing: the PLE n-gram history restarts after it")
    spec = ngram_spec(cfg["vocab_size"], n, per, sizes[0], 128, PLE_SEED, 0, cfg["eos_token_id"])
    stored = {"layer_multipliers": [int(x) for x in meta.require(k("layer_multipliers"))][:n],
              "head_vocab_sizes": sizes, "head_offsets": [int(x) for x in meta.require(k("head_offsets"))]}
    derived = {"layer_multipliers": list(spec.multipliers), "head_vocab_sizes": list(spec.head_sizes),
               "head_offsets": list(spec.head_offsets)}
    for key, want in derived.items():
        if stored[key][:len(want)] != want:
            raise ModelLoadError(f"{path}: {k(key)} is {stored[key]}, but the n-gram hashing Strata computes (seed "
                                 f"{PLE_SEED}, primes from {sizes[0]}) gives {want}: this file's PLE hashing is not "
                                 f"the release's")
    table = tensors.get("per_layer_token_embd.weight")
    if table is None:
        raise ModelLoadError(f"{path}: per_layer_token_embd.weight (the PLE table) is missing; a table kept in "
                             f"another shard is found when the model is named by its first shard "
                             f"(NAME-00001-of-0000N.gguf), one in a file of its own through gguf_parts")
    rows, dim = _shape(table)
    if (rows, dim) != (spec.table_rows, width):
        raise ModelLoadError(f"{path}: per_layer_token_embd.weight is [{rows}, {dim}], expected "
                             f"[{spec.table_rows}, {width}] (the n-gram heads' rows, padded to 128, of "
                             f"embedding_length_per_layer_input values)")
    return out


def qwen35_recipes(arch: str, cfg: dict, tensors: dict[str, ReaderTensor], path: Path):
    """HF name -> zero-argument reader, and HF name -> GGUF source name(s)."""
    globals_, blocks = {**_GLOBAL, **_GLOBAL_OWN[arch]}, {**_BLOCK, **_BLOCK_OWN[arch]}
    geo = {"dv": cfg["linear_value_head_dim"], "nk": cfg["linear_num_key_heads"], "nv": cfg["linear_num_value_heads"],
           "v_start": 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]}
    recipes: dict[str, Callable[[], np.ndarray]] = {}
    origin: dict[str, str] = {}
    unknown = []
    ple = cfg.get("ple_layer_ids", [None])[0]
    mtp = arch == "qwen4exp" and cfg.get("mtp_num_hidden_layers", 0) > 0
    for gname, t in tensors.items():
        if gname == "per_layer_token_embd.weight":
            hf = f"model.layers.{ple - 1}.ple.ple_embedding.ngram_embedding.weight"
            recipes[hf], origin[hf] = _table_recipe(t, path), gname
            continue
        if gname in globals_:
            hf = globals_[gname]
            recipes[hf], origin[hf] = _plain(t, hf), gname
            continue
        m = _BLOCK_RE.match(gname)
        n = cfg["num_hidden_layers"]
        if m is None or int(m.group(1)) > n or (int(m.group(1)) == n and not mtp):
            unknown.append(gname)
            continue
        layer, suffix = int(m.group(1)), m.group(2)
        prefix = f"model.layers.{layer}." if layer < n else "mtp.layers.0."
        if layer == n and suffix in _NEXTN:
            hf = _NEXTN[suffix]
            recipes[hf], origin[hf] = _plain(t, hf), gname
            continue
        if layer == n and suffix == "nextn.eh_proj.weight":       # [H, 2H]: the embedding's columns, then the hidden's
            h = cfg["hidden_size"]
            for name, cols in (("mtp.fc_embedding.weight", slice(0, h)), ("mtp.fc_hidden.weight", slice(h, 2 * h))):
                recipes[name], origin[name] = (lambda cols=cols, t=t: _dequant(t)[:, cols]), gname
            continue
        if suffix in _EXPERT_STACKS:
            for name, fn in _expert_recipes(t, prefix, _EXPERT_STACKS[suffix], cfg["num_experts"], path):
                recipes[name], origin[name] = fn, gname
        elif suffix in _TILED:
            name, axis, block = _TILED[suffix]
            hf = prefix + name
            recipes[hf], origin[hf] = _untiled(t, hf, axis, geo["dv"] if block == "dv" else block, geo), gname
        elif suffix == "indexer.q_proj.weight":
            other = tensors.get(f"blk.{layer}.indexer.k_proj.weight")
            if other is None:
                raise ModelLoadError(f"{path}: {gname} has no partner blk.{layer}.indexer.k_proj.weight")
            hf = prefix + "self_attn.indexer.index_qk_proj.weight"
            recipes[hf] = lambda q=t, k=other: np.concatenate([_dequant(q), _dequant(k)])      # q rows first
            origin[hf] = f"{gname} + {other.name}"
        elif suffix == "indexer.k_proj.weight":
            continue                            # read with indexer.q_proj
        elif suffix in blocks:
            hf = prefix + blocks[suffix]
            recipes[hf], origin[hf] = _plain(t, hf), gname
        else:
            unknown.append(gname)
    if unknown:
        raise ModelLoadError(f"{path}: GGUF tensors with no Hugging Face counterpart for {arch}: "
                             f"{', '.join(sorted(unknown)[:8])}{' ...' if len(unknown) > 8 else ''}")
    return recipes, origin


def _folded(hf: str) -> bool:
    """Whether the converter stored this checkpoint norm as 1 + w: every "*norm.weight" but the delta rule's gated
    norm, the PLE's norm_{key,query,conv} and the MTP head's pre_fc_norm_* (renamed nextn.enorm / hnorm)."""
    return ((hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight")) or ".ple.norm_" in hf
            or hf.startswith("mtp.pre_fc_norm_"))


def _plain(t: ReaderTensor, hf: str) -> Callable[[], np.ndarray]:
    """A tensor as the checkpoint has it: qwen3next's reader, with this family's norms stored as 1 + w (_folded)."""
    return _plain_recipe(t, hf, _folded(hf))


def _untiled(t: ReaderTensor, hf: str, axis: int, block: int, geo: dict) -> Callable[[], np.ndarray]:
    """A delta-rule tensor with its value heads back in grouped order: the file's head j * nk + k is the
    checkpoint's k * r + j. Along `axis`, the value heads start at v_start (in_proj_qkv's and the conv's q and k rows
    come first) else at 0; `block` rows (or columns) a head."""
    nk, nv = geo["nk"], geo["nv"]
    r = nv // nk

    plain = _plain_recipe(t, hf, False)         # A_log from -exp(A_log), the conv's [C, 1, K]

    def read() -> np.ndarray:
        w = np.moveaxis(plain(), axis, 0)
        start = geo["v_start"] if hf.endswith(("in_proj_qkv.weight", "conv1d.weight")) else 0
        v = w[start:start + nv * block]
        if v.shape[0] != nv * block:
            raise ModelLoadError(f"{t.name}: {w.shape[0]} rows along axis {axis}; expected value heads "
                                 f"{nv} x {block} from row {start}")
        v = v.reshape(r, nk, block, *v.shape[1:]).swapaxes(0, 1).reshape(v.shape)
        return np.moveaxis(np.concatenate([w[:start], v, w[start + nv * block:]]), 0, axis)
    return read


def _table_recipe(t: ReaderTensor, path: Path) -> Callable:
    """The PLE table as the file stores it, memory-mapped (rows [R, D]): F32 or BF16 as arrays, another type
    (F16, Q8_0, Q4_0, IQ4_NL, ...) as QuantizedRows."""
    qtype = GGMLQuantizationType(t.tensor_type)
    if qtype in _TABLE_TYPES:
        return lambda: np.asarray(t.data).view(_TABLE_TYPES[qtype]).reshape(_shape(t))
    return lambda: QuantizedRows(t)


class QuantizedRows:
    """A quantized GGUF table's rows, dequantized to float32 as they are read: indexing by rows (an index array or a
    slice) dequantizes those rows' blocks only, so a gather reads a few KB of the memory-mapped file. Array-like as
    strata/model/ple_table.py and HostRows use a row block: shape, dtype, nbytes (the file's bytes), ndim."""

    def __init__(self, t: ReaderTensor):
        self.t = t
        self.shape, self.dtype, self.ndim = _shape(t), np.dtype(np.float32), 2
        self.nbytes = int(t.data.nbytes)

    def __getitem__(self, rows) -> np.ndarray:
        return _dequant(self.t, rows)

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The whole table dequantized (strata pack writes it so: float32, 4 bytes a value)."""
        return self[:] if dtype is None else self[:].astype(dtype)
