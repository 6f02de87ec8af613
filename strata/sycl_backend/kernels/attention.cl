// Causal GQA attention over the KV cache (online softmax), and the fused forms attention_block uses.
// Compiled once per KV format (kernels/__init__.py): KV_SUFFIX names the variant, KVT is the stored type and KV_Q8
// says whether each stored row (one token, one KV head: hd values) carries a float scale (int8: value = q * scale,
// scale = amax / 127 of the row; strata/reference.py quantize_kv). The f32 variant takes the same scale
// arguments and never reads or writes them.
// q, out [T, hq, hd] fp32; k, v [cap, hkv, hd] KVT; ks, vs [cap, hkv] fp32 (int8).  hd <= ATT_HD_MAX.
#ifndef CAT
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#endif
#ifndef ATT_HD_MAX
#define ATT_HD_MAX 512
#endif
#if KV_Q8
#define KV_SCALE(p, i) ((p)[i])
#else
#define KV_SCALE(p, i) 1.0f
#endif
#define attend CAT(attend_, KV_SUFFIX)
#define attend_gated CAT(attend_gated_, KV_SUFFIX)
#define attention_input_head CAT(attention_input_head_, KV_SUFFIX)
#define kv_put CAT(kv_put_, KV_SUFFIX)

// One query row and head over keys 0..last of KV head g -> o[0..hd). An int8 key's scale multiplies its dot product,
// a value's scale its probability.
static void attend(__global const float* qr, __global const KVT* k, __global const KVT* v, __global const float* ks,
                   __global const float* vs, __global float* o, const long last, const int g, const int hkv,
                   const int hd, const float scale) {
    float acc[ATT_HD_MAX];
    for (int d = 0; d < hd; ++d) acc[d] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (long c = 0; c <= last; ++c) {
        const size_t row = (size_t)c * hkv + g;
        __global const KVT* kr = k + row * hd;
        __global const KVT* vr = v + row * hd;
        float s = 0.0f;
        for (int d = 0; d < hd; ++d) s += qr[d] * (float)kr[d];
        s *= scale * KV_SCALE(ks, row);
        const float mn = fmax(m, s);
        const float corr = exp(m - mn);
        const float p = exp(s - mn);
        l = l * corr + p;
        const float pv = p * KV_SCALE(vs, row);
        for (int d = 0; d < hd; ++d) acc[d] = acc[d] * corr + pv * (float)vr[d];
        m = mn;
    }
    for (int d = 0; d < hd; ++d) o[d] = acc[d] / l;
}

// attend(), then the output times sigmoid(gate_row) when has_gate (attention_block's output gate).
static void attend_gated(__global const float* qr, __global const KVT* k, __global const KVT* v,
                         __global const float* ks, __global const float* vs, __global const float* gate_row,
                         __global float* o, const long last, const int g, const int hkv, const int hd,
                         const float scale, const int has_gate) {
    attend(qr, k, v, ks, vs, o, last, g, hkv, hd, scale);
    if (has_gate)
        for (int d = 0; d < hd; ++d) o[d] = o[d] * (1.0f / (1.0f + exp(-gate_row[d])));
}

__kernel void CAT(attention_, KV_SUFFIX)(__global const float* q, __global const KVT* k, __global const KVT* v,
                                         __global const float* ks, __global const float* vs,
                                         __global const long* q_pos, __global float* out, const int hq,
                                         const int hkv, const int hd, const int cap, const float scale,
                                         const uint n) {
    const size_t i = get_global_id(0);
    if (i >= n) return;
    const int h = (int)(i % hq);
    const size_t t = i / hq;
    long last = q_pos[t];
    if (last > cap - 1) last = cap - 1;
    attend(q + i * hd, k, v, ks, vs, out + i * hd, last, h / (hq / hkv), hkv, hd, scale);
}

// The attention of the forward pass's attention_block: the query at row t sits at position start + t (rows at or
// past n_valid look at key 0 only), and its output is multiplied by sigmoid(gate) when has_gate.
// q, gate, out [T, hq, hd]; k, v [cap, hkv, hd].
__kernel void CAT(attention_gated_, KV_SUFFIX)(__global const float* q, __global const KVT* k,
                                               __global const KVT* v, __global const float* ks,
                                               __global const float* vs, __global const float* gate,
                                               __global float* out, const int hq, const int hkv, const int hd,
                                               const int cap, const float scale, const int start,
                                               const int n_valid, const int has_gate, const uint n) {
    const size_t i = get_global_id(0);
    if (i >= n) return;
    const int h = (int)(i % hq);
    const size_t t = i / hq;
    long last = (int)t < n_valid ? (long)start + (long)t : 0;
    if (last > cap - 1) last = cap - 1;
    attend_gated(q + i * hd, k, v, ks, vs, gate + i * hd, out + i * hd, last, h / (hq / hkv), hkv, hd, scale,
                 has_gate);
}

// A cache row of hd values <- val[0..hd) (local memory), by one work-group; int8: quantised with its scale
// amax / 127 written to *dst_scale (a row with a NaN gets an infinite scale, so what reads it is non-finite and the
// numerics guard sees it, as the composition's NaN scale does).
static void kv_put(__local const float* val, __global KVT* dst, __global float* dst_scale, __local float* part,
                   const int hd) {
    const int lid = get_local_id(0);
#if KV_Q8
    float m = 0.0f;
    for (int i = lid; i < hd; i += NORM_WG) m = isnan(val[i]) ? INFINITY : fmax(m, fabs(val[i]));
    const float s = wg_max(part, m) / 127.0f;
    const float div = s > 0.0f ? s : 1.0f;
    for (int i = lid; i < hd; i += NORM_WG) {
        const float x = val[i];
        dst[i] = isnan(x) ? (char)0 : (char)clamp(rint(x / div), -127.0f, 127.0f);
    }
    if (lid == 0) *dst_scale = s;
#else
    for (int i = lid; i < hd; i += NORM_WG) dst[i] = val[i];
#endif
}

// One head of attention_block's inputs, by one work-group: RMSNormed (as rms_norm) and NeoX-rotated on its first
// `rot` features at `position` (as rope), or copied as it is (copy_only: v); to dst (q: fp32) or into a cache row
// (to_cache: k, v, through kv_put). part [NORM_WG], a, b [hd] local scratch.
static void attention_input_head(__global const float* src, __global float* dst, __global KVT* cache_row,
                                 __global float* cache_scale, __global const float* scale,
                                 __global const float* inv_freq, __local float* part, __local float* a,
                                 __local float* b, const int hd, const int rot, const float eps,
                                 const long position, const int copy_only, const int to_cache) {
    const int lid = get_local_id(0);
    if (copy_only) {
        for (int i = lid; i < hd; i += NORM_WG) b[i] = src[i];
    } else {
        float ss = 0.0f;
        for (int i = lid; i < hd; i += NORM_WG) { const float x = src[i]; ss += x * x; }
        const float r = rsqrt(wg_sum(part, ss) / (float)hd + eps);
        for (int i = lid; i < hd; i += NORM_WG) a[i] = (src[i] * r) * scale[i];
        barrier(CLK_LOCAL_MEM_FENCE);
        const int hr = rot / 2;
        for (int d = lid; d < hd; d += NORM_WG) {
            if (d >= rot) { b[d] = a[d]; continue; }
            const int j = d < hr ? d : d - hr;
            const float f = (float)position * inv_freq[j];
            const float c = cos(f) * inv_freq[hr], s = sin(f) * inv_freq[hr];
            b[d] = d < hr ? a[d] * c + (-a[d + hr]) * s : a[d] * c + a[d - hr] * s;
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (to_cache) {
        kv_put(b, cache_row, cache_scale, part, hd);
    } else {
        for (int i = lid; i < hd; i += NORM_WG) dst[i] = b[i];
    }
}

// The inputs of attention_block's attention, one work-group per (row, head) over q, k and v heads: q to q_out, k and
// v into the caches at row s0 + t (s0: start clamped as kv_write clamps), q and k normed and rotated at start + t.
// q [T, hq * hd], k, v [T, hkv * hd]; q_out [T, hq, hd]; kc, vc [cap, hkv, hd]; ks, vs [cap, hkv];
// inv_freq [rot / 2 + 1] (as rope's).
__kernel void CAT(attention_inputs_, KV_SUFFIX)(__global const float* q, __global const float* k,
                                                __global const float* v, __global const float* q_norm,
                                                __global const float* k_norm, __global const float* inv_freq,
                                                __global float* q_out, __global KVT* kc, __global KVT* vc,
                                                __global float* ks, __global float* vs, const int hq,
                                                const int hkv, const int hd, const int rot, const float eps,
                                                const int start, const int s0) {
    __local float part[NORM_WG];
    __local float a[ATT_HD_MAX], b[ATT_HD_MAX];
    const int heads = hq + 2 * hkv;
    const size_t grp = get_group_id(0);
    const int t = (int)(grp / heads), hh = (int)(grp % heads);
    const long position = (long)start + t;
    if (hh < hq) {
        attention_input_head(q + ((size_t)t * hq + hh) * hd, q_out + ((size_t)t * hq + hh) * hd, kc, ks, q_norm,
                             inv_freq, part, a, b, hd, rot, eps, position, 0, 0);
        return;
    }
    const int is_v = hh >= hq + hkv;
    const int j = is_v ? hh - hq - hkv : hh - hq;
    const size_t row = (size_t)(s0 + t) * hkv + j;
    attention_input_head((is_v ? v : k) + ((size_t)t * hkv + j) * hd, q_out, (is_v ? vc : kc) + row * hd,
                         (is_v ? vs : ks) + row, k_norm, inv_freq, part, a, b, hd, rot, eps, position, is_v, 1);
}

// Rows mode (a decode window): row s is one token of sequence s, at position rows[s] (real when rows[S + s] != 0),
// its caches at kc + s * cap * hkv * hd (and its scales at ks + s * cap * hkv). rows int [2, S] = (positions, active).

// attention_inputs for a window: row s's key and value go to cache row min(max(position, 0), cap - 1) of its own
// caches (as kv_write clamps a one-row write). q [S, hq * hd], k, v [S, hkv * hd]; q_out [S, hq, hd];
// kc, vc [S, cap, hkv, hd]; ks, vs [S, cap, hkv].
__kernel void CAT(attention_inputs_rows_, KV_SUFFIX)(__global const float* q, __global const float* k,
                                                     __global const float* v, __global const float* q_norm,
                                                     __global const float* k_norm, __global const float* inv_freq,
                                                     __global float* q_out, __global KVT* kc, __global KVT* vc,
                                                     __global float* ks, __global float* vs,
                                                     __global const int* rows, const int hq, const int hkv,
                                                     const int hd, const int rot, const float eps, const int cap) {
    __local float part[NORM_WG];
    __local float a[ATT_HD_MAX], b[ATT_HD_MAX];
    const int heads = hq + 2 * hkv;
    const size_t grp = get_group_id(0);
    const int s = (int)(grp / heads), hh = (int)(grp % heads);
    const long position = rows[s];
    if (hh < hq) {
        attention_input_head(q + ((size_t)s * hq + hh) * hd, q_out + ((size_t)s * hq + hh) * hd, kc, ks, q_norm,
                             inv_freq, part, a, b, hd, rot, eps, position, 0, 0);
        return;
    }
    const long at = position < 0 ? 0 : (position > cap - 1 ? cap - 1 : position);
    const int is_v = hh >= hq + hkv;
    const int j = is_v ? hh - hq - hkv : hh - hq;
    const size_t row = ((size_t)s * cap + (size_t)at) * hkv + j;
    attention_input_head((is_v ? v : k) + ((size_t)s * hkv + j) * hd, q_out, (is_v ? vc : kc) + row * hd,
                         (is_v ? vs : ks) + row, k_norm, inv_freq, part, a, b, hd, rot, eps, position, is_v, 1);
}

// attention_gated for a window: row s attends to keys 0..position of its own caches (an inactive row to key 0
// only), times sigmoid(gate) when has_gate. q, gate, out [S, hq, hd]; k, v [S, cap, hkv, hd]; ks, vs [S, cap, hkv].
__kernel void CAT(attention_gated_rows_, KV_SUFFIX)(__global const float* q, __global const KVT* k,
                                                    __global const KVT* v, __global const float* ks,
                                                    __global const float* vs, __global const float* gate,
                                                    __global float* out, __global const int* rows, const int n_rows,
                                                    const int hq, const int hkv, const int hd, const int cap,
                                                    const float scale, const int has_gate, const uint n) {
    const size_t i = get_global_id(0);
    if (i >= n) return;
    const int h = (int)(i % hq);
    const int s = (int)(i / hq);
    long last = rows[n_rows + s] != 0 ? (long)rows[s] : 0;
    if (last > cap - 1) last = cap - 1;
    const size_t rows_off = (size_t)s * cap * hkv;
    attend_gated(q + i * hd, k + rows_off * hd, v + rows_off * hd, ks + rows_off, vs + rows_off, gate + i * hd,
                 out + i * hd, last, h / (hq / hkv), hkv, hd, scale, has_gate);
}

#undef attend
#undef attend_gated
#undef attention_input_head
#undef kv_put
#undef KV_SCALE
