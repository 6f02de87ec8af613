// Elementwise activations (fp32) and the bfloat16 widening (bf16 is stored as uint16: its bits are the high half
// of an fp32).

__kernel void silu(__global const float* x, __global float* y, const uint n) {
    const size_t i = get_global_id(0);
    if (i < n) { const float v = x[i]; y[i] = v * (1.0f / (1.0f + exp(-v))); }
}

__kernel void sigmoid(__global const float* x, __global float* y, const uint n) {
    const size_t i = get_global_id(0);
    if (i < n) y[i] = 1.0f / (1.0f + exp(-x[i]));
}

// softplus(x) = logaddexp(x, 0) = max(x, 0) + log1p(exp(-|x|))
__kernel void softplus(__global const float* x, __global float* y, const uint n) {
    const size_t i = get_global_id(0);
    if (i < n) { const float v = x[i]; y[i] = fmax(v, 0.0f) + log1p(exp(-fabs(v))); }
}

__kernel void widen_bf16(__global const ushort* x, __global float* y, const uint n) {
    const size_t i = get_global_id(0);
    if (i < n) y[i] = as_float(((uint)x[i]) << 16);
}
