// What a byte and a FLOP cost in energy on this GPU, and what two ways of moving fewer of them
// through HBM save (at the power limit a step's time is its energy over the limit).
//
//   nvcc -O3 -arch=sm_90a dev/probe_energy.cu -ldl -o probe_energy
//   ./probe_energy sms [SECONDS]      AdamW's traffic (30 bytes an element over ANDREA-120M's
//                                     92.2M parameters) and a copy on k SMs, alone and after 12
//                                     GEMMs
//   ./probe_energy lmhead [SECONDS]   the LM head and an in-place pass over its logits, whole or
//                                     in row chunks whose logits could stay in L2
//   ./probe_energy grads [SECONDS]    the 120M step's weight gradients as the engine keeps them
//                                     (float) against bf16: 12 layers' weight-gradient GEMMs,
//                                     the norm's pass over them, AdamW
//
// Each variant is a CUDA graph replayed for SECONDS (default 1.5; four replays queued between two
// host waits) after 0.4 s of warm-up. NVML's total-energy counter moves about every 100 ms, so the
// measured window runs from one change of it to another, and CUDA events time the same replays.
// Two or three passes, every other one in reverse order. Prints µs, GB/s, W, mJ and the SM
// clock of each.
// cuBLAS and NVML are opened at run time (cuBLAS: $CUBLAS, else libcublas.so.13, else .so.12), so
// it builds wherever nvcc is, without cuBLAS's headers; nothing of the engine.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(x)                                                                            \
    do {                                                                                 \
        cudaError_t e_ = (x);                                                            \
        if (e_ != cudaSuccess) {                                                         \
            fprintf(stderr, "probe_energy: %s at line %d\n", cudaGetErrorString(e_), __LINE__); \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)
#define CB(x)                                                                            \
    do {                                                                                 \
        if ((x) != 0) {                                                                  \
            fprintf(stderr, "probe_energy: cuBLAS error at line %d\n", __LINE__);        \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

// --- NVML, opened at run time (the driver's library) -------------------------------------------
struct Nvml {
    int (*energy)(void*, unsigned long long*) = nullptr;  // millijoules since the driver loaded
    int (*clock)(void*, int, unsigned*) = nullptr;
    void* dev = nullptr;

    // The NVML device of CUDA device 0, found by its PCI bus id (NVML's indices ignore
    // CUDA_VISIBLE_DEVICES); false when the library, the device or its energy counter is missing.
    bool open() {
        void* h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
        if (!h) return false;
        auto init = (int (*)())dlsym(h, "nvmlInit_v2");
        auto by_bus = (int (*)(const char*, void**))dlsym(h, "nvmlDeviceGetHandleByPciBusId_v2");
        energy = (int (*)(void*, unsigned long long*))dlsym(h, "nvmlDeviceGetTotalEnergyConsumption");
        clock = (int (*)(void*, int, unsigned*))dlsym(h, "nvmlDeviceGetClockInfo");
        char bus[32];
        unsigned long long e;
        return init && by_bus && energy && clock && init() == 0 &&
               cudaDeviceGetPCIBusId(bus, sizeof bus, 0) == cudaSuccess && by_bus(bus, &dev) == 0 &&
               energy(dev, &e) == 0;
    }
    unsigned long long mj() const {
        unsigned long long e = 0;
        if (energy(dev, &e) != 0) {
            fprintf(stderr, "probe_energy: NVML's energy counter could not be read\n");
            exit(1);
        }
        return e;
    }
    unsigned sm_mhz() const { unsigned c = 0; clock(dev, 1 /* NVML_CLOCK_SM */, &c); return c; }
};
static Nvml nvml;

// --- kernels ------------------------------------------------------------------------------------
__device__ __forceinline__ float hash_unit(long i, unsigned seed) {  // in [-0.5, 0.5)
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    return (h & 0xffffff) / 16777216.0f - 0.5f;
}

__global__ void k_fill(float* x, long n, unsigned seed, float scale, bool positive) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        x[i] = (positive ? fabsf(hash_unit(i, seed)) : hash_unit(i, seed)) * scale;
}

__global__ void k_fill_bf16(__nv_bfloat16* x, long n, unsigned seed) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        x[i] = __float2bfloat16(hash_unit(i, seed));
}

__global__ void k_smid(int* out) {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    if (threadIdx.x == 0) out[blockIdx.x] = (int)s;
}

__device__ __forceinline__ float4 load4(const float* g, long q) { return reinterpret_cast<const float4*>(g)[q]; }
__device__ __forceinline__ float4 load4(const __nv_bfloat16* g, long q) {
    const uint2 u = reinterpret_cast<const uint2*>(g)[q];
    const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&u);
    return make_float4(__bfloat162float(e[0]), __bfloat162float(e[1]), __bfloat162float(e[2]),
                       __bfloat162float(e[3]));
}

// The engine's AdamW traffic: p, m, v, g read (g as G: float, the engine's, or bf16), p, m, v
// written, p's bf16 copy written. n a multiple of 4 (every caller's is).
template <class G>
__global__ void k_adamw(float* p, __nv_bfloat16* p_lp, const G* g, float* m, float* v, long n) {
    const long nq = n / 4;
    for (long q = blockIdx.x * (long)blockDim.x + threadIdx.x; q < nq; q += (long)gridDim.x * blockDim.x) {
        float4 g4 = load4(g, q), p4 = reinterpret_cast<float4*>(p)[q];
        float4 m4 = reinterpret_cast<float4*>(m)[q], v4 = reinterpret_cast<float4*>(v)[q];
        float *ga = &g4.x, *pa = &p4.x, *ma = &m4.x, *va = &v4.x;
        __align__(8) __nv_bfloat16 lp[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            ma[k] = 0.9f * ma[k] + 0.1f * ga[k];
            va[k] = 0.95f * va[k] + 0.05f * ga[k] * ga[k];
            pa[k] -= 1e-9f * ((ma[k] / 0.5f) / (sqrtf(va[k] / 0.5f) + 1e-8f) + 0.1f * pa[k]);
            lp[k] = __float2bfloat16(pa[k]);
        }
        reinterpret_cast<float4*>(p)[q] = p4;
        reinterpret_cast<float4*>(m)[q] = m4;
        reinterpret_cast<float4*>(v)[q] = v4;
        reinterpret_cast<uint2*>(p_lp)[q] = *reinterpret_cast<uint2*>(lp);
    }
}

// A stand-in for the gradient norm's pass (the engine's k_grad_norm_ranges): each block's sum of
// squares of its share. n a multiple of 4.
template <class G>
__global__ void k_sumsq(float* partials, const G* g, long n) {
    __shared__ float warp_sums[32];
    float s = 0.0f;
    for (long q = blockIdx.x * (long)blockDim.x + threadIdx.x; q < n / 4; q += (long)gridDim.x * blockDim.x) {
        const float4 v = load4(g, q);
        s += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < blockDim.x / 32; w++) s += warp_sums[w];
        partials[blockIdx.x] = s;
    }
}

__global__ void k_copy(float4* dst, const float4* src, long nq) {
    for (long q = blockIdx.x * (long)blockDim.x + threadIdx.x; q < nq; q += (long)gridDim.x * blockDim.x)
        dst[q] = src[q];
}

// A stand-in for the loss kernel: each bf16 logit read and rewritten in place, 8 at a time.
__global__ void k_logits_pass(__nv_bfloat16* x, long n8) {
    for (long q = blockIdx.x * (long)blockDim.x + threadIdx.x; q < n8; q += (long)gridDim.x * blockDim.x) {
        uint4 u = reinterpret_cast<uint4*>(x)[q];
        __nv_bfloat16* e = reinterpret_cast<__nv_bfloat16*>(&u);
#pragma unroll
        for (int k = 0; k < 8; k++)
            e[k] = __float2bfloat16(__expf(__bfloat162float(e[k]) * 0.01f) * 1e-4f - 1e-4f);
        reinterpret_cast<uint4*>(x)[q] = u;
    }
}

// --- measuring ----------------------------------------------------------------------------------
struct Reading {
    double us, watts, mj;  // µs and mJ a call of `enqueue`; the average power
    unsigned mhz;          // the SM clock halfway through, read while replays run
};

// `calls` calls of enqueue in one graph, replayed for about `seconds`, from one change of the
// energy counter to another.
template <class F>
static Reading measure(cudaStream_t st, F enqueue, int calls, double seconds) {
    using clock = std::chrono::steady_clock;
    auto since = [](clock::time_point t) { return std::chrono::duration<double>(clock::now() - t).count(); };
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < calls; i++) enqueue();
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    for (auto t = clock::now(); since(t) < 0.4;) {
        for (int i = 0; i < 4; i++) CK(cudaGraphLaunch(ge, st));
        CK(cudaStreamSynchronize(st));
    }
    // replays one at a time until the counter moves: the window starts and ends at a change
    auto until_change = [&](long* replays) {
        const auto t = clock::now();
        const unsigned long long before = nvml.mj();
        for (;; ++*replays) {
            const unsigned long long now = nvml.mj();
            if (now != before) return now;
            if (since(t) > 2.0) {
                fprintf(stderr, "probe_energy: NVML's energy counter did not move in 2 s\n");
                exit(1);
            }
            CK(cudaGraphLaunch(ge, st));
            CK(cudaStreamSynchronize(st));
        }
    };
    long replays = 0;
    const unsigned long long e1 = until_change(&replays);
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaEventRecord(a, st));
    replays = 0;
    unsigned mhz = 0;
    for (auto t = clock::now(); since(t) < seconds;) {
        for (int i = 0; i < 4; i++, replays++) CK(cudaGraphLaunch(ge, st));
        if (!mhz && since(t) > seconds / 2) mhz = nvml.sm_mhz();
        CK(cudaStreamSynchronize(st));
    }
    const unsigned long long e2 = until_change(&replays);
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    const double n = (double)replays * calls;
    return {ms * 1e3 / n, (double)(e2 - e1) / ms, (double)(e2 - e1) / n, mhz};
}

static void row(const char* what, const Reading& r, double bytes) {
    char gbs[16] = "";
    if (bytes > 0) snprintf(gbs, sizeof gbs, "%.0f", bytes / r.us / 1e3);
    printf("%-52s %9.1f %7s %6.0f %9.3f %6u\n", what, r.us, gbs, r.watts, r.mj, r.mhz);
}

// --- cuBLAS, opened at run time: the four calls this needs ------------------------------------
enum : int { OP_N = 0, OP_T = 1, R_32F = 0, R_16BF = 14, COMPUTE_32F = 68, GEMM_DEFAULT = -1 };

struct Blas {
    using H = void*;
    int (*create)(H*) = nullptr;
    int (*set_stream)(H, cudaStream_t) = nullptr;
    int (*set_workspace)(H, void*, size_t) = nullptr;
    int (*gemm)(H, int, int, int, int, int, const void*, const void*, int, int, const void*, int,
                int, const void*, void*, int, int, int, int) = nullptr;
    H h = nullptr;
    void* ws = nullptr;

    explicit Blas(cudaStream_t st) {
        const char* env = getenv("CUBLAS");
        void* lib = nullptr;
        for (const char* name : {env, "libcublas.so.13", "libcublas.so.12"})
            if (name && *name && (lib = dlopen(name, RTLD_NOW))) break;
        if (!lib) {
            fprintf(stderr, "probe_energy: cuBLAS could not be opened (set CUBLAS to its path)\n");
            exit(2);
        }
        sym(lib, create, "cublasCreate_v2");
        sym(lib, set_stream, "cublasSetStream_v2");
        sym(lib, set_workspace, "cublasSetWorkspace_v2");
        sym(lib, gemm, "cublasGemmEx");
        CB(create(&h));
        CB(set_stream(h, st));
        CK(cudaMalloc(&ws, 32 << 20));
        CB(set_workspace(h, ws, 32 << 20));
    }
    template <class F>
    static void sym(void* lib, F& f, const char* name) {
        f = reinterpret_cast<F>(dlsym(lib, name));
        if (!f) {
            fprintf(stderr, "probe_energy: %s not in the cuBLAS library\n", name);
            exit(2);
        }
    }
    // Row-major C[M, N] = A[M, K] · op(B), bf16 in and out, fp32 accumulation; B is [K, N], or
    // [N, K] when tb.
    void mm(void* c, const void* a, const void* b, int M, int N, int K, bool tb) {
        const float one = 1.0f, zero = 0.0f;
        CB(gemm(h, tb ? OP_T : OP_N, OP_N, N, M, K, &one, b, R_16BF, tb ? K : N, a, R_16BF, K, &zero,
                c, R_16BF, N, COMPUTE_32F, GEMM_DEFAULT));
    }
    // Row-major C[M, N] = A[K, M]ᵀ · B[K, N] (a weight gradient), C in float (or bf16: out16).
    void mm_ta(void* c, const void* a, const void* b, int M, int N, int K, int lda, int ldb,
               bool out16 = false) {
        const float one = 1.0f, zero = 0.0f;
        CB(gemm(h, OP_N, OP_T, N, M, K, &one, b, R_16BF, ldb, a, R_16BF, lda, &zero, c,
                out16 ? R_16BF : R_32F, N, COMPUTE_32F, GEMM_DEFAULT));
    }
};

template <class T>
static T* alloc(long n) {
    T* p;
    CK(cudaMalloc(&p, n * sizeof(T)));
    return p;
}

// --- sms: memory-bound traffic on k SMs -----------------------------------------------------------
static void sms(cudaStream_t st, Blas& blas, int nsm, double seconds) {
    const long n = 92248320L, nc = 64L << 20;  // ANDREA-120M's parameters; the copy's floats each way
    float *p = alloc<float>(n), *g = alloc<float>(n), *m = alloc<float>(n), *v = alloc<float>(n);
    __nv_bfloat16* p_lp = alloc<__nv_bfloat16>(n);
    float *src = alloc<float>(nc), *dst = alloc<float>(nc);
    k_fill<<<1024, 256>>>(p, n, 1, 0.1f, false);
    k_fill<<<1024, 256>>>(g, n, 2, 0.01f, false);
    k_fill<<<1024, 256>>>(m, n, 3, 0.001f, false);
    k_fill<<<1024, 256>>>(v, n, 4, 1e-5f, true);
    k_fill<<<1024, 256>>>(src, nc, 5, 1.0f, false);
    const int M = 8192, N = 3072, K = 768;  // the 120M MLP's first GEMM
    auto *A = alloc<__nv_bfloat16>((long)M * K), *B = alloc<__nv_bfloat16>((long)K * N);
    auto* C = alloc<__nv_bfloat16>((long)M * N);
    k_fill_bf16<<<1024, 256>>>(A, (long)M * K, 7);
    k_fill_bf16<<<1024, 256>>>(B, (long)K * N, 8);
    CK(cudaDeviceSynchronize());

    struct Grid { std::string name; int blocks, threads; };
    std::vector<Grid> grids = {{"2048 x 256 (the engine's)", 2048, 256},
                               {"2 a SM: " + std::to_string(2 * nsm) + " x 1024", 2 * nsm, 1024}};
    for (int k : {nsm, 99, 66, 48, 33, 22})
        if (k <= nsm) grids.push_back({std::to_string(k) + " SMs: " + std::to_string(k) + " x 1024", k, 1024});
    int* smid = alloc<int>(4096);
    for (auto& gr : grids) {  // where the blocks land: one a SM for the "k SMs" grids
        k_smid<<<gr.blocks, gr.threads>>>(smid);
        std::vector<int> ids(gr.blocks);
        CK(cudaMemcpy(ids.data(), smid, gr.blocks * sizeof(int), cudaMemcpyDeviceToHost));
        std::sort(ids.begin(), ids.end());
        printf("  %-28s on %ld SMs\n", gr.name.c_str(), std::unique(ids.begin(), ids.end()) - ids.begin());
    }
    const double adamw_bytes = n * 30.0, copy_bytes = nc * 8.0;
    printf("\n%-52s %9s %7s %6s %9s %6s\n", "variant", "us", "GB/s", "W", "mJ", "MHz");
    for (int pass = 0; pass < 2; pass++) {
        row(("pass " + std::to_string(pass) + " GEMM 8192x3072x768").c_str(),
            measure(st, [&] { blas.mm(C, A, B, M, N, K, false); }, 20, seconds), 0);
        for (size_t i = 0; i < grids.size(); i++) {
            const Grid& gr = grids[pass ? grids.size() - 1 - i : i];
            const std::string at = "pass " + std::to_string(pass) + " ";
            row((at + "adamw " + gr.name).c_str(),
                measure(st, [&] { k_adamw<float><<<gr.blocks, gr.threads, 0, st>>>(p, p_lp, g, m, v, n); }, 10, seconds),
                adamw_bytes);
            row((at + "copy " + gr.name).c_str(),
                measure(st, [&] { k_copy<<<gr.blocks, gr.threads, 0, st>>>((float4*)dst, (const float4*)src, nc / 4); },
                        10, seconds),
                copy_bytes);
            row((at + "12 GEMMs, adamw " + gr.name).c_str(), measure(st, [&] {
                    for (int j = 0; j < 12; j++) blas.mm(C, A, B, M, N, K, false);
                    k_adamw<float><<<gr.blocks, gr.threads, 0, st>>>(p, p_lp, g, m, v, n);
                }, 2, seconds), 0);
        }
    }
}

// --- lmhead: the logits in L2 ------------------------------------------------------------------
static void lmhead(cudaStream_t st, Blas& blas, double seconds) {
    const int R = 8192, V = 8512, d = 768;  // ANDREA-120M: rows, aligned vocabulary, width
    auto *x = alloc<__nv_bfloat16>((long)R * d), *w = alloc<__nv_bfloat16>((long)V * d);
    auto *logits = alloc<__nv_bfloat16>((long)R * V), *dx = alloc<__nv_bfloat16>((long)R * d);
    float* dw = alloc<float>((long)V * d);
    k_fill_bf16<<<1024, 256>>>(x, (long)R * d, 11);
    k_fill_bf16<<<1024, 256>>>(w, (long)V * d, 12);
    CK(cudaDeviceSynchronize());
    // per chunk of rc rows: logits = x·wᵀ, the pass over them, dx = dlogits·w; then dw once
    auto step = [&](int rc) {
        for (long r0 = 0; r0 < R; r0 += rc) {
            blas.mm(logits + r0 * V, x + r0 * d, w, rc, V, d, true);
            k_logits_pass<<<1056, 256, 0, st>>>(logits + r0 * V, (long)rc * V / 8);
            blas.mm(dx + r0 * d, logits + r0 * V, w, rc, d, V, false);
        }
        blas.mm_ta(dw, logits, x, V, d, R, V, d);
    };
    printf("\n%-52s %9s %7s %6s %9s %6s\n", "LM head and a pass over the logits", "us", "", "W", "mJ", "MHz");
    const int chunks[] = {8192, 4096, 2048, 1024, 512};
    for (int pass = 0; pass < 3; pass++)
        for (int i = 0; i < 5; i++) {
            const int rc = chunks[pass == 1 ? 4 - i : i];
            const std::string what = "pass " + std::to_string(pass) + " chunks of " + std::to_string(rc) + " rows";
            row(what.c_str(), measure(st, [&] { step(rc); }, 4, seconds), 0);
        }
}

// --- grads: the weight gradients in float (the engine) or in bf16 --------------------------------
static void grads(cudaStream_t st, Blas& blas, double seconds) {
    const int R = 8192, d = 768, L = 12;
    // one layer's weights as [in, out]: W_QKV, W_O, W_fc, W_proj
    const int shape[4][2] = {{d, 3 * d}, {d, d}, {d, 4 * d}, {4 * d, d}};
    long per_layer = 0;
    for (auto& sh : shape) per_layer += (long)sh[0] * sh[1];
    const long n = per_layer * L;  // 84.9M
    auto *x = alloc<__nv_bfloat16>((long)R * 4 * d), *dy = alloc<__nv_bfloat16>((long)R * 4 * d);
    k_fill_bf16<<<1024, 256>>>(x, (long)R * 4 * d, 21);
    k_fill_bf16<<<1024, 256>>>(dy, (long)R * 4 * d, 22);
    float *p = alloc<float>(n), *m = alloc<float>(n), *v = alloc<float>(n), *partials = alloc<float>(2048);
    float* g32 = alloc<float>(n);
    auto *g16 = alloc<__nv_bfloat16>(n), *p_lp = alloc<__nv_bfloat16>(n);
    k_fill<<<1024, 256>>>(p, n, 23, 0.1f, false);
    k_fill<<<1024, 256>>>(m, n, 24, 0.001f, false);
    k_fill<<<1024, 256>>>(v, n, 25, 1e-5f, true);
    CK(cudaDeviceSynchronize());
    auto wgrads = [&](bool bf16) {
        long at = 0;
        for (int l = 0; l < L; l++)
            for (auto& sh : shape) {
                void* out = bf16 ? (void*)(g16 + at) : (void*)(g32 + at);
                blas.mm_ta(out, x, dy, sh[0], sh[1], R, 4 * d, 4 * d, bf16);
                at += (long)sh[0] * sh[1];
            }
    };
    auto norm = [&](bool bf16) {
        if (bf16) k_sumsq<<<2048, 256, 0, st>>>(partials, g16, n);
        else k_sumsq<<<2048, 256, 0, st>>>(partials, g32, n);
    };
    auto adamw = [&](bool bf16) {
        if (bf16) k_adamw<<<2048, 256, 0, st>>>(p, p_lp, g16, m, v, n);
        else k_adamw<<<2048, 256, 0, st>>>(p, p_lp, g32, m, v, n);
    };
    printf("\n%-52s %9s %7s %6s %9s %6s\n", "weight gradients of 12 layers (84.9M)", "us", "", "W", "mJ", "MHz");
    for (int pass = 0; pass < 3; pass++)
        for (int i = 0; i < 2; i++) {
            const bool bf16 = (i == 1) != (pass == 1);
            const std::string at = "pass " + std::to_string(pass) + (bf16 ? " bf16 " : " float ");
            row((at + "GEMMs").c_str(), measure(st, [&] { wgrads(bf16); }, 2, seconds), 0);
            row((at + "norm").c_str(), measure(st, [&] { norm(bf16); }, 20, seconds), n * (bf16 ? 2.0 : 4.0));
            row((at + "AdamW").c_str(), measure(st, [&] { adamw(bf16); }, 10, seconds), n * (bf16 ? 28.0 : 30.0));
            row((at + "GEMMs, norm, AdamW").c_str(), measure(st, [&] { wgrads(bf16); norm(bf16); adamw(bf16); }, 2, seconds), 0);
        }
}

int main(int argc, char** argv) {
    const std::string mode = argc > 1 ? argv[1] : "";
    char* end = nullptr;
    const double seconds = argc > 2 ? strtod(argv[2], &end) : 1.5;
    if ((mode != "sms" && mode != "lmhead" && mode != "grads") || argc > 3 || (argc > 2 && (*end || !(seconds >= 0.2 && seconds <= 30)))) {
        fprintf(stderr, "usage: probe_energy sms|lmhead|grads [SECONDS, 0.2 to 30]\n");
        return 2;
    }
    if (!nvml.open()) {
        fprintf(stderr, "probe_energy: NVML (libnvidia-ml.so.1) could not be opened\n");
        return 2;
    }
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
        fprintf(stderr, "probe_energy: no CUDA device\n");
        return 2;
    }
    printf("%s, %d SMs; %.1f s a variant\n", prop.name, prop.multiProcessorCount, seconds);
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    Blas blas(st);
    if (mode == "sms") sms(st, blas, prop.multiProcessorCount, seconds);
    else if (mode == "lmhead") lmhead(st, blas, seconds);
    else grads(st, blas, seconds);
    return 0;
}
