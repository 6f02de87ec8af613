// Causal GQA attention over the KV cache, online softmax. One work-item per (query row t, query head h):
// it reads keys 0..q_pos[t] of its KV head h / (hq / hkv).
// q, out [T, hq, hd]; k, v [cap, hkv, hd] fp32; q_pos [T] int64.  hd <= ATT_HD_MAX.
#define ATT_HD_MAX 512

__kernel void attention(__global const float* q, __global const float* k, __global const float* v,
                        __global const long* q_pos, __global float* out,
                        const int hq, const int hkv, const int hd, const int cap, const float scale,
                        const uint n) {
    const size_t i = get_global_id(0);
    if (i >= n) return;
    const int h = (int)(i % hq);
    const size_t t = i / hq;
    const int g = h / (hq / hkv);
    __global const float* qr = q + i * hd;
    float acc[ATT_HD_MAX];
    for (int d = 0; d < hd; ++d) acc[d] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    long last = q_pos[t];
    if (last > cap - 1) last = cap - 1;
    for (long c = 0; c <= last; ++c) {
        __global const float* kr = k + ((size_t)c * hkv + g) * hd;
        __global const float* vr = v + ((size_t)c * hkv + g) * hd;
        float s = 0.0f;
        for (int d = 0; d < hd; ++d) s += qr[d] * kr[d];
        s *= scale;
        const float mn = fmax(m, s);
        const float corr = exp(m - mn);
        const float p = exp(s - mn);
        l = l * corr + p;
        for (int d = 0; d < hd; ++d) acc[d] = acc[d] * corr + p * vr[d];
        m = mn;
    }
    __global float* o = out + i * hd;
    for (int d = 0; d < hd; ++d) o[d] = acc[d] / l;
}
