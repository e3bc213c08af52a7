// The GELU (tanh form) and its derivative, as the MLP's kernels compute them (kernels/mlp.cu)
// and the FP8 MLP's casts that produce them (kernels/fp8.cu): one definition, so both give the
// same bits.
#pragma once

#define GELU_K 0.7978845608028654f  // sqrt(2/pi)

// tanh(y) = 1 - 2/(exp(2y) + 1), with the hardware exp (__expf) and one division: a few
// 1e-6 absolute at most, and a handful of instructions where tanhf's accurate path takes
// several times as many, enough to make these kernels compute-bound (about 2 TB/s on the
// H200). Saturates to ±1 (exp overflows to inf, or underflows to 0); NaN stays NaN.
__device__ __forceinline__ float tanh_exp(float y) {
    return 1.0f - 2.0f / (__expf(2.0f * y) + 1.0f);
}

// GELU(u) = ½u(1 + tanh(k(u + 0.044715u³))), k = sqrt(2/π)   (ops.mlp_fwd's docstring)
__device__ __forceinline__ float gelu(float x) {
    return 0.5f * x * (1.0f + tanh_exp(GELU_K * (x + 0.044715f * x * x * x)));
}

// With t = tanh(k(u + c·u³)): GELU'(u) = ½(1+t) + ½u(1-t²)·k(1 + 3c·u²)   (ops.mlp_bwd's
// docstring gives this form and the one numpy computes, ½(1+t)·(1 + (1-t)·u·k(1 + 3c·u²)))
__device__ __forceinline__ float gelu_grad(float x) {
    const float th = tanh_exp(GELU_K * (x + 0.044715f * x * x * x));
    const float du = GELU_K * (1.0f + 3.0f * 0.044715f * x * x);
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
}
