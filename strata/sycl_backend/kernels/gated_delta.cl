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


// The gated delta rule straight from the conv output (the forward pass's delta_block): each work-item forms its own
// inputs at every row, as the composition does: q and k of key head h / (hv / hk) l2-normed (q then times qscale,
// dk^-0.5 rounded on the host as the composition rounds it), v[e] of head h, beta = sigmoid(b) and
// g = -exp(A_log) * softplus(a + dt_bias), both 0 for rows at or past n_valid (the state is then unchanged). With
// `reset` the old state reads as zeros (a sequence starting at 0).
// u [T, 2*hk*dk + hv*dv]; b, a [T, hv]; a_log, dt_bias [hv]; S [hv, dk, dv] fp32 in place; o [T, hv, dv].
static void gated_delta_column(__global const float* u, __global const float* b, __global const float* a,
                               __global const float* a_log, __global const float* dt_bias, __global float* S,
                               __global float* o, const int T, const int hk, const int hv, const int dk,
                               const int dv, const float qscale, const int n_valid, const int reset, const int h,
                               const int e) {
    const int j = h / (hv / hk);
    const size_t C = (size_t)2 * hk * dk + (size_t)hv * dv;
    float s[GDN_DK_MAX];
    __global float* Sh = S + (size_t)h * dk * dv;
    for (int d = 0; d < dk; ++d) s[d] = reset ? 0.0f : Sh[d * dv + e];
    const float neg_a = -exp(a_log[h]);
    for (int t = 0; t < T; ++t) {
        __global const float* ut = u + t * C;
        __global const float* qs = ut + j * dk;
        __global const float* ks = ut + hk * dk + j * dk;
        float sq = 0.0f, sk = 0.0f;
        for (int d = 0; d < dk; ++d) { sq += qs[d] * qs[d]; sk += ks[d] * ks[d]; }
        const float nq = sqrt(sq + 1e-6f), nk = sqrt(sk + 1e-6f);
        const size_t th = (size_t)t * hv + h;
        const int ok = t < n_valid;
        const float x = a[th] + dt_bias[h];
        const float g = ok ? neg_a * (fmax(x, 0.0f) + log1p(exp(-fabs(x)))) : 0.0f;
        const float beta = ok ? 1.0f / (1.0f + exp(-b[th])) : 0.0f;
        const float decay = exp(g);
        float kv = 0.0f;
        for (int d = 0; d < dk; ++d) { s[d] *= decay; kv += s[d] * (ks[d] / nk); }
        const float delta = (ut[2 * hk * dk + h * dv + e] - kv) * beta;
        float acc = 0.0f;
        for (int d = 0; d < dk; ++d) { s[d] += (ks[d] / nk) * delta; acc += s[d] * (qs[d] / nq * qscale); }
        o[th * dv + e] = acc;
    }
    for (int d = 0; d < dk; ++d) Sh[d * dv + e] = s[d];
}

__kernel void gated_delta_raw(__global const float* u, __global const float* b, __global const float* a,
                              __global const float* a_log, __global const float* dt_bias, __global float* S,
                              __global float* o, const int T, const int hk, const int hv, const int dk,
                              const int dv, const float qscale, const int n_valid, const int reset) {
    const int h = (int)(get_global_id(0) / dv);
    const int e = (int)(get_global_id(0) % dv);
    if (h >= hv) return;
    gated_delta_column(u, b, a, a_log, dt_bias, S, o, T, hk, hv, dk, dv, qscale, n_valid, reset, h, e);
}

// Rows mode (a decode window): row s is one token of sequence s, with its own state [hv, dk, dv] at
// S + s hv dk dv; rows int [2, S] = (positions, active): a row at position 0 starts from a zero state, an inactive
// row leaves its state unchanged. u [S, C]; b, a [S, hv]; S [S, hv, dk, dv]; o [S, hv, dv].
__kernel void gated_delta_raw_rows(__global const float* u, __global const float* b, __global const float* a,
                                   __global const float* a_log, __global const float* dt_bias, __global float* S,
                                   __global float* o, __global const int* rows, const int n_rows, const int hk,
                                   const int hv, const int dk, const int dv, const float qscale) {
    const size_t i = get_global_id(0);
    if (i >= (size_t)n_rows * hv * dv) return;
    const int s = (int)(i / ((size_t)hv * dv));
    const int h = (int)(i / dv % hv), e = (int)(i % dv);
    const size_t C = (size_t)2 * hk * dk + (size_t)hv * dv;
    gated_delta_column(u + s * C, b + (size_t)s * hv, a + (size_t)s * hv, a_log, dt_bias,
                       S + (size_t)s * hv * dk * dv, o + (size_t)s * hv * dv, 1, hk, hv, dk, dv, qscale,
                       rows[n_rows + s] != 0, rows[s] <= 0, h, e);
}
