// Cross-entropy after the tied output projection (DESIGN §3 `loss_fwd` / `loss_bwd`).
// logits = x @ wte.T comes from cuBLAS into a float buffer [R, ldv] (ldv >= V, padded for
// alignment); these kernels are the softmax cross-entropy, one block per row r = t*B + b.
#include "common.cuh"

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
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, z[j]);
    mx = block_max(mx, shared);
    float s = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) s += __expf(z[j] - mx);
    s = block_sum(s, shared);
    if (threadIdx.x == 0) {
        const int t = r / B, b = r - t * B;
        const float l = mx + logf(s);
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
    const int tgt = targets[(long)b * T + t];
    const float l = lse[r], sc = scale[0];
    const float* z = logits + (long)r * ldv;
    act_t* dz = dlogits + (long)r * ldv;
    for (int j = threadIdx.x; j < ldv; j += blockDim.x)
        dz[j] = to_act(j < V ? (__expf(z[j] - l) - (j == tgt ? 1.0f : 0.0f)) * sc : 0.0f);
}
