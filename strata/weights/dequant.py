"""Quantized checkpoints read as float: a TensorSource over another that dequantizes the weights of the published
quantized forms when asked for, and hides the scales it consumed.
- Block FP8 (Qwen's and DeepSeek's `-FP8` releases): `W.weight` float8_e4m3fn [N, K] and `W.weight_scale_inv`
  float32 [ceil(N / bn), ceil(K / bk)] (the config's quantization_config.weight_block_size, default 128 x 128):
  w = fp8 x the scale of its block.
- NVFP4 (NVIDIA ModelOpt): `W.weight` uint8 [N, K / 2] (two e2m1 codes a byte, the low nibble first),
  `W.weight_scale` float8_e4m3fn [N, K / 16] and `W.weight_scale_2` float32 (one value): w = e2m1 x block scale x
  global scale. `W.input_scale` (activations' scale) is not used.
A tensor whose scales are missing or misshapen is a ModelLoadError naming both; any other tensor (a float8 PLE table
with its one scale included) passes through unchanged.
"""
from __future__ import annotations

from collections.abc import Iterable

import ml_dtypes
import numpy as np

from strata.errors import ModelLoadError
from strata.weights.quant import E2M1_LUT, NVFP4_BLOCK

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def dequantizing(src, config: dict):
    """src read through Dequantized when it holds a quantized weight (block FP8 with the config's
    quantization_config.weight_block_size, or NVFP4), else src itself."""
    names = set(src.names())
    if not any(n.endswith((".weight_scale_inv", ".weight_scale_2")) for n in names) and \
            not any(np.dtype(src.get(n).dtype) == FP8 for n in names if n.endswith(".weight")):
        return src
    quant = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config") or {}
    block = quant.get("weight_block_size") or (128, 128)
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ModelLoadError(f"quantization_config.weight_block_size must be two positive integers, found {block!r}")
    return Dequantized(src, tuple(block))


class Dequantized:
    """src's tensors with the quantized weights dequantized to float32 (see the module docstring)."""

    def __init__(self, src, block: tuple[int, int] = (128, 128)):
        self.src, self.block = src, tuple(block)
        names = set(src.names())
        self.kinds: dict[str, str] = {}
        for name in sorted(names):
            if not name.endswith(".weight"):
                continue
            base = name.removesuffix("weight")
            if base + "weight_scale_2" in names:
                self.kinds[name] = "nvfp4"
            elif base + "weight_scale_inv" in names and self._blocked(name, base + "weight_scale_inv"):
                self.kinds[name] = "fp8"
            elif np.dtype(src.get(name).dtype) == FP8 and len(src.get(name).shape) == 2 and \
                    base + "weight_scale_inv" not in names and base + "weight_scale" not in names:
                raise ModelLoadError(f"tensor {name} in {src.where(name)} is float8 but has no scale "
                                     f"({base}weight_scale_inv): a block-FP8 checkpoint stores one per "
                                     f"{self.block[0]}x{self.block[1]} block")
        hidden = set()
        for name, kind in self.kinds.items():
            base = name.removesuffix("weight")
            hidden |= {base + "weight_scale_inv"} if kind == "fp8" else \
                {base + "weight_scale", base + "weight_scale_2", base + "input_scale"}
        self._names = [n for n in src.names() if n not in hidden]

    def _blocked(self, name: str, scale: str) -> bool:
        """Whether `scale` is a block grid over `name` (a per-tensor scale of one value is the weight's own: a float8
        PLE table keeps it)."""
        s, w = self.src.get(scale), self.src.get(name)
        return not (s.size == 1 and (w.shape[0] > self.block[0] or w.ndim != 2))

    def names(self) -> Iterable[str]:
        return self._names

    def where(self, name: str) -> str:
        return self.src.where(name)

    def nvfp4_parts(self, name: str) -> tuple | None:
        """An NVFP4 weight as stored (packed codes, block scales, global scale), or None for any other tensor."""
        if self.kinds.get(name) != "nvfp4":
            return None
        base = name.removesuffix("weight")
        nvfp4(self.src, name, base + "weight_scale", base + "weight_scale_2")        # checks the three
        return (np.asarray(self.src.get(name)), np.asarray(self.src.get(base + "weight_scale")),
                np.asarray(self.src.get(base + "weight_scale_2"), np.float32))

    def get(self, name: str) -> np.ndarray:
        kind = self.kinds.get(name)
        if kind is None:
            return self.src.get(name)
        base = name.removesuffix("weight")
        return block_fp8(self.src, name, base + "weight_scale_inv", self.block) if kind == "fp8" else \
            nvfp4(self.src, name, base + "weight_scale", base + "weight_scale_2")


def block_fp8(src, name: str, scale_name: str, block: tuple[int, int]) -> np.ndarray:
    w, s = src.get(name), np.asarray(src.get(scale_name), np.float32)
    if np.dtype(w.dtype) != FP8 or w.ndim != 2:
        raise ModelLoadError(f"tensor {name} in {src.where(name)} has dtype {w.dtype} and shape {list(w.shape)}; a "
                             f"block-FP8 weight (beside {scale_name}) is a float8_e4m3fn matrix")
    n, k = w.shape
    grid = (-(-n // block[0]), -(-k // block[1]))
    if s.shape != grid:
        raise ModelLoadError(f"tensor {scale_name} in {src.where(scale_name)} has shape {list(s.shape)}, expected "
                             f"{list(grid)}: one scale per {block[0]}x{block[1]} block of {name} {list(w.shape)} "
                             f"(quantization_config.weight_block_size)")
    full = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[:n, :k]
    return np.asarray(w).astype(np.float32) * full


def nvfp4(src, name: str, scale_name: str, global_name: str) -> np.ndarray:
    w = np.asarray(src.get(name))
    if scale_name not in set(src.names()):
        raise ModelLoadError(f"tensor {name} in {src.where(name)} has {global_name} but no {scale_name}: an NVFP4 "
                             f"weight needs both scales")
    s, g = src.get(scale_name), np.asarray(src.get(global_name), np.float32)
    if w.dtype != np.uint8 or w.ndim != 2 or np.dtype(s.dtype) != FP8 or \
            s.shape != (w.shape[0], 2 * w.shape[1] // NVFP4_BLOCK) or g.size != 1:
        raise ModelLoadError(f"tensors {name} {w.dtype} {list(w.shape)}, {scale_name} {s.dtype} {list(s.shape)} and "
                             f"{global_name} {list(g.shape)} (in {src.where(name)}) are not NVFP4: expected uint8 "
                             f"[N, K/2], float8_e4m3fn [N, K/{NVFP4_BLOCK}] and one float32")
    codes = np.stack([w & 0xF, w >> 4], axis=-1).reshape(w.shape[0], 2 * w.shape[1])     # low nibble first
    return E2M1_LUT[codes] * np.repeat(np.asarray(s).astype(np.float32), NVFP4_BLOCK, axis=1) * g.reshape(())
