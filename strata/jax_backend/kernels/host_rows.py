"""Copy rows of a host chunk (pinned host memory) into a device buffer, inside a compiled window: the kernel that
brings a decode window's missing experts to the GPU. The rows a window needs are known only on the device (after
the router), so the copy is issued from inside the compiled function; XLA's form of it (a fori_loop of device_put
over dynamic slices) reads the loop's predicate back to the host on every row, this kernel reads the host rows
directly (pinned host memory is mapped into the GPU's address space; XLA hands a pinned_host operand to the kernel
without copying it) with no host round trip.

Backend: Pallas' Triton backend. In interpret mode (CPU tests) a kernel cannot read host memory, so the wrapper
first copies the chunk to the device (small test shapes only); the engine on a CPU uses XLA's loop (experts_fetching).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from strata.jax_backend.kernels import triton_params

BLOCK_BYTES = 8192      # bytes per program (one row's block); a blob's stride is a multiple of 4096 (quant.BLOB_ALIGN)
MAX_CHUNK_BYTES = (1 << 31) - 1   # the kernel's offsets into a chunk are 32-bit


def _block(nbytes: int) -> int:
    for b in (BLOCK_BYTES, 4096):
        if nbytes % b == 0:
            return b
    raise ValueError(f"row stride {nbytes} bytes is not a multiple of 4096 (blob strides are: quant.BLOB_ALIGN)")


def _kernel(bounds_ref, rows_ref, src_ref, dst_in_ref, dst_ref):
    """Program (i, j): if lo <= i < hi, block j of dst row i = block j of src row rows[i]; else dst stays as is."""
    del dst_in_ref                                    # aliased with dst_ref: blocks not written keep their bytes
    i, j = pl.program_id(0), pl.program_id(1)
    blk = dst_ref.shape[-1]

    @pl.when((i >= bounds_ref[0]) & (i < bounds_ref[1]))
    def _():
        dst_ref[...] = src_ref[rows_ref[i], pl.ds(j * blk, blk)]


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def copy_host_rows(dst, src, rows, lo, hi, *, interpret: bool = False):
    """dst with rows lo .. hi-1 replaced: dst[i] = src[rows[i]] for lo <= i < hi; the other rows keep their bytes.

    dst uint8 [M, nbytes] (a device staging buffer; donated); src uint8 [n, nbytes] (a host chunk in pinned host
    memory, or device memory); rows int32 [M] (entries outside [lo, hi) are not read); lo, hi int32 scalars
    (device values). Only the rows copied cross PCIe. Both operands stay under 2 GiB (32-bit offsets): a slot pool
    is filled through a staging buffer (JaxBackend.pool_fill), never written by this kernel directly."""
    m, nbytes = dst.shape
    if src.shape[1] != nbytes:
        raise ValueError(f"source rows have {src.shape[1]} bytes, destination rows {nbytes}")
    if max(src.size, dst.size) > MAX_CHUNK_BYTES:
        raise ValueError(f"a {max(src.size, dst.size)}-byte operand is over the kernel's {MAX_CHUNK_BYTES} bytes "
                         f"(32-bit offsets)")
    blk = _block(nbytes)
    if interpret:                                     # interpret mode reads device memory only (see the docstring)
        src = jax.device_put(src, jax.memory.Space.Device)
    bounds = jnp.stack([jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)])
    return pl.pallas_call(
        _kernel,
        out_shape=jax.ShapeDtypeStruct((m, nbytes), jnp.uint8),
        grid=(m, nbytes // blk),
        in_specs=[pl.no_block_spec, pl.no_block_spec, pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec((None, blk), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((None, blk), lambda i, j: (i, j)),
        input_output_aliases={3: 0},
        interpret=interpret,
        **triton_params(interpret, num_warps=4, num_stages=1),
    )(bounds, rows.astype(jnp.int32), src, dst)


def _reference(dst, src, rows, lo, hi):
    """numpy: copy_host_rows' result."""
    out = np.array(dst, copy=True)
    for i in range(int(lo), int(hi)):
        out[i] = np.asarray(src)[int(rows[i])]
    return out
