"""A llama.cpp GGUF file (qwen3moe, qwen3next, qwen35moe, qwen4exp) seen as a Hugging Face checkpoint.

llama.cpp's converter (convert_hf_to_gguf.py, classes Qwen3MoeModel / Qwen3NextModel) renames every tensor, stacks the
experts of a layer into one [E, ...] tensor and, for qwen3next, changes some values. This module undoes all of it, so
`get()` returns exactly what the Hugging Face safetensors hold (name, layout, values up to the rounding the converter's
own arithmetic caused). Metadata becomes config.json keys; what GGUF does not record is read off the tensors. Tensors
are dequantized only when asked for, and a routed expert alone (its rows sliced out of the stacked tensor first). The
mapping, tensor by tensor: docs/formats.md. A file named NAME-00001-of-0000N.gguf is read with its other shards
(llama.cpp's gguf-split): metadata from the first, tensors from all. qwen35moe, qwen4exp: weights/gguf_qwen35.py.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from strata.errors import ModelLoadError

SUPPORTED_ARCHS = ("qwen3moe", "qwen3next", "qwen35moe", "qwen4exp")
_MODEL_TYPE = {"qwen3moe": "qwen3_moe", "qwen3next": "qwen3_next"}
# stored as plain numpy arrays that gguf.quants.dequantize does not take; cast them
_PLAIN_TYPES = {GGMLQuantizationType.I8, GGMLQuantizationType.I16, GGMLQuantizationType.I32,
                GGMLQuantizationType.I64, GGMLQuantizationType.F64}

# Per-block GGUF suffix -> HF suffix (after "model.layers.N."), for names that map one to one.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QWEN3MOE_BLOCK_NAMES = {
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_QWEN3NEXT_BLOCK_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ssm_in.weight": "linear_attn.in_proj_qkvz.weight",  # legacy files: in_proj_qkvz kept interleaved
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# qwen3next norms the converter stored as 1 + w (every "*norm.weight" but linear_attn.norm, i.e. ssm_norm)
_PLUS_ONE = {"attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
             "output_norm.weight"}
_EXPERT_STACKS = {"ffn_gate_exps.weight": ("gate_proj",), "ffn_up_exps.weight": ("up_proj",),
                  "ffn_down_exps.weight": ("down_proj",), "ffn_gate_up_exps.weight": ("gate_proj", "up_proj")}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


class GGUFTensors:
    """TensorSource over one GGUF file: Hugging Face names, Hugging Face layout, float32."""

    def __init__(self, path: Path, recipes: dict[str, Callable[[], np.ndarray]], origin: dict[str, str]):
        self.path = path
        self._recipes = recipes   # HF name -> function that reads, dequantizes and un-transforms
        self._origin = origin     # HF name -> GGUF tensor name(s), for error messages

    def names(self) -> Iterable[str]:
        return self._recipes.keys()

    def get(self, name: str) -> np.ndarray:
        recipe = self._recipes[name]  # KeyError for an unknown name, as the protocol says
        try:
            return recipe()
        except ModelLoadError:
            raise
        except (ValueError, NotImplementedError, IndexError) as e:
            raise ModelLoadError(f"cannot read tensor {self._origin[name]} (for {name}) from {self.path}: "
                                 f"{e}") from None

    def where(self, name: str) -> str:
        return str(self.path)


def read_gguf(path: str | Path, parts: tuple[str, ...] = ()) -> tuple[dict, GGUFTensors]:
    """(config.json-style dict, tensors) of a GGUF file of a SUPPORTED_ARCHS architecture (and its shards), with the
    tensors of the GGUF files `parts` joined."""
    path = Path(path)
    reader = _open(path)
    meta = _Metadata(reader, path)
    arch = meta.require("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"{path}: GGUF architecture '{arch}' is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHS)}")
    tensors = _shard_tensors(path, reader, meta)
    for part in parts:
        _join_part(Path(part), arch, tensors)
    if arch in ("qwen35moe", "qwen4exp"):
        from strata.weights.gguf_qwen35 import qwen35_config, qwen35_recipes
        config = qwen35_config(arch, meta, tensors, path)
        recipes, origin = qwen35_recipes(arch, config, tensors, path)
    else:
        config = _config(arch, meta, tensors, path)
        recipes, origin = _recipes(arch, config, tensors, path)
    return config, GGUFTensors(path, recipes, origin)


def _join_part(part: Path, arch: str, tensors: dict[str, ReaderTensor]) -> None:
    """A gguf_parts file's tensors added to the model's (its metadata is not read, but its architecture)."""
    reader = _open(part)
    other = _Metadata(reader, part).get("general.architecture")
    if other is not None and other != arch:
        raise ModelLoadError(f"gguf_parts {part}: its architecture is '{other}', the model's '{arch}'")
    _add_tensors(tensors, reader, f"gguf_parts {part}", "the model's files")


def _add_tensors(tensors: dict[str, ReaderTensor], reader: GGUFReader, where: str, others: str) -> None:
    """reader's tensors into tensors by name; one already there is an error (named in `where`, found in `others`)."""
    for t in reader.tensors:
        if t.name in tensors:
            raise ModelLoadError(f"{where}: tensor {t.name} is in {others} too")
        tensors[t.name] = t


_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


def _shard_tensors(path: Path, first: GGUFReader, meta: _Metadata) -> dict[str, ReaderTensor]:
    """Tensors by name of a file, or of every shard of a gguf-split set named by its first shard."""
    tensors = {t.name: t for t in first.tensors}
    m = _SHARD_RE.match(path.name)
    count = meta.get("split.count")
    if m is None or not count or int(count) < 2:
        return tensors
    if int(m.group("i")) != 1:
        raise ModelLoadError(f"{path} is shard {int(m.group('i'))} of {int(m.group('n'))}: pass the first shard "
                             f"({m.group('stem')}-00001-of-{m.group('n')}.gguf); the others are read with it")
    for i in range(2, int(count) + 1):
        shard = path.with_name(f"{m.group('stem')}-{i:05d}-of-{int(count):05d}.gguf")
        _add_tensors(tensors, _open(shard), str(shard), "another shard")
    want = meta.get("split.tensors.count")
    if want is not None and int(want) != len(tensors):
        raise ModelLoadError(f"{path}: the {int(count)} shards hold {len(tensors)} tensors; split.tensors.count "
                             f"says {int(want)}")
    return tensors


# ---------------------------------------------------------------------------------------------------- file access

def _open(path: Path) -> GGUFReader:
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # noqa: BLE001 - any parse failure means the file cannot be used; say why
        # a cut-off file fails here too: the reader views each tensor's bytes and cannot reshape a short view
        raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt): "
                             f"{type(e).__name__}: {e}") from None
    return reader


class _Metadata:
    """Scalar metadata by key; reads a field only when asked (tokenizer arrays can hold 150k strings)."""

    def __init__(self, reader: GGUFReader, path: Path):
        self._fields = reader.fields
        self._path = path

    def get(self, key: str, default=None):
        field = self._fields.get(key)
        if field is None:
            return default
        value = field.contents()
        if isinstance(value, float):
            # float32 in the file: 1e-06 comes back as 9.99999997e-07; take the shortest decimal that rounds
            # to the same float32, which is what the HF config said
            value = float(str(np.float32(value)))
        return value

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self._path}: required GGUF metadata key '{key}' is missing")
        return value


def _dequant(t: ReaderTensor, index: int | slice | tuple | None = None) -> np.ndarray:
    """float32 copy of tensor t (numpy / HF dim order), or of t.data[index] sliced on its outer dims."""
    data = t.data if index is None else t.data[index]
    qtype = GGMLQuantizationType(t.tensor_type)
    if qtype in _PLAIN_TYPES:
        return np.array(data, dtype=np.float32)
    # quantized data arrive as uint8 rows [..., bytes per row]; dequantize turns them into [..., elements per row]
    return np.array(dequantize(data, qtype), dtype=np.float32)


# ----------------------------------------------------------------------------------------------------- config

def _config(arch: str, meta: _Metadata, tensors: dict[str, ReaderTensor], path: Path) -> dict:
    k = lambda name: f"{arch}.{name}"  # noqa: E731
    n_layers = int(meta.require(k("block_count")))
    hidden = int(meta.require(k("embedding_length")))
    heads = int(meta.require(k("attention.head_count")))
    head_dim = int(meta.get(k("attention.key_length"), hidden // heads))
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: tensor token_embd.weight is missing")
    moe_layers = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    cfg: dict = {
        "architectures": ["Qwen3NextForCausalLM" if arch == "qwen3next" else "Qwen3MoeForCausalLM"],
        "model_type": _MODEL_TYPE[arch],
        "vocab_size": int(_shape(tensors["token_embd.weight"])[0]),  # [V, H]
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(k("attention.head_count_kv"), heads)),
        "head_dim": head_dim,
        "intermediate_size": _intermediate_size(meta.get(k("feed_forward_length")), n_layers, tensors),
        "moe_intermediate_size": int(meta.get(k("expert_feed_forward_length"))
                                     or _rows(tensors, moe_layers, "ffn_gate_exps.weight", 1)
                                     or _rows(tensors, moe_layers, "ffn_gate_up_exps.weight", 1) // 2),
        "num_experts": int(meta.require(k("expert_count"))),
        "num_experts_per_tok": int(meta.require(k("expert_used_count"))),
        # llama.cpp's qwen3moe / qwen3next graphs always renormalise the top-k weights (norm_w = true); the
        # converter writes no key for it. A file that does carry expert_weights_norm is believed.
        "norm_topk_prob": bool(meta.get(k("expert_weights_norm"), True)),
        **_sparse_pattern(n_layers, moe_layers),
        "rms_norm_eps": float(meta.require(k("attention.layer_norm_rms_epsilon"))),
        # llama.cpp's default base when the key is absent
        "rope_theta": float(meta.get(k("rope.freq_base"), 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
    }
    if (partial := _partial_rotary(meta.get(k("rope.dimension_count")), head_dim, arch)) is not None:
        cfg["partial_rotary_factor"] = partial
    if (ctx := meta.get(k("context_length"))) is not None:
        cfg["max_position_embeddings"] = int(ctx)
    if (scaling := _rope_scaling(meta, arch)) is not None:
        cfg["rope_scaling"] = scaling
    if arch == "qwen3next":
        # only Qwen3-Next has a shared expert (Qwen3MoeConfig has no such key)
        cfg["shared_expert_intermediate_size"] = int(meta.get(k("expert_shared_feed_forward_length"))
                                                     or _rows(tensors, moe_layers, "ffn_gate_shexp.weight", 0))
        cfg.update(_linear_attention_config(meta, arch, n_layers, tensors, path))
    for hf_key, gguf_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                             ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if (token := meta.get(gguf_key)) is not None:
            cfg[hf_key] = int(token)
    return cfg


def _shape(t: ReaderTensor) -> tuple[int, ...]:
    """numpy / HF order of a tensor's dims (GGUF lists them innermost first)."""
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def _rows(tensors: dict[str, ReaderTensor], layers: list[int], suffix: str, axis: int) -> int:
    """Size of dim `axis` of blk.{first layer}.{suffix}, 0 when there is no such tensor."""
    for i in layers:
        if (t := tensors.get(f"blk.{i}.{suffix}")) is not None:
            return _shape(t)[axis]
    return 0


def _intermediate_size(value, n_layers: int, tensors: dict[str, ReaderTensor]) -> int:
    # dense MLP width; only dense layers use it, so a file without the key and without dense layers gives 0
    if value is not None:
        return int(value[0] if isinstance(value, list) else value)
    return _rows(tensors, list(range(n_layers)), "ffn_gate.weight", 0)  # [I, H]


def _sparse_pattern(n_layers: int, moe_layers: list[int]) -> dict:
    """decoder_sparse_step + mlp_only_layers that reproduce which layers carry a router.

    GGUF has no key for this; the tensors say it. Prefer the plain step form (HF's usual config), and fall back
    to step 1 with the dense layers listed."""
    moe = set(moe_layers)
    if not moe:
        return {"decoder_sparse_step": 1, "mlp_only_layers": list(range(n_layers))}
    for step in range(1, n_layers + 1):
        if moe == {i for i in range(n_layers) if (i + 1) % step == 0}:
            return {"decoder_sparse_step": step, "mlp_only_layers": []}
    return {"decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(n_layers) if i not in moe]}


def _partial_rotary(rope_dims, head_dim: int, arch: str) -> float | None:
    """Fraction of head_dim that RoPE rotates; None for qwen3moe's whole-head RoPE (Qwen3MoeConfig has no key)."""
    if rope_dims is None:
        # the qwen3next converter always writes rope.dimension_count; qwen3moe files rotate the whole head
        return 0.25 if arch == "qwen3next" else None
    if arch == "qwen3moe" and int(rope_dims) == head_dim:
        return None
    return int(rope_dims) / head_dim


def _rope_scaling(meta: _Metadata, arch: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0))}
    if (orig := meta.get(f"{arch}.rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling


def _linear_attention_config(meta: _Metadata, arch: str, n_layers: int, tensors: dict[str, ReaderTensor],
                             path: Path) -> dict:
    k = lambda name: f"{arch}.ssm.{name}"  # noqa: E731
    n_v_heads = int(meta.require(k("time_step_rank")))
    return {
        "layer_types": [_layer_type(i, tensors, path) for i in range(n_layers)],
        "linear_num_key_heads": int(meta.require(k("group_count"))),
        "linear_num_value_heads": n_v_heads,
        "linear_key_head_dim": int(meta.require(k("state_size"))),
        "linear_value_head_dim": int(meta.require(k("inner_size"))) // n_v_heads,
        "linear_conv_kernel_dim": int(meta.require(k("conv_kernel"))),
    }


def _layer_type(i: int, tensors: dict[str, ReaderTensor], path: Path) -> str:
    # the tensors decide: qwen3next.full_attention_interval is written as 4 by the converter whatever the HF
    # config's layer_types said
    if f"blk.{i}.ssm_a" in tensors:
        return "linear_attention"
    if f"blk.{i}.attn_q.weight" in tensors or f"blk.{i}.attn_qkv.weight" in tensors:
        return "full_attention"
    raise ModelLoadError(f"{path}: block {i} has neither attention (blk.{i}.attn_q.weight or attn_qkv.weight) nor "
                         f"linear-attention (blk.{i}.ssm_a) tensors")


# ---------------------------------------------------------------------------------------------------- tensors

def _recipes(arch: str, cfg: dict, tensors: dict[str, ReaderTensor], path: Path):
    """HF name -> zero-argument reader, and HF name -> GGUF source name(s)."""
    block_names = {**_BLOCK_NAMES, **(_QWEN3NEXT_BLOCK_NAMES if arch == "qwen3next" else _QWEN3MOE_BLOCK_NAMES)}
    plus_one = _PLUS_ONE if arch == "qwen3next" else set()
    recipes: dict[str, Callable[[], np.ndarray]] = {}
    origin: dict[str, str] = {}
    unknown = []
    for gname, t in tensors.items():
        m = _BLOCK_RE.match(gname)
        if m is None:
            if gname not in _GLOBAL_NAMES:
                unknown.append(gname)
                continue
            hf, suffix = _GLOBAL_NAMES[gname], gname
        else:
            layer, suffix = int(m.group(1)), m.group(2)
            if layer >= cfg["num_hidden_layers"]:
                unknown.append(gname)
                continue
            prefix = f"model.layers.{layer}."
            if suffix in _EXPERT_STACKS:
                for name, fn in _expert_recipes(t, prefix, _EXPERT_STACKS[suffix], cfg["num_experts"], path):
                    recipes[name], origin[name] = fn, gname
                continue
            linear = f"blk.{layer}.ssm_a" in tensors
            if suffix == "attn_qkv.weight" and linear:
                name = prefix + "linear_attn.in_proj_qkvz.weight"
                gate = tensors.get(f"blk.{layer}.attn_gate.weight")
                if gate is None:
                    raise ModelLoadError(f"{path}: {gname} has no partner blk.{layer}.attn_gate.weight")
                recipes[name] = _qkvz_recipe(t, gate, cfg, path)
                origin[name] = f"{gname} + {gate.name}"
                continue
            if suffix == "attn_gate.weight" and linear:
                continue  # read together with attn_qkv
            if suffix == "attn_qkv.weight":
                for name, fn in _fused_attention_recipes(t, prefix, arch, cfg, path):
                    recipes[name], origin[name] = fn, gname
                continue
            if suffix not in block_names:
                unknown.append(gname)
                continue
            hf = prefix + block_names[suffix]
        recipes[hf], origin[hf] = _plain_recipe(t, hf, suffix in plus_one), gname
    if unknown:
        raise ModelLoadError(f"{path}: GGUF tensors with no Hugging Face counterpart for {arch}: "
                             f"{', '.join(sorted(unknown)[:8])}{' ...' if len(unknown) > 8 else ''}")
    return recipes, origin


def _plain_recipe(t: ReaderTensor, hf: str, minus_one: bool) -> Callable[[], np.ndarray]:
    def read() -> np.ndarray:
        w = _dequant(t)
        if minus_one:
            w = w - np.float32(1.0)  # converter stored 1 + w for zero-centred norms
        if hf.endswith(".A_log"):
            # ssm_a = -exp(A_log); invert in float64 so only the final cast rounds
            w = np.log(-w.astype(np.float64)).astype(np.float32)
        if hf.endswith(".conv1d.weight"):
            w = w.reshape(w.shape[0], 1, w.shape[-1])  # [C, K] -> HF Conv1d [C, 1, K]
        elif hf.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)                       # [H] or [1, H] -> HF Linear(H, 1) [1, H]
        elif hf.endswith((".A_log", ".dt_bias", "norm.weight")):
            w = w.reshape(-1)                          # per-head / per-channel vectors
        return w
    return read


def _expert_recipes(t: ReaderTensor, prefix: str, parts: tuple[str, ...], n_experts: int, path: Path):
    """One reader per (expert, projection) of a stacked tensor.

    gate/up stacks are [E, I, H], down [E, H, I]; the fused gate_up stack is [E, 2I, H] with gate first
    (converter: cat([gate, up], dim=1)). Quant blocks run along the innermost dim, so slicing outer dims of the raw
    data before dequantizing is exact."""
    shape = _shape(t)
    if len(shape) != 3 or shape[0] != n_experts:
        raise ModelLoadError(f"{path}: {t.name} has shape {list(shape)}; expected [{n_experts}, rows, cols] "
                             f"(one slice per expert)")
    rows = shape[1] // len(parts)
    for e in range(n_experts):
        for j, part in enumerate(parts):
            index = (e, slice(j * rows, (j + 1) * rows)) if len(parts) > 1 else e
            yield f"{prefix}mlp.experts.{e}.{part}.weight", (lambda index=index: _dequant(t, index))


def _fused_attention_recipes(t: ReaderTensor, prefix: str, arch: str, cfg: dict, path: Path):
    """A full-attention layer's fused attn_qkv [q rows; k rows; v rows] (llama.cpp loads it when present) split
    back into q_proj / k_proj / v_proj. Qwen3-Next's q rows carry [query | gate] per head, as HF's q_proj does.
    Rows are the outer dim, so each projection is sliced out of the raw data before dequantizing."""
    head_dim, kv_rows = cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    q_rows = cfg["num_attention_heads"] * head_dim * (2 if arch == "qwen3next" else 1)
    if _shape(t)[0] != q_rows + 2 * kv_rows:
        raise ModelLoadError(f"{path}: {t.name} has {_shape(t)[0]} rows; expected q {q_rows} + k {kv_rows} + "
                             f"v {kv_rows}")
    bounds = {"q_proj": (0, q_rows), "k_proj": (q_rows, q_rows + kv_rows),
              "v_proj": (q_rows + kv_rows, q_rows + 2 * kv_rows)}
    for proj, (lo, hi) in bounds.items():
        yield f"{prefix}self_attn.{proj}.weight", (lambda lo=lo, hi=hi: _dequant(t, slice(lo, hi)))


def _qkvz_recipe(qkv: ReaderTensor, gate: ReaderTensor, cfg: dict, path: Path) -> Callable[[], np.ndarray]:
    """Re-interleave attn_qkv [q all (Hk*dk); k all (Hk*dk); v all (Hv*dv)] and attn_gate z [Hv*dv] (rows, each
    block ordered by key-head group) into HF in_proj_qkvz: per key-head group [q(dk) | k(dk) | v(r*dv) | z(r*dv)]."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    r = hv // hk
    want_qkv, want_z = 2 * hk * dk + hv * dv, hv * dv
    if _shape(qkv)[0] != want_qkv or _shape(gate)[0] != want_z or hv % hk:
        raise ModelLoadError(f"{path}: {qkv.name} {list(_shape(qkv))} / {gate.name} {list(_shape(gate))} do not "
                             f"match linear heads (key {hk}x{dk}, value {hv}x{dv}): expected {want_qkv} and "
                             f"{want_z} rows")

    def read() -> np.ndarray:
        w_qkv, w_z = _dequant(qkv), _dequant(gate)            # [2*Hk*dk + Hv*dv, H], [Hv*dv, H]
        h = w_qkv.shape[1]
        q = w_qkv[:hk * dk].reshape(hk, dk, h)
        k = w_qkv[hk * dk:2 * hk * dk].reshape(hk, dk, h)
        v = w_qkv[2 * hk * dk:].reshape(hk, r * dv, h)
        z = w_z.reshape(hk, r * dv, h)
        return np.concatenate([q, k, v, z], axis=1).reshape(-1, h)  # [Hk*(2dk + 2r*dv), H]
    return read
