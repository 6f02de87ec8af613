// NeoX rotate-half RoPE on the first `rot` features of each head; the rest pass through.
// x, y [T, heads, hd] fp32; pos [T] int64; inv_freq [rot / 2 + 1] fp32: the inverse frequencies, then the factor on
// cos and sin (strata/backend.py Rope.table). One work-item per element.
__kernel void rope(__global const float* x, __global const long* pos, __global const float* inv_freq,
                   __global float* y, const int heads, const int hd, const int rot, const uint n) {
    const size_t i = get_global_id(0);
    if (i >= n) return;
    const int d = (int)(i % hd);
    const size_t t = i / ((size_t)hd * heads);
    if (d >= rot) { y[i] = x[i]; return; }
    const int hr = rot / 2;
    const int j = d < hr ? d : d - hr;
    const float f = (float)pos[t] * inv_freq[j];
    const float m = inv_freq[hr];
    const float c = cos(f) * m, s = sin(f) * m;
    y[i] = d < hr ? x[i] * c + (-x[i + hr]) * s : x[i] * c + x[i - hr] * s;
}
