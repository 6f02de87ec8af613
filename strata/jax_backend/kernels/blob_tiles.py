"""Reading expert blobs inside Pallas kernels: the fields of strata/weights/quant.py's formats decoded from a uint8
pool ref, tile by tile (expert_grouped.py's tiles; expert_decode.py reads int4 scales with u16_at), so a format's
bytes, scales and zero points are decoded by one piece of code (ARCHITECTURE.md: one expert op). Bit-for-bit
agreement with quant.decode_expert in float32 is held by the kernels' tests.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from strata.weights import quant
from strata.weights.quant import BlobLayout

# fields are little-endian; offsets are int32 arrays (or ints) of byte positions in the blob


def load_as(pool_ref, slot, off, dtype):
    return pool_ref[slot, off].astype(dtype)


def f32_at(pool_ref, slot, off):
    u = [load_as(pool_ref, slot, off + i, jnp.uint32) for i in range(4)]
    return lax.bitcast_convert_type(u[0] | (u[1] << 8) | (u[2] << 16) | (u[3] << 24), jnp.float32)


def u16_at(pool_ref, slot, off):
    return load_as(pool_ref, slot, off, jnp.uint16) | (load_as(pool_ref, slot, off + 1, jnp.uint16) << 8)


def col_range(k0, n: int):
    """[1, n] int32: columns k0 .. k0 + n - 1."""
    return k0 + lax.broadcasted_iota(jnp.int32, (1, n), 1)


def interleave(even, odd):
    """[B, n] and [B, n] -> [B, 2n] with even[:, i] at column 2i and odd[:, i] at 2i + 1 (tt.join + tt.reshape)."""
    return jnp.stack([even, odd], axis=-1).reshape(even.shape[0], 2 * even.shape[1])


def e2m1(code):
    """int32 e2m1 codes (bit 3 sign, bits 0..2 magnitude) -> bfloat16 values, by building the bfloat16 bits."""
    mag = code & 7
    exp = jnp.where(mag >= 2, (mag >> 1) + 126, jnp.where(mag == 1, 126, 0))   # 0.5 = 2^-1; 1, 1.5 = 2^0 ...
    man = jnp.where(mag >= 2, mag & 1, 0)                                         # 1.5, 3, 6: half-step mantissa
    bits = ((code >> 3) << 15) | (exp << 7) | (man << 6)
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def e4m3(byte):
    """int32 float8_e4m3fn bytes -> float32 values, by bit operations (0x7F / 0xFF: NaN, as ml_dtypes decodes)."""
    exp, man = (byte >> 3) & 15, byte & 7
    normal = lax.bitcast_convert_type(((exp + 120) << 23) | (man << 20), jnp.float32)     # 2^(e-7) (1 + m/8)
    mag = jnp.where(exp == 0, man.astype(jnp.float32) * np.float32(2.0 ** -9), normal)    # subnormal m/8 2^-6
    mag = jnp.where((byte & 0x7F) == 0x7F, np.float32(np.nan), mag)
    return jnp.where(byte >= 128, -mag, mag)


def weight_tile(pool_ref, slot, lay: BlobLayout, m: str, rows, k0, bk: int, dt):
    """Rows `rows` [B], columns k0 .. k0 + bk - 1 of matrix m of the blob in `slot`, decoded: (w [B, bk] in dt,
    scale [B] float32 that multiplies this tile's partial product, or None). f32 / bf16: bytes bitcast; int8: q
    (exact in bfloat16), its row scale left to matrix_scale; int4: low / high nibbles (even / odd columns) minus the
    zero point, interleaved, q - z exact in bfloat16, with the float16 group scale (bk divides the group); nvfp4:
    e2m1 codes to bfloat16 by bit operations (no float4 loads: they fail on Hopper) times the float8_e4m3 block
    scale (exact in bfloat16), its global scale left to matrix_scale."""
    _, cols = lay.shape_of(m)
    r = rows[:, None]
    fmt = lay.fmt
    if fmt == "f32":
        return f32_at(pool_ref, slot, lay.field(m).offset + (r * cols + col_range(k0, bk)) * 4).astype(dt), None
    if fmt == "bf16":
        bits = u16_at(pool_ref, slot, lay.field(m).offset + (r * cols + col_range(k0, bk)) * 2)
        return lax.bitcast_convert_type(bits, jnp.bfloat16).astype(dt), None
    if fmt == "int8":
        q = pool_ref[slot, lay.field(f"{m}.q").offset + r * cols + col_range(k0, bk)]
        return lax.bitcast_convert_type(q, jnp.int8).astype(jnp.float32).astype(dt), None
    packed = pool_ref[slot, lay.field(f"{m}.q").offset + r * (cols // 2) + col_range(k0 // 2, bk // 2)]  # [B, bk/2]
    lo, hi = (packed & 0xF).astype(jnp.int32), (packed >> 4).astype(jnp.int32)   # even, odd columns
    if fmt == "int4":
        g = lay.group_of(m)
        at = rows * (cols // g) + k0 // g                                         # [B]: the tile's group
        z = pool_ref[slot, lay.field(f"{m}.z").offset + at].astype(jnp.int32)[:, None]
        w = interleave((lo - z).astype(dt), (hi - z).astype(dt))                 # q - z: exact in bfloat16
        s = lax.bitcast_convert_type(u16_at(pool_ref, slot, lay.field(f"{m}.s").offset + 2 * at), jnp.float16)
        return w, s.astype(jnp.float32)
    # nvfp4: columns 2i and 2i + 1 share block (k0 + 2i) // 16 = k0 // 16 + i // 8
    blk = cols // quant.NVFP4_BLOCK
    pair_blk = k0 // quant.NVFP4_BLOCK + col_range(0, bk // 2) // (quant.NVFP4_BLOCK // 2)       # [1, bk/2]
    bs = e4m3(pool_ref[slot, lay.field(f"{m}.s").offset + r * blk + pair_blk].astype(jnp.int32))  # [B, bk/2]
    even = (e2m1(lo).astype(jnp.float32) * bs).astype(dt)                       # exact in bfloat16
    odd = (e2m1(hi).astype(jnp.float32) * bs).astype(dt)
    return interleave(even, odd), None


def matrix_scale(pool_ref, slot, lay: BlobLayout, m: str, rows):
    """What multiplies matrix m's finished accumulator: int8's row scales [B], nvfp4's global scale (a scalar),
    or None."""
    if lay.fmt == "int8":
        return f32_at(pool_ref, slot, lay.field(f"{m}.s").offset + 4 * rows)
    if lay.fmt == "nvfp4":
        return f32_at(pool_ref, slot, lay.field("tail").offset + 4 * quant.MATRICES.index(m))
    return None


def scaled(acc, s):
    """acc [M, B] times a tile's or matrix's scale: s [B] per column of acc, a scalar, or None (nothing)."""
    if s is None:
        return acc
    return acc * (s[None, :] if getattr(s, "ndim", 0) else s)
