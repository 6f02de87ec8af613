// The Gated DeltaNet's causal depthwise conv with SiLU over [conv_state | u], and the conv state after the part
// (the K-1 inputs ending at row n_valid - 1), written IN PLACE over the old state. One work-item per channel:
// it computes every output row from the old state first, then shifts its own column of the state, so no other
// work-item reads what it overwrites.
// u, y [T, C]; state [K-1, C] (in/out); w [C, K] fp32.
__kernel void causal_conv(__global const float* u, __global float* state, __global const float* w,
                          __global float* y, const int T, const int C, const int K, const int n_valid) {
    const int c = get_global_id(0);
    if (c >= C) return;
    const int km1 = K - 1;
    for (int t = 0; t < T; ++t) {
        float s = 0.0f;
        for (int j = 0; j < K; ++j) {
            const int e = t + j;                      // row of ext = [state; u]
            const float xv = e < km1 ? state[e * C + c] : u[(e - km1) * C + c];
            s += xv * w[c * K + j];
        }
        y[t * C + c] = s * (1.0f / (1.0f + exp(-s)));
    }
    // new_state[j] = ext[n_valid + j]: reading row n_valid + j >= j before writing row j keeps it in place
    for (int j = 0; j < km1; ++j) {
        const int e = n_valid + j;
        state[j * C + c] = e < km1 ? state[e * C + c] : u[(e - km1) * C + c];
    }
}
