// Benchmark: the MLP's two epilogue GEMMs, cuBLASLt (what the engine runs) against CUTLASS 3
// SM90 kernels with the same work in their epilogues, at ANDREA-120M's shapes (R = B·T = 8192,
// d = 768, F = 3072; bf16 in and out, float32 accumulation):
//   forward   pre = ln2[R,d] . W1[d,F], act = gelu(pre)          cuBLASLt GELU_AUX
//   backward  dpre = (dy[R,d] . W2[F,d]^T) * gelu'(pre)         cuBLASLt DGELU (aux in)
// and the plain GEMM of the same shape beside them. Each kernel: 10 calls captured in a CUDA
// graph, 30 replays a timing, median of 7 timings (µs a call); cuBLASLt's the fastest of its
// heuristic's first 8. Every CUTLASS output is compared with cuBLASLt's.
// Built by dev/bench-mlp-gemm (nvcc -arch=sm_90a, CUTLASS headers); cuBLASLt is opened at
// run time (argv[1]: the library's path), so the build machine needs no cuBLAS.
// cuBLASLt runs first in each problem, then the CUTLASS configurations in a fixed order.
// dev/README.md has the figures it prints on an H200.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;
using bf16 = cutlass::bfloat16_t;

static void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_mlp_gemm: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
#define CK(x) check_cuda((x), #x)

// ---- cuBLASLt, opened at run time: the handful of calls this needs -------------------------
struct LtAlgo { uint64_t data[8]; };
struct LtHeuristic { LtAlgo algo; size_t workspace; int state; float waves; int reserved[4]; };
enum : int {
  DESC_TRANSA = 3, DESC_TRANSB = 4, DESC_EPILOGUE = 7, DESC_AUX_POINTER = 11, DESC_AUX_LD = 12,
  PREF_MAX_WORKSPACE = 1, COMPUTE_32F = 68, R_32F = 0, R_16BF = 14, OP_N = 0, OP_T = 1,
  EPILOGUE_DEFAULT = 1, EPILOGUE_GELU_AUX = 160, EPILOGUE_DGELU = 192
};

struct CublasLt {
  using H = void*;
  int (*create)(H*);
  int (*desc_create)(H*, int, int);
  int (*desc_set)(H, int, const void*, size_t);
  int (*layout_create)(H*, int, uint64_t, uint64_t, int64_t);
  int (*pref_create)(H*);
  int (*pref_set)(H, int, const void*, size_t);
  int (*heuristic)(H, H, H, H, H, H, H, int, LtHeuristic*, int*);
  int (*matmul)(H, H, const void*, const void*, H, const void*, H, const void*, const void*, H,
                void*, H, const LtAlgo*, void*, size_t, cudaStream_t);
  H handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = size_t(32) << 20;

  explicit CublasLt(const char* path) {
    void* lib = dlopen(path, RTLD_NOW);
    if (!lib) {
      std::fprintf(stderr, "bench_mlp_gemm: cannot open %s: %s\n", path, dlerror());
      std::exit(2);
    }
    sym(lib, create, "cublasLtCreate");
    sym(lib, desc_create, "cublasLtMatmulDescCreate");
    sym(lib, desc_set, "cublasLtMatmulDescSetAttribute");
    sym(lib, layout_create, "cublasLtMatrixLayoutCreate");
    sym(lib, pref_create, "cublasLtMatmulPreferenceCreate");
    sym(lib, pref_set, "cublasLtMatmulPreferenceSetAttribute");
    sym(lib, heuristic, "cublasLtMatmulAlgoGetHeuristic");
    sym(lib, matmul, "cublasLtMatmul");
    ok(create(&handle), "cublasLtCreate");
    CK(cudaMalloc(&workspace, workspace_bytes));
  }
  template <class F>
  static void sym(void* lib, F& f, const char* name) {
    f = reinterpret_cast<F>(dlsym(lib, name));
    if (!f) {
      std::fprintf(stderr, "bench_mlp_gemm: %s not in the cuBLASLt library\n", name);
      std::exit(2);
    }
  }
  static void ok(int status, const char* what) {
    if (status != 0) {
      std::fprintf(stderr, "bench_mlp_gemm: %s: cuBLASLt status %d\n", what, status);
      std::exit(1);
    }
  }
};

// ---- timing ---------------------------------------------------------------------------------
static double time_us(cudaStream_t s, const std::function<void()>& call) {
  call();  // first call outside the graph (module loads, lazy set-up)
  CK(cudaStreamSynchronize(s));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < 10; ++i) call();
  CK(cudaStreamEndCapture(s, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<double> us;
  for (int r = 0; r < 8; ++r) {  // the first timing warms up and is dropped
    CK(cudaEventRecord(a, s));
    for (int i = 0; i < 30; ++i) CK(cudaGraphLaunch(exec, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (r > 0) us.push_back(ms * 1000.0 / 300.0);
  }
  std::sort(us.begin(), us.end());
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return us[us.size() / 2];
}

// Row-major D[M,N] = X[M,K] · op(W), in cuBLASLt's column-major terms Dᵀ = op(W)ᵀ·Xᵀ.
// w_nk: W is [N,K] row-major (the product uses Wᵀ); else W is [K,N] row-major.
// The fastest of the heuristic's first 8; D is left holding its output.
static double cublaslt_best(CublasLt& lt, cudaStream_t s, int M, int N, int K, const bf16* X,
                            const bf16* W, bool w_nk, bf16* D, int epilogue, void* aux) {
  CublasLt::H desc, la, lb, ld, pref;
  CublasLt::ok(lt.desc_create(&desc, COMPUTE_32F, R_32F), "matmul desc");
  int ta = w_nk ? OP_T : OP_N, tb = OP_N;
  CublasLt::ok(lt.desc_set(desc, DESC_TRANSA, &ta, sizeof ta), "transa");
  CublasLt::ok(lt.desc_set(desc, DESC_TRANSB, &tb, sizeof tb), "transb");
  CublasLt::ok(lt.desc_set(desc, DESC_EPILOGUE, &epilogue, sizeof epilogue), "epilogue");
  if (aux) {
    int64_t aux_ld = N;
    CublasLt::ok(lt.desc_set(desc, DESC_AUX_POINTER, &aux, sizeof aux), "aux pointer");
    CublasLt::ok(lt.desc_set(desc, DESC_AUX_LD, &aux_ld, sizeof aux_ld), "aux ld");
  }
  if (w_nk) CublasLt::ok(lt.layout_create(&la, R_16BF, K, N, K), "layout W");
  else CublasLt::ok(lt.layout_create(&la, R_16BF, N, K, N), "layout W");
  CublasLt::ok(lt.layout_create(&lb, R_16BF, K, M, K), "layout X");
  CublasLt::ok(lt.layout_create(&ld, R_16BF, N, M, N), "layout D");
  CublasLt::ok(lt.pref_create(&pref), "preference");
  CublasLt::ok(lt.pref_set(pref, PREF_MAX_WORKSPACE, &lt.workspace_bytes, sizeof(size_t)), "ws");
  LtHeuristic cand[8];
  int n = 0;
  CublasLt::ok(lt.heuristic(lt.handle, desc, la, lb, ld, ld, pref, 8, cand, &n), "heuristic");
  const float one = 1.f, zero = 0.f;
  double best = 1e30;
  int pick = -1;
  for (int i = 0; i < n; ++i) {
    if (lt.matmul(lt.handle, desc, &one, W, la, X, lb, &zero, D, ld, D, ld, &cand[i].algo,
                  lt.workspace, lt.workspace_bytes, s) != 0)
      continue;  // refused at run time: nothing was launched
    auto call = [&] {
      CublasLt::ok(lt.matmul(lt.handle, desc, &one, W, la, X, lb, &zero, D, ld, D, ld,
                             &cand[i].algo, lt.workspace, lt.workspace_bytes, s), "matmul");
    };
    double t = time_us(s, call);
    if (t < best) best = t, pick = i;
  }
  if (pick < 0) {
    std::fprintf(stderr, "bench_mlp_gemm: cuBLASLt proposed no algorithm that ran\n");
    std::exit(1);
  }
  CublasLt::ok(lt.matmul(lt.handle, desc, &one, W, la, X, lb, &zero, D, ld, D, ld,
                         &cand[pick].algo, lt.workspace, lt.workspace_bytes, s), "matmul");
  CK(cudaStreamSynchronize(s));
  return best;
}

// ---- CUTLASS: A [M,K] row-major, B [K,N] with K contiguous ([N,K] row-major), D [M,N] row-major
template <class Tile, class Cluster, class Schedule, class EpiSchedule, class Fusion>
struct CutlassGemm {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor, 8, bf16, cutlass::layout::RowMajor, 8,
      EpiSchedule, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      bf16, cutlass::layout::RowMajor, 8, bf16, cutlass::layout::ColumnMajor, 8, float,
      Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop,
                                                      Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

using Plain = cutlass::epilogue::fusion::LinearCombination<bf16, float, void>;
using DGelu = cutlass::epilogue::fusion::LinCombDeEltAct<
    cutlass::layout::RowMajor, cutlass::epilogue::thread::dGELU, bf16, float, bf16>;
// GELU with the pre-activation as aux out; CUTLASS has it only with a bias (zeros here)
using GeluAux = cutlass::epilogue::fusion::LinCombPerColBiasEltActAux<
    cutlass::layout::RowMajor, cutlass::epilogue::thread::GELU_taylor, bf16, float, bf16, bf16>;
using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using EpiCoop = cutlass::epilogue::TmaWarpSpecializedCooperative;
using EpiPing = cutlass::epilogue::TmaWarpSpecialized;
using T128x256 = Shape<_128, _256, _64>;
using T256x128 = Shape<_256, _128, _64>;
using T128x128 = Shape<_128, _128, _64>;
using C1 = Shape<_1, _1, _1>;
using C2 = Shape<_2, _1, _1>;

// Time one CUTLASS GEMM; set(epilogue args) fills its fusion's arguments. NaN when CUTLASS
// refuses the problem or its first launch fails (the row then says so and compares nothing).
template <class G, class Set>
static double cutlass_time(cudaStream_t s, int M, int N, int K, const bf16* A, const bf16* B,
                           bf16* D, Set set) {
  using Kern = typename G::Kernel;
  auto sa = cutlass::make_cute_packed_stride(typename Kern::StrideA{}, {M, K, 1});
  auto sb = cutlass::make_cute_packed_stride(typename Kern::StrideB{}, {N, K, 1});
  auto sd = cutlass::make_cute_packed_stride(typename Kern::StrideD{}, {M, N, 1});
  typename G::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, 1},
                                   {A, sa, B, sb}, {{}, nullptr, sd, D, sd}};
  set(args.epilogue.thread);
  typename G::Gemm gemm;
  if (G::Gemm::can_implement(args) != cutlass::Status::kSuccess) return NAN;
  void* ws = nullptr;
  size_t ws_bytes = G::Gemm::get_workspace_size(args);
  if (ws_bytes) CK(cudaMalloc(&ws, ws_bytes));
  double t = NAN;
  if (gemm.initialize(args, ws) == cutlass::Status::kSuccess &&
      gemm.run(s) == cutlass::Status::kSuccess && cudaStreamSynchronize(s) == cudaSuccess) {
    t = time_us(s, [&] {
      if (gemm.run(s) != cutlass::Status::kSuccess) {
        std::fprintf(stderr, "bench_mlp_gemm: a CUTLASS launch failed after its first one\n");
        std::exit(1);
      }
    });
    CK(cudaStreamSynchronize(s));
  }
  cudaGetLastError();  // a failed first launch leaves nothing behind for the next kernel
  if (ws) CK(cudaFree(ws));
  return t;
}

// ---- data and comparison --------------------------------------------------------------------
__global__ void fill_uniform(bf16* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ (seed * 0x9e3779b9u);
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    p[i] = bf16(scale * (float(x >> 8) / float(1 << 24) * 2.f - 1.f));
  }
}

static std::vector<uint16_t> bits(const bf16* p, size_t n) {
  std::vector<uint16_t> h(n);
  CK(cudaMemcpy(h.data(), p, n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  return h;
}

static bool is_nan(uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x007f) != 0; }
static float value(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Bit for bit against ref: "same bits as cuBLASLt", or how many elements differ, how many are
// NaN where ref is not, the max |diff| and the relative rms difference of the rest.
static std::string compare(const bf16* a, const bf16* ref, size_t n) {
  auto x = bits(a, n), y = bits(ref, n);
  size_t differ = 0, nan = 0;
  double max_diff = 0, d2 = 0, r2 = 0;
  for (size_t i = 0; i < n; ++i) {
    if (x[i] == y[i]) continue;
    ++differ;
    if (is_nan(x[i]) || is_nan(y[i])) { ++nan; continue; }
    double d = std::fabs(double(value(x[i])) - value(y[i]));
    max_diff = std::max(max_diff, d);
    d2 += d * d;
  }
  if (differ == 0) return "same bits as cuBLASLt";
  for (size_t i = 0; i < n; ++i) r2 += double(value(y[i])) * value(y[i]);
  char buf[160];
  std::snprintf(buf, sizeof buf, "%zu of %zu differ (%zu NaN), max |diff| %.2g, rel rms %.2g",
                differ, n, nan, max_diff, std::sqrt(d2 / std::max(r2, 1e-30)));
  return buf;
}

template <class T>
struct template_tag { using type = T; };  // a type passed to a generic lambda

struct Row { std::string problem, impl; double us; double tflops; std::string note; };

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: bench_mlp_gemm LIBCUBLASLT_PATH\n");
    return 2;
  }
  int dev = 0, major = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (major != 9) {
    std::fprintf(stderr, "bench_mlp_gemm: needs an SM90 GPU (compute capability %d.x here)\n",
                 major);
    return 2;
  }
  CublasLt lt(argv[1]);
  const int R = 8192, d = 768, F = 3072;
  const size_t RF = size_t(R) * F, Rd = size_t(R) * d, Fd = size_t(F) * d;
  const double flops = 2.0 * R * F * d;
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  bf16 *dy, *W2, *x, *W1, *W1t, *pre, *ref, *out, *aux_ref, *aux_out, *zero_bias;
  for (bf16** p : {&dy, &x}) CK(cudaMalloc(p, Rd * sizeof(bf16)));
  for (bf16** p : {&W2, &W1, &W1t}) CK(cudaMalloc(p, Fd * sizeof(bf16)));
  for (bf16** p : {&pre, &ref, &out, &aux_ref, &aux_out}) CK(cudaMalloc(p, RF * sizeof(bf16)));
  CK(cudaMalloc(&zero_bias, F * sizeof(bf16)));
  CK(cudaMemset(zero_bias, 0, F * sizeof(bf16)));
  fill_uniform<<<1024, 256>>>(dy, Rd, 1, 0.05f);
  fill_uniform<<<1024, 256>>>(W2, Fd, 2, 0.05f);
  fill_uniform<<<1024, 256>>>(x, Rd, 3, 1.0f);
  fill_uniform<<<1024, 256>>>(W1, Fd, 4, 0.05f);
  fill_uniform<<<1024, 256>>>(pre, RF, 5, 3.0f);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  {  // CUTLASS's B operand is K-major: W1ᵀ [F,d], transposed once on the host
    auto w = bits(W1, Fd);
    std::vector<uint16_t> t(Fd);
    for (int k = 0; k < d; ++k)
      for (int n = 0; n < F; ++n) t[size_t(n) * d + k] = w[size_t(k) * F + n];
    CK(cudaMemcpy(W1t, t.data(), Fd * sizeof(uint16_t), cudaMemcpyHostToDevice));
  }
  std::vector<Row> rows;
  auto add = [&](const char* problem, const std::string& impl, double us, std::string note) {
    rows.push_back({problem, impl, us, std::isnan(us) ? NAN : flops / us / 1e6, note});
  };
  auto plain = [](auto& a) { a.alpha = 1.f; a.beta = 0.f; };
  auto dgelu = [&](auto& a) {
    a.alpha = 1.f; a.beta = 0.f; a.aux_ptr = pre;
    a.dAux = cutlass::make_cute_packed_stride(decltype(a.dAux){}, {R, F, 1});
  };
  auto gelu_aux = [&](auto& a) {
    a.alpha = 1.f; a.beta = 0.f; a.bias_ptr = zero_bias; a.aux_ptr = aux_out;
    a.dAux = cutlass::make_cute_packed_stride(decltype(a.dAux){}, {R, F, 1});
  };

  // One CUTLASS configuration: its output buffers filled with NaN (0xFFFF) first, so an
  // output it did not write cannot pass for cuBLASLt's; timed; then compared with ref (and its
  // aux with aux_ref when given), unless CUTLASS refused it.
  auto cutlass_row = [&](auto gemm, const char* problem, const char* impl, const bf16* A,
                         const bf16* B, auto set, const bf16* aux_want = nullptr) {
    using G = typename decltype(gemm)::type;
    CK(cudaMemset(out, 0xFF, RF * sizeof(bf16)));
    CK(cudaMemset(aux_out, 0xFF, RF * sizeof(bf16)));
    double us = cutlass_time<G>(s, R, F, d, A, B, out, set);
    std::string note;
    if (!std::isnan(us)) {
      note = compare(out, ref, RF);
      if (aux_want) note = "act " + note + "; pre " + compare(aux_out, aux_want, RF);
    }
    add(problem, impl, us, note);
  };

  const char* pln = "dy.W2^T, plain";
  add(pln, "cuBLASLt", cublaslt_best(lt, s, R, F, d, dy, W2, true, ref, EPILOGUE_DEFAULT,
                                     nullptr), "");
  cutlass_row(template_tag<CutlassGemm<T128x256, C1, Coop, EpiCoop, Plain>>{}, pln,
              "CUTLASS coop 128x256", dy, W2, plain);
  cutlass_row(template_tag<CutlassGemm<T128x128, C1, Ping, EpiPing, Plain>>{}, pln,
              "CUTLASS ping 128x128", dy, W2, plain);

  const char* bwd = "dpre = dy.W2^T * gelu'(pre)";
  add(bwd, "cuBLASLt DGELU", cublaslt_best(lt, s, R, F, d, dy, W2, true, ref, EPILOGUE_DGELU,
                                           pre), "");
  cutlass_row(template_tag<CutlassGemm<T128x256, C1, Coop, EpiCoop, DGelu>>{}, bwd,
              "CUTLASS coop 128x256", dy, W2, dgelu);
  cutlass_row(template_tag<CutlassGemm<T128x256, C2, Coop, EpiCoop, DGelu>>{}, bwd,
              "CUTLASS coop 128x256 2x1", dy, W2, dgelu);
  cutlass_row(template_tag<CutlassGemm<T256x128, C1, Coop, EpiCoop, DGelu>>{}, bwd,
              "CUTLASS coop 256x128", dy, W2, dgelu);
  cutlass_row(template_tag<CutlassGemm<T128x128, C1, Ping, EpiPing, DGelu>>{}, bwd,
              "CUTLASS ping 128x128", dy, W2, dgelu);
  cutlass_row(template_tag<CutlassGemm<T128x128, C2, Ping, EpiPing, DGelu>>{}, bwd,
              "CUTLASS ping 128x128 2x1", dy, W2, dgelu);

  const char* fwd = "act = gelu(x.W1), pre saved";
  add(fwd, "cuBLASLt GELU_AUX", cublaslt_best(lt, s, R, F, d, x, W1, false, ref,
                                             EPILOGUE_GELU_AUX, aux_ref), "");
  cutlass_row(template_tag<CutlassGemm<T128x256, C1, Coop, EpiCoop, GeluAux>>{}, fwd,
              "CUTLASS coop 128x256", x, W1t, gelu_aux, aux_ref);
  cutlass_row(template_tag<CutlassGemm<T128x128, C1, Ping, EpiPing, GeluAux>>{}, fwd,
              "CUTLASS ping 128x128", x, W1t, gelu_aux, aux_ref);

  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("MLP epilogue GEMMs at R=%d d=%d F=%d, bf16, %s: us a call (10 calls in a graph, "
              "median of 7)\n", R, d, F, prop.name);
  std::printf("%-28s %-26s %8s %8s  %s\n", "problem", "implementation", "us", "TFLOP/s", "output");
  for (const Row& r : rows) {
    if (std::isnan(r.us))
      std::printf("%-28s %-26s %8s %8s  refused by CUTLASS or failed at its first launch\n",
                  r.problem.c_str(), r.impl.c_str(), "-", "-");
    else
      std::printf("%-28s %-26s %8.1f %8.0f  %s\n", r.problem.c_str(), r.impl.c_str(), r.us,
                  r.tflops, r.note.c_str());
  }
  return 0;
}
