// Row-wise reductions: RMSNorm and softmax over the last axis, one work-group of NORM_WG work-items per row.
// fp32 in and out (the SYCL backend computes activations in fp32).

#define NORM_WG 64

static float wg_sum(__local float* part, float v) {
    const int lid = get_local_id(0);
    part[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int o = NORM_WG / 2; o > 0; o >>= 1) {
        if (lid < o) part[lid] += part[lid + o];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float r = part[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return r;
}

static float wg_max(__local float* part, float v) {
    const int lid = get_local_id(0);
    part[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int o = NORM_WG / 2; o > 0; o >>= 1) {
        if (lid < o) part[lid] = fmax(part[lid], part[lid + o]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float r = part[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return r;
}

// y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * scale      x, y [rows, d]; scale [d]
__kernel void rms_norm(__global const float* x, __global const float* scale, __global float* y,
                       const int d, const float eps) {
    __local float part[NORM_WG];
    const size_t row = get_group_id(0);
    const int lid = get_local_id(0);
    __global const float* xr = x + row * d;
    float s = 0.0f;
    for (int i = lid; i < d; i += NORM_WG) { const float v = xr[i]; s += v * v; }
    const float r = rsqrt(wg_sum(part, s) / (float)d + eps);
    for (int i = lid; i < d; i += NORM_WG) y[row * d + i] = (xr[i] * r) * scale[i];
}

// y[r, :] = softmax(x[r, :])       x, y [rows, n]
__kernel void softmax_rows(__global const float* x, __global float* y, const int n) {
    __local float part[NORM_WG];
    const size_t row = get_group_id(0);
    const int lid = get_local_id(0);
    __global const float* xr = x + row * n;
    float m = -INFINITY;
    for (int i = lid; i < n; i += NORM_WG) m = fmax(m, xr[i]);
    m = wg_max(part, m);
    float s = 0.0f;
    for (int i = lid; i < n; i += NORM_WG) s += exp(xr[i] - m);
    s = wg_sum(part, s);
    for (int i = lid; i < n; i += NORM_WG) y[row * n + i] = exp(xr[i] - m) / s;
}

// The Gated DeltaNet's gated RMSNorm per head: y[r, :] = rms_norm(x[r, :]) * scale * silu(z[r, :]), in the order
// of rms_norm then silu then the product (as the composition). x, z, y [rows, d]; scale [d].
__kernel void gated_rms_norm(__global const float* x, __global const float* z, __global const float* scale,
                             __global float* y, const int d, const float eps) {
    __local float part[NORM_WG];
    const size_t row = get_group_id(0);
    const int lid = get_local_id(0);
    __global const float* xr = x + row * d;
    __global const float* zr = z + row * d;
    float s = 0.0f;
    for (int i = lid; i < d; i += NORM_WG) { const float v = xr[i]; s += v * v; }
    const float r = rsqrt(wg_sum(part, s) / (float)d + eps);
    for (int i = lid; i < d; i += NORM_WG) {
        const float zv = zr[i];
        y[row * d + i] = ((xr[i] * r) * scale[i]) * (zv * (1.0f / (1.0f + exp(-zv))));
    }
}
