"""Layer split: the model's layers as contiguous stages, one per device, each with its own backend, its layers'
parameters (the first also the embedding; the last the final norm, the head and, with mtp, the MTP head and a copy of
the embedding), expert cache and path, and its layers' sequence state. Unsplit: one stage holding everything.

A window runs each stage's compiled function in turn; between stages the residual rows [T, residual width] (and the rows' tokens
and positions, which every stage reads) move to the next device: one hand-off per window per boundary. Every device
is driven from the same host thread, so stage 0 can start window n+1 while the last stage still runs window n when
n+1 needs nothing of n (the scheduler's two groups of slots: Capacity.stages).
`layer_split`: "auto" (balanced by each device's free memory and the layers' bytes) or "K1,K2,...": the first layer
of each later stage.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from strata.errors import ConfigError
from strata.experts.tiers import ExpertSource
from strata.model.config import ModelConfig


@dataclass(eq=False)
class Stage:
    index: int
    first: int                   # the model's index of its first layer
    ops: object                  # its backend, bound to its device
    cfg: ModelConfig             # the model's config cut to its layers (stage_config)
    params: dict                 # its layers; "embed" on the first stage, the final norm (or mixer) and "lm_head" on
                                 # the last
    path: object = None          # its ExpertPath (its own cache); set by Engine.attach_experts
    moe_first: int = 0           # the model's index of its first MoE layer (the experts' p)
    by_layer: object = None      # its LayerByLayer (strata/model/forward.py)
    compiled: object = None      # its memo of compiled functions, compiled(name, make) (None: the engine's own)
    handoff_s: float = field(default=0.0)   # host seconds spent handing rows to this stage

    @property
    def layers(self) -> range:
        return range(self.first, self.first + self.cfg.num_layers)

    @property
    def experts(self):
        return self.path.experts if self.path is not None else None

    @property
    def layout(self):
        return self.experts.layout if self.experts is not None else None

    def of(self, states: list) -> list:
        """This stage's layers of a whole-model state list."""
        return states[self.first:self.first + self.cfg.num_layers]

    def describe(self) -> str:
        last = self.first + self.cfg.num_layers - 1
        return f"layers {self.first}-{last} ({self.ops.device})"


def split_points(setting: str | None, cfg: ModelConfig, n_devices: int, layer_bytes=None, free=None) -> list[int]:
    """The first layer of each stage after the first ([] when unsplit). setting: None (off), "auto" (every device,
    balanced: each stage's share of the layer bytes (layer_bytes [L]) in proportion to its device's free bytes
    (free [N], None: equal)) or "K1,K2,..." (increasing, each in 1..num_layers - 1)."""
    if setting is None:
        return []
    n = cfg.num_layers
    if setting == "auto":
        if n_devices < 2:
            raise ConfigError(f"layer_split auto needs at least 2 devices of the backend's kind; found {n_devices} "
                              f"(unset layer_split to run on one)")
        stages = min(n_devices, n)
        sizes = np.ones(n) if layer_bytes is None else np.asarray(layer_bytes, np.float64)
        share = np.ones(stages) if free is None or any(f is None for f in free[:stages]) else \
            np.asarray(free[:stages], np.float64)
        goal = np.cumsum(share)[:-1] / share.sum() * sizes.sum()
        ends = np.cumsum(sizes)
        points, last = [], 0
        for g in goal:                                  # each boundary where the running sum crosses its goal
            k = int(np.argmin(np.abs(ends - g))) + 1
            k = min(max(k, last + 1), n - (stages - 1 - len(points)))
            points.append(k)
            last = k
        return points
    try:
        points = [int(x) for x in setting.split(",")]
    except ValueError:
        raise ConfigError(f"layer_split {setting!r} is not allowed; layer_split must be auto or the first layer of "
                          f"each later stage, e.g. 24 or 16,32") from None
    bounds = [0, *points, n]
    if not all(a < b for a, b in zip(bounds, bounds[1:])):
        raise ConfigError(f"layer_split {setting!r} must list increasing layers in 1..{n - 1} (this model has {n} "
                          f"layers): the first layer of each stage after the first")
    if len(points) + 1 > n_devices:
        raise ConfigError(f"layer_split {setting!r} makes {len(points) + 1} stages but the backend sees {n_devices} "
                          f"device(s) of its kind")
    return points


def stage_config(cfg: ModelConfig, first: int, end: int) -> ModelConfig:
    """The model's config cut to layers first..end-1, renumbered from 0 (which of them are sparse is kept)."""
    n = end - first
    dense = tuple(i for i in range(n) if not cfg.is_sparse_layer(first + i))
    return replace(cfg, num_layers=n, layer_types=cfg.layer_types[first:end], mlp_only_layers=dense,
                   decoder_sparse_step=1, first_layer=cfg.first_layer + first)


def stage_params(params: dict, first: int, end: int, is_first: bool, is_last: bool, mtp: bool = False) -> dict:
    """A stage's share of the parameter tree (still on the host or the device they came from); mtp: the head is
    used (the mtp setting), so the last stage holds it."""
    out = {"layers": params["layers"][first:end]}
    if is_first:
        out["embed"] = params["embed"]
    if is_last:
        # the head and what precedes it: the final norm, or qwen4_exp's final hyper-connection mixer (hcf_*)
        out.update({k: v for k, v in params.items() if k not in ("layers", "embed", "mtp")})
        if mtp and "mtp" in params:             # the head drafts on the last stage and embeds its draft tokens
            out.update(mtp=params["mtp"], embed=params["embed"])
    return out


class LayerSlice(ExpertSource):
    """An expert source's MoE layers first..first+n-1, as layers 0..n-1: a stage's share of the store, so its host
    mirror and cache hold its own experts only."""

    def __init__(self, store, first: int, n: int):
        self.store, self.first = store, first
        self.layout, self.n_layers, self.n_experts = store.layout, n, store.n_experts
        self.in_memory = store.in_memory
        self.where = f"{store.where}, MoE layers {first}-{first + n - 1}"

    def blob(self, p: int, e: int) -> np.ndarray:
        return self.store.blob(self.first + p, e)

    def checksum(self, p: int, e: int) -> int:
        return self.store.checksum(self.first + p, e)
