"""Strata: serve Mixture-of-Experts models larger than the GPU over an OpenAI-compatible API."""

__all__ = ["Engine"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # `from strata import Engine` imports the engine on first use, so importing a part that does not need it (the
    # scheduler, the plan, the config) does not load the engine, the model code and their libraries
    if name == "Engine":
        from strata.engine import Engine
        return Engine
    raise AttributeError(f"module 'strata' has no attribute {name!r}")
