// y[t, o] = x[t, :] . w[o, :] for a few rows t (decode, small prompt parts): one work-group of LIN_WG work-items
// per output element, reading the weight row contiguously across the group (coalesced on a GPU), then a local
// reduction. Compiled once per weight format (WT stored type, LOAD widening to fp32, SUFFIX the variant's name).
// x [T, n] fp32; w [O, n] WT; y [T, O] fp32.
#ifndef CAT
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#endif
#define LIN_WG 64

__kernel void CAT(linear_, SUFFIX)(__global const float* x, __global const WT* w, __global float* y,
                                   const int n, const int O) {
    __local float part[LIN_WG];
    const size_t row = get_group_id(0);              // t * O + o
    const size_t t = row / O, o = row % O;
    const int lid = get_local_id(0);
    __global const float* xt = x + t * n;
    __global const WT* p = w + o * n;
    float s = 0.0f;
    for (int i = lid; i < n; i += LIN_WG) s += LOAD(p, i) * xt[i];
    part[lid] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int k = LIN_WG / 2; k > 0; k >>= 1) {
        if (lid < k) part[lid] += part[lid + k];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) y[row] = part[0];
}

// Up to four projections of one input in one launch (the forward pass's norm_linears, linears and linear_add):
// y_j[t, o] = xs[t, :] . w_j[o, :], where xs = x, or rms_norm(x) * scale when `norm` (the groups of a row's first
// output also write xs to h), plus res[t, o] when `add` (one weight). One work-group per output element of all the
// weights together; an unused weight has 0 outputs. The sums run in the order of linear_ and rms_norm (wg_sum from
// norms.cl), so the fused form gives what the separate kernels give.
// x, h [T, n]; scale [n]; w_j [o_j, n] WT; y_j, res [T, o_j] fp32.
__kernel void CAT(linears_, SUFFIX)(__global const float* x, __global const float* scale, __global float* h,
                                    __global const WT* w0, __global const WT* w1, __global const WT* w2,
                                    __global const WT* w3, __global float* y0, __global float* y1,
                                    __global float* y2, __global float* y3, __global const float* res,
                                    const int n, const int o0, const int o1, const int o2, const int o3,
                                    const int norm, const float eps, const int add) {
    __local float part[NORM_WG];
    const int total = o0 + o1 + o2 + o3;
    const size_t grp = get_group_id(0);
    const size_t t = grp / total;
    int o = (int)(grp % total);
    const int first = o == 0;
    const int lid = get_local_id(0);
    __global const float* xt = x + t * n;
    float r = 1.0f;
    if (norm) {
        float ss = 0.0f;
        for (int i = lid; i < n; i += NORM_WG) { const float v = xt[i]; ss += v * v; }
        r = rsqrt(wg_sum(part, ss) / (float)n + eps);
    }
    __global const WT* w;
    __global float* y;
    int on;
    if (o < o0) { w = w0; y = y0; on = o0; }
    else if ((o -= o0) < o1) { w = w1; y = y1; on = o1; }
    else if ((o -= o1) < o2) { w = w2; y = y2; on = o2; }
    else { o -= o2; w = w3; y = y3; on = o3; }
    __global const WT* p = w + (size_t)o * n;
    float s = 0.0f;
    if (norm) { for (int i = lid; i < n; i += NORM_WG) s += LOAD(p, i) * ((xt[i] * r) * scale[i]); }
    else { for (int i = lid; i < n; i += NORM_WG) s += LOAD(p, i) * xt[i]; }
    s = wg_sum(part, s);
    if (lid == 0) y[t * on + o] = add ? res[t * on + o] + s : s;
    if (norm && first) for (int i = lid; i < n; i += NORM_WG) h[t * n + i] = (xt[i] * r) * scale[i];
}

// An MLP's down projection with what follows it (the forward pass's swiglu_out):
// out[t, o] = res[t, o] + (add[t, o] + sigmoid(gate[t]) * sum_i w[o, i] * silu(g[t, i]) * u[t, i]), the gate and
// add terms only when has_gate / has_add. One work-group per output element.
// g, u [T, n]; w [O, n] WT; gate [T]; add, res, out [T, O] fp32.
__kernel void CAT(swiglu_down_, SUFFIX)(__global const float* g, __global const float* u, __global const WT* w,
                                        __global const float* gate, __global const float* add,
                                        __global const float* res, __global float* out, const int n, const int O,
                                        const int has_gate, const int has_add) {
    __local float part[NORM_WG];
    const size_t row = get_group_id(0);
    const size_t t = row / O, o = row % O;
    const int lid = get_local_id(0);
    __global const float* gt = g + t * n;
    __global const float* ut = u + t * n;
    __global const WT* p = w + o * n;
    float s = 0.0f;
    for (int i = lid; i < n; i += NORM_WG) {
        const float v = gt[i];
        s += LOAD(p, i) * ((v * (1.0f / (1.0f + exp(-v)))) * ut[i]);
    }
    s = wg_sum(part, s);
    if (lid == 0) {
        if (has_gate) s = (1.0f / (1.0f + exp(-gate[t]))) * s;
        if (has_add) s = add[row] + s;
        out[row] = res[row] + s;
    }
}
