// The GELU (tanh form) between the MLP's two cuBLAS GEMMs (DESIGN §3 `mlp_fwd` / `mlp_bwd`).
// 16-byte vectors where the buffers allow it, scalars for the tail.
#include "common.cuh"
#include "gelu.cuh"

// numpy twin: ops.gelu_fwd (between ops.mlp_fwd's two matmuls; pre = u is h here, act is g)
// >   np.multiply(pre, pre, out=act)
// >   act *= GELU_K * GELU_C
// >   act += GELU_K
// >   act *= pre
// >   np.tanh(act, out=act)
// >   act += 1.0
// >   act *= pre
// >   act *= 0.5
// The GEMMs pre = x @ W_1 and out = act @ W_2 are cuBLAS (Ops.mlp_fwd), which runs this kernel
// when the cuBLASLt GELU_AUX epilogue is off, unavailable or the slower; the FP8 MLP always
// does. amax (may be null): the max |g| written, for g's FP8 copy (common.cuh block_amax).
extern "C" __global__ void k_mlp_gelu_fwd(act_t* g, const act_t* h, long n, unsigned* amax) {
    const long i0 = blockIdx.x * (long)blockDim.x + threadIdx.x, step = (long)gridDim.x * blockDim.x;
    const long nv = (aligned16(g) && aligned16(h)) ? n / VEC : 0;
    float m = 0.0f;  // fmaxf drops NaN: a NaN is caught by the step's gradient norm
    for (long v = i0; v < nv; v += step) {
        const Vec x = load_vec(h + v * VEC);
        Vec y;
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            y[k] = to_act(gelu(to_f(x[k])));
            m = fmaxf(m, fabsf(to_f(y[k])));
        }
        store_vec(g + v * VEC, y);
    }
    for (long i = nv * VEC + i0; i < n; i += step) {
        g[i] = to_act(gelu(to_f(h[i])));
        m = fmaxf(m, fabsf(to_f(g[i])));
    }
    if (amax) block_amax(amax, m);
}

// numpy twin: ops.gelu_bwd (du from da, between ops.mlp_bwd's matmuls; dpre is dh here, da dg)
// >   GELU'(u) = ½(1+t) + ½u(1-t²)·k(1 + 3c·u²) = ½(1+t)·(1 + (1-t)·u·k(1 + 3c·u²)).
// >   np.tanh(ftmp, out=ftmp)  # t
// >   dpre *= ftmp  # du
// numpy builds ftmp = GELU'(u) in place from t; here gelu_grad computes the first form.
// dh may alias dg (numpy: dpre holds da, then du). Run when the cuBLASLt DGELU epilogue is off,
// unavailable or the slower (Ops.mlp_bwd), and by the FP8 MLP; amax as in k_mlp_gelu_fwd (of dh).
extern "C" __global__ void k_mlp_gelu_bwd(act_t* dh, const act_t* dg, const act_t* h, long n,
                                          unsigned* amax) {
    const long i0 = blockIdx.x * (long)blockDim.x + threadIdx.x, step = (long)gridDim.x * blockDim.x;
    const long nv = (aligned16(dh) && aligned16(dg) && aligned16(h)) ? n / VEC : 0;
    float m = 0.0f;
    for (long v = i0; v < nv; v += step) {
        const Vec x = load_vec(h + v * VEC), gv = load_vec(dg + v * VEC);
        Vec y;
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            y[k] = to_act(to_f(gv[k]) * gelu_grad(to_f(x[k])));
            m = fmaxf(m, fabsf(to_f(y[k])));
        }
        store_vec(dh + v * VEC, y);
    }
    for (long i = nv * VEC + i0; i < n; i += step) {
        dh[i] = to_act(to_f(dg[i]) * gelu_grad(to_f(h[i])));
        m = fmaxf(m, fabsf(to_f(dh[i])));
    }
    if (amax) block_amax(amax, m);
}
