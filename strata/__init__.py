"""Strata: serve Mixture-of-Experts models larger than the GPU over an OpenAI-compatible API."""
from strata.engine import Engine

__all__ = ["Engine"]
__version__ = "0.1.0"
