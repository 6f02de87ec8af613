// The Gated DeltaNet's causal depthwise conv with SiLU over [conv_state | u], and the conv state after the part
// (the K-1 inputs ending at row n_valid - 1), written IN PLACE over the old state. One work-item per channel:
// it computes every output row from the old state first, then shifts its own column of the state, so no other
// work-item reads what it overwrites. With `reset` the old state reads as zeros (a sequence starting at 0).
// u, y [T, C]; state [K-1, C] (in/out); w [C, K] fp32.

static void causal_conv_channel(__global const float* u, __global float* state, __global const float* w,
                                __global float* y, const int T, const int C, const int K, const int n_valid,
                                const int reset, const int c) {
    const int km1 = K - 1;
    for (int t = 0; t < T; ++t) {
        float s = 0.0f;
        for (int j = 0; j < K; ++j) {
            const int e = t + j;                      // row of ext = [state; u]
            const float xv = e < km1 ? (reset ? 0.0f : state[e * C + c]) : u[(e - km1) * C + c];
            s += xv * w[c * K + j];
        }
        y[t * C + c] = s * (1.0f / (1.0f + exp(-s)));
    }
    // new_state[j] = ext[n_valid + j]: reading row n_valid + j >= j before writing row j keeps it in place
    for (int j = 0; j < km1; ++j) {
        const int e = n_valid + j;
        state[j * C + c] = e < km1 ? (reset ? 0.0f : state[e * C + c]) : u[(e - km1) * C + c];
    }
}

__kernel void causal_conv(__global const float* u, __global float* state, __global const float* w,
                          __global float* y, const int T, const int C, const int K, const int n_valid,
                          const int reset) {
    const int c = get_global_id(0);
    if (c >= C) return;
    causal_conv_channel(u, state, w, y, T, C, K, n_valid, reset, c);
}

// Rows mode (a decode window): row s is one token of sequence s, with its own state [K-1, C] at state + s (K-1) C;
// rows int [2, S] = (positions, active): a row at position 0 starts from a zero state, an inactive row leaves its
// state as it was. u, y [S, C]; state [S, K-1, C].
__kernel void causal_conv_rows(__global const float* u, __global float* state, __global const float* w,
                               __global float* y, __global const int* rows, const int n_rows, const int C,
                               const int K) {
    const size_t i = get_global_id(0);
    if (i >= (size_t)n_rows * C) return;
    const int s = (int)(i / C), c = (int)(i % C);
    causal_conv_channel(u + (size_t)s * C, state + (size_t)s * (K - 1) * C, w, y + (size_t)s * C, 1, C, K,
                        rows[n_rows + s] != 0, rows[s] <= 0, c);
}
