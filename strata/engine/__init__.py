"""The engine: loads a model and runs windows of plans on the backend (the Executor the scheduler is given)."""
from strata.engine.core import Engine

__all__ = ["Engine"]
