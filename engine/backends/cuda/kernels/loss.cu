// Cross-entropy after the tied output projection (DESIGN §3 `loss_fwd` / `loss_bwd`).
// logits = x @ wte.T comes from cuBLAS into a buffer [R, ldv] (ldv >= V, padded for alignment:
// ldv % 64 == 0, so rows are whole 16-byte vectors) of floats, or of act_t (the `_lp` kernels,
// CudaBackend.logits_lp: the GEMM rounds z to the compute precision, as PyTorch's autocast
// does); these kernels are the softmax cross-entropy, one block per row r = t*B + b, in float
// whatever z is stored in: the `_lp` kernels give the bits of the float ones on z's values.
#include "common.cuh"

#define LOSS_CACHE 12  // float4s per thread kept in registers: rows of up to 12·4·blockDim.x floats
// The row kernels are latency-bound (one block a row, the row loaded once): 3 blocks of 256
// threads an SM instead of 2 (at most 85 registers, no spills) took k_loss_fwd_bwd_lp from
// 220 to 153 µs and k_loss_fwd_bwd from 189 to 143 at R = 8192, ldv = 8512 on the H200, the
// same bits (NOTES.md, tenth session). Ops launches them with THREADS = 256.
#define LOSS_BOUNDS __launch_bounds__(256, 3)
// The act_t-logits kernels keep a row in half the registers (Cached): 4 blocks an SM, at most
// 64 registers, no spills for bf16 (5 would spill). With float activations they are the float
// kernels (never launched: the backend keeps float32 logits then).
#if ANDREA_ACT != 0
#define LOSS_LP_BOUNDS __launch_bounds__(256, 4)
#else
#define LOSS_LP_BOUNDS LOSS_BOUNDS
#endif

// Thread t's share of a row of ldv floats (ldv % 4 == 0, 16-byte aligned): the float4s
// q = t, t + blockDim.x, ..., slot j holding q = t + j·blockDim.x. A row that fits is read from
// memory once, into registers (`cached`); a longer one is streamed on each pass.
__device__ __forceinline__ bool row_fits(int ldv) { return ldv <= LOSS_CACHE * 4 * (int)blockDim.x; }


// Columns 4q .. 4q + 3 of a row of logits, as floats.
__device__ __forceinline__ float4 load4(const float* z, int q) {
    return reinterpret_cast<const float4*>(z)[q];
}
#if ANDREA_ACT != 0
__device__ __forceinline__ float4 load4(const act_t* z, int q) {
    const Act4 a = reinterpret_cast<const Act4*>(z)[q];
    return make_float4(to_f(a.v[0]), to_f(a.v[1]), to_f(a.v[2]), to_f(a.v[3]));
}
#endif

// What a thread keeps of a row that fits: four columns per slot as stored (float4 for float
// logits, Act4 for act_t ones: half the registers, so more rows in flight an SM), converted to
// float where used (exact: the same values, the same bits).
template <typename Z>
struct Cached {
    typedef float4 type;
};
#if ANDREA_ACT != 0
template <>
struct Cached<act_t> {
    typedef Act4 type;
};
#endif
__device__ __forceinline__ float4 as_f4(const float4& v) { return v; }
__device__ __forceinline__ float4 as_f4(const Act4& a) {
    return make_float4(to_f(a.v[0]), to_f(a.v[1]), to_f(a.v[2]), to_f(a.v[3]));
}
__device__ __forceinline__ float4 load_raw(const float* z, int q) { return load4(z, q); }
#if ANDREA_ACT != 0
__device__ __forceinline__ Act4 load_raw(const act_t* z, int q) {
    return reinterpret_cast<const Act4*>(z)[q];
}
#endif

template <typename Z, typename C>
__device__ __forceinline__ void row_load(C (&zc)[LOSS_CACHE], const Z* z, int ldv) {
#pragma unroll
    for (int j = 0; j < LOSS_CACHE; j++) {
        const int q = threadIdx.x + j * blockDim.x;
        if (q * 4 < ldv) zc[j] = load_raw(z, q);
    }
}

// z[tgt] from the row row_load left in registers, into *out by the thread holding it (before a
// barrier: the one inside row_lse), so that no thread waits on a load of its own for it.
template <typename C>
__device__ __forceinline__ void cached_target(const C (&zc)[LOSS_CACHE], int tgt, float* out) {
#pragma unroll
    for (int j = 0; j < LOSS_CACHE; j++) {
        if ((int)threadIdx.x + j * (int)blockDim.x == tgt >> 2) {
            const float4 v = as_f4(zc[j]);
            const int i = tgt & 3;
            *out = i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
        }
    }
}

// max and Σ exp(x - m) over the columns < V of one float4 at column 4q, in column order
__device__ __forceinline__ float vec_max(float4 v, int q, int V, float m) {
    const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++)
        if (q * 4 + i < V) m = fmaxf(m, e[i]);
    return m;
}
__device__ __forceinline__ float vec_sumexp(float4 v, int q, int V, float m, float s) {
    const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++)
        if (q * 4 + i < V) s = __fadd_rn(s, __expf(__fsub_rn(e[i], m)));
    return s;
}

// The log-sum-exp of row z (V used of its ldv floats): the max first (exact in any order),
// then each thread's Σ exp(z - max) over its float4s in order, the threads' sums added in a
// fixed order (block_sum). Shared by k_loss_fwd and k_loss_fwd_bwd (same bits); zc: the row
// as row_load leaves it when row_fits(ldv), else unused (the row is read from z).
template <typename Z, typename C>
__device__ __forceinline__ float row_lse(const C (&zc)[LOSS_CACHE], const Z* z, int V, int ldv,
                                         float* shared) {
    float m = -INFINITY, s = 0.0f;
    if (row_fits(ldv)) {
#pragma unroll
        for (int j = 0; j < LOSS_CACHE; j++) {
            const int q = threadIdx.x + j * blockDim.x;
            if (q * 4 < ldv) m = vec_max(as_f4(zc[j]), q, V, m);
        }
        m = block_max(m, shared);
#pragma unroll
        for (int j = 0; j < LOSS_CACHE; j++) {
            const int q = threadIdx.x + j * blockDim.x;
            if (q * 4 < ldv) s = vec_sumexp(as_f4(zc[j]), q, V, m, s);
        }
    } else {
        for (int q = threadIdx.x; q * 4 < ldv; q += blockDim.x) m = vec_max(load4(z, q), q, V, m);
        m = block_max(m, shared);
        for (int q = threadIdx.x; q * 4 < ldv; q += blockDim.x)
            s = vec_sumexp(load4(z, q), q, V, m, s);
    }
    s = block_sum(s, shared);
    // The butterflies leave each lane a sum in its own order: lanes may differ in the last
    // bit. Every thread takes thread 0's value, the one k_loss_fwd stores, so k_loss_fwd_bwd's
    // dlogits are k_loss_bwd's bits.
    const float l = m + logf(s);
    __syncthreads();  // every warp has read block_sum's partials
    if (threadIdx.x == 0) shared[0] = l;
    __syncthreads();
    return shared[0];
}

// dz = scale·(softmax(z) - onehot(target)) for the float4 at column 4q of one row, padding
// columns V <= j < ldv set to 0 (rounded as written: no contraction).
__device__ __forceinline__ void vec_dlogits(act_t* dz, float4 v, int q, float l, int tgt,
                                            float sc, int V) {
    const float e[4] = {v.x, v.y, v.z, v.w};
    Act4 out;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int j = q * 4 + i;
        const float p = __expf(__fsub_rn(e[i], l));
        out.v[i] = to_act(j < V ? __fmul_rn(__fsub_rn(p, j == tgt ? 1.0f : 0.0f), sc) : 0.0f);
    }
    *reinterpret_cast<Act4*>(dz + q * 4) = out;
}

// The forward of row r (every loss kernel but k_loss_bwd): lse[r] and losses[r] from the row
// z of V used columns; returns the lse. A row that fits (row_fits) is left in zc, and z[tgt]
// comes from there, so that the row may be overwritten after the barriers inside row_lse.
template <typename Z, typename C>
__device__ __forceinline__ float row_loss(C (&zc)[LOSS_CACHE], float* losses, float* lse,
                                          const Z* z, int r, int tgt, int V, int ldv) {
    __shared__ float shared[32];
    __shared__ float zt;
    const bool fits = row_fits(ldv);
    if (fits) {
        row_load(zc, z, ldv);
        cached_target(zc, tgt, &zt);
    }
    const float l = row_lse(zc, z, V, ldv, shared);
    if (threadIdx.x == 0) {
        lse[r] = l;
        losses[r] = l - (fits ? zt : to_f(z[tgt]));
    }
    return l;
}

// The target of row r = t*B + b: targets[b, t].
__device__ __forceinline__ int row_target(const int* targets, int r, int B, int T) {
    const int t = r / B, b = r - t * B;
    return targets[(long)b * T + t];
}

// One row of k_loss_fwd, k_loss_fwd_lp.
template <typename Z>
__device__ __forceinline__ void loss_fwd_row(float* losses, float* lse, const Z* logits,
                                             const int* targets, int B, int T, int V, int ldv) {
    const int r = blockIdx.x;
    if (r >= B * T) return;
    typename Cached<Z>::type zc[LOSS_CACHE];
    row_loss(zc, losses, lse, logits + (long)r * ldv, r, row_target(targets, r, B, T), V, ldv);
}

// numpy twin: ops.loss_fwd (after its matmul, per row chunk z = logits[r0:r1])
// >   m = z.max(axis=1)
// >   z -= m[:, None]
// >   zt = z[np.arange(r1 - r0), targets[r0:r1]]  # z_target - m
// >   np.exp(z, out=z)
// >   np.sum(z, axis=1, out=s)
// >   np.log(s, out=losses[r0:r1])
// >   losses[r0:r1] -= zt
// The same loss, lse - z_target with lse = m + log s. What is saved differs (activations.py):
// numpy overwrites logits with E = exp(z - m) and keeps s (row_sum); this kernel leaves z in
// logits and keeps lse. The logits GEMM z = x @ wteᵀ is cuBLAS (Ops.loss_fwd).
extern "C" __global__ void LOSS_BOUNDS k_loss_fwd(float* losses, float* lse, const float* logits,
                                      const int* targets, int B, int T, int V, int ldv) {
    loss_fwd_row(losses, lse, logits, targets, B, T, V, ldv);
}

// numpy twin: ops.loss_fwd (after its matmul, on logits in the compute precision)
// >   np.log(s, out=losses[r0:r1])
// k_loss_fwd on z stored as act_t (CudaBackend.logits_lp): the same bits on the same values.
extern "C" __global__ void LOSS_LP_BOUNDS k_loss_fwd_lp(float* losses, float* lse, const act_t* logits,
                                         const int* targets, int B, int T, int V, int ldv) {
    loss_fwd_row(losses, lse, logits, targets, B, T, V, ldv);
}

// numpy twin: ops.loss_bwd
// >   dz = scale · (softmax(z) - onehot(targets)) = diag(scale/s)·E - scale·onehot;
// numpy never stores dz: it applies the row factor scale/s to x and dx (`r = scale / row_sum`)
// and the one-hot part with np.add.at. Here dz is written out (dlogits, rounded to act_t) for
// the two GEMMs of Ops.loss_bwd: dx = dz @ wte (overwritten), dwte += dzᵀ @ x.
// scale[0] is numpy's `scale` = loss_scale / (B*T), in device memory so that a captured graph
// reads the current value.
// The padding columns V <= j < ldv get 0, so the dx GEMM can run over aligned K = ldv.
extern "C" __global__ void k_loss_bwd(act_t* dlogits, const float* logits, const float* lse,
                                      const int* targets, const float* scale, int B, int T, int V,
                                      int ldv) {
    const int r = blockIdx.x;
    if (r >= B * T) return;
    const float4* z4 = reinterpret_cast<const float4*>(logits + (long)r * ldv);
    const float l = lse[r], sc = scale[0];
    const int tgt = row_target(targets, r, B, T);
    for (int q = threadIdx.x; q * 4 < ldv; q += blockDim.x)
        vec_dlogits(dlogits + (long)r * ldv, z4[q], q, l, tgt, sc, V);
}

// One row of k_loss_fwd_bwd, k_loss_fwd_bwd_lp.
template <typename Z>
__device__ __forceinline__ void loss_fwd_bwd_row(float* losses, float* lse, act_t* dlogits,
                                                 const Z* logits, const int* targets,
                                                 const float* scale, int B, int T, int V,
                                                 int ldv) {
    const int r = blockIdx.x;
    if (r >= B * T) return;
    const Z* z = logits + (long)r * ldv;
    const bool fits = row_fits(ldv);
    const int tgt = row_target(targets, r, B, T);
    typename Cached<Z>::type zc[LOSS_CACHE];
    const float l = row_loss(zc, losses, lse, z, r, tgt, V, ldv);
    act_t* dz = dlogits + (long)r * ldv;
    const float sc = scale[0];
    if (fits) {
#pragma unroll
        for (int j = 0; j < LOSS_CACHE; j++) {
            const int q = threadIdx.x + j * blockDim.x;
            if (q * 4 < ldv) vec_dlogits(dz, as_f4(zc[j]), q, l, tgt, sc, V);
        }
    } else {
        for (int q = threadIdx.x; q * 4 < ldv; q += blockDim.x)
            vec_dlogits(dz, load4(z, q), q, l, tgt, sc, V);
    }
}

// numpy twin: ops.loss_bwd (with the forward's softmax statistics, in one pass)
// >   dz = scale · (softmax(z) - onehot(targets)) = diag(scale/s)·E - scale·onehot;
// k_loss_fwd and k_loss_bwd in one launch, with their bits: a training step knows its loss
// scale before the forward, so the row of logits is read from memory once (into registers,
// when it fits) instead of again in the backward. Writes losses, lse and dlogits.
extern "C" __global__ void LOSS_BOUNDS k_loss_fwd_bwd(float* losses, float* lse, act_t* dlogits,
                                          const float* logits, const int* targets,
                                          const float* scale, int B, int T, int V, int ldv) {
    loss_fwd_bwd_row(losses, lse, dlogits, logits, targets, scale, B, T, V, ldv);
}

// numpy twin: ops.loss_bwd (with the forward's statistics, on logits in the compute precision)
// >   dz = scale · (softmax(z) - onehot(targets)) = diag(scale/s)·E - scale·onehot;
// k_loss_fwd_bwd on z stored as act_t (CudaBackend.logits_lp): the same bits on the same
// values. dlogits may be the logits buffer itself (each row is read before it is written:
// every thread holds its share of the row in registers once row_fits, which the backend
// checks before it aliases them).
extern "C" __global__ void LOSS_LP_BOUNDS k_loss_fwd_bwd_lp(float* losses, float* lse, act_t* dlogits,
                                             const act_t* logits, const int* targets,
                                             const float* scale, int B, int T, int V, int ldv) {
    loss_fwd_bwd_row(losses, lse, dlogits, logits, targets, scale, B, T, V, ldv);
}
