// FP8 copies for the MLP's GEMMs (train/precision "fp8"): per-tensor current scaling.
//
// A tensor x goes to FP8 as q = sat(x·s) with s = FMAX / amax(|x|) of this very tensor (E4M3,
// FMAX 448, for weights and activations; E5M2, FMAX 57344, for gradients); cuBLASLt multiplies
// the product back by the inverse scales (its A/B scale pointers), which `inv` receives. amax == 0
// gives s = 1. A non-finite amax gives s = 0 or NaN: the copy, the GEMM and the step's gradient
// norm are then not finite, and the step is skipped like any other non-finite step.
//
// amax is reduced with atomicMax on the float's bits as an unsigned int: |x| >= 0 orders like its
// bits, and a max is exact in any order, so the result is the same bits on every run (the one
// atomic here; no float atomics). The caller zeroes the amax words before the step.
//
// Hopper's FP8 GEMMs take both operands K-contiguous ("TN"), so some GEMMs need a transposed copy
// (engine/backends/cuda/NOTES.md, "FP8"): k_fp8_cast_t writes it, with the plain copy when asked.
#include <cuda_fp8.h>

#include "common.cuh"

#define E4M3_MAX 448.0f
#define E5M2_MAX 57344.0f
#define TILE 32  // k_fp8_cast_t's square tile; blocks of 256 threads: 8 rows of TILE

__device__ __forceinline__ float fp8_scale(const unsigned* amax, int e5m2) {
    const float a = __uint_as_float(amax[0]);
    const float fmax = e5m2 ? E5M2_MAX : E4M3_MAX;
    return a == 0.0f ? 1.0f : fmax / a;
}

__device__ __forceinline__ unsigned char to_fp8(float v, int e5m2) {
    return e5m2 ? __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2)
                : __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

template <typename T>
__device__ __forceinline__ void amax_body(unsigned* amax, const T* x, long n) {
    float m = 0.0f;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x)
        m = fmaxf(m, fabsf(to_f(x[i])));  // fmaxf drops NaN: a NaN is caught by the norm
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) atomicMax(amax, __float_as_uint(m));
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

// numpy twin: none — q = sat(x·s) over n activations, s from amax (the top of this file);
// inv[0] = 1/s for cuBLASLt.
extern "C" __global__ void k_fp8_cast(unsigned char* q, float* inv, const act_t* x,
                                      const unsigned* amax, long n, int e5m2) {
    const float s = fp8_scale(amax, e5m2);
    if (blockIdx.x == 0 && threadIdx.x == 0) inv[0] = 1.0f / s;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x)
        q[i] = to_fp8(to_f(x[i]) * s, e5m2);
}

// x [rows, cols] row-major into qt = FP8 of xᵀ [cols, rows] and, when q is not null, q = FP8 of x
// [rows, cols], both with the scale of k_fp8_cast; inv[0] = 1/s. A TILE x TILE tile per block goes
// through shared memory, so reads and writes are both along rows.
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
