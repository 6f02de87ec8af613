"""Where tensors come from: one small interface for every reader (safetensors dir, GGUF, packs later)."""
from __future__ import annotations

from typing import Iterable, Protocol

import numpy as np


class TensorSource(Protocol):
    """Tensors by Hugging Face name, in Hugging Face layout."""

    def names(self) -> Iterable[str]:
        """Every tensor name the source holds."""

    def get(self, name: str) -> np.ndarray:
        """The tensor as a numpy array (float32, or its stored float dtype); KeyError if absent."""

    def where(self, name: str) -> str:
        """The file that holds `name` (or would hold it), for error messages."""
