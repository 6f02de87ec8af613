"""Checkpoint tensors (Hugging Face names and layout) -> the model's parameter tree (numpy, host).
Every tensor is checked against the shape the config implies; a missing or misshapen tensor is a ModelLoadError
naming the tensor, its file, and the expected and found shapes. Load-time rearrangements (done once, here):
- zero-centred norm weights w become scales (1 + w), so every norm on every backend is `x_hat * scale`;
- Gated DeltaNet's in_proj_qkvz rows [q|k|v|z] per key-head group become [all q|all k|all v|all z] (the conv's
  channel order), in_proj_ba [b|a] per group [all b|all a]; gated attention's q_proj [query|gate] per head: 2 matrices;
- with join_projections, the projections that read the same input are joined into one matrix (`projections`);
- qwen4_exp: hyper-connections ("hca_*", "hcm_*", "hcf_*") in place of norms; the PLE table's shards joined;
- routed experts are not in the tree: they live in an expert pool (strata/experts/); `read_experts` stacks a
  checkpoint's experts per sparse layer as gate, up [E, I, H], down [E, H, I] for encoding into blobs.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from strata.host_rows import HostRows
from strata.errors import ModelLoadError
from strata.model.config import FULL, LINEAR, ModelConfig
from strata.model.ple_table import PleTablePlace, mapped_table, stored_table
from strata.weights.source import TensorSource


class TensorReader:
    """Reads checkpoint tensors by name and expected shape. `xp` is the array namespace the tree is built in
    (numpy for loading; a device namespace lets a benchmark build random weights where they will be used)."""

    xp = np

    def __init__(self, src: TensorSource, dtype):
        self.src, self.dtype = src, dtype
        self.names = set(src.names())

    def has(self, name: str) -> bool:
        return name in self.names

    def get(self, name: str, shape: tuple[int, ...], dtype=None) -> np.ndarray:
        if name not in self.names:
            raise ModelLoadError(f"tensor {name} is missing (looked in {self.src.where(name)}); "
                                 f"expected shape {list(shape)}")
        a = self.src.get(name)
        if tuple(a.shape) != tuple(shape):
            raise ModelLoadError(f"tensor {name} in {self.src.where(name)} has shape {list(a.shape)}, "
                                 f"expected {list(shape)}")
        return np.asarray(a, dtype=dtype or self.dtype)

    def norm(self, name: str, dim: int, zero_centred: bool) -> np.ndarray:
        w = self.get(name, (dim,), np.float32)
        return (1.0 + w).astype(np.float32) if zero_centred else w

    def table_blocks(self, e: str, rows: int, dim: int, why: str) -> tuple[list, list | None]:
        """A row table stored whole (`{e}weight`) or in shards (`{e}shard_N.weight`), as the files hold it (memory-
        mapped, not copied) -> (row blocks, their float8 scales `weight_scale_inv` or None); checked: `rows` rows
        (as `why` derives them) of `dim`."""
        names = [e + "weight"] if self.has(e + "weight") else []
        while not self.has(e + "weight") and self.has(f"{e}shard_{len(names)}.weight"):
            names.append(f"{e}shard_{len(names)}.weight")
        if not names:
            raise ModelLoadError(f"tensor {e}weight (or its shards {e}shard_0.weight, ...) is missing; expected "
                                 f"shape [{rows}, {dim}]")
        blocks = [self.src.get(name) for name in names]
        for name, a in zip(names, blocks):
            if a.ndim != 2 or a.shape[1] != dim:
                raise ModelLoadError(f"tensor {name} in {self.src.where(name)} has shape {list(a.shape)}, expected "
                                     f"[rows, {dim}] (ple_embed_dim / n-gram heads)")
        found = sum(int(a.shape[0]) for a in blocks)
        if found != rows:
            what = f"{e}weight" if len(names) == 1 else f"{e}shard_0..{len(names) - 1}"
            raise ModelLoadError(f"the PLE table {what} (in {self.src.where(names[0])}) has {found} rows, expected "
                                 f"{rows} ({why}): a shard is missing or truncated, or the config is not this "
                                 f"checkpoint's")
        if np.dtype(blocks[0].dtype) != np.dtype(ml_dtypes.float8_e4m3fn):
            return blocks, None
        scales = []
        for name in names:
            base = name.removesuffix("weight")
            found = [s for s in (base + "weight_scale_inv", base + "weight_scale") if self.has(s)]
            if not found:
                raise ModelLoadError(f"tensor {name} in {self.src.where(name)} is float8 but has no scale "
                                     f"({base}weight_scale_inv)")
            sc = np.asarray(self.src.get(found[0]), np.float32)
            if sc.size != 1:
                raise ModelLoadError(f"tensor {found[0]} in {self.src.where(found[0])} has shape {list(sc.shape)}: "
                                     f"a PLE table's float8 scale is one value per tensor")
            scales.append(sc)
        return blocks, scales


def projections(cfg: ModelConfig, kind: str, sparse: bool) -> dict[str, tuple[tuple[str, int], ...]]:
    """The joined projections of a layer: {joined name: ((part, rows), ...)} in row order. "in_proj": the layer's
    input projections; "post_proj", after the post-attention norm: the router and the shared expert's gate, up and
    scalar gate, or a dense MLP's gate and up. One matmul each instead of two to four, which at decode is that many
    fewer kernel launches a layer; forward.py splits the product's columns. Joined when the backend's
    joins_projections is set (build_params' join_projections)."""
    if kind == LINEAR:
        hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        ins = (("qkv", cfg.linear_conv_dim), ("z", hv * dv), ("b", hv), ("a", hv))
    else:
        q = cfg.num_heads * cfg.head_dim
        kv = cfg.num_kv_heads * cfg.head_dim
        ins = (("q", q), ("k", kv), ("v", kv)) + ((("gate", q),) if cfg.gated_attention else ())
        if cfg.qsa is not None:     # the indexer's queries and its one key head read the layer's input too
            ins += (("idx_qk", (cfg.qsa.heads + 1) * cfg.qsa.head_dim),)
    if sparse:
        post = (("router", cfg.num_experts),)
        if cfg.shared_expert_intermediate_size:
            Is = cfg.shared_expert_intermediate_size
            post += (("sh_gate", Is), ("sh_up", Is), ("sh_router", 1))
    else:
        post = (("mlp_gate", cfg.intermediate_size), ("mlp_up", cfg.intermediate_size))
    return {"in_proj": ins, "post_proj": post}


def is_sparse(lp: dict) -> bool:
    """Whether a layer's parameters are a sparse (routed-expert) layer's: a dense layer has an MLP down projection."""
    return "mlp_down" not in lp


def build_params(cfg: ModelConfig, src: TensorSource, dtype=np.float32, join_projections: bool = True,
                 ple: PleTablePlace | None = None) -> dict:
    """The parameter tree: {embed, lm_head, norm, layers: [...], mtp: {...} | absent}."""
    return params_from_reader(cfg, TensorReader(src, dtype), join_projections, ple)


def text_prefix(has) -> str:
    """The language model's tensor prefix: "model.language_model." in a published image-text checkpoint
    (qwen4_exp's Qwen4ExpForConditionalGeneration), else "model."; has(name) -> bool."""
    return "model.language_model." if has("model.language_model.embed_tokens.weight") else "model."


def params_from_reader(cfg: ModelConfig, r: TensorReader, join_projections: bool = True,
                       ple: PleTablePlace | None = None) -> dict:
    """ple: where and in which format the PLE tables are kept (None: on the device, as the checkpoint has them)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    m = text_prefix(r.has)
    embed = r.get(m + "embed_tokens.weight", (V, H))
    if cfg.tie_word_embeddings and not r.has("lm_head.weight"):
        lm_head = embed
    else:
        lm_head = r.get("lm_head.weight", (V, H))
    params = {
        "embed": embed,
        "lm_head": lm_head,
        "layers": [_layer(cfg, r, f"{m}layers.{i}.", cfg.layer_types[i], cfg.is_sparse_layer(i), join_projections,
                          _ple_index(cfg, i), ple)
                   for i in range(cfg.num_layers)],
    }
    if cfg.hyper:
        params.update(_hyper(cfg, r, m + "hyper_connection_mixer.", "hcf_", inject=False))
    else:
        params["norm"] = r.norm(m + "norm.weight", H, cfg.zero_centred_norms)
    if r.has("mtp.fc_hidden.weight"):            # qwen4_exp's head: per-stream projections, its own final mixer
        params["mtp"] = {
            "fc_embedding": r.get("mtp.fc_embedding.weight", (H, H)),
            "fc_hidden": r.get("mtp.fc_hidden.weight", (H, H)),
            "pre_fc_norm_embedding": r.norm("mtp.pre_fc_norm_embedding.weight", H, True),
            "pre_fc_norm_hidden": r.norm("mtp.pre_fc_norm_hidden.weight", cfg.residual_width, True),
            **_hyper(cfg, r, "mtp.hyper_connection_mixer.", "hcf_", inject=False),
            "layer": _layer(cfg, r, "mtp.layers.0.", FULL, cfg.num_experts > 0, join_projections),
        }
    elif r.has("mtp.fc.weight"):
        params["mtp"] = {
            "fc": r.get("mtp.fc.weight", (H, 2 * H)),
            "pre_fc_norm_embedding": r.norm("mtp.pre_fc_norm_embedding.weight", H, cfg.zero_centred_norms),
            "pre_fc_norm_hidden": r.norm("mtp.pre_fc_norm_hidden.weight", H, cfg.zero_centred_norms),
            "norm": r.norm("mtp.norm.weight", H, cfg.zero_centred_norms),
            "layer": _layer(cfg, r, "mtp.layers.0.", FULL, cfg.num_experts > 0, join_projections),
        }
    return params


def _ple_index(cfg: ModelConfig, i: int) -> int | None:
    """Layer i's place among the PLE layers (its hash multipliers and table sizes depend on it), or None."""
    return cfg.ple.layers.index(i) if cfg.ple is not None and i in cfg.ple.layers else None


def ngram_spec_for(cfg: ModelConfig, ple_index: int):
    """The n-gram hashing of the ple_index-th PLE layer (strata/model/ngram.py)."""
    from strata.ngram import ngram_spec
    p = cfg.ple
    return ngram_spec(cfg.vocab_size, p.ngram_size, p.heads_per_ngram, p.vocab_size_base, p.divisible_by, p.seed,
                      ple_index, p.eos_token_id)


def _layer(cfg: ModelConfig, r: TensorReader, p: str, kind: str, sparse: bool, join: bool,
           ple_index: int | None = None, ple: PleTablePlace | None = None) -> dict:
    H, zc = cfg.hidden_size, cfg.zero_centred_norms
    if cfg.hyper:
        lp = {**_hyper(cfg, r, p + "attn_hyper_connection.", "hca_"), **_hyper(cfg, r, p + "mlp_hyper_connection.",
                                                                                "hcm_")}
        if ple_index is not None:
            lp.update(_ple(cfg, r, p + "ple.", ple_index, ple))
    else:
        lp = {
            "in_norm": r.norm(p + "input_layernorm.weight", H, zc),
            "post_norm": r.norm(p + "post_attention_layernorm.weight", H, zc),
        }
    lp.update(_linear_attention(cfg, r, p + "linear_attn.") if kind == LINEAR else _attention(cfg, r, p + "self_attn."))
    lp.update(_moe(cfg, r, p + "mlp.") if sparse else _dense_mlp(cfg, r, p + "mlp.", cfg.intermediate_size))
    for joined, parts in projections(cfg, kind, sparse).items() if join else ():
        lp[joined] = r.xp.concatenate([lp.pop(name) for name, _ in parts], axis=0)
    return lp


def _attention(cfg: ModelConfig, r: TensorReader, p: str) -> dict:
    H, hd, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    out = {
        "k": r.get(p + "k_proj.weight", (hkv * hd, H)),
        "v": r.get(p + "v_proj.weight", (hkv * hd, H)),
        "o": r.get(p + "o_proj.weight", (H, hq * hd)),
        "q_norm": r.norm(p + "q_norm.weight", hd, cfg.zero_centred_norms),
        "k_norm": r.norm(p + "k_norm.weight", hd, cfg.zero_centred_norms),
    }
    if cfg.gated_attention:
        q = r.get(p + "q_proj.weight", (hq * hd * 2, H)).reshape(hq, 2, hd, H)   # per head [query | gate]
        out["q"] = q[:, 0].reshape(hq * hd, H)
        out["gate"] = q[:, 1].reshape(hq * hd, H)
    else:
        out["q"] = r.get(p + "q_proj.weight", (hq * hd, H))
    if cfg.qsa is not None:
        di = cfg.qsa.head_dim
        out.update({"idx_qk": r.get(p + "indexer.index_qk_proj.weight", ((cfg.qsa.heads + 1) * di, H)),
                    "idx_q_norm": r.norm(p + "indexer.q_layernorm.weight", di, True),
                    "idx_k_norm": r.norm(p + "indexer.k_layernorm.weight", di, True)})
    return out


def _hyper(cfg: ModelConfig, r: TensorReader, p: str, name: str, inject: bool = True) -> dict:
    """A gated-residual hyper-connection: the streams' norm, the low-rank input mixer and (a layer's, not the final
    mixer's) the per-stream injection weights."""
    n, R = cfg.residual_width, cfg.hc_lowrank
    out = {name + "norm": r.norm(p + "hc_norm.weight", n, True),
           name + "down": r.get(p + "input_mix_weight_down.weight", (R, n)),
           name + "up": r.get(p + "input_mix_weight_up.weight", (n, R))}
    if inject:
        out[name + "inject"] = r.get(p + "block_inject_weight.weight", (cfg.hc_count, n))
    return out


def ple_table_blocks(cfg: ModelConfig, r: TensorReader, ple_index: int, p: str | None = None) -> tuple:
    """The ple_index-th PLE layer's table as the checkpoint stores it (TensorReader.table_blocks: memory-mapped,
    checked); p: the layer's "...ple." prefix (default: from the checkpoint's names)."""
    ple = cfg.ple
    if p is None:
        p = f"{text_prefix(r.has)}layers.{ple.layers[ple_index]}.ple."
    return r.table_blocks(p + "ple_embedding.ngram_embedding.", ngram_spec_for(cfg, ple_index).table_rows,
                          ple.embed_dim // ple.heads,
                          f"the config's {ple.heads} n-gram heads' prime sizes from ngram_vocab_size_base "
                          f"{ple.vocab_size_base}, padded to {ple.divisible_by}")


def _ple(cfg: ModelConfig, r: TensorReader, p: str, ple_index: int, place: PleTablePlace | None) -> dict:
    """A PLE layer: its n-gram table (in the place and format `place` says; None: on the device as the checkpoint
    has it, float8 kept), projections, norms and the dilated conv's weights."""
    ple, n, H = cfg.ple, cfg.residual_width, cfg.hidden_size
    blocks, scales = ple_table_blocks(cfg, r, ple_index, p)
    place = place or PleTablePlace("device", "auto")
    if place.where == "disk":
        stored = {"ple_table": mapped_table(blocks, scales, place.fmt)}
    else:
        values, scale = stored_table(blocks, scales, place.fmt, r.dtype)
        stored = {"ple_table": values if place.where == "device" else HostRows([values], scale, "host")}
        if place.where == "device" and scale is not None:
            stored["ple_scale"] = scale
    return {**stored,
            "ple_key": r.get(p + "key_proj.weight", (n, ple.embed_dim)),
            "ple_value": r.get(p + "value_proj.weight", (H, ple.embed_dim)),
            "ple_norm_key": r.norm(p + "norm_key.weight", n, True),
            "ple_norm_query": r.norm(p + "norm_query.weight", n, True),
            "ple_norm_conv": r.norm(p + "norm_conv.weight", n, True),
            "ple_conv": r.get(p + "conv1d.weight", (n, 1, ple.conv_kernel))[:, 0, :]}          # [n*H, K]


def _linear_attention(cfg: ModelConfig, r: TensorReader, p: str) -> dict:
    H, hk, hv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    rv = hv // hk
    if r.has(p + "in_proj_qkv.weight"):
        # qwen4_exp (Qwen3.5's layout): q, k, v, z, b, a each a matrix of its own, heads in order
        return {"qkv": r.get(p + "in_proj_qkv.weight", (cfg.linear_conv_dim, H)),
                "z": r.get(p + "in_proj_z.weight", (hv * dv, H)),
                "b": r.get(p + "in_proj_b.weight", (hv, H)),
                "a": r.get(p + "in_proj_a.weight", (hv, H)),
                **_delta_rest(cfg, r, p)}
    qkvz = r.get(p + "in_proj_qkvz.weight", (2 * hk * dk + 2 * hv * dv, H)).reshape(hk, 2 * dk + 2 * rv * dv, H)
    q, k = qkvz[:, :dk], qkvz[:, dk:2 * dk]
    v, z = qkvz[:, 2 * dk:2 * dk + rv * dv], qkvz[:, 2 * dk + rv * dv:]
    ba = r.get(p + "in_proj_ba.weight", (2 * hv, H)).reshape(hk, 2 * rv, H)
    return {
        # rows: all q (hk*dk) | all k (hk*dk) | all v (hv*dv) = the conv's channels, then z (hv*dv)
        "qkv": r.xp.concatenate([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)], axis=0),
        "z": z.reshape(-1, H),
        "b": ba[:, :rv].reshape(hv, H),
        "a": ba[:, rv:].reshape(hv, H),
        **_delta_rest(cfg, r, p),
    }


def _delta_rest(cfg: ModelConfig, r: TensorReader, p: str) -> dict:
    H, hv, dv, K = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    return {
        "conv": r.get(p + "conv1d.weight", (cfg.linear_conv_dim, 1, K))[:, 0, :],    # [C, K]
        "dt_bias": r.get(p + "dt_bias", (hv,), np.float32),
        "A_log": r.get(p + "A_log", (hv,), np.float32),
        "gnorm": r.get(p + "norm.weight", (dv,), np.float32),                        # plain gated RMSNorm weight
        "out": r.get(p + "out_proj.weight", (H, hv * dv)),
    }


def _dense_mlp(cfg: ModelConfig, r: TensorReader, p: str, width: int) -> dict:
    H = cfg.hidden_size
    return {
        "mlp_gate": r.get(p + "gate_proj.weight", (width, H)),
        "mlp_up": r.get(p + "up_proj.weight", (width, H)),
        "mlp_down": r.get(p + "down_proj.weight", (H, width)),
    }


def _moe(cfg: ModelConfig, r: TensorReader, p: str) -> dict:
    H, E = cfg.hidden_size, cfg.num_experts
    out = {"router": r.get(p + "gate.weight", (E, H))}
    if cfg.shared_expert_intermediate_size:
        Is = cfg.shared_expert_intermediate_size
        out.update({
            "sh_gate": r.get(p + "shared_expert.gate_proj.weight", (Is, H)),
            "sh_up": r.get(p + "shared_expert.up_proj.weight", (Is, H)),
            "sh_down": r.get(p + "shared_expert.down_proj.weight", (H, Is)),
            "sh_router": r.get(p + "shared_expert_gate.weight", (1, H)),
        })
    return out


def expert_layer_prefixes(cfg: ModelConfig, model: str = "model.") -> list[str]:
    """The tensor-name prefix of every sparse layer's MLP, in order (MoE layer position p = index here); model:
    the language model's prefix (text_prefix)."""
    return [f"{model}layers.{i}.mlp." for i in range(cfg.num_layers) if cfg.is_sparse_layer(i)]


def read_experts(cfg: ModelConfig, src: TensorSource, dtype=np.float32, prefix: str | None = None):
    """One sparse layer's routed experts (or, with prefix None, every sparse layer's): (gate [E, I, H],
    up [E, I, H], down [E, H, I]) from either the per-expert names or transformers' fused layout."""
    if prefix is None:
        names = set(src.names())
        return [read_experts(cfg, src, dtype, p) for p in expert_layer_prefixes(cfg, text_prefix(names.__contains__))]
    r = TensorReader(src, dtype)
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    p = prefix
    if r.has(p + "experts.gate_up_proj"):
        # transformers' fused in-memory layout, when a checkpoint was saved that way
        gate_up = r.get(p + "experts.gate_up_proj", (E, 2 * I, H))
        return gate_up[:, :I], gate_up[:, I:], r.get(p + "experts.down_proj", (E, H, I))
    gate = np.stack([r.get(f"{p}experts.{e}.gate_proj.weight", (I, H)) for e in range(E)])
    up = np.stack([r.get(f"{p}experts.{e}.up_proj.weight", (I, H)) for e in range(E)])
    down = np.stack([r.get(f"{p}experts.{e}.down_proj.weight", (H, I)) for e in range(E)])
    return gate, up, down
