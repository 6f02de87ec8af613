// Causal GQA attention over the KV cache, online softmax. One work-item per (query row t, query head h):
// it reads keys 0..q_pos[t] of its KV head h / (hq / hkv).
// q, out [T, hq, hd]; k, v [cap, hkv, hd] fp32; q_pos [T] int64.  hd <= ATT_HD_MAX.
#define ATT_HD_MAX 512

// One query row and head over keys 0..last of KV head g -> o[0..hd).
static void attend(__global const float* qr, __global const float* k, __global const float* v, __global float* o,
                   const long last, const int g, const int hkv, const int hd, const float scale) {
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
    for (int d = 0; d < hd; ++d) o[d] = acc[d] / l;
}

// attend(), then the output times sigmoid(gate_row) when has_gate (attention_block's output gate).
static void attend_gated(__global const float* qr, __global const float* k, __global const float* v,
                         __global const float* gate_row, __global float* o, const long last, const int g,
                         const int hkv, const int hd, const float scale, const int has_gate) {
    attend(qr, k, v, o, last, g, hkv, hd, scale);
    if (has_gate)
        for (int d = 0; d < hd; ++d) o[d] = o[d] * (1.0f / (1.0f + exp(-gate_row[d])));
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
    attend(q + i * hd, k, v, out + i * hd, last, h / (hq / hkv), hkv, hd, scale);
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
    attend_gated(q + i * hd, k, v, gate + i * hd, out + i * hd, last, h / (hq / hkv), hkv, hd, scale, has_gate);
}

// One head of attention_block's inputs, by one work-group: RMSNormed (as rms_norm) and NeoX-rotated on its first
// `rot` features at `position` (as rope), src -> dst; with copy_only, a plain copy (v).
// part [NORM_WG], a [hd] local scratch.
static void attention_input_head(__global const float* src, __global float* dst, __global const float* scale,
                                 __global const float* inv_freq, __local float* part, __local float* a,
                                 const int hd, const int rot, const float eps, const long position,
                                 const int copy_only) {
    const int lid = get_local_id(0);
    if (copy_only) {
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
        const float f = (float)position * inv_freq[j];
        const float c = cos(f), s = sin(f);
        dst[d] = d < hr ? a[d] * c + (-a[d + hr]) * s : a[d] * c + a[d - hr] * s;
    }
}

// The inputs of attention_block's attention, one work-group per (row, head) over q, k and v heads: q to q_out, k and
// v into the caches at row s0 + t (s0: start clamped as kv_write clamps), q and k normed and rotated at start + t.
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
    const long position = (long)start + t;
    if (hh < hq) {
        attention_input_head(q + ((size_t)t * hq + hh) * hd, q_out + ((size_t)t * hq + hh) * hd, q_norm, inv_freq,
                             part, a, hd, rot, eps, position, 0);
    } else if (hh < hq + hkv) {
        const int j = hh - hq;
        attention_input_head(k + ((size_t)t * hkv + j) * hd, kc + ((size_t)(s0 + t) * hkv + j) * hd, k_norm,
                             inv_freq, part, a, hd, rot, eps, position, 0);
    } else {
        const int j = hh - hq - hkv;
        attention_input_head(v + ((size_t)t * hkv + j) * hd, vc + ((size_t)(s0 + t) * hkv + j) * hd, k_norm,
                             inv_freq, part, a, hd, rot, eps, position, 1);
    }
}

// Rows mode (a decode window): row s is one token of sequence s, at position rows[s] (real when rows[S + s] != 0),
// its caches at kc + s * cap * hkv * hd. rows int [2, S] = (positions, active).

// attention_inputs for a window: row s's key and value go to cache row min(max(position, 0), cap - 1) of its own
// caches (as kv_write clamps a one-row write). q [S, hq * hd], k, v [S, hkv * hd]; q_out [S, hq, hd];
// kc, vc [S, cap, hkv, hd].
__kernel void attention_inputs_rows(__global const float* q, __global const float* k, __global const float* v,
                                    __global const float* q_norm, __global const float* k_norm,
                                    __global const float* inv_freq, __global float* q_out, __global float* kc,
                                    __global float* vc, __global const int* rows, const int hq, const int hkv,
                                    const int hd, const int rot, const float eps, const int cap) {
    __local float part[NORM_WG];
    __local float a[ATT_HD_MAX];
    const int heads = hq + 2 * hkv;
    const size_t grp = get_group_id(0);
    const int s = (int)(grp / heads), hh = (int)(grp % heads);
    const long position = rows[s];
    const long at = position < 0 ? 0 : (position > cap - 1 ? cap - 1 : position);
    const size_t cache_row = ((size_t)s * cap + (size_t)at) * hkv;
    if (hh < hq) {
        attention_input_head(q + ((size_t)s * hq + hh) * hd, q_out + ((size_t)s * hq + hh) * hd, q_norm, inv_freq,
                             part, a, hd, rot, eps, position, 0);
    } else if (hh < hq + hkv) {
        const int j = hh - hq;
        attention_input_head(k + ((size_t)s * hkv + j) * hd, kc + (cache_row + j) * hd, k_norm, inv_freq, part, a,
                             hd, rot, eps, position, 0);
    } else {
        const int j = hh - hq - hkv;
        attention_input_head(v + ((size_t)s * hkv + j) * hd, vc + (cache_row + j) * hd, k_norm, inv_freq, part, a,
                             hd, rot, eps, position, 1);
    }
}

// attention_gated for a window: row s attends to keys 0..position of its own caches (an inactive row to key 0
// only), times sigmoid(gate) when has_gate. q, gate, out [S, hq, hd]; k, v [S, cap, hkv, hd].
__kernel void attention_gated_rows(__global const float* q, __global const float* k, __global const float* v,
                                   __global const float* gate, __global float* out, __global const int* rows,
                                   const int n_rows, const int hq, const int hkv, const int hd, const int cap,
                                   const float scale, const int has_gate, const uint n) {
    const size_t i = get_global_id(0);
    if (i >= n) return;
    const int h = (int)(i % hq);
    const int s = (int)(i / hq);
    long last = rows[n_rows + s] != 0 ? (long)rows[s] : 0;
    if (last > cap - 1) last = cap - 1;
    const size_t off = (size_t)s * cap * hkv * hd;
    attend_gated(q + i * hd, k + off, v + off, gate + i * hd, out + i * hd, last, h / (hq / hkv), hkv, hd, scale,
                 has_gate);
}
