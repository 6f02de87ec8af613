"""RoPE's frequencies, computed here once for every backend: the default form and the scaled forms transformers
implements (linear, dynamic NTK, YaRN with its attention factor on cos and sin), over the rotated part of a head.

`read_scaling` reads a checkpoint's `rope_scaling` or `rope_parameters` as transformers does; `scaling_for` is the
rope_scaling / rope_scale settings over it; `rope_for` gives the `Rope` every backend applies. Dynamic NTK is
computed for one sequence length, the serving context (`RopeScaling.seq_len`): transformers recomputes it per call
from the longest position, and the two agree when a sequence reaches that length; a KV cache cannot keep keys rotated
under a base that moves as the sequence grows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from strata.errors import ConfigError, ModelLoadError

KINDS = ("linear", "dynamic", "yarn")


@dataclass(frozen=True)
class Rope:
    """What attention's RoPE applies (strata/backend.py's Rope protocol): the fp32 inverse frequencies of the rotated
    pairs and the factor on cos and sin. Hashable: a compile-time constant. sections: for positions given as
    (t, h, w) rows [T, 3] (interleaved MRoPE, an image's tokens), the axis each pair's angle takes its position from."""
    inv_freq: tuple[float, ...]
    scale: float = 1.0
    sections: tuple[int, ...] = ()

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)

    def table(self) -> np.ndarray:
        """fp32 [rotary_dim / 2 + 1]: the inverse frequencies, then the scale (the layout device kernels read)."""
        return np.array(self.inv_freq + (self.scale,), np.float32)


@dataclass(frozen=True)
class RopeScaling:
    kind: str                           # one of KINDS
    factor: float                       # >= 1
    original: int                       # the window the model was trained at (yarn's original_max_position_embeddings;
                                        # linear and dynamic: max_position_embeddings)
    attention_factor: float | None = None   # yarn: the factor on cos and sin; None: from factor (and mscale)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    seq_len: int | None = None          # dynamic: the sequence length its base is computed for (None: positions)

    @property
    def positions(self) -> int:
        """Positions the scaled model supports: the original window times the factor."""
        return int(self.original * self.factor)

    def describe(self) -> str:
        return f"{self.kind} x{self.factor:g} over {self.original} positions"


def _number(params: dict, key: str, source: str, default=None):
    v = params.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ModelLoadError(f"{source}: rope scaling key '{key}' must be a number, found {v!r}")
    return float(v)


def read_scaling(d: dict, source: str) -> tuple[dict, RopeScaling | None]:
    """A config.json's rope parameters (`rope_scaling` wins over `rope_parameters`, as in transformers) -> (the dict
    the other rope keys are read from, the scaling or None)."""
    rp = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        raise ModelLoadError(f"{source}: rope_scaling must be an object, found {rp!r}")
    kind = rp.get("rope_type") or rp.get("type") or "default"
    if kind == "default":
        return rp, None
    if kind not in KINDS:
        raise ModelLoadError(f"{source}: rope_type '{kind}' is not supported; supported: default, {', '.join(KINDS)}")
    max_pos = int(d.get("max_position_embeddings") or 0)
    original = max_pos
    if kind == "yarn":
        # transformers: a top-level original_max_position_embeddings wins, else the rope parameters', else
        # max_position_embeddings
        top = d.get("original_max_position_embeddings")
        original = int(top if top is not None else rp.get("original_max_position_embeddings") or max_pos)
    factor = _number(rp, "factor", source)
    if factor is None:
        if kind != "yarn" or not original:
            raise ModelLoadError(f"{source}: rope_type '{kind}' needs a 'factor'")
        factor = max_pos / original
    if factor < 1:
        raise ModelLoadError(f"{source}: rope scaling factor must be >= 1, found {factor:g}")
    if original < 1:
        raise ModelLoadError(f"{source}: rope_type '{kind}' needs max_position_embeddings"
                             + (" or original_max_position_embeddings" if kind == "yarn" else ""))
    return rp, RopeScaling(kind=kind, factor=factor, original=original,
                           attention_factor=_number(rp, "attention_factor", source),
                           beta_fast=_number(rp, "beta_fast", source) or 32.0,
                           beta_slow=_number(rp, "beta_slow", source) or 1.0,
                           mscale=_number(rp, "mscale", source), mscale_all_dim=_number(rp, "mscale_all_dim", source),
                           truncate=bool(rp.get("truncate", True)))


def mrope_sections(pairs: int, section: tuple[int, ...]) -> tuple[int, ...]:
    """Interleaved MRoPE's axis of each rotated pair (0 t, 1 h, 2 w): pair j takes h where j % 3 == 1 and
    j < 3 * section[1], w where j % 3 == 2 and j < 3 * section[2], else t (transformers' Qwen3.5 recomposition)."""
    return tuple(a if a and j % 3 == a and j < 3 * section[a] else 0 for j in range(pairs) for a in [j % 3])


def scaling_for(checkpoint: RopeScaling | None, kind: str, scale: float | None,
                max_position_embeddings: int) -> RopeScaling | None:
    """The rope_scaling / rope_scale settings over a checkpoint's own scaling. kind "auto": the checkpoint's (scale,
    when set, replaces its factor); "none": no scaling; a KINDS name: that form with factor `scale` over the
    checkpoint's max_position_embeddings, as a model card's rope_scaling block would set it."""
    if kind == "auto":
        if scale is None:
            return checkpoint
        if checkpoint is None:
            raise ConfigError(f"rope_scale = {scale:g} needs a rope_scaling form (one of {', '.join(KINDS)}): this "
                              f"checkpoint has no rope scaling of its own")
        return replace(checkpoint, factor=float(scale))
    if kind == "none":
        if scale is not None:
            raise ConfigError(f"rope_scale = {scale:g} with rope_scaling none: unset rope_scale, or pick a form "
                              f"({', '.join(KINDS)})")
        return None
    if scale is None:
        raise ConfigError(f"rope_scaling {kind} needs rope_scale (--rope-scale F), the factor of the context "
                          f"extension: a number >= 1")
    return RopeScaling(kind=kind, factor=float(scale), original=max_position_embeddings)


def rope_for(head_dim: int, partial_rotary_factor: float, theta: float, scaling: RopeScaling | None,
             mrope_section: tuple[int, ...] = ()) -> Rope:
    """The inverse frequencies of the rotated pairs and the factor on cos and sin, computed in float64 from
    transformers' formulas and rounded once to fp32; mrope_section: interleaved MRoPE's pairs per axis."""
    dim = int(head_dim * partial_rotary_factor)
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    scale = 1.0
    if scaling is None:
        inv = 1.0 / theta ** exponents
    elif scaling.kind == "linear":
        inv = 1.0 / theta ** exponents / scaling.factor
    elif scaling.kind == "dynamic":
        seq = max(scaling.seq_len or scaling.positions, scaling.original)
        f = scaling.factor
        base = theta * ((f * seq / scaling.original) - (f - 1)) ** (dim / (dim - 2))
        inv = 1.0 / base ** exponents
    else:
        inv, scale = _yarn(dim, theta, scaling, exponents)
    return Rope(inv_freq=tuple(float(x) for x in inv.astype(np.float32)), scale=float(np.float32(scale)),
                sections=mrope_sections(len(inv), mrope_section) if mrope_section else ())


def _yarn(dim: int, theta: float, s: RopeScaling, exponents: np.ndarray) -> tuple[np.ndarray, float]:
    def mscale(factor, m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention = s.attention_factor
    if attention is None:
        attention = (mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
                     if s.mscale and s.mscale_all_dim else mscale(s.factor))

    def correction_dim(rotations):
        # the pair index whose wavelength turns `rotations` times over the original window
        return dim * math.log(s.original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolated = 1.0 - ramp            # high frequencies keep their rotation; low ones are interpolated
    pos_freqs = theta ** exponents
    inv = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv, attention
