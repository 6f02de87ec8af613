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
    quant = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config") or {}
    d = Dequantized(src, quant.get("weight_block_size") or (128, 128))
    return d if d.kinds else src


def _block_size(block) -> tuple[int, int]:
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ModelLoadError(f"quantization_config.weight_block_size must be two positive integers, found {block!r}")
    return tuple(block)


class Dequantized:
    """src's tensors with the quantized weights dequantized to float32 (see the module docstring). One pass over the
    names and dtypes at open (memory-mapped: nothing is read), none per tensor after."""

    def __init__(self, src, block=(128, 128)):
        self.src, self._block = src, block
        self._all = set(src.names())
        self.kinds: dict[str, str] = {}
        for name in sorted(self._all):
            if not name.endswith(".weight"):
                continue
            base = name.removesuffix("weight")
            if base + "weight_scale_2" in self._all:
                self.kinds[name] = "nvfp4"
            elif base + "weight_scale_inv" in self._all:
                if self._blocked(name, base + "weight_scale_inv"):
                    self.kinds[name] = "fp8"
            elif base + "weight_scale" not in self._all:
                w = src.get(name)
                if np.dtype(w.dtype) == FP8 and w.ndim == 2:
                    bn, bk = self.block
                    raise ModelLoadError(f"tensor {name} in {src.where(name)} is float8 but has no scale "
                                         f"({base}weight_scale_inv): a block-FP8 checkpoint stores one per "
                                         f"{bn}x{bk} block")
        hidden = set()
        for name, kind in self.kinds.items():
            base = name.removesuffix("weight")
            hidden |= {base + "weight_scale_inv"} if kind == "fp8" else \
                {base + "weight_scale", base + "weight_scale_2", base + "input_scale"}
        self._names = [n for n in src.names() if n not in hidden]

    @property
    def block(self) -> tuple[int, int]:
        """quantization_config.weight_block_size, checked when a block-FP8 tensor needs it."""
        return _block_size(self._block)

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
        """An NVFP4 weight as stored (packed codes, block scales, global scale), checked; None for any other."""
        if self.kinds.get(name) != "nvfp4":
            return None
        base = name.removesuffix("weight")
        scale_name, global_name = base + "weight_scale", base + "weight_scale_2"
        w = np.asarray(self.src.get(name))
        if scale_name not in self._all:
            raise ModelLoadError(f"tensor {name} in {self.src.where(name)} has {global_name} but no {scale_name}: an "
                                 f"NVFP4 weight needs both scales")
        s, g = np.asarray(self.src.get(scale_name)), np.asarray(self.src.get(global_name), np.float32)
        if w.dtype != np.uint8 or w.ndim != 2 or np.dtype(s.dtype) != FP8 or \
                s.shape != (w.shape[0], 2 * w.shape[1] // NVFP4_BLOCK) or g.size != 1:
            raise ModelLoadError(f"tensors {name} {w.dtype} {list(w.shape)}, {scale_name} {s.dtype} {list(s.shape)} "
                                 f"and {global_name} {list(g.shape)} (in {self.src.where(name)}) are not NVFP4: "
                                 f"expected uint8 [N, K/2], float8_e4m3fn [N, K/{NVFP4_BLOCK}] and one float32")
        return w, s, g

    def get(self, name: str) -> np.ndarray:
        kind = self.kinds.get(name)
        if kind is None:
            return self.src.get(name)
        if kind == "fp8":
            return block_fp8(self.src, name, name.removesuffix("weight") + "weight_scale_inv", self.block)
        w, s, g = self.nvfp4_parts(name)
        codes = np.stack([w & 0xF, w >> 4], axis=-1).reshape(w.shape[0], 2 * w.shape[1])     # low nibble first
        return E2M1_LUT[codes] * np.repeat(s.astype(np.float32), NVFP4_BLOCK, axis=1) * g.reshape(())


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
