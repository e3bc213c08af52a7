// Cross-entropy after the tied output projection (DESIGN §3 `loss_fwd` / `loss_bwd`).
// logits = x @ wte.T comes from cuBLAS into a buffer [R, ldv] (ldv >= V, padded for alignment:
// ldv % 64 == 0, so rows are whole 16-byte vectors) of floats, or of act_t (the `_lp` kernels,
// CudaBackend.logits_lp: the GEMM rounds z to the compute precision, as PyTorch's autocast
// does); these kernels are the softmax cross-entropy, one block per row r = t*B + b, in float
// whatever z is stored in: the `_lp` kernels give the bits of the float ones on z's values.
#include "common.cuh"

// A row is handled in octets, 8 consecutive columns (ldv % 8 == 0, rows 16-byte aligned): one
// 16-byte load of act_t logits, two of float ones. Thread t's octets are o = t, t + blockDim.x,
// ..., slot j holding o = t + j·blockDim.x, so the float and the act_t kernels add the same
// values in the same order (the `_lp` kernels give the float kernels' bits on z's values).
#define LOSS_OCTETS 5  // octets per thread kept in registers: rows of up to 40·blockDim.x columns
// The row kernels are latency-bound (one block a row, the row loaded once, one barrier): as
// many rows in flight as the registers allow. k_loss_fwd_bwd_lp at R = 8192, ldv = 8512 on the
// H200 (dev/bench_kernels.py --ops loss): 89.5 µs, against 69.0 for a copy of the same
// bytes; 138.8 µs before, with float4s 12 a thread and two block reductions. The float ones
// keep 40 floats a thread, 4 blocks of 256 threads an SM (at most 64 registers, no spills).
// Ops launches them with THREADS = 256.
#define LOSS_BOUNDS __launch_bounds__(256, 4)
// The act_t-logits kernels keep a row as stored, half the registers: 6 blocks an SM (at most
// 40 registers, no spills for bf16; 6 octets a thread would spill there). With float
// activations they are the float kernels (never launched: the backend keeps float32 logits).
#if ANDREA_ACT != 0
#define LOSS_LP_BOUNDS __launch_bounds__(256, 6)
#else
#define LOSS_LP_BOUNDS LOSS_BOUNDS
#endif
#define LOG2E 1.4426950408889634f

__device__ __forceinline__ bool row_fits(int ldv) { return ldv <= LOSS_OCTETS * 8 * (int)blockDim.x; }

// 2^x, the hardware's approximation (what __expf is built on): exp(z - c) is ex2(z·log2 e - c·log2 e),
// one fused multiply-add and one ex2 an element.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// An octet as stored: float logits in two float4s, act_t ones in one Vec (VEC == 8 for bf16,
// fp16); load_oct reads octet o of a row, unpack gives its 8 values as floats (exact).
struct OctF {
    float4 a, b;
};
__device__ __forceinline__ OctF load_oct(const float* z, int o) {
    const float4* p = reinterpret_cast<const float4*>(z) + 2 * o;
    return {p[0], p[1]};
}
__device__ __forceinline__ void unpack(const OctF& c, float (&f)[8]) {
    f[0] = c.a.x, f[1] = c.a.y, f[2] = c.a.z, f[3] = c.a.w;
    f[4] = c.b.x, f[5] = c.b.y, f[6] = c.b.z, f[7] = c.b.w;
}
template <typename Z>
struct Cached {  // what a thread keeps of a row that fits, an octet a slot
    typedef OctF type;
};
#if ANDREA_ACT != 0
static_assert(VEC == 8, "an octet of act_t logits is one 16-byte Vec");
__device__ __forceinline__ Vec load_oct(const act_t* z, int o) { return load_vec(z + 8 * o); }
__device__ __forceinline__ void unpack(const Vec& c, float (&f)[8]) {
#pragma unroll
    for (int i = 0; i < 8; i++) f[i] = to_f(c[i]);
}
template <>
struct Cached<act_t> {
    typedef Vec type;
};
#endif

// Octet o's 8 dlogits, stored at dz + 8·o as act_t (one or two 16-byte stores).
__device__ __forceinline__ void store_oct(act_t* dz, int o, const act_t (&v)[8]) {
    int4* p = reinterpret_cast<int4*>(dz + 8 * o);
    const int4* q = reinterpret_cast<const int4*>(v);
#pragma unroll
    for (int k = 0; k < (int)(8 * sizeof(act_t) / 16); k++) p[k] = q[k];
}

template <typename Z, typename C>
__device__ __forceinline__ void row_load(C (&zc)[LOSS_OCTETS], const Z* z, int ldv) {
#pragma unroll
    for (int j = 0; j < LOSS_OCTETS; j++) {
        const int o = threadIdx.x + j * blockDim.x;
        if (o * 8 < ldv) zc[j] = load_oct(z, o);
    }
}

// The max over the columns < V of octet o (exact in any order).
// (Both test o * 8 + 8 <= V first: at most one octet a row straddles V; the others are all
// columns < V, or all padding.)
__device__ __forceinline__ float oct_max(const float (&f)[8], int o, int V, float m) {
    const bool whole = o * 8 + 8 <= V;
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (whole || o * 8 + i < V) m = fmaxf(m, f[i]);
    return m;
}
// s + Σ exp(z - m) over the columns < V of octet o, in column order; mL = m·log2 e.
__device__ __forceinline__ float oct_sumexp(const float (&f)[8], int o, int V, float mL, float s) {
    const bool whole = o * 8 + 8 <= V;
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (whole || o * 8 + i < V) s = __fadd_rn(s, ex2(__fmaf_rn(f[i], LOG2E, -mL)));
    return s;
}

// A thread's (max, Σ exp(z - max)), combined across the block: (m, s) ⊕ (m', s') = (M, s·e^(m-M)
// + s'·e^(m'-M)), M = max(m, m'); an empty share is (-inf, 0).
struct MaxSum {
    float m, s;
};
// The share holding the max keeps its sum as it is (s·e^0); the other is scaled.
__device__ __forceinline__ float ms_scaled(MaxSum a, float m) {
    if (a.m == m) return a.s;
    return a.m == -INFINITY ? 0.0f : __fmul_rn(a.s, ex2(__fmul_rn(__fsub_rn(a.m, m), LOG2E)));
}
__device__ __forceinline__ MaxSum ms_add(MaxSum a, MaxSum b) {
    const float m = fmaxf(a.m, b.m);
    if (m == -INFINITY) return {m, 0.0f};
    return {m, __fadd_rn(ms_scaled(a, m), ms_scaled(b, m))};
}
// A butterfly over lanes 0 .. 2k - 1 (k = 16: the whole warp): lane 0 ends with their sum in a
// fixed order (other lanes in orders of their own).
__device__ __forceinline__ MaxSum warp_ms(MaxSum v, int k) {
    for (; k > 0; k >>= 1)
        v = ms_add(v, {__shfl_xor_sync(0xffffffffu, v.m, k), __shfl_xor_sync(0xffffffffu, v.s, k)});
    return v;
}
// The row's log-sum-exp from every thread's share, in a fixed order, one barrier: a butterfly
// in each warp, then a butterfly over the warps' results (lanes past the warp count hold
// (-inf, 0)), which every warp runs alike on the same shared values; each thread takes its
// lane 0's result, so the whole block has one value. shared: 64 floats, written once per block.
__device__ __forceinline__ float block_lse(MaxSum v, float* shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
    v = warp_ms(v, 16);
    if (lane == 0) shared[warp] = v.m, shared[32 + warp] = v.s;
    __syncthreads();
    v = lane < nwarp ? MaxSum{shared[lane], shared[32 + lane]} : MaxSum{-INFINITY, 0.0f};
    int k = 1;  // the butterfly over the nwarp results: 4, 2, 1 for 8 warps
    while (2 * k < nwarp) k <<= 1;
    v = warp_ms(v, k);
    const float m = __shfl_sync(0xffffffffu, v.m, 0), s = __shfl_sync(0xffffffffu, v.s, 0);
    return m + logf(s);
}

// The log-sum-exp of row z (V used of its ldv columns): each thread's max over its octets,
// then its Σ exp(z - max) over them in order, then block_lse. zc: the row as row_load leaves
// it when row_fits(ldv), else unused (the row is read from z on each pass).
template <typename Z, typename C>
__device__ __forceinline__ float row_lse(const C (&zc)[LOSS_OCTETS], const Z* z, int V, int ldv,
                                         float* shared) {
    float m = -INFINITY, s = 0.0f, f[8];
    if (row_fits(ldv)) {
#pragma unroll
        for (int j = 0; j < LOSS_OCTETS; j++) {
            const int o = threadIdx.x + j * blockDim.x;
            if (o * 8 < ldv) unpack(zc[j], f), m = oct_max(f, o, V, m);
        }
        const float mL = __fmul_rn(m, LOG2E);
#pragma unroll
        for (int j = 0; j < LOSS_OCTETS; j++) {
            const int o = threadIdx.x + j * blockDim.x;
            if (o * 8 < ldv) unpack(zc[j], f), s = oct_sumexp(f, o, V, mL, s);
        }
    } else {
        for (int o = threadIdx.x; o * 8 < ldv; o += blockDim.x)
            unpack(load_oct(z, o), f), m = oct_max(f, o, V, m);
        const float mL = __fmul_rn(m, LOG2E);
        for (int o = threadIdx.x; o * 8 < ldv; o += blockDim.x)
            unpack(load_oct(z, o), f), s = oct_sumexp(f, o, V, mL, s);
    }
    return block_lse({m, s}, shared);
}

// dz = scale·(softmax(z) - onehot(target)) for octet o of a row, softmax(z) = exp(z - lse),
// padding columns V <= j < ldv set to 0 (rounded as written: no contraction).
__device__ __forceinline__ void oct_dlogits(act_t* dz, const float (&f)[8], int o, float lL,
                                            int tgt, float sc, int V) {
    alignas(16) act_t out[8];  // stored as 16-byte words (store_oct)
    if (o * 8 + 8 <= V && (tgt >> 3) != o) {  // the common octet: no padding, not the target
#pragma unroll
        for (int i = 0; i < 8; i++) out[i] = to_act(__fmul_rn(ex2(__fmaf_rn(f[i], LOG2E, -lL)), sc));
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int j = o * 8 + i;
            const float p = ex2(__fmaf_rn(f[i], LOG2E, -lL));
            out[i] = to_act(j < V ? __fmul_rn(__fsub_rn(p, j == tgt ? 1.0f : 0.0f), sc) : 0.0f);
        }
    }
    store_oct(dz, o, out);
}

// The forward of row r (every loss kernel but k_loss_bwd): lse[r] and losses[r] from the row
// z of V used columns; returns the lse. A row that fits (row_fits) is left in zc, and z[tgt]
// comes from there (written to shared by the thread holding it, before block_lse's barrier),
// so that the row may be overwritten once row_lse returns.
template <typename Z, typename C>
__device__ __forceinline__ float row_loss(C (&zc)[LOSS_OCTETS], float* losses, float* lse,
                                          const Z* z, int r, int tgt, int V, int ldv) {
    __shared__ float shared[64];
    __shared__ float zt;
    const bool fits = row_fits(ldv);
    if (fits) {
        row_load(zc, z, ldv);
#pragma unroll
        for (int j = 0; j < LOSS_OCTETS; j++) {
            if ((int)threadIdx.x + j * (int)blockDim.x == tgt >> 3) {
                float f[8];
                unpack(zc[j], f);
#pragma unroll
                for (int i = 0; i < 8; i++)
                    if (i == (tgt & 7)) zt = f[i];
            }
        }
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
    typename Cached<Z>::type zc[LOSS_OCTETS];
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
    const float* z = logits + (long)r * ldv;
    const float lL = __fmul_rn(lse[r], LOG2E), sc = scale[0];
    const int tgt = row_target(targets, r, B, T);
    float f[8];
    for (int o = threadIdx.x; o * 8 < ldv; o += blockDim.x)
        unpack(load_oct(z, o), f), oct_dlogits(dlogits + (long)r * ldv, f, o, lL, tgt, sc, V);
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
    typename Cached<Z>::type zc[LOSS_OCTETS];
    const float l = row_loss(zc, losses, lse, z, r, tgt, V, ldv);
    act_t* dz = dlogits + (long)r * ldv;
    const float lL = __fmul_rn(l, LOG2E), sc = scale[0];
    float f[8];
    if (fits) {
#pragma unroll
        for (int j = 0; j < LOSS_OCTETS; j++) {
            const int o = threadIdx.x + j * blockDim.x;
            if (o * 8 < ldv) unpack(zc[j], f), oct_dlogits(dz, f, o, lL, tgt, sc, V);
        }
    } else {
        for (int o = threadIdx.x; o * 8 < ldv; o += blockDim.x)
            unpack(load_oct(z, o), f), oct_dlogits(dz, f, o, lL, tgt, sc, V);
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
