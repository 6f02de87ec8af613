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
