// The gated delta rule, recurrent form, over T tokens and all value heads at once. Every column e of a head's
// state S[h, :, e] evolves independently, so one work-item owns one (head, column) and keeps it in registers:
//   S *= exp(g_t);  delta = (v_t[e] - S[:, e] . k_t) * beta_t;  S[:, e] += k_t * delta;  o_t[e] = S[:, e] . q_t
// q, k [T, hv, dk]; v, o [T, hv, dv]; g, beta [T, hv]; S [hv, dk, dv] fp32, updated in place.  dk <= GDN_DK_MAX.
#define GDN_DK_MAX 512

__kernel void gated_delta(__global const float* q, __global const float* k, __global const float* v,
                          __global const float* g, __global const float* beta, __global float* S,
                          __global float* o, const int T, const int hv, const int dk, const int dv) {
    const int h = (int)(get_global_id(0) / dv);
    const int e = (int)(get_global_id(0) % dv);
    if (h >= hv) return;
    float s[GDN_DK_MAX];
    __global float* Sh = S + (size_t)h * dk * dv;
    for (int d = 0; d < dk; ++d) s[d] = Sh[d * dv + e];
    for (int t = 0; t < T; ++t) {
        const size_t th = (size_t)t * hv + h;
        const float decay = exp(g[th]);
        __global const float* kt = k + th * dk;
        __global const float* qt = q + th * dk;
        float kv = 0.0f;
        for (int d = 0; d < dk; ++d) { s[d] *= decay; kv += s[d] * kt[d]; }
        const float delta = (v[th * dv + e] - kv) * beta[th];
        float acc = 0.0f;
        for (int d = 0; d < dk; ++d) { s[d] += kt[d] * delta; acc += s[d] * qt[d]; }
        o[th * dv + e] = acc;
    }
    for (int d = 0; d < dk; ++d) Sh[d * dv + e] = s[d];
}
