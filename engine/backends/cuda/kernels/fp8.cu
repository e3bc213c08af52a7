// FP8 copies for the MLP's GEMMs (train/precision "fp8"): per-tensor current scaling.
//
// A tensor x goes to FP8 as q = sat(x·s) with s = FMAX / amax(|x|) of this very tensor (E4M3,
// FMAX 448, for weights and activations; E5M2, FMAX 57344, for gradients); cuBLASLt multiplies
// the product back by the inverse scales (its A/B scale pointers), which `inv` receives. amax == 0
// gives s = 1. A non-finite amax gives s = 0 or NaN: the copy, the GEMM and the step's gradient
// norm are then not finite, and the step is skipped like any other non-finite step.
//
// amax is reduced with atomicMax on the float's bits as an unsigned int (common.cuh block_amax:
// |x| >= 0 orders like its bits, and a max is exact in any order, so the result is the same bits
// on every run; no float atomics), here or in the kernel that writes the tensor (the GELU
// kernels, kernels/mlp.cu). The caller zeroes the amax words before the step.
//
// Hopper's FP8 GEMMs take both operands K-contiguous ("TN"), so some GEMMs need a transposed copy
// (fp8.py's table): k_fp8_cast_t writes it, with the plain copy when asked.
// cuda_fp8.h comes with CUDA 11.8 and newer: the engine's kernels need that toolkit at least
// (every .cu is compiled at start, whatever the precision).
#include <cfloat>
#include <cuda_fp8.h>

#include "common.cuh"

#define E4M3_MAX 448.0f
#define E5M2_MAX 57344.0f
#define TILE 32  // k_fp8_cast_t's square tile; blocks of 256 threads: 8 rows of TILE

__device__ __forceinline__ float fp8_scale(const unsigned* amax, int e5m2) {
    const float a = __uint_as_float(amax[0]);
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

// numpy twin: none — FP8 exists only on the GPU. amax[0] = max(amax[0], max |x|) over n
// activations (float bits as unsigned; see the top of this file).
extern "C" __global__ void k_fp8_amax(unsigned* amax, const act_t* x, long n) {
    amax_body(amax, x, n);
}

// numpy twin: none — k_fp8_amax over float32 (the master weights).
extern "C" __global__ void k_fp8_amax_f32(unsigned* amax, const float* x, long n) {
    amax_body(amax, x, n);
}

// Eight FP8 bytes, stored as one 8-byte word.
struct alignas(8) Fp8x8 {
    unsigned char v[8];
};

// x [rows, cols] row-major into qt = FP8 of xᵀ [cols, rows] and, when q is not null, q = FP8 of x
// [rows, cols], both scaled by s from amax (fp8_scale); inv[0] = 1/s. A TILE x TILE tile per
// block goes through shared memory, so reads and writes are both along rows.
template <typename T>
__device__ __forceinline__ void cast_t_body(unsigned char* q, unsigned char* qt, float* inv,
                                            const T* x, const unsigned* amax, int rows, int cols,
                                            int e5m2) {
    __shared__ unsigned char tile[TILE][TILE + 4];
    const int tx = threadIdx.x % TILE, ty = threadIdx.x / TILE, ny = blockDim.x / TILE;
    const float s = fp8_scale(amax, e5m2);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) inv[0] = 1.0f / s;
    const int c0 = blockIdx.x * TILE, r0 = blockIdx.y * TILE;
    for (int k = ty; k < TILE; k += ny) {
        const int r = r0 + k, c = c0 + tx;
        if (r < rows && c < cols) {
            const unsigned char v = to_fp8(to_f(x[(long)r * cols + c]) * s, e5m2);
            tile[k][tx] = v;
            if (q) q[(long)r * cols + c] = v;
        }
    }
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

// k_fp8_cast_t for rows % 64 == 0 and cols % 64 == 0 (and 16-byte aligned x, q, qt): a 64 x 64
// tile per block of 256 threads, x read as 16-byte vectors (8 elements a thread per pass), q
// written as 8-byte words from registers, qt as 16-byte words (16 rows of one column) from
// shared memory. The same bytes as k_fp8_cast_t.
template <typename T>
__device__ __forceinline__ void cast_t64_body(unsigned char* q, unsigned char* qt, float* inv,
                                              const T* x, const unsigned* amax, int rows,
                                              int cols, int e5m2) {
    __shared__ unsigned char tile[64][64 + 16];
    const float s = fp8_scale(amax, e5m2);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) inv[0] = 1.0f / s;
    const int c0 = blockIdx.x * 64, r0 = blockIdx.y * 64;
    const int cv = (threadIdx.x & 7) * 8;  // this thread's 8 columns of the tile
#pragma unroll
    for (int pass = 0; pass < 2; pass++) {
        const int r = pass * 32 + (threadIdx.x >> 3);
        float f[8];
        load8(x + (long)(r0 + r) * cols + c0 + cv, f);
        Fp8x8 o;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            o.v[k] = to_fp8(f[k] * s, e5m2);
            tile[r][cv + k] = o.v[k];
        }
        if (q) *reinterpret_cast<Fp8x8*>(q + (long)(r0 + r) * cols + c0 + cv) = o;
    }
    __syncthreads();
    const int c = threadIdx.x >> 2, rv = (threadIdx.x & 3) * 16;  // column c, rows rv..rv+15
    alignas(16) unsigned char out[16];
#pragma unroll
    for (int k = 0; k < 16; k++) out[k] = tile[rv + k][c];
    *reinterpret_cast<int4*>(qt + (long)(c0 + c) * rows + r0 + rv) =
        *reinterpret_cast<const int4*>(out);
}

// numpy twin: none — k_fp8_cast_t on whole 64 x 64 tiles, 16-byte accesses (above).
extern "C" __global__ void k_fp8_cast_t64(unsigned char* q, unsigned char* qt, float* inv,
                                          const act_t* x, const unsigned* amax, int rows,
                                          int cols, int e5m2) {
    cast_t64_body(q, qt, inv, x, amax, rows, cols, e5m2);
}

// numpy twin: none — k_fp8_cast_t_f32 on whole 64 x 64 tiles (the weights' copies).
extern "C" __global__ void k_fp8_cast_t64_f32(unsigned char* q, unsigned char* qt, float* inv,
                                              const float* x, const unsigned* amax, int rows,
                                              int cols, int e5m2) {
    cast_t64_body(q, qt, inv, x, amax, rows, cols, e5m2);
}

// numpy twin: none — FP8 copies of activations or gradients for a TN GEMM (above).
extern "C" __global__ void k_fp8_cast_t(unsigned char* q, unsigned char* qt, float* inv,
                                        const act_t* x, const unsigned* amax, int rows, int cols,
                                        int e5m2) {
    cast_t_body(q, qt, inv, x, amax, rows, cols, e5m2);
}

// numpy twin: none — the FP8 copies of a float32 master weight W [rows, cols]: W as stored (q,
// for dgrad) and Wᵀ (qt, for the forward), made at the start of each step from the masters.
extern "C" __global__ void k_fp8_cast_t_f32(unsigned char* q, unsigned char* qt, float* inv,
                                            const float* x, const unsigned* amax, int rows,
                                            int cols, int e5m2) {
    cast_t_body(q, qt, inv, x, amax, rows, cols, e5m2);
}
