"""lowered(): the JAX functions compiled inside a `with` block (tests that warm-up left nothing to compile)."""
from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def lowered():
    """Yields a list that fills with one entry per function JAX lowers while the block runs."""
    import jax
    names: list[str] = []

    def listen(name, secs, **kw):
        if name.endswith("jaxpr_to_mlir_module_duration"):
            names.append(name)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
