// The GELU (tanh form) between the MLP's two cuBLAS GEMMs (DESIGN §3 `mlp_fwd` / `mlp_bwd`).
// 16-byte vectors where the buffers allow it, scalars for the tail.
#include "common.cuh"

#define GELU_K 0.7978845608028654f  // sqrt(2/pi)

// numpy: g = 0.5 * h * (1 + np.tanh(sqrt(2/pi) * (h + 0.044715 * h**3)))
__device__ __forceinline__ float gelu(float x) {
    return 0.5f * x * (1.0f + tanhf(GELU_K * (x + 0.044715f * x * x * x)));
}

// numpy: th = np.tanh(u); GELU'(h) = 0.5 * (1 + th) + 0.5 * h * (1 - th**2) * du/dh
__device__ __forceinline__ float gelu_grad(float x) {
    const float th = tanhf(GELU_K * (x + 0.044715f * x * x * x));
    const float du = GELU_K * (1.0f + 3.0f * 0.044715f * x * x);
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
}

extern "C" __global__ void k_mlp_gelu_fwd(act_t* g, const act_t* h, long n) {
    const long i0 = blockIdx.x * (long)blockDim.x + threadIdx.x, step = (long)gridDim.x * blockDim.x;
    const long nv = (aligned16(g) && aligned16(h)) ? n / VEC : 0;
    for (long v = i0; v < nv; v += step) {
        const Vec x = load_vec(h + v * VEC);
        Vec y;
#pragma unroll
        for (int k = 0; k < VEC; k++) y[k] = to_act(gelu(to_f(x[k])));
        store_vec(g + v * VEC, y);
    }
    for (long i = nv * VEC + i0; i < n; i += step) g[i] = to_act(gelu(to_f(h[i])));
}

// numpy: dh = dg * GELU'(h)      (dh may alias dg)
extern "C" __global__ void k_mlp_gelu_bwd(act_t* dh, const act_t* dg, const act_t* h, long n) {
    const long i0 = blockIdx.x * (long)blockDim.x + threadIdx.x, step = (long)gridDim.x * blockDim.x;
    const long nv = (aligned16(dh) && aligned16(dg) && aligned16(h)) ? n / VEC : 0;
    for (long v = i0; v < nv; v += step) {
        const Vec x = load_vec(h + v * VEC), gv = load_vec(dg + v * VEC);
        Vec y;
#pragma unroll
        for (int k = 0; k < VEC; k++) y[k] = to_act(to_f(gv[k]) * gelu_grad(to_f(x[k])));
        store_vec(dh + v * VEC, y);
    }
    for (long i = nv * VEC + i0; i < n; i += step)
        dh[i] = to_act(to_f(dg[i]) * gelu_grad(to_f(h[i])));
}
