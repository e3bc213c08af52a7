// Cross-entropy after the tied output projection (DESIGN §3 `loss_fwd` / `loss_bwd`).
// logits = x @ wte.T comes from cuBLAS into a float buffer [R, ldv] (ldv >= V, padded for
// alignment: ldv % 64 == 0, so rows are whole 16-byte vectors); these kernels are the softmax
// cross-entropy, one block per row r = t*B + b.
#include "common.cuh"

// (max, Σ exp(z - max)) pairs combined: the running form of the softmax's two reductions.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    const float M = fmaxf(m, m2);
    if (M == -INFINITY) return;  // both empty
    s = s * __expf(m - M) + s2 * __expf(m2 - M);
    m = M;
}

// The log-sum-exp of row z (V used of its ldv floats, ldv % 4 == 0, 16-byte aligned rows): one
// pass of 16-byte loads keeping each thread's running (max, sum), then the pairs combined in a
// fixed order (warp butterflies, then warp 0 over the warps). Shared by k_loss_fwd and
// k_loss_fwd_bwd (same bits).
__device__ __forceinline__ float row_lse(const float* z, int V, float* shared) {
    float m = -INFINITY, s = 0.0f;
    const float4* z4 = reinterpret_cast<const float4*>(z);
    for (int q = threadIdx.x; q * 4 < V; q += blockDim.x) {
        const float4 v = z4[q];
        const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (q * 4 + i < V) {
                const float x = e[i];
                if (x > m) {
                    s = s * __expf(m - x) + 1.0f;
                    m = x;
                } else {
                    s += __expf(x - m);
                }
            }
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_merge(m, s, m2, s2);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();  // `shared` may still be read by a previous call
    if (lane == 0) {
        shared[warp] = m;
        shared[16 + warp] = s;
    }
    __syncthreads();
    m = lane < nw ? shared[lane] : -INFINITY;
    s = lane < nw ? shared[16 + lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_merge(m, s, m2, s2);
    }
    // The butterflies leave each lane a merge in its own order (lse_merge's sum contracts to an
    // fma, which is not symmetric): lanes may differ in the last bit. Every thread takes thread
    // 0's value, the one k_loss_fwd stores, so k_loss_fwd_bwd's dlogits are k_loss_bwd's bits.
    const float l = m + logf(s);
    __syncthreads();  // every warp has read the warp partials
    if (threadIdx.x == 0) shared[0] = l;
    __syncthreads();
    return shared[0];
}

// dz = scale·(softmax(z) - onehot(target)) for one row, padding columns V <= j < ldv set to 0;
// four columns per thread (16-byte loads of z, 8- or 16-byte stores of dz).
__device__ __forceinline__ void row_dlogits(act_t* dz, const float* z, float l, int tgt, float sc,
                                            int V, int ldv) {
    const float4* z4 = reinterpret_cast<const float4*>(z);
    for (int q = threadIdx.x; q * 4 < ldv; q += blockDim.x) {
        const float4 v = z4[q];
        const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int j = q * 4 + i;
            const float p = __expf(__fsub_rn(e[i], l));  // rounded as written: no contraction
            dz[j] = to_act(j < V ? __fmul_rn(__fsub_rn(p, j == tgt ? 1.0f : 0.0f), sc) : 0.0f);
        }
    }
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
extern "C" __global__ void k_loss_fwd(float* losses, float* lse, const float* logits,
                                      const int* targets, int B, int T, int V, int ldv) {
    __shared__ float shared[32];
    const int r = blockIdx.x;
    if (r >= B * T) return;
    const float* z = logits + (long)r * ldv;
    const float l = row_lse(z, V, shared);
    if (threadIdx.x == 0) {
        const int t = r / B, b = r - t * B;
        lse[r] = l;
        losses[r] = l - z[targets[(long)b * T + t]];
    }
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
    const int t = r / B, b = r - t * B;
    row_dlogits(dlogits + (long)r * ldv, logits + (long)r * ldv, lse[r], targets[(long)b * T + t],
                scale[0], V, ldv);
}

// numpy twin: ops.loss_bwd (with the forward's softmax statistics, in one pass)
// >   dz = scale · (softmax(z) - onehot(targets)) = diag(scale/s)·E - scale·onehot;
// k_loss_fwd and k_loss_bwd in one launch, with their bits: a training step knows its loss
// scale before the forward, so the row of logits is read from memory once (the passes after
// the first find it in L2) instead of again in the backward. Writes losses, lse and dlogits.
extern "C" __global__ void k_loss_fwd_bwd(float* losses, float* lse, act_t* dlogits,
                                          const float* logits, const int* targets,
                                          const float* scale, int B, int T, int V, int ldv) {
    __shared__ float shared[32];
    const int r = blockIdx.x;
    if (r >= B * T) return;
    const float* z = logits + (long)r * ldv;
    const float l = row_lse(z, V, shared);
    const int t = r / B, b = r - t * B;
    const int tgt = targets[(long)b * T + t];
    if (threadIdx.x == 0) {
        lse[r] = l;
        losses[r] = l - z[tgt];
    }
    row_dlogits(dlogits + (long)r * ldv, z, l, tgt, scale[0], V, ldv);
}
