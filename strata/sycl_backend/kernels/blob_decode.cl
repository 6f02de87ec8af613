// The expert pool (strata/weights/quant.py): a uint8 pool [nslots, nbytes] of expert blobs, each holding one
// expert's gate [I, H], up [I, H] and down [H, I], quantised in one of the formats of quant.FORMATS.
//
// pool_select: from the routes' pool slots (slots [routes], -1 = skipped) to the distinct slots used, ascending
//   (sel [R + 1]: sel[0..used) the slots, the rest -1, sel[R] always -1: the all-zero expert), each route's index
//   into them (idx [routes]; R for a skipped route, or a route beyond the first R distinct slots) and its weight
//   (wout [routes]; 0 where idx == R). ONE work-group of SELECT_WG: marks the used slots in `mark` [nslots]
//   (scratch), ranks them with a work-group prefix sum, then remaps the routes.
// blob_decode_<fmt>: sel's blobs -> fp32 gate [E, I, H], up [E, I, H], down [E, H, I], E = len(sel), all three in
//   one launch; one work-item per BD_CHUNK consecutive values of one row; an entry with sel < 0 (or >= nslots)
//   decodes to zeros without reading the pool. The field offsets (bytes from the blob's start, multiples of 64)
//   and the scale groups come from the layout as arguments. Each format's arithmetic is quant.decode_expert's,
//   operation for operation, so the result is bit-identical in fp32. One kernel per format (a constant `fmt`
//   folded into a shared body), all with the same arguments.
#define SELECT_WG 256

#define BD_CHUNK 16
#define BD_F32 0
#define BD_BF16 1
#define BD_INT8 2
#define BD_INT4 3
#define BD_NVFP4 4

__kernel __attribute__((reqd_work_group_size(SELECT_WG, 1, 1)))
void pool_select(__global const int* slots, __global const float* weight, __global int* mark,
                 __global int* sel, __global int* idx, __global float* wout,
                 const uint routes, const int nslots, const int R) {
    __local int scan[SELECT_WG];
    const int lid = (int)get_local_id(0);
    for (int n = lid; n < nslots; n += SELECT_WG) mark[n] = 0;
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (uint r = (uint)lid; r < routes; r += SELECT_WG) {
        const int s = slots[r];
        if (s >= 0 && s < nslots) mark[s] = 1;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    int carry = 0;                                  // used slots below this chunk (the same in every work-item)
    for (int base = 0; base < nslots; base += SELECT_WG) {
        const int n = base + lid;
        const int m = n < nslots ? mark[n] : 0;
        scan[lid] = m;
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int off = 1; off < SELECT_WG; off <<= 1) {      // inclusive prefix sum (Hillis-Steele)
            const int v = lid >= off ? scan[lid - off] : 0;
            barrier(CLK_LOCAL_MEM_FENCE);
            scan[lid] += v;
            barrier(CLK_LOCAL_MEM_FENCE);
        }
        const int rank = carry + scan[lid] - m;
        if (m) {
            if (rank < R) sel[rank] = n;
            mark[n] = rank < R ? rank : R;       // mark now maps a used slot to its index (R: past the bound)
        }
        carry += scan[SELECT_WG - 1];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int e = min(carry, R) + lid; e <= R; e += SELECT_WG) sel[e] = -1;
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (uint r = (uint)lid; r < routes; r += SELECT_WG) {
        const int s = slots[r];
        const int e = (s >= 0 && s < nslots) ? mark[s] : R;
        idx[r] = e;
        wout[r] = e < R ? weight[r] : 0.0f;
    }
}

__constant float BD_E2M1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

static float bd_e4m3(const uint b) {               // float8_e4m3fn: bias 7, no infinities, S.1111.111 = NaN
    const uint e = (b >> 3) & 15u, m = b & 7u;
    float v;
    if (e == 15u && m == 7u) v = as_float(0x7fc00000u);
    else if (e == 0u) v = (float)m * 0.001953125f;            // subnormal: m / 8 * 2^-6
    else v = as_float(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -v : v;
}

static float bd_half(const uint h) {               // float16 bits -> fp32, exact (vload_half on a __global half*
    const uint s = (h & 0x8000u) << 16;            // breaks llvm-spirv 15, the SPIR-V route)
    const uint e = (h >> 10) & 31u, m = h & 1023u;
    if (e == 31u) return as_float(s | 0x7f800000u | (m << 13));              // inf, NaN
    if (e != 0u) return as_float(s | ((e + 112u) << 23) | (m << 13));
    const float v = (float)m * 5.9604644775390625e-8f;                       // subnormal: m * 2^-24
    return s ? -v : v;
}

static void bd_decode(__global const uchar* pool, __global const int* sel,
                      __global float* gate, __global float* up, __global float* down,
                      const ulong nbytes, const int nslots, const uint H, const uint I,
                      const uint q_gate, const uint q_up, const uint q_down,
                      const uint s_gate, const uint s_up, const uint s_down,
                      const uint z_gate, const uint z_up, const uint z_down,
                      const uint tail, const uint g_gu, const uint g_down, const uint total, const int fmt) {
    const uint gid = (uint)get_global_id(0);
    if (gid >= total) return;
    const uint ch_gu = (H + BD_CHUNK - 1) / BD_CHUNK, ch_d = (I + BD_CHUNK - 1) / BD_CHUNK;
    const uint per_gu = I * ch_gu;                       // work-items of gate (and of up) per expert
    const uint per = 2 * per_gu + H * ch_d;
    const uint e = gid / per;
    uint w = gid - e * per;
    int m;
    if (w < per_gu) m = 0;
    else if (w < 2 * per_gu) { m = 1; w -= per_gu; }
    else { m = 2; w -= 2 * per_gu; }
    const uint cols = m < 2 ? H : I, nch = m < 2 ? ch_gu : ch_d;
    const uint row = w / nch;
    const uint c0 = (w - row * nch) * BD_CHUNK;
    const uint c1 = min(c0 + BD_CHUNK, cols);
    __global float* out = (m == 0 ? gate : (m == 1 ? up : down)) + (size_t)e * I * H + (size_t)row * cols;
    const int slot = sel[e];
    if (slot < 0 || slot >= nslots) {
        for (uint c = c0; c < c1; ++c) out[c] = 0.0f;
        return;
    }
    __global const uchar* blob = pool + (size_t)slot * nbytes;
    const uint qo = m == 0 ? q_gate : (m == 1 ? q_up : q_down);
    const uint so = m == 0 ? s_gate : (m == 1 ? s_up : s_down);
    const size_t base = (size_t)row * cols;
    if (fmt == BD_F32) {
        __global const float* src = (__global const float*)(blob + qo) + base;
        for (uint c = c0; c < c1; ++c) out[c] = src[c];
    } else if (fmt == BD_BF16) {
        __global const ushort* src = (__global const ushort*)(blob + qo) + base;
        for (uint c = c0; c < c1; ++c) out[c] = as_float(((uint)src[c]) << 16);
    } else if (fmt == BD_INT8) {
        __global const uchar* src = blob + qo + base;
        const float s = ((__global const float*)(blob + so))[row];
        for (uint c = c0; c < c1; ++c) out[c] = (float)as_char(src[c]) * s;
    } else {
        __global const uchar* src = blob + qo + base / 2;        // two values a byte, low nibble = even column
        const uint g = m < 2 ? g_gu : g_down;                    // columns per scale
        // a chunk lies in one scale group: g is a multiple of BD_CHUNK or the whole row (checked by the launcher)
        const size_t gi = (size_t)row * (cols / g) + c0 / g;
        if (fmt == BD_INT4) {
            const uint zo = m == 0 ? z_gate : (m == 1 ? z_up : z_down);
            __global const ushort* sp = (__global const ushort*)(blob + so);
            __global const uchar* zp = blob + zo;
            const float z = (float)zp[gi], sc = bd_half(sp[gi]);
            for (uint c = c0; c < c1; ++c) {
                const uint b = src[c / 2];
                out[c] = ((float)((c & 1u) ? (b >> 4) : (b & 15u)) - z) * sc;
            }
        } else {                                                 // nvfp4
            const float gs = ((__global const float*)(blob + tail))[m];
            __global const uchar* sp = blob + so;
            const float bs = bd_e4m3(sp[gi]);
            for (uint c = c0; c < c1; ++c) {
                const uint b = src[c / 2];
                const uint q = (c & 1u) ? (b >> 4) : (b & 15u);
                const float v = (q & 8u) ? -BD_E2M1[q & 7u] : BD_E2M1[q & 7u];
                out[c] = (v * bs) * gs;
            }
        }
    }
}

#define BD_KERNEL(NAME, FMT)                                                                                    \
__kernel void NAME(__global const uchar* pool, __global const int* sel,                                        \
                   __global float* gate, __global float* up, __global float* down,                             \
                   const ulong nbytes, const int nslots, const uint H, const uint I,                           \
                   const uint q_gate, const uint q_up, const uint q_down,                                      \
                   const uint s_gate, const uint s_up, const uint s_down,                                      \
                   const uint z_gate, const uint z_up, const uint z_down,                                      \
                   const uint tail, const uint g_gu, const uint g_down, const uint total) {                    \
    bd_decode(pool, sel, gate, up, down, nbytes, nslots, H, I, q_gate, q_up, q_down, s_gate, s_up, s_down,    \
              z_gate, z_up, z_down, tail, g_gu, g_down, total, FMT);                                           \
}
BD_KERNEL(blob_decode_f32, BD_F32)
BD_KERNEL(blob_decode_bf16, BD_BF16)
BD_KERNEL(blob_decode_int8, BD_INT8)
BD_KERNEL(blob_decode_int4, BD_INT4)
BD_KERNEL(blob_decode_nvfp4, BD_NVFP4)
