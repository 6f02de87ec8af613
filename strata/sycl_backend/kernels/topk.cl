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

// The router (the forward pass's route): softmax over the row's n logits (as softmax_rows: one work-group, the
// same reductions), then the top k of the probabilities (as topk), optionally renormalised to sum to 1.
// x [rows, n] fp32 -> w [rows, k] fp32, idx [rows, k] int32.  k <= TOPK_MAX.
__kernel void route(__global const float* x, __global float* w, __global int* idx, const int n, const int k,
                    const int renorm) {
    __local float part[NORM_WG];
    const size_t r = get_group_id(0);
    const int lid = get_local_id(0);
    __global const float* xr = x + r * n;
    float m = -INFINITY;
    for (int i = lid; i < n; i += NORM_WG) m = fmax(m, xr[i]);
    m = wg_max(part, m);
    float s = 0.0f;
    for (int i = lid; i < n; i += NORM_WG) s += exp(xr[i] - m);
    s = wg_sum(part, s);
    if (lid != 0) return;
    float bv[TOPK_MAX];
    int bi[TOPK_MAX];
    int filled = 0;
    for (int i = 0; i < n; ++i) {
        const float v = exp(xr[i] - m) / s;
        if (filled == k && !(v > bv[k - 1])) continue;
        int p = filled < k ? filled : k - 1;
        while (p > 0 && v > bv[p - 1]) { bv[p] = bv[p - 1]; bi[p] = bi[p - 1]; --p; }
        bv[p] = v; bi[p] = i;
        if (filled < k) ++filled;
    }
    float total = 0.0f;
    for (int j = 0; j < k; ++j) total += bv[j];
    for (int j = 0; j < k; ++j) { w[r * k + j] = renorm ? bv[j] / total : bv[j]; idx[r * k + j] = bi[j]; }
}

// Routes' expert ids -> their pool slots: slots[t, j] = table[idx[t, j]] for rows t < n_valid, else -1.
// idx, slots [T, k] int32; table [E] int32.
__kernel void expert_slots(__global const int* idx, __global const int* table, __global int* slots, const int k,
                           const int n_valid, const uint n) {
    const size_t i = get_global_id(0);
    if (i < n) slots[i] = (int)(i / k) < n_valid ? table[idx[i]] : -1;
}

// expert_slots for a decode window: -1 for the routes of inactive rows (rows int [2, S] = (positions, active)).
__kernel void expert_slots_rows(__global const int* idx, __global const int* table, __global int* slots,
                                __global const int* rows, const int n_rows, const int k, const uint n) {
    const size_t i = get_global_id(0);
    if (i < n) slots[i] = rows[n_rows + (int)(i / k)] != 0 ? table[idx[i]] : -1;
}
