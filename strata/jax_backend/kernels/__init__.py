"""Device kernels of the JAX backend: ops over packed expert blobs (experts.py: XLA), and Pallas kernels on the Triton
backend (host_rows.py: host-row copies; expert_decode.py: the int4 decode expert op), each with its reference."""
from __future__ import annotations


def triton_params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    """pallas_call's compiler_params for the Triton backend; none in interpret mode (the CPU tests)."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as pltr
    return {"compiler_params": pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
