"""Strata: serve Mixture-of-Experts models larger than the GPU over an OpenAI-compatible API."""

__all__ = ["Engine"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # the engine (and JAX) load on first use, so `python -m strata.config` runs without importing itself twice
    if name == "Engine":
        from strata.engine import Engine
        return Engine
    raise AttributeError(f"module 'strata' has no attribute {name!r}")
