// Gradient norm, clipping and AdamW over the flat fp32 buffers (DESIGN §3 utility kernels, §4).
#include "common.cuh"

// numpy twin: ops.grad_norm_partial
// >   g = grads[j * block : (j + 1) * block]
// >   partials[j] = np.dot(g, g)
// numpy's partial j is a contiguous block of 65536 (float64); here partial blk is float and sums
// block blk's grid-stride share of the elements. gs: a gradient scale not yet applied to the
// buffer (CudaBackend.grad_scale defers it; numpy's grad_scale has already done `grads *= s`),
// so x = g*gs is rounded to float exactly as that pass would have stored it.
// Fixed grid and fixed per-thread order + fixed block tree: the same bits every run.
extern "C" __global__ void k_grad_norm_partial(float* partials, const float* g, long n,
                                               float gs) {
    __shared__ float shared[32];
    float s = 0.0f;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        const float x = g[i] * gs;
        s += x * x;
    }
    s = block_sum(s, shared);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// numpy twin: ops.grad_norm_final
// >   return float(np.sqrt(np.sum(partials)))
// One block, float sums in a fixed order; inf/nan propagate.
extern "C" __global__ void k_grad_norm_final(float* norm, const float* partials, int n) {
    __shared__ float shared[32];
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += partials[i];
    s = block_sum(s, shared);
    if (threadIdx.x == 0) norm[0] = sqrtf(s);
}

// numpy twin: ops.grad_scale
// >   grads *= s
// The backend defers it when it can (CudaBackend.grad_scale): k_grad_norm_partial and k_adamw
// multiply by the pending scale as they read; this pass settles it before anything else reads
// or adds to the gradients.
extern "C" __global__ void k_grad_scale(float* g, long n, float s) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x)
        g[i] *= s;
}

// numpy twin: model.NumpyBackend.forward_backward
// >   self._grads += self._gsave
// A micro-batch's gradient formed on its own (separate=True) is added to the others' sum in one
// pass: gradient accumulation then adds whole micro-batch gradients, as an all-reduce does.
extern "C" __global__ void k_grad_add(float* g, const float* other, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x)
        g[i] = g[i] + other[i];
}

#define ADAMW_MAX_SEGS 1024

// numpy twin: ops.adamw
// >   m = β1·m + (1-β1)·g;  v = β2·v + (1-β2)·g²;  m̂ = m/(1-β1ᵗ);  v̂ = v/(1-β2ᵗ);
// >   p -= lr·(m̂/(sqrt(v̂)+eps) + wd·p·decay)
// Here bc1 = 1-β1ᵗ, bc2 = 1-β2ᵗ and p -= lr·((m/bc1)/(sqrt(v/bc2)+eps) + wd·p·decay): the same
// formula, which numpy evaluates in another order (sqrt(v)·(1/sqrt(bc2)) + eps, then ·(1/bc1)).
// decay is per tensor: tensor i covers [seg_start[i], seg_start[i+1]) and decays (2-D tensors
// only) when seg_decay[i] != 0. Not in numpy, whose ops.adamw reads g as it is:
// - gs: a gradient scale (1/n_micro or the clip) that CudaBackend.grad_scale deferred; g*gs is
//   rounded to float exactly as a k_grad_scale pass (numpy: `grads *= s`) would have stored it,
//   and the pass over the gradients is saved (llm.c's way).
// - p_lp (may be null) receives the rounded low-precision copy of p that the GEMMs read.
// Four elements per thread (16-byte float loads).
extern "C" __global__ void k_adamw(float* p, act_t* p_lp, const float* g, float* m, float* v,
                                   const long* seg_start, const int* seg_decay, int nseg, long n,
                                   float lr, float b1, float b2, float eps, float wd, float bc1,
                                   float bc2, float gs) {
    __shared__ long starts[ADAMW_MAX_SEGS + 1];
    __shared__ int decay[ADAMW_MAX_SEGS];
    for (int i = threadIdx.x; i <= nseg; i += blockDim.x) starts[i] = seg_start[i];
    for (int i = threadIdx.x; i < nseg; i += blockDim.x) decay[i] = seg_decay[i];
    __syncthreads();
    const long nq = n / 4;  // float4 groups; the tail (n % 4) goes element by element
    for (long q = blockIdx.x * (long)blockDim.x + threadIdx.x; q < nq + (n & 3);
         q += (long)gridDim.x * blockDim.x) {
        const bool vec = q < nq;
        const long i0 = vec ? q * 4 : nq * 4 + (q - nq);
        int lo = 0, hi = nseg - 1;  // the segment with starts[k] <= i0 < starts[k+1]
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (starts[mid] <= i0) lo = mid; else hi = mid - 1;
        }
        float4 g4, p4, m4, v4;
        if (vec) {
            g4 = *reinterpret_cast<const float4*>(g + i0);
            p4 = *reinterpret_cast<const float4*>(p + i0);
            m4 = *reinterpret_cast<const float4*>(m + i0);
            v4 = *reinterpret_cast<const float4*>(v + i0);
        } else {
            g4.x = g[i0]; p4.x = p[i0]; m4.x = m[i0]; v4.x = v[i0];
        }
        float* ga = &g4.x;
        float* pa = &p4.x;
        float* ma = &m4.x;
        float* va = &v4.x;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (k > 0 && !vec) break;
            while (i0 + k >= starts[lo + 1]) lo++;  // a tensor boundary inside the group
            const float gk = ga[k] * gs;
            const float mi = b1 * ma[k] + (1.0f - b1) * gk;
            const float vi = b2 * va[k] + (1.0f - b2) * gk * gk;
            const float pi = pa[k];
            ma[k] = mi;
            va[k] = vi;
            pa[k] = pi - lr * ((mi / bc1) / (sqrtf(vi / bc2) + eps) + (decay[lo] ? wd * pi : 0.0f));
            if (p_lp) p_lp[i0 + k] = to_act(pa[k]);
        }
        if (vec) {
            *reinterpret_cast<float4*>(p + i0) = p4;
            *reinterpret_cast<float4*>(m + i0) = m4;
            *reinterpret_cast<float4*>(v + i0) = v4;
        } else {
            p[i0] = p4.x; m[i0] = m4.x; v[i0] = v4.x;
        }
    }
}

// numpy twin: none — numpy computes in its one dtype and keeps no low-precision weights. This
// rounds (to nearest even) the float32 masters into the act_t copy the GEMMs read, at start and
// after load_params; k_adamw keeps the copy current after each update.
extern "C" __global__ void k_params_to_lp(act_t* p_lp, const float* p, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x)
        p_lp[i] = to_act(p[i]);
}
