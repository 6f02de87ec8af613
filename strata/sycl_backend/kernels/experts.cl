// The expert op's gathered (decode) form: each route (token t, choice j) reads only its expert's weights.
//   act[r, i] = silu(gate[e, i, :] . x[t]) * (up[e, i, :] . x[t])          r = t * kk + j, e = idx[r]
//   y[t, h]   = sum_j weight[t, j] * sum_i down[e, h, i] * act[r, i]
// Compiled once per weight format: WT is the stored element type, LOAD(p, i) widens element i to fp32,
// SUFFIX names the variant (f32: float; bf16: uint16 bits of a bfloat16).
#ifndef CAT
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#endif

__kernel void CAT(experts_act_, SUFFIX)(__global const float* x, __global const int* idx,
                                        __global const WT* gate, __global const WT* up, __global float* act,
                                        const int kk, const int H, const int I, const uint routes) {
    const size_t r = get_global_id(0) / I;
    const int i = (int)(get_global_id(0) % I);
    if (r >= routes) return;
    const size_t e = (size_t)idx[r];
    __global const float* xt = x + (r / kk) * H;
    __global const WT* gr = gate + (e * I + i) * H;
    __global const WT* ur = up + (e * I + i) * H;
    float g = 0.0f, u = 0.0f;
    for (int c = 0; c < H; ++c) { const float xv = xt[c]; g += LOAD(gr, c) * xv; u += LOAD(ur, c) * xv; }
    act[r * I + i] = g * (1.0f / (1.0f + exp(-g))) * u;
}

__kernel void CAT(experts_down_, SUFFIX)(__global const float* act, __global const int* idx,
                                         __global const float* weight, __global const WT* down, __global float* y,
                                         const int kk, const int H, const int I, const uint tokens) {
    const size_t t = get_global_id(0) / H;
    const int h = (int)(get_global_id(0) % H);
    if (t >= tokens) return;
    float out = 0.0f;
    for (int j = 0; j < kk; ++j) {
        const size_t r = t * kk + j;
        __global const WT* dr = down + ((size_t)idx[r] * H + h) * I;
        __global const float* ar = act + r * I;
        float s = 0.0f;
        for (int i = 0; i < I; ++i) s += LOAD(dr, i) * ar[i];
        out += s * weight[r];
    }
    y[t * H + h] = out;
}
