"""Device kernels of the JAX backend: XLA forms (experts.py: the expert op over packed blobs; gated_delta.py: the
chunked delta rule's intra-chunk products) and Pallas kernels on the Triton backend (expert_grouped.py,
expert_decode.py: the expert op's prompt and int4 decode forms; decode_attention.py; route.py; host_rows.py: host-row
copies), each with its reference."""
from __future__ import annotations


def triton_params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    """pallas_call's compiler_params for the Triton backend; none in interpret mode (the CPU tests)."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as pltr
    return {"compiler_params": pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
