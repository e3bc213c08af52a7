// Shared helpers for ANDREA's kernels: the activation type and fixed-order warp/block reductions.
//
// Each .cu file is compiled on its own (`nvcc -arch=sm_90 -std=c++17 -O3 --cubin FILE`); the
// backend compiles it once per precision with -DANDREA_ACT=0 (fp32), 1 (bf16, default), 2 (fp16).
// Master weights, gradients, Adam moments and LayerNorm statistics are float; act_t is the type of
// activations, activation gradients and the low-precision weight copy used by the GEMMs, and of
// the layers' weight gradients where the fused bf16 step keeps them so (optim.cu g_lp).
//
// Twins: every k_ kernel opens with `// numpy twin: ops.NAME` (engine/backends/numpy/ops.py; or
// model.NAME, numpy/model.py; or fp8.NAME, the FP8 recipe in engine/model/fp8.py) and quotes, on lines marked `// >`, the numpy lines it implements; a kernel with no numpy
// counterpart says `// numpy twin: none — ` and what it is for. tests/test_kernel_twins.py
// checks that every named twin exists and every quoted line is in it.
// As in numpy (DESIGN §3): backward kernels ACCUMULATE (+=) into the float32 parameter
// gradients, so micro-batches add up until zero_grads; activation gradients are overwritten
// unless a kernel says otherwise (k_layernorm_bwd's `accumulate`).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#ifndef ANDREA_ACT
#define ANDREA_ACT 1
#endif

#if ANDREA_ACT == 0
typedef float act_t;
#elif ANDREA_ACT == 1
typedef __nv_bfloat16 act_t;
#else
typedef __half act_t;
#endif

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

// Round-to-nearest-even conversion from float: deterministic, so low-precision copies derived
// from the fp32 masters are the same bits on every run (and after a resume).
__device__ __forceinline__ act_t to_act(float x) {
#if ANDREA_ACT == 0
    return x;
#elif ANDREA_ACT == 1
    return __float2bfloat16_rn(x);
#else
    return __float2half_rn(x);
#endif
}

// Butterfly reductions: every lane ends with the same value, combined in a fixed order.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum for blockDim.x a multiple of 32 (<= 1024); `shared` holds 32 floats.
// Fixed order: warps reduce, then warp 0 reduces the per-warp sums. All threads get the result.
__device__ __forceinline__ float block_sum(float v, float* shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // `shared` may still be read by a previous call
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < nwarp ? shared[lane] : 0.0f;
    v = warp_sum(v);
    return v;
}
__device__ __forceinline__ float block_max(float v, float* shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < nwarp ? shared[lane] : -INFINITY;
    v = warp_max(v);
    return v;
}

// amax[0] = max(amax[0], the block's max of m), on the float's bits as an unsigned int (for
// m >= 0 they order alike, and a max is exact in any order: the same bits every run), one
// atomic per block: the FP8 path's per-tensor amax (kernels/fp8.cu). Every thread calls it,
// once per kernel (its shared words are not guarded for reuse).
__device__ __forceinline__ void block_amax(unsigned* amax, float m) {
    __shared__ float wmax[32];
    m = warp_max(m);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) wmax[warp] = m;
    __syncthreads();
    if (warp == 0) {
        m = lane < (int)(blockDim.x >> 5) ? wmax[lane] : 0.0f;
        m = warp_max(m);
        if (lane == 0) atomicMax(amax, __float_as_uint(m));
    }
}

// 16-byte vectors of activations (8 bf16/fp16 or 4 fp32): one load or store instruction each.
constexpr int VEC = 16 / sizeof(act_t);
struct Vec {
    int4 raw;
    __device__ __forceinline__ act_t& operator[](int i) { return reinterpret_cast<act_t*>(&raw)[i]; }
    __device__ __forceinline__ const act_t& operator[](int i) const {
        return reinterpret_cast<const act_t*>(&raw)[i];
    }
};
__device__ __forceinline__ Vec load_vec(const act_t* p) {
    Vec v;
    v.raw = *reinterpret_cast<const int4*>(p);
    return v;
}
__device__ __forceinline__ void store_vec(act_t* p, const Vec& v) {
    *reinterpret_cast<int4*>(p) = v.raw;
}

// Four act_t as one 8-byte (bf16, fp16) or 16-byte (float) word: one load or store of four.
struct alignas(4 * sizeof(act_t)) Act4 {
    act_t v[4];
};
__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15) == 0;
}

// VEC consecutive float32 values (a parameter's, e.g. LayerNorm's γ beside a Vec of activations),
// as 16-byte loads where p is 16-byte aligned: a quarter of the load instructions of scalars,
// which the LayerNorm kernels were bound by (measured on the H200).
__device__ __forceinline__ void load_floats(float (&out)[VEC], const float* p) {
    if (aligned16(p)) {
#pragma unroll
        for (int j = 0; j < VEC; j += 4) {
            const float4 q = *reinterpret_cast<const float4*>(p + j);
            out[j] = q.x;
            out[j + 1] = q.y;
            out[j + 2] = q.z;
            out[j + 3] = q.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < VEC; i++) out[i] = p[i];
    }
}
