// The sampling draw: per row, over the vocabulary sorted by descending logit, keep the entries that pass top_k,
// top_p and min_p (the best one always stays), and pick argmax(scaled logit + Gumbel noise). The noise of token
// `tok` comes from a counter-based hash of (the row's key, tok): a row's draw depends on its own key only, never
// on the batch it is in. A row with temperature <= 0 takes the greedy token.
// scaled, probs, cum [B, V] fp32 (cum = inclusive cumsum of probs); order [B, V] int64 (token ids, sorted);
// greedy [B] int64; temperature, top_p, min_p [B] fp32; top_k [B] int32; keys [B, 2] uint32; out [B] int32.

static ulong mix64(ulong z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9UL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebUL;
    return z ^ (z >> 31);
}

// uniform in (0, 1) from 24 bits of the hash of (key, token)
static float uniform01(ulong key, ulong tok) {
    const ulong h = mix64(key + 0x9e3779b97f4a7c15UL * (tok + 1UL));
    return ((float)(h >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

__kernel void sample_pick(__global const float* scaled, __global const float* probs, __global const float* cum,
                          __global const long* order, __global const long* greedy,
                          __global const float* temperature, __global const int* top_k,
                          __global const float* top_p, __global const float* min_p,
                          __global const uint* keys, __global int* out, const int V, const uint B) {
    const size_t b = get_global_id(0);
    if (b >= B) return;
    if (!(temperature[b] > 0.0f)) { out[b] = (int)greedy[b]; return; }
    const ulong key = ((ulong)keys[2 * b + 1] << 32) | (ulong)keys[2 * b];
    const size_t row = b * (size_t)V;
    const int tk = top_k[b];
    const float tp = top_p[b];
    const float floor_p = min_p[b] * probs[row];
    float best = -INFINITY;
    int choice = 0;
    for (int i = 0; i < V; ++i) {
        const float p = probs[row + i];
        const bool keep = i == 0 || ((tk <= 0 || i < tk) && (cum[row + i] - p < tp) && (p >= floor_p));
        if (!keep) continue;
        const float u = uniform01(key, (ulong)order[row + i]);
        const float val = scaled[row + i] - log(-log(u));
        if (val > best) { best = val; choice = i; }
    }
    out[b] = (int)order[row + choice];
}
