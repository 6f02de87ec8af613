// Top-k over the last axis, one work-item per row, ties to the lower index (as lax.top_k).
// x [rows, n] fp32 -> vals [rows, k] fp32, idx [rows, k] int32, in descending order.  k <= TOPK_MAX.
#define TOPK_MAX 64

__kernel void topk(__global const float* x, __global float* vals, __global int* idx,
                   const int n, const int k, const uint rows) {
    const size_t r = get_global_id(0);
    if (r >= rows) return;
    float bv[TOPK_MAX];
    int bi[TOPK_MAX];
    int filled = 0;
    __global const float* xr = x + r * n;
    for (int i = 0; i < n; ++i) {
        const float v = xr[i];
        if (filled == k && !(v > bv[k - 1])) continue;
        int p = filled < k ? filled : k - 1;         // insertion point, shifting smaller entries down
        while (p > 0 && v > bv[p - 1]) { bv[p] = bv[p - 1]; bi[p] = bi[p - 1]; --p; }
        bv[p] = v; bi[p] = i;
        if (filled < k) ++filled;
    }
    for (int j = 0; j < k; ++j) { vals[r * k + j] = bv[j]; idx[r * k + j] = bi[j]; }
}
