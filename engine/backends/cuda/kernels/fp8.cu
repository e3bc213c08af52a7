// FP8 copies for the layers' GEMMs (train/precision "fp8"), scaled as engine/model/fp8.py says.
//
// A tensor x goes to FP8 as q = sat(x·s) with s = FMAX / a (E4M3, FMAX 448, for weights and
// activations; E5M2, FMAX 57344, for gradients); cuBLASLt multiplies the product back by the
// inverse scales (its A/B scale pointers), which `inv` receives. a == 0 gives s = 1. For the
// weights, the activations and the gradients alike a is the largest amax of the tensor's history
// of the last HISTORY training passes (delayed scaling), so the cast need not wait for a pass
// over the tensor: it takes the tensor's amax as it goes, for the history (a weight's copies are
// made from its fp32 master in every pass, k_fp8_cast_t_f32). A tensor with no history yet (all
// 0) is scaled by its own amax in that pass, taken first by an amax kernel that is a no-op once
// there is a history (k_fp8_amax_delayed; k_fp8_amax_f32_delayed over a weight's master;
// k_fp8_gelu_amax_delayed, k_fp8_dgelu_amax_delayed) or by the kernel that wrote the tensor (the
// GELU kernels, kernels/mlp.cu). At the end of the pass k_fp8_record writes every amax into the
// history's next slot (0 where not finite).
// An infinite amax that a scale divides by (a tensor's own while it has no history) gives s = 0:
// the copy, the GEMM and the step's gradient norm are then not finite, and the step is skipped
// like any other non-finite step. Scaled from a history, an infinite value saturates at ±FMAX
// (__NV_SATFINITE, as round_fp8 does); in an activation or a gradient, the non-finite value that
// made it reaches the gradient norm by the residual stream. The masters stay finite: a step
// whose gradient norm is not finite is skipped, so no update writes one.
//
// amax is reduced with atomicMax on the float's bits as an unsigned int (common.cuh block_amax:
// |x| >= 0 orders like its bits, and a max is exact in any order, so the result is the same bits
// on every run; no float atomics), here or in the kernel that writes the tensor. The caller
// zeroes the amax words before the pass.
//
// Hopper's FP8 GEMMs take both operands K-contiguous ("TN"), so some GEMMs need a transposed copy
// (fp8.py's table): k_fp8_cast_t writes it, with the plain copy when asked.
// cuda_fp8.h comes with CUDA 11.8 and newer: the engine's kernels need that toolkit at least
// (every .cu is compiled at start, whatever the precision).
#include <cfloat>
#include <cuda_fp8.h>

#include "common.cuh"
#include "gelu.cuh"

#define E4M3_MAX 448.0f
#define E5M2_MAX 57344.0f
#define TILE 32  // k_fp8_cast_t's square tile; blocks of 256 threads: 8 rows of TILE

// The amax a tensor's scale divides FMAX by: the largest of its history (hist: H floats), or,
// with none yet or none given (hist null: amax[0] as the caller took it), its amax in this pass.
__device__ __forceinline__ float scaling_amax(const unsigned* amax, const float* hist, int H) {
    float a = 0.0f;
    if (hist)
        for (int k = 0; k < H; k++) a = fmaxf(a, hist[k]);
    return a > 0.0f ? a : __uint_as_float(amax[0]);
}

__device__ __forceinline__ float fp8_scale(float a, int e5m2) {
    const float fmax = e5m2 ? E5M2_MAX : E4M3_MAX;
    if (a == 0.0f) return 1.0f;
    const float s = fmax / a;
    // a tiny amax (below ~1e-36) makes fmax/a infinite, and 0·inf a NaN: the largest finite
    // scale instead (x·s then stays within FMAX). An infinite amax still gives s = 0 (above).
    return isinf(s) ? FLT_MAX : s;
}

__device__ __forceinline__ unsigned char to_fp8(float v, int e5m2) {
    return e5m2 ? __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2)
                : __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

// The block's max of |x|, then one atomicMax per block (an atomic per warp on one word made
// the first version spend milliseconds queueing at that word). 16-byte loads where x allows.
template <typename T>
__device__ __forceinline__ void amax_body(unsigned* amax, const T* x, long n) {
    constexpr int V = 16 / sizeof(T);
    const long stride = (long)gridDim.x * blockDim.x;
    const long i0 = blockIdx.x * (long)blockDim.x + threadIdx.x;
    const long nv = (reinterpret_cast<unsigned long long>(x) & 15) == 0 ? n / V : 0;
    float m = 0.0f;  // fmaxf drops NaN: a NaN is caught by the step's gradient norm
    for (long v = i0; v < nv; v += stride) {
        const int4 raw = reinterpret_cast<const int4*>(x)[v];
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int k = 0; k < V; k++) m = fmaxf(m, fabsf(to_f(e[k])));
    }
    for (long i = nv * V + i0; i < n; i += stride) m = fmaxf(m, fabsf(to_f(x[i])));
    block_amax(amax, m);
}

// Whether a delayed tensor has an amax history (hist: its H floats), the same in every
// thread (an early return on it is uniform).
__device__ __forceinline__ bool has_history(const float* hist, int H) {
    float past = 0.0f;
    for (int k = 0; k < H; k++) past = fmaxf(past, hist[k]);
    return past > 0.0f;
}

// numpy twin: fp8.amax_of — amax[0] = max(amax[0], max |x|) over n activations (float bits as
// unsigned; see the top of this file), for a tensor with no amax history yet (hist: its H
// floats, all 0); once it has one, nothing: the cast kernel takes the amax as it goes.
// >   return np.float32(np.fmax.reduce(np.abs(np.asarray(x, np.float32)).ravel(), initial=0.0))
extern "C" __global__ void k_fp8_amax_delayed(unsigned* amax, const act_t* x, long n,
                                              const float* hist, int H) {
    if (has_history(hist, H)) return;
    amax_body(amax, x, n);
}

// numpy twin: fp8.amax_of — k_fp8_amax_delayed over a float32 master weight: its amax while it
// has no history (then its copies' scale needs it first); once it has one, nothing:
// k_fp8_cast_t_f32 takes the amax as it goes.
// >   return np.float32(np.fmax.reduce(np.abs(np.asarray(x, np.float32)).ravel(), initial=0.0))
extern "C" __global__ void k_fp8_amax_f32_delayed(unsigned* amax, const float* x, long n,
                                                  const float* hist, int H) {
    if (has_history(hist, H)) return;
    amax_body(amax, x, n);
}

// numpy twin: fp8.AmaxHistory.record — the pass's amax of each of n delayed tensors (tensor i:
// layer i / per_layer, amax word (i / per_layer)·stride + i % per_layer) into slot next[0] of its
// history hist [n, H], 0 where not finite; then next[0] moves on. One block.
// >   self.amax[:, self.next] = np.where(np.isfinite(now), now, np.float32(0.0))
// >   self.next = (self.next + 1) % self.amax.shape[1]
extern "C" __global__ void k_fp8_record(float* hist, int* next, const unsigned* amax, int n,
                                        int per_layer, int stride, int H) {
    const int slot = next[0];
    __syncthreads();  // every thread has read the slot before it moves on
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = __uint_as_float(amax[(i / per_layer) * stride + i % per_layer]);
        hist[(long)i * H + slot] = isfinite(v) ? v : 0.0f;
    }
    if (threadIdx.x == 0) next[0] = (slot + 1) % H;
}

// Eight FP8 bytes, stored as one 8-byte word.
struct alignas(8) Fp8x8 {
    unsigned char v[8];
};

// x [rows, cols] row-major into qt = FP8 of xᵀ [cols, rows] and, when q is not null, q = FP8 of x
// [rows, cols] (its rows ldq bytes apart: cols, or a wider row that holds x beside other
// tensors, W_QKV's [W_Q | W_K | W_V]), both scaled by s from amax (fp8_scale); inv[0] = 1/s.
// A TILE x TILE tile per block goes through shared memory, so reads and writes are both along
// rows.
// hist (H floats, or null: amax[0] as given) as scaling_amax says; with a history, the tensor's
// amax is taken into amax[0] as it goes (for k_fp8_record).
template <typename T>
__device__ __forceinline__ void cast_t_body(unsigned char* q, unsigned char* qt, float* inv,
                                            const T* x, unsigned* amax, const float* hist, int H,
                                            int rows, int cols, int ldq, int e5m2) {
    __shared__ unsigned char tile[TILE][TILE + 4];
    const int tx = threadIdx.x % TILE, ty = threadIdx.x / TILE, ny = blockDim.x / TILE;
    const float s = fp8_scale(scaling_amax(amax, hist, H), e5m2);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) inv[0] = 1.0f / s;
    const int c0 = blockIdx.x * TILE, r0 = blockIdx.y * TILE;
    float m = 0.0f;
    for (int k = ty; k < TILE; k += ny) {
        const int r = r0 + k, c = c0 + tx;
        if (r < rows && c < cols) {
            const float f = to_f(x[(long)r * cols + c]);
            const unsigned char v = to_fp8(f * s, e5m2);
            m = fmaxf(m, fabsf(f));
            tile[k][tx] = v;
            if (q) q[(long)r * ldq + c] = v;
        }
    }
    if (hist) block_amax(amax, m);  // its __syncthreads also orders the tile's writes
    __syncthreads();
    for (int k = ty; k < TILE; k += ny) {
        const int c = c0 + k, r = r0 + tx;
        if (c < cols && r < rows) qt[(long)c * rows + r] = tile[tx][k];
    }
}

// Eight elements at p (16-byte aligned) as floats: one 16-byte load of bf16/fp16, two of float.
#if ANDREA_ACT != 0  // with fp32 activations act_t is float: the overload below
__device__ __forceinline__ void load8(const act_t* p, float (&f)[8]) {
    const Vec v = load_vec(p);
#pragma unroll
    for (int k = 0; k < 8; k++) f[k] = to_f(v[k % VEC]);
}
#endif
__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

// Eight act_t at p (16-byte aligned): one 16-byte store of bf16/fp16, two of float.
__device__ __forceinline__ void store8(act_t* p, const act_t (&v)[8]) {
#pragma unroll
    for (int j = 0; j < 8; j += VEC) {
        Vec w;
#pragma unroll
        for (int i = 0; i < VEC; i++) w[i] = v[j + i];
        store_vec(p + j, w);
    }
}

// What cast_t64_body casts, eight elements at a time (at: the first one's row-major index, a
// multiple of 8): a tensor as it is (Plain), or the GELU's output (GeluOf) or its input's
// gradient (DgeluOf) computed from the tensors that produce it, each value rounded to act_t as
// k_mlp_gelu_fwd / k_mlp_gelu_bwd round it, and stored to `keep` where that is not null (for a
// GEMM that runs in bf16 and reads it).
template <typename T>
struct Plain {
    const T* x;
    __device__ __forceinline__ void operator()(long at, float (&f)[8]) const { load8(x + at, f); }
};

struct GeluOf {
    const act_t* pre;
    act_t* keep;
    __device__ __forceinline__ void operator()(long at, float (&f)[8]) const {
        load8(pre + at, f);
        act_t g[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            g[k] = to_act(gelu(f[k]));
            f[k] = to_f(g[k]);
        }
        if (keep) store8(keep + at, g);
    }
};

struct DgeluOf {
    const act_t* dg;  // the gradient of the GELU's output
    const act_t* pre;
    act_t* keep;
    __device__ __forceinline__ void operator()(long at, float (&f)[8]) const {
        float u[8];
        load8(dg + at, f);
        load8(pre + at, u);
        act_t g[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            g[k] = to_act(f[k] * gelu_grad(u[k]));
            f[k] = to_f(g[k]);
        }
        if (keep) store8(keep + at, g);
    }
};

// k_fp8_cast_t for rows % 64 == 0 and cols % 64 == 0 (and 16-byte aligned x, q, qt): a 64 x 64
// tile per block of 256 threads, x read as 16-byte vectors (8 elements a thread per pass), q
// written as 8-byte words from registers, qt as 16-byte words (16 rows of one column) from
// shared memory (ldq a multiple of 8). The same bytes as k_fp8_cast_t. x comes from `src`
// (Plain, GeluOf, DgeluOf).
template <typename Src>
__device__ __forceinline__ void cast_t64_body(unsigned char* q, unsigned char* qt, float* inv,
                                              Src src, unsigned* amax, const float* hist,
                                              int H, int rows, int cols, int ldq, int e5m2) {
    // rows 66 bytes apart: the transposed reads (16 rows of one column a thread, four
    // threads 16 rows apart in a warp) then fall in distinct banks, and the row-wise byte
    // writes in at most two words a bank: 320 shared-memory wavefronts a block (a 16-byte
    // aligned stride, 80, would take 896: every tile read a 4-way conflict)
    __shared__ unsigned char tile[64][64 + 2];
    const float s = fp8_scale(scaling_amax(amax, hist, H), e5m2);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) inv[0] = 1.0f / s;
    const int c0 = blockIdx.x * 64, r0 = blockIdx.y * 64;
    const int cv = (threadIdx.x & 7) * 8;  // this thread's 8 columns of the tile
    float m = 0.0f;
#pragma unroll
    for (int pass = 0; pass < 2; pass++) {
        const int r = pass * 32 + (threadIdx.x >> 3);
        float f[8];
        src((long)(r0 + r) * cols + c0 + cv, f);
        Fp8x8 o;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            o.v[k] = to_fp8(f[k] * s, e5m2);
            m = fmaxf(m, fabsf(f[k]));
            tile[r][cv + k] = o.v[k];
        }
        if (q) *reinterpret_cast<Fp8x8*>(q + (long)(r0 + r) * ldq + c0 + cv) = o;
    }
    if (hist) block_amax(amax, m);
    __syncthreads();
    const int c = threadIdx.x >> 2, rv = (threadIdx.x & 3) * 16;  // column c, rows rv..rv+15
    alignas(16) unsigned char out[16];
#pragma unroll
    for (int k = 0; k < 16; k++) out[k] = tile[rv + k][c];
    *reinterpret_cast<int4*>(qt + (long)(c0 + c) * rows + r0 + rv) =
        *reinterpret_cast<const int4*>(out);
}

// numpy twin: fp8.round_fp8 — k_fp8_cast_t on whole 64 x 64 tiles, 16-byte accesses (above).
// >   q = np.minimum(np.rint(a / quantum) * quantum, np.float32(fmt.max))
extern "C" __global__ void k_fp8_cast_t64(unsigned char* q, unsigned char* qt, float* inv,
                                          const act_t* x, unsigned* amax, const float* hist,
                                          int H, int rows, int cols, int e5m2) {
    cast_t64_body(q, qt, inv, Plain<act_t>{x}, amax, hist, H, rows, cols, cols, e5m2);
}

// numpy twin: fp8.round_fp8 — k_fp8_cast_t_f32 on whole 64 x 64 tiles (the weights' copies).
// >   q = np.minimum(np.rint(a / quantum) * quantum, np.float32(fmt.max))
extern "C" __global__ void k_fp8_cast_t64_f32(unsigned char* q, unsigned char* qt, float* inv,
                                              const float* x, unsigned* amax, const float* hist,
                                              int H, int rows, int cols, int ldq, int e5m2) {
    cast_t64_body(q, qt, inv, Plain<float>{x}, amax, hist, H, rows, cols, ldq, e5m2);
}

// numpy twin: fp8.round_fp8 — FP8 copies of activations or gradients for a TN GEMM (above): the
// nearest FP8 value of x·s, ties to even, saturated (__NV_SATFINITE).
// >   q = np.minimum(np.rint(a / quantum) * quantum, np.float32(fmt.max))
extern "C" __global__ void k_fp8_cast_t(unsigned char* q, unsigned char* qt, float* inv,
                                        const act_t* x, unsigned* amax, const float* hist, int H,
                                        int rows, int cols, int e5m2) {
    cast_t_body(q, qt, inv, x, amax, hist, H, rows, cols, cols, e5m2);
}

// numpy twin: fp8.round_fp8 — the FP8 copies of a float32 master weight W [rows, cols]: W as
// stored (q, rows ldq bytes apart, for dgrad) and Wᵀ (qt, for the forward), made in each pass
// from the masters, a layer's at the start of its forward, scaled from the weight's history like
// any delayed tensor.
// >   q = np.minimum(np.rint(a / quantum) * quantum, np.float32(fmt.max))
extern "C" __global__ void k_fp8_cast_t_f32(unsigned char* q, unsigned char* qt, float* inv,
                                            const float* x, unsigned* amax, const float* hist,
                                            int H, int rows, int cols, int ldq, int e5m2) {
    cast_t_body(q, qt, inv, x, amax, hist, H, rows, cols, ldq, e5m2);
}

// The max |x| over n elements (n a multiple of 8, 16-byte aligned) that `src` gives, eight at a
// time, then one atomicMax per block (as amax_body).
template <typename Src>
__device__ __forceinline__ void amax_of_src(unsigned* amax, Src src, long n) {
    const long stride = (long)gridDim.x * blockDim.x;
    float m = 0.0f;
    for (long v = blockIdx.x * (long)blockDim.x + threadIdx.x; v < n / 8; v += stride) {
        float f[8];
        src(v * 8, f);
#pragma unroll
        for (int k = 0; k < 8; k++) m = fmaxf(m, fabsf(f[k]));
    }
    block_amax(amax, m);
}

// numpy twin: fp8.amax_of — k_fp8_amax_delayed of GELU(pre) (the values k_mlp_gelu_fwd
// writes), computed here: the FP8 MLP's forward writes the GELU only as its FP8 copies
// (k_fp8_gelu_cast_t64), whose scale needs this amax while the tensor has no history.
// >   return np.float32(np.fmax.reduce(np.abs(np.asarray(x, np.float32)).ravel(), initial=0.0))
extern "C" __global__ void k_fp8_gelu_amax_delayed(unsigned* amax, const act_t* pre, long n,
                                                   const float* hist, int H) {
    if (has_history(hist, H)) return;
    amax_of_src(amax, GeluOf{pre, nullptr}, n);
}

// numpy twin: fp8.amax_of — k_fp8_amax_delayed of dg·GELU'(pre) (the values k_mlp_gelu_bwd
// writes), for k_fp8_dgelu_cast_t64 as k_fp8_gelu_amax_delayed is for k_fp8_gelu_cast_t64.
// >   return np.float32(np.fmax.reduce(np.abs(np.asarray(x, np.float32)).ravel(), initial=0.0))
extern "C" __global__ void k_fp8_dgelu_amax_delayed(unsigned* amax, const act_t* dg,
                                                    const act_t* pre, long n, const float* hist,
                                                    int H) {
    if (has_history(hist, H)) return;
    amax_of_src(amax, DgeluOf{dg, pre, nullptr}, n);
}

// numpy twin: fp8.round_fp8 — k_fp8_cast_t64 of GELU(pre): k_mlp_gelu_fwd and the cast of its
// output in one pass (the same bytes; the GELU [rows, cols] written to keep too where not null).
// >   q = np.minimum(np.rint(a / quantum) * quantum, np.float32(fmt.max))
extern "C" __global__ void k_fp8_gelu_cast_t64(unsigned char* q, unsigned char* qt, float* inv,
                                               act_t* keep, const act_t* pre, unsigned* amax,
                                               const float* hist, int H, int rows, int cols) {
    cast_t64_body(q, qt, inv, GeluOf{pre, keep}, amax, hist, H, rows, cols, cols, 0);
}

// numpy twin: fp8.round_fp8 — k_fp8_cast_t64 of dg·GELU'(pre) in E5M2: k_mlp_gelu_bwd and the
// cast of its output in one pass (the same bytes; that gradient written to keep where not null).
// >   q = np.minimum(np.rint(a / quantum) * quantum, np.float32(fmt.max))
extern "C" __global__ void k_fp8_dgelu_cast_t64(unsigned char* q, unsigned char* qt, float* inv,
                                                act_t* keep, const act_t* dg, const act_t* pre,
                                                unsigned* amax, const float* hist, int H,
                                                int rows, int cols) {
    cast_t64_body(q, qt, inv, DgeluOf{dg, pre, keep}, amax, hist, H, rows, cols, cols, 1);
}
