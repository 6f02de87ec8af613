"""The Qwen3-VL vision tower of qwen3_5_moe and qwen4_exp, and the text model's positions for a prompt with images.

tower(): an image's patches [N, C * T * P * P] (merge-block order, strata/vision/image.py) -> its embeddings
[N / merge^2, text hidden]: the patch embedding (a Conv3d whose stride is its kernel: one linear map), the learned
position grid resampled bilinearly (align_corners) to the image's grid, blocks of LayerNorm, attention of every
patch to every patch with 2D rotary positions (rows, columns), and a GELU MLP, then the merger (LayerNorm, each
merge x merge block's features joined, a GELU MLP). mrope_positions(): the (t, h, w) rotary positions of a prompt's
tokens, an image's tokens on its grid, and the offset of the text after it. Exact against transformers'
Qwen3_5MoeVisionModel / Qwen4ExpVisionModel and get_rope_index (tests/model/test_vision.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from strata.errors import ModelLoadError

VISION_TYPES = ("qwen3_5_moe", "qwen4_exp")     # the image-text families with this tower
LN_EPS = 1e-6
QUERY_BLOCK = 1024      # the tower's attention queries at a time (a 1024 x 1024 image has 4,096 patches)


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge: int                          # spatial_merge_size: merge x merge patches make one text token
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_features(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_config(cls, d: dict, source: str) -> "VisionConfig | None":
        """A published image-text config.json's vision_config (with the top level's image token ids); None for a
        text-only config."""
        v = d.get("vision_config")
        if d.get("model_type") not in VISION_TYPES or v is None:
            return None
        if not isinstance(v, dict):
            raise ModelLoadError(f"{source}: vision_config must be an object, found {v!r}")
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ModelLoadError(f"{source}: vision_config.hidden_act {act!r} is not supported; supported: "
                                 f"gelu_pytorch_tanh")
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ModelLoadError(f"{source}: vision_config rope_type {rope.get('rope_type')!r} is not supported; "
                                 f"supported: axial")

        def num(key, default=None, kind=int):
            x = v.get(key, default)
            if isinstance(x, (list, tuple)) and len(set(x)) == 1:       # patch sizes may be given per axis
                x = x[0]
            if isinstance(x, bool) or not isinstance(x, (int, float)) or x <= 0 or (kind is int and x != int(x)):
                raise ModelLoadError(f"{source}: vision_config.{key} must be a positive {kind.__name__}, found {x!r}")
            return kind(x)

        def token(key, default):
            x = d.get(key, default)
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise ModelLoadError(f"{source}: {key} must be a token id, found {x!r}")
            return x
        c = cls(depth=num("depth", 27), hidden_size=num("hidden_size", 1152),
                intermediate_size=num("intermediate_size", 4304), num_heads=num("num_heads", 16),
                in_channels=num("in_channels", 3), patch_size=num("patch_size", 16),
                temporal_patch_size=num("temporal_patch_size", 2), merge=num("spatial_merge_size", 2),
                out_hidden_size=num("out_hidden_size", 3584),
                num_position_embeddings=num("num_position_embeddings", 2304),
                rope_theta=float(rope.get("rope_theta", 10000.0)),
                image_token_id=token("image_token_id", 248056),
                vision_start_token_id=token("vision_start_token_id", 248053),
                vision_end_token_id=token("vision_end_token_id", 248054))
        if c.hidden_size % c.num_heads or c.head_dim % 4:
            raise ModelLoadError(f"{source}: vision_config hidden_size {c.hidden_size} over {c.num_heads} heads must "
                                 f"give a head size divisible by 4 (two axes of rotary pairs)")
        if c.grid_side ** 2 != c.num_position_embeddings:
            raise ModelLoadError(f"{source}: vision_config.num_position_embeddings must be a square, found "
                                 f"{c.num_position_embeddings}")
        return c


def vision_params(vc: VisionConfig, r, prefix: str = "model.visual.") -> dict:
    """The tower's tensors from a TensorReader (strata/model/params.py), the patch embedding as a [E, C*T*P*P]
    matrix; every LayerNorm and bias in float32."""
    E, F = vc.hidden_size, vc.patch_features
    f32 = np.float32

    def linear(name, out, inp):
        return {"w": r.get(name + ".weight", (out, inp)), "b": r.get(name + ".bias", (out,), f32)}

    def norm(name, dim):
        return {"w": r.get(name + ".weight", (dim,), f32), "b": r.get(name + ".bias", (dim,), f32)}
    conv = (E, vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size)
    merged = E * vc.merge ** 2
    return {
        "patch": {"w": r.get(prefix + "patch_embed.proj.weight", conv).reshape(E, F),
                  "b": r.get(prefix + "patch_embed.proj.bias", (E,), f32)},
        "pos": r.get(prefix + "pos_embed.weight", (vc.num_position_embeddings, E), f32),
        "blocks": [{"norm1": norm(f"{prefix}blocks.{i}.norm1", E), "norm2": norm(f"{prefix}blocks.{i}.norm2", E),
                    "qkv": linear(f"{prefix}blocks.{i}.attn.qkv", 3 * E, E),
                    "proj": linear(f"{prefix}blocks.{i}.attn.proj", E, E),
                    "fc1": linear(f"{prefix}blocks.{i}.mlp.linear_fc1", vc.intermediate_size, E),
                    "fc2": linear(f"{prefix}blocks.{i}.mlp.linear_fc2", E, vc.intermediate_size)}
                   for i in range(vc.depth)],
        "merger": {"norm": norm(prefix + "merger.norm", E), "fc1": linear(prefix + "merger.linear_fc1", merged, merged),
                   "fc2": linear(prefix + "merger.linear_fc2", vc.out_hidden_size, merged)},
    }


# --- what an image's grid fixes (host numpy, float32 as transformers computes it)

def _block_order(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each patch in merge-block order: blocks in raster order, each block's patches in raster."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    return rows.reshape(shape).transpose(0, 2, 1, 3).ravel(), cols.reshape(shape).transpose(0, 2, 1, 3).ravel()


def _taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (align_corners) on one axis of the side x side position grid for target indices of a size."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    weights = np.maximum(np.float32(1) - np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32)), 0)
    return taps, weights.astype(np.float32)


def grid_inputs(vc: VisionConfig, grid: tuple[int, int, int]) -> dict:
    """The arrays an image's grid (t, h, w in patches) fixes: the position grid's taps and weights [N, 4] and the
    rotary cos, sin [N, head_dim] of each patch, in merge-block order, frame after frame."""
    t, h, w = grid
    if h % vc.merge or w % vc.merge:
        raise ValueError(f"an image grid of {h} x {w} patches does not divide into {vc.merge} x {vc.merge} blocks")
    row, col = _block_order(h, w, vc.merge)
    side = vc.grid_side
    (rt, rw), (ct, cw) = _taps(row, h, side), _taps(col, w, side)
    taps = (rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4)
    weights = (rw[:, :, None] * cw[:, None, :]).reshape(-1, 4)
    half = vc.head_dim // 2
    inv = (1.0 / (vc.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / half))).astype(np.float32)
    freqs = np.concatenate([row[:, None].astype(np.float32) * inv, col[:, None].astype(np.float32) * inv], axis=1)
    freqs = np.concatenate([freqs, freqs], axis=1)
    return {"taps": np.tile(taps, (t, 1)), "weights": np.tile(weights, (t, 1)),
            "cos": np.tile(np.cos(freqs), (t, 1)), "sin": np.tile(np.sin(freqs), (t, 1))}


# --- the tower (traced: ops.xp arrays)

def _layer_norm(xp, x, p):
    xf = x.astype(xp.float32)
    mu = xp.mean(xf, axis=-1, keepdims=True)
    var = xp.mean((xf - mu) ** 2, axis=-1, keepdims=True)
    return ((xf - mu) / xp.sqrt(var + LN_EPS) * p["w"] + p["b"]).astype(x.dtype)


def _affine(ops, x, p):
    return ops.linear(x, p["w"]) + p["b"].astype(x.dtype)


def _gelu_tanh(xp, x):
    xf = x.astype(xp.float32)
    return (0.5 * xf * (1 + xp.tanh(math.sqrt(2 / math.pi) * (xf + 0.044715 * xf ** 3)))).astype(x.dtype)


# erf(x) = x P(x^2) / Q(x^2) on [-4, 4] (clamped beyond: erf is 1 to float32 there), the rational form XLA and Eigen
# use for float32: numpy-like namespaces without erf (dpnp) compute the merger's exact GELU the same way
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)


def _erf(xp, x):
    x = xp.clip(x, -4.0, 4.0)
    x2 = x * x
    p = x2 * 0 + _ERF_P[0]
    for c in _ERF_P[1:]:
        p = p * x2 + c
    q = x2 * 0 + _ERF_Q[0]
    for c in _ERF_Q[1:]:
        q = q * x2 + c
    return x * p / q


def _gelu(xp, x):
    xf = x.astype(xp.float32)
    return (0.5 * xf * (1 + _erf(xp, xf * np.float32(1 / math.sqrt(2))))).astype(x.dtype)


def _rotate(xp, x, cos, sin):
    """Rotate-half RoPE over the whole head in float32, as transformers applies the vision rotary."""
    xf = x.astype(xp.float32)
    half = x.shape[-1] // 2
    rotated = xp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def _attention(ops, vc: VisionConfig, x, p, cos, sin, frame: int, query_block: int):
    """Every patch of a frame attends to every patch of it (frames of `frame` patches, one after another), the
    queries `query_block` at a time: the scores of a block are heads x block x frame floats."""
    xp = ops.xp
    n = x.shape[0]
    qkv = _affine(ops, x, p["qkv"]).reshape(n, 3, vc.num_heads, vc.head_dim)
    q, k = _rotate(xp, qkv[:, 0], cos, sin), _rotate(xp, qkv[:, 1], cos, sin)
    v = qkv[:, 2]
    f = n // frame
    q, k, v = (a.reshape(f, frame, vc.num_heads, vc.head_dim).astype(xp.float32) for a in (q, k, v))
    out = []
    for at in range(0, frame, query_block):
        s = xp.einsum("fqhd,fkhd->fhqk", q[:, at:at + query_block], k) * vc.head_dim ** -0.5
        out.append(xp.einsum("fhqk,fkhd->fqhd", ops.softmax(s), v))
    o = (out[0] if len(out) == 1 else xp.concatenate(out, axis=1)).astype(x.dtype)
    return _affine(ops, o.reshape(n, vc.hidden_size), p["proj"])


def tower(ops, vc: VisionConfig, params: dict, patches, inputs: dict, frame: int, query_block: int = QUERY_BLOCK):
    """patches [N, C*T*P*P] of one image (its grid's grid_inputs, `frame` = h * w patches a frame) -> its text
    embeddings [N / merge^2, out_hidden_size]. query_block: _attention's."""
    xp = ops.xp
    x = _affine(ops, patches.astype(params["patch"]["w"].dtype), params["patch"])
    pos = xp.sum(params["pos"][inputs["taps"]] * inputs["weights"][:, :, None], axis=1)
    x = x + pos.astype(x.dtype)
    for b in params["blocks"]:
        x = x + _attention(ops, vc, _layer_norm(xp, x, b["norm1"]), b, inputs["cos"], inputs["sin"], frame,
                           query_block)
        x = x + _affine(ops, _gelu_tanh(xp, _affine(ops, _layer_norm(xp, x, b["norm2"]), b["fc1"])), b["fc2"])
    m = params["merger"]
    x = _layer_norm(xp, x, m["norm"]).reshape(-1, vc.hidden_size * vc.merge ** 2)
    x = _affine(ops, _gelu(xp, _affine(ops, x, m["fc1"])), m["fc2"])
    return x


# --- the text model's positions

def image_tokens(vc: VisionConfig, grid: tuple[int, int, int]) -> int:
    """Placeholder tokens an image of this grid takes in the prompt."""
    t, h, w = grid
    return t * h * w // vc.merge ** 2


def mrope_positions(vc: VisionConfig, tokens, grids, first: int = 0) -> tuple[np.ndarray, int]:
    """The (t, h, w) rotary positions [3, T] of a prompt's tokens whose images (runs of image_token_id, in order)
    have these grids, the first token at `first`, and the rotary position of the token after them. Text runs count
    on from the last position (one position, in all three); an image's tokens sit on its merged grid from the
    position it starts at, and the text after it starts max(h, w) / merge further on."""
    tokens = np.asarray(tokens)
    out = np.zeros((3, len(tokens)), np.int64)
    at, pos, grids = 0, first, list(grids)
    is_image = tokens == vc.image_token_id
    while at < len(tokens):
        if not is_image[at]:
            end = at + int(np.argmax(is_image[at:])) if is_image[at:].any() else len(tokens)
            out[:, at:end] = pos + np.arange(end - at)
            pos += end - at
            at = end
            continue
        if not grids:
            raise ValueError(f"the prompt has more images (image tokens at {at}) than images given")
        t, h, w = grids.pop(0)
        gt, gh, gw = t, h // vc.merge, w // vc.merge
        n = gt * gh * gw
        if not is_image[at:at + n].all() or (at + n < len(tokens) and is_image[at + n]):
            run = int(np.argmin(is_image[at:])) if not is_image[at:].all() else len(tokens) - at
            raise ValueError(f"an image of {h} x {w} patches takes {n} image tokens; the prompt has {run} at {at}")
        tt, hh, ww = np.meshgrid(np.arange(gt), np.arange(gh), np.arange(gw), indexing="ij")
        out[:, at:at + n] = pos + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
        pos += max(gh, gw)
        at += n
    if grids:
        raise ValueError(f"{len(grids)} image(s) given beyond the prompt's image tokens")
    return out, pos
