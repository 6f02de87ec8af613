"""Device kernels of the JAX backend: XLA forms (experts.py: the expert op over packed blobs; gated_delta.py: the
chunked delta rule's intra-chunk products) and Pallas kernels on the Triton backend (expert_grouped.py,
expert_decode.py: the expert op's prompt and int4 decode forms; decode_attention.py; route.py; host_rows.py: host-row
copies), each with its reference."""
from __future__ import annotations

import math

# JAX's Triton lowering offsets a ref in elements, in signed int32 when the ref is at most this many bytes and in 64
# bits above (jax/_src/pallas/triton/lowering.py, _compute_offsets_from_indices); expert_grouped.py keeps its own
INT32_OFFSETS_MAX_BYTES = 2**32


def int32_offsets_overflow(shape, itemsize: int) -> bool:
    """Whether a Pallas (Triton) operand of this shape and item size gets int32 element offsets that can pass
    2^31 - 1: more than 2^31 - 1 elements in at most INT32_OFFSETS_MAX_BYTES bytes (only 1-byte types can)."""
    n = math.prod(shape)
    return n >= 2**31 - 1 and n * itemsize <= INT32_OFFSETS_MAX_BYTES


def triton_params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    """pallas_call's compiler_params for the Triton backend; none in interpret mode (the CPU tests)."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as pltr
    return {"compiler_params": pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
