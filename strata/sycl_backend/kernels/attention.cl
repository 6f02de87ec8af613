// Causal GQA attention over the KV cache, online softmax. One work-item per (query row t, query head h):
// it reads keys 0..q_pos[t] of its KV head h / (hq / hkv).
// q, out [T, hq, hd]; k, v [cap, hkv, hd] fp32; q_pos [T] int64.  hd <= ATT_HD_MAX.
#define ATT_HD_MAX 512

// One query row and head over keys 0..last of KV head g -> out[0..hd) (times gmul, the output gate).
static void attend(__global const float* qr, __global const float* k, __global const float* v, __global float* o,
                   const long last, const int g, const int hkv, const int hd, const float scale, const float gmul) {
    float acc[ATT_HD_MAX];
    for (int d = 0; d < hd; ++d) acc[d] = 0.0f;
    float m = -INFINITY, l = 0.0f;
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
    for (int d = 0; d < hd; ++d) o[d] = acc[d] / l * gmul;
}

__kernel void attention(__global const float* q, __global const float* k, __global const float* v,
                        __global const long* q_pos, __global float* out,
                        const int hq, const int hkv, const int hd, const int cap, const float scale,
                        const uint n) {
    const size_t i = get_global_id(0);
    if (i >= n) return;
    const int h = (int)(i % hq);
    const size_t t = i / hq;
    long last = q_pos[t];
    if (last > cap - 1) last = cap - 1;
    attend(q + i * hd, k, v, out + i * hd, last, h / (hq / hkv), hkv, hd, scale, 1.0f);
}

// The attention of the forward pass's attention_block: the query at row t sits at position start + t (rows at or
// past n_valid look at key 0 only), and its output is multiplied by sigmoid(gate) when has_gate.
// q, gate, out [T, hq, hd]; k, v [cap, hkv, hd].
__kernel void attention_gated(__global const float* q, __global const float* k, __global const float* v,
                              __global const float* gate, __global float* out, const int hq, const int hkv,
                              const int hd, const int cap, const float scale, const int start, const int n_valid,
                              const int has_gate, const uint n) {
    const size_t i = get_global_id(0);
    if (i >= n) return;
    const int h = (int)(i % hq);
    const size_t t = i / hq;
    long last = (int)t < n_valid ? (long)start + (long)t : 0;
    if (last > cap - 1) last = cap - 1;
    __global float* o = out + i * hd;
    attend(q + i * hd, k, v, o, last, h / (hq / hkv), hkv, hd, scale, 1.0f);
    if (has_gate)
        for (int d = 0; d < hd; ++d) o[d] = o[d] * (1.0f / (1.0f + exp(-gate[i * hd + d])));
}

// The inputs of attention_block's attention, one work-group per (row, head) over q, k and v heads: q and k
// RMSNormed per head (as rms_norm) and NeoX-rotated on their first `rot` features at position start + t (as rope);
// q to q_out, k and v into the caches at row s0 + t (s0: start clamped as kv_write clamps).
// q [T, hq * hd], k, v [T, hkv * hd]; q_out [T, hq, hd]; kc, vc [cap, hkv, hd]; inv_freq [rot / 2].
__kernel void attention_inputs(__global const float* q, __global const float* k, __global const float* v,
                               __global const float* q_norm, __global const float* k_norm,
                               __global const float* inv_freq, __global float* q_out, __global float* kc,
                               __global float* vc, const int hq, const int hkv, const int hd, const int rot,
                               const float eps, const int start, const int s0) {
    __local float part[NORM_WG];
    __local float a[ATT_HD_MAX];
    const int heads = hq + 2 * hkv;
    const size_t grp = get_group_id(0);
    const int t = (int)(grp / heads), hh = (int)(grp % heads);
    const int lid = get_local_id(0);
    __global const float* src;
    __global float* dst;
    __global const float* scale;
    if (hh < hq) { src = q + ((size_t)t * hq + hh) * hd; dst = q_out + ((size_t)t * hq + hh) * hd; scale = q_norm; }
    else if (hh < hq + hkv) {
        const int j = hh - hq;
        src = k + ((size_t)t * hkv + j) * hd; dst = kc + ((size_t)(s0 + t) * hkv + j) * hd; scale = k_norm;
    } else {
        const int j = hh - hq - hkv;
        src = v + ((size_t)t * hkv + j) * hd; dst = vc + ((size_t)(s0 + t) * hkv + j) * hd;
        for (int i = lid; i < hd; i += NORM_WG) dst[i] = src[i];
        return;
    }
    float ss = 0.0f;
    for (int i = lid; i < hd; i += NORM_WG) { const float x = src[i]; ss += x * x; }
    const float r = rsqrt(wg_sum(part, ss) / (float)hd + eps);
    for (int i = lid; i < hd; i += NORM_WG) a[i] = (src[i] * r) * scale[i];
    barrier(CLK_LOCAL_MEM_FENCE);
    const int hr = rot / 2;
    for (int d = lid; d < hd; d += NORM_WG) {
        if (d >= rot) { dst[d] = a[d]; continue; }
        const int j = d < hr ? d : d - hr;
        const float f = (float)(long)(start + t) * inv_freq[j];
        const float c = cos(f), s = sin(f);
        dst[d] = d < hr ? a[d] * c + (-a[d + hr]) * s : a[d] * c + a[d - hr] * s;
    }
}
