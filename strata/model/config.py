"""Model configuration: one typed, validated view of a Hugging Face config.json (Hub or transformers-saved form).

The model code reads only `ModelConfig`; where a key comes from (Hub's top-level `rope_theta` or transformers'
`rope_parameters`, `num_experts` or `num_local_experts`) is settled here, once. RoPE scaling (strata/model/rope.py)
is part of it: `cfg.rope` is what every backend applies, `cfg.max_positions` the context the model supports.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from functools import cached_property

from strata.errors import ModelLoadError
from strata.model.rope import Rope, RopeScaling, read_scaling, rope_for, scaling_for

SUPPORTED_MODEL_TYPES = ("qwen3_next", "qwen3_moe", "qwen4_exp", "qwen3_5_moe")
LINEAR, FULL = "linear_attention", "full_attention"
INDEXED = "indexed_attention"              # qwen4_exp's name for its attention layers (FULL here, with QSA)
_HYBRID = ("qwen3_next", "qwen4_exp", "qwen3_5_moe")      # Gated DeltaNet + gated attention, zero-centred norms
_NESTED = ("qwen4_exp", "qwen3_5_moe")     # image-text models: the language model's config is text_config


@dataclass(frozen=True)
class PleConfig:
    """qwen4_exp's PLE: hashed n-gram embeddings added to the streams at `layers` (0-indexed, linear layers)."""
    layers: tuple[int, ...]
    embed_dim: int                        # the n-gram heads' rows concatenated
    conv_kernel: int                      # the dilated causal depthwise conv (dilation ngram_size)
    ngram_size: int
    heads_per_ngram: int
    vocab_size_base: int
    divisible_by: int
    seed: int
    eos_token_id: int                     # the n-gram history restarts after it

    @property
    def heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def conv_rows(self) -> int:
        """Rows of the conv's state: (kernel - 1) * dilation."""
        return (self.conv_kernel - 1) * self.ngram_size


@dataclass(frozen=True)
class QsaConfig:
    """qwen4_exp's QSA indexer: each query attends to the top `budget // ratio` key blocks of `ratio` tokens
    (mean-pooled index keys scored by `heads` query heads of `head_dim`) plus the tail (strata/model/qsa.py)."""
    heads: int
    head_dim: int
    budget: int
    ratio: int


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]          # per layer: LINEAR (Gated DeltaNet) or FULL (softmax attention)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float          # fraction of head_dim that RoPE rotates (Qwen3-Next: 0.25)
    rms_norm_eps: float
    tie_word_embeddings: bool
    # sparse MoE
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int  # 0: no shared expert (Qwen3-MoE)
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    intermediate_size: int                # dense MLP layers
    # Gated DeltaNet (Qwen3-Next linear layers)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    eos_token_ids: tuple[int, ...] = field(default=())
    max_position_embeddings: int = 32768  # transformers' default for both model types
    rope_scaling: RopeScaling | None = None
    first_layer: int = 0                  # the whole model's index of layer 0 (a layer split's stage: its first)
    # qwen4_exp (Qwen3.8-Flash-Next): hyper-connection streams, PLE n-gram embeddings, QSA, the delta rule's gate
    hc_count: int = 1                     # residual streams (1: the plain residual of the other families)
    hc_lowrank: int = 0
    ple: PleConfig | None = None          # the PLE layers' settings (None: no PLE)
    qsa: QsaConfig | None = None          # the attention layers' indexer (None: dense attention)
    linear_gate: str = "silu"             # the activation of the delta rule's output gate (qwen4_exp: sigmoid)
    mrope_section: tuple[int, ...] = ()   # interleaved MRoPE's rotated pairs per (t, h, w) axis (image-text families)

    @cached_property
    def rope(self) -> Rope:
        """The inverse frequencies and the factor on cos and sin that attention's RoPE applies."""
        return rope_for(self.head_dim, self.partial_rotary_factor, self.rope_theta, self.rope_scaling,
                        self.mrope_section)

    @property
    def max_positions(self) -> int:
        """Positions the model supports: max_position_embeddings, or the scaled window with rope scaling."""
        return self.rope_scaling.positions if self.rope_scaling is not None else self.max_position_embeddings

    def with_rope_settings(self, kind: str, scale: float | None) -> "ModelConfig":
        """The rope_scaling / rope_scale settings over this checkpoint's own scaling (strata/model/rope.py)."""
        return replace(self, rope_scaling=scaling_for(self.rope_scaling, kind, scale, self.max_position_embeddings))

    def for_context(self, max_context: int) -> "ModelConfig":
        """Dynamic NTK scaling computed for sequences of max_context tokens; any other form is unchanged."""
        s = self.rope_scaling
        return replace(self, rope_scaling=replace(s, seq_len=max_context)) if s and s.kind == "dynamic" else self

    @property
    def zero_centred_norms(self) -> bool:
        """Qwen3-Next, qwen4_exp and Qwen3.5-MoE scale by (1 + w); Qwen3-MoE by w."""
        return self.model_type in _HYBRID

    @property
    def gated_attention(self) -> bool:
        """Qwen3-Next's, qwen4_exp's and Qwen3.5-MoE's q_proj carries a per-head output gate."""
        return self.model_type in _HYBRID

    @property
    def hyper(self) -> bool:
        """Whether the residual is hc_count streams mixed by hyper-connections (qwen4_exp)."""
        return self.hc_count > 1

    @property
    def residual_width(self) -> int:
        """Features of a row of the residual between layers: hc_count streams of hidden_size."""
        return self.hc_count * self.hidden_size

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sparse_layer(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the causal conv: all q, all k, all v."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    @staticmethod
    def from_hf(d: dict, source: str = "config.json") -> "ModelConfig":
        return _parse(d, source)


def _get(d: dict, key: str, source: str, kind=int, default=None):
    if key not in d or d[key] is None:
        if default is None:
            raise ModelLoadError(f"{source}: required key '{key}' is missing")
        return default
    value = d[key]
    try:
        if kind is bool:
            if not isinstance(value, bool):
                raise TypeError
            return value
        if kind is int and (isinstance(value, bool) or float(value) != int(value)):
            raise TypeError
        return kind(value)
    except (TypeError, ValueError):
        raise ModelLoadError(f"{source}: key '{key}' must be {kind.__name__}, found {value!r}") from None


def _rope(d: dict, source: str, partial_default: float | None) -> tuple[float, float, RopeScaling | None]:
    # transformers writes rope_parameters {rope_theta, partial_rotary_factor, rope_type, ...}; Hub files use top-level
    # keys and rope_scaling.
    rp, scaling = read_scaling(d, source)
    theta = _get(rp if rp.get("rope_theta") is not None else d, "rope_theta", source, float, 10000.0)
    # Qwen3-MoE rotates the whole head (partial_default None: transformers ignores partial_rotary_factor there);
    # Qwen3-Next defaults to 0.25, qwen4_exp to 1.0 (its config sets no default)
    partial = 1.0 if partial_default is None else _get(
        rp if rp.get("partial_rotary_factor") is not None else d, "partial_rotary_factor", source, float,
        partial_default)
    if not 0.0 < partial <= 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor must be in (0, 1], found {partial}")
    return theta, partial, scaling


def _int_list(d: dict, key: str, source: str) -> tuple[int, ...]:
    """An integer or a list of integers (eos_token_id, mlp_only_layers); absent or null: ()."""
    v = d.get(key)
    if v is None:
        return ()
    try:
        return tuple(operator.index(x) for x in (v if isinstance(v, list) else [v]))
    except TypeError:
        raise ModelLoadError(f"{source}: key '{key}' must be a list of integers, found {v!r}") from None


def _text_config(d: dict, source: str) -> dict:
    """qwen4_exp's and qwen3_5_moe's published configs nest the language model in text_config (beside
    vision_config); a text-only save (Qwen4ExpForCausalLM, Qwen3_5MoeForCausalLM) is that text_config with model_type
    qwen4_exp_text / qwen3_5_moe_text."""
    kind = d.get("model_type")
    if kind in [f"{k}_text" for k in _NESTED]:
        return {**d, "model_type": kind.removesuffix("_text")}
    if kind not in _NESTED:
        return d
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"{source}: model_type {kind!r} needs a 'text_config' object, found {text!r}")
    # keys the top level carries for the whole model (eos, tied embeddings) fill what text_config leaves out
    outer = {k: d[k] for k in ("eos_token_id", "tie_word_embeddings") if d.get(k) is not None}
    return {**outer, **text, "model_type": kind}


def _parse(d: dict, source: str) -> ModelConfig:
    d = _text_config(d, source)
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"{source}: model_type {model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} (and their _text forms)")
    is_next = model_type in _HYBRID
    is_q4 = model_type == "qwen4_exp"
    if d.get("attention_bias"):
        raise ModelLoadError(f"{source}: attention_bias=true is not supported")
    if d.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act {d['hidden_act']!r} is not supported; supported: silu")
    if d.get("use_sliding_window"):
        raise ModelLoadError(f"{source}: use_sliding_window=true is not supported")
    g = lambda k, kind=int, default=None: _get(d, k, source, kind, default)  # noqa: E731
    hidden = g("hidden_size")
    layers = g("num_hidden_layers")
    heads = g("num_attention_heads")
    if is_next:
        types = d.get("layer_types")
        if types is None:
            n = g("full_attention_interval", int, 4)
            if n < 1:
                raise ModelLoadError(f"{source}: full_attention_interval must be >= 1, found {n}")
            types = [LINEAR if (i + 1) % n else FULL for i in range(layers)]
        if is_q4 and isinstance(types, list):
            types = [FULL if t == INDEXED else t for t in types]
    else:
        types = [FULL] * layers
    if len(types) != layers or any(t not in (LINEAR, FULL) for t in types):
        raise ModelLoadError(f"{source}: layer_types must list {layers} entries of "
                             f"'{LINEAR}' or '{FULL}', found {types!r}")
    theta, partial, scaling = _rope(d, source, 1.0 if is_q4 else 0.25 if is_next else None)
    num_experts = g("num_experts" if d.get("num_experts") is not None else "num_local_experts", int, 0)
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=g("vocab_size"),
        hidden_size=hidden,
        num_layers=layers,
        layer_types=tuple(types),
        num_heads=heads,
        num_kv_heads=g("num_key_value_heads", int, heads),
        head_dim=g("head_dim", int, hidden // heads),
        rope_theta=theta,
        partial_rotary_factor=partial,
        rms_norm_eps=g("rms_norm_eps", float, 1e-6),
        tie_word_embeddings=g("tie_word_embeddings", bool, False),
        num_experts=num_experts,
        num_experts_per_tok=g("num_experts_per_tok", int, 1),
        moe_intermediate_size=g("moe_intermediate_size", int, 0),
        shared_expert_intermediate_size=g("shared_expert_intermediate_size", int, 0) if is_next else 0,
        norm_topk_prob=g("norm_topk_prob", bool, is_next),
        decoder_sparse_step=g("decoder_sparse_step", int, 1),
        mlp_only_layers=_int_list(d, "mlp_only_layers", source),
        intermediate_size=g("intermediate_size", int, 0),
        linear_num_key_heads=g("linear_num_key_heads", int, 0) if is_next else 0,
        linear_num_value_heads=g("linear_num_value_heads", int, 0) if is_next else 0,
        linear_key_head_dim=g("linear_key_head_dim", int, 0) if is_next else 0,
        linear_value_head_dim=g("linear_value_head_dim", int, 0) if is_next else 0,
        linear_conv_kernel_dim=g("linear_conv_kernel_dim", int, 0) if is_next else 0,
        eos_token_ids=_int_list(d, "eos_token_id", source),
        max_position_embeddings=g("max_position_embeddings", int, 32768),
        rope_scaling=scaling,
        mrope_section=_mrope_section(d, source) if model_type in _NESTED else (),
        **(_qwen4_exp(d, source, layers, hidden) if is_q4 else {}),
    )
    _validate(cfg, source)
    return cfg


def _mrope_section(d: dict, source: str) -> tuple[int, ...]:
    """The image-text families' interleaved MRoPE sections (transformers' default [11, 11, 10]): text rows have one
    position in all three axes; an image's tokens have their (t, h, w) positions (strata/model/vision.py)."""
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    sec = rp.get("mrope_section", [11, 11, 10]) if isinstance(rp, dict) else None
    if (not isinstance(sec, list) or len(sec) != 3
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in sec)):
        raise ModelLoadError(f"{source}: mrope_section must be three non-negative integers, found {sec!r}")
    if rp.get("mrope_interleaved") is False:
        raise ModelLoadError(f"{source}: mrope_interleaved=false is not supported: {d.get('model_type')} interleaves "
                             f"its MRoPE sections")
    return tuple(sec)


def _qwen4_exp(d: dict, source: str, layers: int, hidden: int) -> dict:
    """qwen4_exp's own fields: hyper-connections, PLE, QSA and the delta rule's gate."""
    g = lambda k, kind=int, default=None: _get(d, k, source, kind, default)  # noqa: E731
    gate = d.get("output_gate_type") or d.get("hidden_act", "silu")
    if gate not in ("silu", "sigmoid"):
        raise ModelLoadError(f"{source}: output_gate_type {gate!r} is not supported; supported: silu, sigmoid")
    out = dict(hc_count=g("hc_count", int, 4), hc_lowrank=g("hc_lowrank", int, 320), linear_gate=gate)
    if out["hc_count"] < 2 or out["hc_lowrank"] < 1:
        raise ModelLoadError(f"{source}: hc_count must be >= 2 and hc_lowrank >= 1, found {out['hc_count']} and "
                             f"{out['hc_lowrank']}")
    ple_ids = _int_list(d, "ple_layer_ids", source)
    if ple_ids:
        eos = _int_list(d, "eos_token_id", source)
        if not eos:
            raise ModelLoadError(f"{source}: PLE layers (ple_layer_ids) need eos_token_id: the n-gram history "
                                 f"restarts after it")
        bad = [i for i in ple_ids if not 1 <= i <= layers]
        if bad:
            raise ModelLoadError(f"{source}: ple_layer_ids are 1-indexed layers in 1..{layers}, found {bad}")
        out["ple"] = PleConfig(
            layers=tuple(sorted({i - 1 for i in ple_ids})), embed_dim=g("ple_embed_dim", int, hidden),
            conv_kernel=g("ple_conv_kernel_size", int, 4), ngram_size=g("ngram_size", int, 3),
            heads_per_ngram=g("heads_per_ngram", int, 8), vocab_size_base=g("ngram_vocab_size_base", int, 20_000_000),
            divisible_by=g("make_ngram_vocab_size_divisible_by", int, 128), seed=g("seed", int, 1234),
            eos_token_id=eos[0])
    qsa = {k: d.get(k) for k in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
                                 "indexer_compress_ratio")}
    if any(v is not None for v in qsa.values()):
        missing = [k for k, v in qsa.items() if v is None]
        if missing:
            raise ModelLoadError(f"{source}: the QSA indexer needs all of {', '.join(qsa)}; missing: "
                                 f"{', '.join(missing)}")
        if g("indexer_kv_heads") != 1:
            raise ModelLoadError(f"{source}: indexer_kv_heads must be 1, found {qsa['indexer_kv_heads']}")
        out["qsa"] = QsaConfig(heads=g("indexer_n_heads"), head_dim=g("indexer_head_dim"),
                               budget=g("indexer_budget"), ratio=g("indexer_compress_ratio"))
    return out


def _validate(c: ModelConfig, source: str) -> None:
    def need(ok: bool, msg: str):
        if not ok:
            raise ModelLoadError(f"{source}: {msg}")
    need(c.vocab_size > 0 and c.hidden_size > 0 and c.num_layers > 0, "vocab_size, hidden_size and "
         "num_hidden_layers must be positive")
    need(c.num_heads % c.num_kv_heads == 0, f"num_attention_heads ({c.num_heads}) must be a multiple of "
         f"num_key_value_heads ({c.num_kv_heads})")
    need(c.rotary_dim % 2 == 0, f"head_dim * partial_rotary_factor = {c.rotary_dim} must be even")
    need(c.max_position_embeddings >= 1, f"max_position_embeddings must be positive, found "
         f"{c.max_position_embeddings}")
    need(c.rotary_dim > 2 or c.rope_scaling is None or c.rope_scaling.kind != "dynamic",
         f"dynamic rope scaling needs a rotary dimension above 2, found {c.rotary_dim}")
    need(c.decoder_sparse_step >= 1, f"decoder_sparse_step must be >= 1, found {c.decoder_sparse_step}")
    if any(c.is_sparse_layer(i) for i in range(c.num_layers)):
        need(0 < c.num_experts_per_tok <= c.num_experts, f"num_experts_per_tok ({c.num_experts_per_tok}) must be "
             f"in 1..num_experts ({c.num_experts})")
        need(c.moe_intermediate_size > 0, "moe_intermediate_size must be positive")
    if not all(c.is_sparse_layer(i) for i in range(c.num_layers)):
        need(c.intermediate_size > 0, "intermediate_size must be positive (dense MLP layers exist)")
    if c.ple is not None:
        p = c.ple
        need(p.ngram_size >= 2 and p.heads_per_ngram >= 1 and p.embed_dim % p.heads == 0,
             f"ple_embed_dim ({p.embed_dim}) must be a multiple of (ngram_size - 1) * heads_per_ngram ({p.heads})")
        need(p.conv_kernel >= 1, f"ple_conv_kernel_size must be >= 1, found {p.conv_kernel}")
        need(all(c.layer_types[i] == LINEAR for i in p.layers), "PLE layers (ple_layer_ids) must be "
             "linear_attention layers")
    if c.qsa is not None:
        q = c.qsa
        need(min(q.heads, q.head_dim, q.budget, q.ratio) > 0 and q.budget % q.ratio == 0,
             f"indexer_budget ({q.budget}) must be a positive multiple of indexer_compress_ratio ({q.ratio}), and "
             f"the indexer's heads and head_dim positive")
        need(c.rotary_dim <= q.head_dim, f"the rotary dimension ({c.rotary_dim}) must fit indexer_head_dim "
             f"({q.head_dim})")
    if LINEAR in c.layer_types:
        need(c.linear_num_key_heads > 0 and c.linear_num_value_heads % c.linear_num_key_heads == 0,
             f"linear_num_value_heads ({c.linear_num_value_heads}) must be a positive multiple of "
             f"linear_num_key_heads ({c.linear_num_key_heads})")
        need(c.linear_key_head_dim > 0 and c.linear_value_head_dim > 0 and c.linear_conv_kernel_dim > 0,
             "linear_key_head_dim, linear_value_head_dim and linear_conv_kernel_dim must be positive")
