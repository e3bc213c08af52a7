// Causal scaled dot-product attention, the part between the cuBLAS GEMMs (DESIGN §3 `attn_fwd` /
// `attn_bwd`), one warp per query row.
//
// The GEMMs run per chunk of C query rows: queries [cC, (c+1)C) only need keys [0, (c+1)C), so
// S = scale·Q Kᵀ is computed (and P, dP, dS stored) for columns j < kend(tq) = min(T, (tq/C+1)·C)
// only: about (n+1)/2n of the full T×T work and bytes for n chunks. Entries j >= kend(tq) are
// never written or read.
#include "common.cuh"

__device__ __forceinline__ int key_end(int tq, int T, int C) { return min(T, (tq / C + 1) * C); }

// numpy twin: ops.attn_fwd (the softmax between its two matmuls)
// >   np.copyto(probs, -np.inf, where=_causal_mask(T))
// >   row_max = probs.max(axis=-1, keepdims=True)
// >   probs -= row_max
// >   np.exp(probs, out=probs)
// >   row_sum = probs.sum(axis=-1, keepdims=True)
// >   np.divide(1.0, row_sum, out=row_sum)
// >   probs *= row_sum
// S = Q Kᵀ/sqrt(hd) before and Y = P V after are cuBLAS GEMMs (Ops.attn_fwd); the 1/sqrt(hd)
// is the first GEMM's alpha. Row `row` = bh*T + tq sees keys 0..tq; P is 0 for tq < j < kend
// so the chunked P @ V is exact.
// P may alias S (each element is read, then written by the same lane).
// Fast path when rows are whole 16-byte vectors (T % VEC == 0): vector loads and stores.
extern "C" __global__ void k_attn_fwd(act_t* P, const act_t* S, int BH, int T, int C) {
    const int lane = threadIdx.x & 31;
    const long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= (long)BH * T) return;
    const int tq = (int)(row % T), kend = key_end(tq, T, C);
    const act_t* s = S + row * T;
    act_t* p = P + row * T;
    if (T % VEC == 0 && C % VEC == 0 && aligned16(P) && aligned16(S)) {
        const int nread = tq / VEC + 1, nwrite = kend / VEC;
        // one pass: running max and sum per lane (online softmax), then combined across lanes
        float mx = -INFINITY, sum = 0.0f;
        for (int v = lane; v < nread; v += 32) {
            const Vec x = load_vec(s + v * VEC);
#pragma unroll
            for (int i = 0; i < VEC; i++) {
                if (v * VEC + i > tq) break;
                const float z = to_f(x[i]);
                if (z > mx) {
                    sum = sum * __expf(mx - z) + 1.0f;
                    mx = z;
                } else {
                    sum += __expf(z - mx);
                }
            }
        }
        const float row_max = warp_max(mx);
        sum = sum > 0.0f ? sum * __expf(mx - row_max) : 0.0f;
        mx = row_max;
        const float inv = 1.0f / warp_sum(sum);
        for (int v = lane; v < nwrite; v += 32) {
            Vec x, y;
            x.raw = make_int4(0, 0, 0, 0);
            if (v < nread) x = load_vec(s + v * VEC);
#pragma unroll
            for (int i = 0; i < VEC; i++)
                y[i] = to_act(v * VEC + i <= tq ? __expf(to_f(x[i]) - mx) * inv : 0.0f);
            store_vec(p + v * VEC, y);
        }
        return;
    }
    float mx = -INFINITY;
    for (int j = lane; j <= tq; j += 32) mx = fmaxf(mx, to_f(s[j]));
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int j = lane; j <= tq; j += 32) sum += __expf(to_f(s[j]) - mx);
    const float inv = 1.0f / warp_sum(sum);
    for (int j = lane; j < kend; j += 32)
        p[j] = to_act(j <= tq ? __expf(to_f(s[j]) - mx) * inv : 0.0f);
}

// numpy twin: ops.attn_bwd (dS from dP and P, between its matmuls)
// >   row_dot = np.einsum("bhij,bhij->bhi", dprobs, probs)
// >   dprobs -= row_dot[..., None]
// >   dprobs *= probs
// numpy's next line, `dprobs *= scale`, is the alpha of the dQ and dK GEMMs (Ops.attn_bwd).
// dS may alias P or dP: each element is read and then written by the same lane.
extern "C" __global__ void k_attn_bwd(act_t* dS, const act_t* P, const act_t* dP, int BH, int T,
                                      int C) {
    const int lane = threadIdx.x & 31;
    const long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= (long)BH * T) return;
    const int tq = (int)(row % T), kend = key_end(tq, T, C);
    const act_t* p = P + row * T;
    const act_t* dp = dP + row * T;
    act_t* ds = dS + row * T;
    if (T % VEC == 0 && C % VEC == 0 && aligned16(dS) && aligned16(P) && aligned16(dP)) {
        const int nread = tq / VEC + 1, nwrite = kend / VEC;
        float dot = 0.0f;
        for (int v = lane; v < nread; v += 32) {
            const Vec a = load_vec(p + v * VEC), b = load_vec(dp + v * VEC);
#pragma unroll
            for (int i = 0; i < VEC; i++)
                if (v * VEC + i <= tq) dot += to_f(a[i]) * to_f(b[i]);
        }
        dot = warp_sum(dot);
        for (int v = lane; v < nwrite; v += 32) {
            Vec a, b, y;
            a.raw = b.raw = make_int4(0, 0, 0, 0);
            if (v < nread) {
                a = load_vec(p + v * VEC);
                b = load_vec(dp + v * VEC);
            }
#pragma unroll
            for (int i = 0; i < VEC; i++)
                y[i] = to_act(v * VEC + i <= tq ? to_f(a[i]) * (to_f(b[i]) - dot) : 0.0f);
            store_vec(ds + v * VEC, y);
        }
        return;
    }
    float dot = 0.0f;
    for (int j = lane; j <= tq; j += 32) dot += to_f(p[j]) * to_f(dp[j]);
    dot = warp_sum(dot);
    for (int j = lane; j < kend; j += 32)
        ds[j] = to_act(j <= tq ? to_f(p[j]) * (to_f(dp[j]) - dot) : 0.0f);
}
