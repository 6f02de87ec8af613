"""Routing profiles: how often each (MoE layer, expert) was routed to over a set of prompts (`strata profile`), used
to place experts at start (the most-routed first). A profile is a JSON file:
{"format": "strata-profile", "version": 1, "model": ..., "tokens": N, "counts": [[...E] * Lp]}.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from strata.errors import ConfigError

FORMAT, VERSION = "strata-profile", 1


def save_profile(path, counts: np.ndarray, model: str, tokens: int) -> None:
    counts = np.asarray(counts, np.int64)
    data = {"format": FORMAT, "version": VERSION, "model": model, "tokens": int(tokens),
            "layers": int(counts.shape[0]), "experts": int(counts.shape[1]), "counts": counts.tolist()}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def load_profile(path, n_layers: int, n_experts: int) -> np.ndarray:
    """-> counts [Lp, E] float64; a profile of another shape or not a profile is a ConfigError naming both."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"profile {path}: cannot read it as a strata profile ({e})") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise ConfigError(f"profile {path} is not a {FORMAT} version {VERSION} file (write one with strata profile)")
    counts = np.asarray(data.get("counts"), np.float64)
    if counts.shape != (n_layers, n_experts):
        raise ConfigError(f"profile {path} has counts for {counts.shape[0] if counts.ndim else 0} layers x "
                          f"{counts.shape[1] if counts.ndim == 2 else 0} experts; this model has {n_layers} MoE "
                          f"layers x {n_experts} experts")
    if (counts < 0).any():
        raise ConfigError(f"profile {path} has negative counts")
    return counts
