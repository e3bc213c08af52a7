// Layer normalisation (DESIGN §3 `layernorm_fwd` / `layernorm_bwd`), eps 1e-5, one warp per row.
//
// Rows whose length is a whole number of 16-byte vectors (d % VEC == 0, d <= 32·VEC·MAXV)
// take the vector path: the row is read once, as vectors held in registers, MAXV of them a lane.
// Each row kernel comes twice: MAXV = LN_MAXV (rows up to 1024 bf16 elements) and, as
// `<name>_wide`, MAXV = LN_MAXV_WIDE (up to 2048), which holds twice the registers and is
// launched only for rows too long for the first (ops.py: ln_kernel); longer or unaligned rows
// take the scalar path, which reads the row from global memory. The forward's row functions
// are shared by k_layernorm_fwd and k_residual_layernorm_fwd, so the fused kernel gives the very
// bits of the unfused sequence it replaces (tests/gpu/test_fusions.py checks that).
#include "common.cuh"

#define LN_MAXV 4  // 16-byte vectors cached per lane: rows up to 32*VEC*LN_MAXV elements
#define LN_MAXV_WIDE 8  // the _wide kernels': rows up to 32*VEC*LN_MAXV_WIDE elements

template <int MAXV>
__device__ __forceinline__ bool ln_vector_row(int d) {
    return d % VEC == 0 && d <= 32 * VEC * MAXV;
}

// LayerNorm of one row held in registers (xv[k] = elements (k*32 + lane)*VEC ...), written to o;
// lane 0 stores mean and rstd. Sums run per lane over its vectors, then across the warp.
template <int MAXV>
__device__ __forceinline__ void ln_fwd_row(const Vec (&xv)[MAXV], act_t* o, float* mean,
                                           float* rstd, const float* gamma, const float* beta,
                                           int r, int d, int lane) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < MAXV; k++) {
        if ((k * 32 + lane) * VEC < d) {
#pragma unroll
            for (int i = 0; i < VEC; i++) s += to_f(xv[k][i]);
        }
    }
    const float mu = warp_sum(s) / d;
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < MAXV; k++) {
        if ((k * 32 + lane) * VEC < d) {
#pragma unroll
            for (int i = 0; i < VEC; i++) {
                const float z = to_f(xv[k][i]) - mu;
                ss += z * z;
            }
        }
    }
    const float rs = rsqrtf(warp_sum(ss) / d + 1e-5f);
    // every value first, then the stores: a load after a store to a pointer that may alias it
    // waits for that store, so stores in between would serialise the row's memory accesses
    Vec y[MAXV];
#pragma unroll
    for (int k = 0; k < MAXV; k++) {
        const int c = (k * 32 + lane) * VEC;
        if (c < d) {
            float gk[VEC], bk[VEC];
            load_floats(gk, gamma + c);
            load_floats(bk, beta + c);
#pragma unroll
            for (int i = 0; i < VEC; i++)
                y[k][i] = to_act((to_f(xv[k][i]) - mu) * rs * gk[i] + bk[i]);
        }
    }
#pragma unroll
    for (int k = 0; k < MAXV; k++) {
        const int c = (k * 32 + lane) * VEC;
        if (c < d) store_vec(o + c, y[k]);
    }
    if (lane == 0) {
        mean[r] = mu;
        rstd[r] = rs;
    }
}

// The scalar path: any d, any alignment; reads the row from global memory.
__device__ __forceinline__ void ln_fwd_row_scalar(const act_t* xr, act_t* o, float* mean,
                                                  float* rstd, const float* gamma,
                                                  const float* beta, int r, int d, int lane) {
    float s = 0.0f;
    for (int c = lane; c < d; c += 32) s += to_f(xr[c]);
    const float mu = warp_sum(s) / d;
    float ss = 0.0f;
    for (int c = lane; c < d; c += 32) {
        const float z = to_f(xr[c]) - mu;
        ss += z * z;
    }
    const float rs = rsqrtf(warp_sum(ss) / d + 1e-5f);
    for (int c = lane; c < d; c += 32) o[c] = to_act((to_f(xr[c]) - mu) * rs * gamma[c] + beta[c]);
    if (lane == 0) {
        mean[r] = mu;
        rstd[r] = rs;
    }
}

// The body of k_layernorm_fwd and k_layernorm_fwd_wide, with MAXV vectors a lane.
template <int MAXV>
__device__ __forceinline__ void layernorm_fwd(act_t* out, float* mean, float* rstd,
                                              const act_t* x, const float* gamma,
                                              const float* beta, int R, int d) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= R) return;
    const act_t* xr = x + (long)r * d;
    act_t* o = out + (long)r * d;
    if (ln_vector_row<MAXV>(d) && aligned16(x) && aligned16(out)) {
        Vec xv[MAXV];
#pragma unroll
        for (int k = 0; k < MAXV; k++) {
            const int c = (k * 32 + lane) * VEC;
            if (c < d) xv[k] = load_vec(xr + c);
        }
        ln_fwd_row<MAXV>(xv, o, mean, rstd, gamma, beta, r, d, lane);
        return;
    }
    ln_fwd_row_scalar(xr, o, mean, rstd, gamma, beta, r, d, lane);
}

// numpy twin: ops.layernorm_fwd
// >   np.mean(x, axis=1, out=mean)
// >   np.subtract(x, mean[:, None], out=out)
// >   var = np.einsum("ij,ij->i", out, out)  # [N] row sums of squares
// >   var *= 1.0 / d
// >   var += LN_EPS
// >   np.sqrt(var, out=var)
// >   np.divide(1.0, var, out=rstd)
// >   out *= rstd[:, None]
// >   out *= gamma
// >   out += beta
// Here rstd = rsqrtf(var/d + 1e-5) in one step; mean and rstd are saved as float.
extern "C" __global__ void k_layernorm_fwd(act_t* out, float* mean, float* rstd, const act_t* x,
                                           const float* gamma, const float* beta, int R, int d) {
    layernorm_fwd<LN_MAXV>(out, mean, rstd, x, gamma, beta, R, d);
}

// numpy twin: ops.layernorm_fwd — k_layernorm_fwd for rows up to 32·VEC·LN_MAXV_WIDE elements
// >   out += beta
extern "C" __global__ void k_layernorm_fwd_wide(act_t* out, float* mean, float* rstd,
                                                const act_t* x, const float* gamma,
                                                const float* beta, int R, int d) {
    layernorm_fwd<LN_MAXV_WIDE>(out, mean, rstd, x, gamma, beta, R, d);
}

// The body of k_residual_layernorm_fwd and k_residual_layernorm_fwd_wide, MAXV vectors a lane.
template <int MAXV>
__device__ __forceinline__ void residual_layernorm_fwd(act_t* xsum, act_t* out, float* mean,
                                                       float* rstd, const act_t* a,
                                                       const act_t* b, const float* gamma,
                                                       const float* beta, int R, int d) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= R) return;
    const long base = (long)r * d;
    if (ln_vector_row<MAXV>(d) && aligned16(xsum) && aligned16(out) && aligned16(a) &&
        aligned16(b)) {
        Vec xv[MAXV], bv[MAXV];
#pragma unroll
        for (int k = 0; k < MAXV; k++) {  // the whole row's loads first (see ln_fwd_row)
            const int c = (k * 32 + lane) * VEC;
            if (c < d) {
                xv[k] = load_vec(a + base + c);
                bv[k] = load_vec(b + base + c);
            }
        }
#pragma unroll
        for (int k = 0; k < MAXV; k++) {
            const int c = (k * 32 + lane) * VEC;
            if (c < d) {
#pragma unroll
                for (int i = 0; i < VEC; i++) xv[k][i] = to_act(to_f(xv[k][i]) + to_f(bv[k][i]));
                store_vec(xsum + base + c, xv[k]);
            }
        }
        ln_fwd_row<MAXV>(xv, out + base, mean, rstd, gamma, beta, r, d, lane);
        return;
    }
    for (int c = lane; c < d; c += 32) xsum[base + c] = to_act(to_f(a[base + c]) + to_f(b[base + c]));
    __syncwarp();  // the row's sums are read back by other lanes of this warp
    ln_fwd_row_scalar(xsum + base, out + base, mean, rstd, gamma, beta, r, d, lane);
}

// numpy twin: model.NumpyBackend._trunk (a residual_add and the LayerNorm after it, fused)
// >   ops.residual_add(x(i), proj, xmid)
// >   ops.layernorm_fwd(xmid, p[h + "ln2.gamma"], p[h + "ln2.beta"], ln2,
// >   ops.residual_add(xmid, proj, x(i + 1))
// xsum = a + b (rounded to act_t: the residual stream, saved), then out = LayerNorm(xsum) from
// the rounded values, with k_layernorm_fwd's row functions: the bits of k_residual_add followed
// by k_layernorm_fwd, in one pass and one launch. Used for ln2 (a = x[l], b = attention branch)
// and for the next layer's ln1 or lnf (a = xmid, b = MLP branch).
extern "C" __global__ void k_residual_layernorm_fwd(act_t* xsum, act_t* out, float* mean,
                                                    float* rstd, const act_t* a, const act_t* b,
                                                    const float* gamma, const float* beta, int R,
                                                    int d) {
    residual_layernorm_fwd<LN_MAXV>(xsum, out, mean, rstd, a, b, gamma, beta, R, d);
}

// numpy twin: model.NumpyBackend._trunk — k_residual_layernorm_fwd for rows up to
// 32·VEC·LN_MAXV_WIDE elements
// >   ops.residual_add(xmid, proj, x(i + 1))
extern "C" __global__ void k_residual_layernorm_fwd_wide(act_t* xsum, act_t* out, float* mean,
                                                         float* rstd, const act_t* a,
                                                         const act_t* b, const float* gamma,
                                                         const float* beta, int R, int d) {
    residual_layernorm_fwd<LN_MAXV_WIDE>(xsum, out, mean, rstd, a, b, gamma, beta, R, d);
}

// One row's inputs of the backward, held in registers: dout (g), x and, when accumulating,
// the residual gradient (o, whose registers then receive dx).
template <int MAXV>
struct LnBwdRow {
    Vec g[MAXV], x[MAXV], o[MAXV];
};

// The whole row's loads, issued together (see ln_fwd_row).
template <int MAXV>
__device__ __forceinline__ void ln_bwd_load(LnBwdRow<MAXV>& in, const act_t* res,
                                            const act_t* g, const act_t* xr, int d, int lane,
                                            int accumulate) {
#pragma unroll
    for (int k = 0; k < MAXV; k++) {
        const int c = (k * 32 + lane) * VEC;
        if (c < d) {
            in.g[k] = load_vec(g + c);
            in.x[k] = load_vec(xr + c);
            if (accumulate) in.o[k] = load_vec(res + c);
        }
    }
}

// dx of one row loaded by ln_bwd_load: dx = rstd·(g - mean(g) - x̂·mean(g·x̂)), g = dout·γ; with
// accumulate, dx = resid + that (resid may be dx itself), stored to o. Every operation is
// explicitly rounded (no fused multiply-add), so no build contracts it differently.
template <int MAXV>
__device__ __forceinline__ void ln_bwd_finish(LnBwdRow<MAXV>& in, act_t* o, float mu, float rs,
                                              const float* gamma, int d, int lane,
                                              int accumulate) {
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int k = 0; k < MAXV; k++) {
        const int c = (k * 32 + lane) * VEC;
        if (c < d) {
            float gk[VEC];
            load_floats(gk, gamma + c);
#pragma unroll
            for (int i = 0; i < VEC; i++) {
                const float gi = to_f(in.g[k][i]);
                const float xc = __fsub_rn(to_f(in.x[k][i]), mu);
                const float dn = __fmul_rn(gi, gk[i]);
                s1 = __fadd_rn(s1, dn);
                s2 = __fadd_rn(s2, __fmul_rn(__fmul_rn(dn, xc), rs));
            }
        }
    }
    const float m1 = warp_sum(s1) / d, m2 = warp_sum(s2) / d;
#pragma unroll
    for (int k = 0; k < MAXV; k++) {
        const int c = (k * 32 + lane) * VEC;
        if (c < d) {
            float gk[VEC];
            load_floats(gk, gamma + c);
#pragma unroll
            for (int i = 0; i < VEC; i++) {
                const float dn = __fmul_rn(to_f(in.g[k][i]), gk[i]);
                const float xh = __fmul_rn(__fsub_rn(to_f(in.x[k][i]), mu), rs);
                const float v = __fmul_rn(rs, __fsub_rn(__fsub_rn(dn, m1), __fmul_rn(xh, m2)));
                in.o[k][i] = to_act(accumulate ? __fadd_rn(to_f(in.o[k][i]), v) : v);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < MAXV; k++) {
        const int c = (k * 32 + lane) * VEC;
        if (c < d) store_vec(o + c, in.o[k]);
    }
}

// The body of k_layernorm_bwd and k_layernorm_bwd_wide, with MAXV vectors a lane.
template <int MAXV>
__device__ __forceinline__ void layernorm_bwd(act_t* dx, const act_t* resid, const act_t* dout,
                                              const act_t* x, const float* mean,
                                              const float* rstd, const float* gamma, int R, int d,
                                              int accumulate) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= R) return;
    const act_t* xr = x + (long)r * d;
    const act_t* g = dout + (long)r * d;
    act_t* o = dx + (long)r * d;
    const act_t* res = resid ? resid + (long)r * d : o;
    const float mu = mean[r], rs = rstd[r];
    if (ln_vector_row<MAXV>(d) && aligned16(dx) && aligned16(res) && aligned16(dout) &&
        aligned16(x)) {
        LnBwdRow<MAXV> in;
        ln_bwd_load(in, res, g, xr, d, lane, accumulate);
        ln_bwd_finish(in, o, mu, rs, gamma, d, lane, accumulate);
        return;
    }
    float s1 = 0.0f, s2 = 0.0f;  // general rows: two passes over global memory
    for (int c = lane; c < d; c += 32) {
        const float dn = to_f(g[c]) * gamma[c];
        s1 += dn;
        s2 += dn * (to_f(xr[c]) - mu) * rs;
    }
    const float m1 = warp_sum(s1) / d, m2 = warp_sum(s2) / d;
    for (int c = lane; c < d; c += 32) {
        const float dn = to_f(g[c]) * gamma[c];
        const float xh = (to_f(xr[c]) - mu) * rs;
        const float v = rs * (dn - m1 - xh * m2);
        o[c] = to_act(accumulate ? to_f(res[c]) + v : v);
    }
}

// numpy twin: ops.layernorm_bwd (dx; dgamma and dbeta are k_layernorm_bwd_params')
// >   np.subtract(x, mean[:, None], out=xhat)
// >   xhat *= rstd[:, None]
// >   np.multiply(dout, gamma, out=dx)  # g
// >   mean_g = dx.mean(axis=1)
// >   mean_gx = np.einsum("ij,ij->i", dx, xhat)
// >   mean_gx *= 1.0 / d
// >   xhat *= mean_gx[:, None]
// >   dx -= xhat
// >   dx -= mean_g[:, None]
// >   dx *= rstd[:, None]
// That is dx = rstd·(g - mean(g) - x̂·mean(g·x̂)), overwritten. With accumulate != 0 it is
// dx = resid + that instead: numpy's next call in model.py, ops.residual_add_bwd (`dx += dout`,
// the skip path's gradient), fused in; resid may be dx itself (in place) or the buffer of the
// previous residual gradient (the backend's ring, so a second stream may still read it).
// Fast path: the row's dout and x are read once, as 16-byte vectors kept in registers.
extern "C" __global__ void k_layernorm_bwd(act_t* dx, const act_t* resid, const act_t* dout,
                                           const act_t* x, const float* mean, const float* rstd,
                                           const float* gamma, int R, int d, int accumulate) {
    layernorm_bwd<LN_MAXV>(dx, resid, dout, x, mean, rstd, gamma, R, d, accumulate);
}

// numpy twin: ops.layernorm_bwd — k_layernorm_bwd for rows up to 32·VEC·LN_MAXV_WIDE elements
// >   dx *= rstd[:, None]
extern "C" __global__ void k_layernorm_bwd_wide(act_t* dx, const act_t* resid, const act_t* dout,
                                                const act_t* x, const float* mean,
                                                const float* rstd, const float* gamma, int R,
                                                int d, int accumulate) {
    layernorm_bwd<LN_MAXV_WIDE>(dx, resid, dout, x, mean, rstd, gamma, R, d, accumulate);
}

#define LN_PARAMS_GROUPS 8  // row groups of k_layernorm_bwd_params' block (blockDim.x / 32)

// numpy twin: ops.layernorm_bwd (dgamma and dbeta, first pass)
// >   dgamma += np.einsum("ij,ij->j", dout, xhat)
// >   dbeta += dout.sum(axis=0)
// Column sums in two fixed-order passes, no atomics: this one sums chunks of rows, then
// k_colsum_reduce adds the chunks (+=) into the gradients.
// Block (column tile, chunk), 32 x LN_PARAMS_GROUPS threads: lane x owns VEC adjacent columns
// of the tile (one 16-byte vector per row where d % VEC == 0 and dout, x are aligned, else VEC
// scalars: the same sums), warp y the chunk's rows y, y + G, y + 2G, ... (G = LN_PARAMS_GROUPS),
// all of its rows loaded before they are added, so that enough bytes are in flight to reach
// the memory's bandwidth. The warps' sums are added in warp order through shared memory.
// partial[chunk, c] = dgamma part, partial[chunk, d + c] = dbeta part (gamma and beta are
// adjacent in the flat gradient buffer, so one k_colsum_reduce over 2*d columns adds both).
// Explicitly rounded operations (no fused multiply-add). rows_per_chunk <= 8·G.
extern "C" __global__ void k_layernorm_bwd_params(float* partial, const act_t* dout,
                                                  const act_t* x, const float* mean,
                                                  const float* rstd, int R, int d,
                                                  int rows_per_chunk) {
    __shared__ float sm[LN_PARAMS_GROUPS][2][32 * VEC];
    const int lane = threadIdx.x & 31, y = threadIdx.x >> 5;
    const int c0 = (blockIdx.x * 32 + lane) * VEC;
    const int chunk = blockIdx.y;
    const int r0 = chunk * rows_per_chunk, r1 = min(R, r0 + rows_per_chunk);
    const bool vec = d % VEC == 0 && aligned16(dout) && aligned16(x);
    constexpr int PER = 8;  // rows per warp: rows_per_chunk / LN_PARAMS_GROUPS at most
    Vec gv[PER], xv[PER];
    float mu[PER], rs[PER];
#pragma unroll
    for (int u = 0; u < PER; u++) {
        const int r = r0 + y + u * LN_PARAMS_GROUPS;
        if (r < r1 && c0 < d) {
            const long at = (long)r * d + c0;
            if (vec) {
                gv[u] = load_vec(dout + at);
                xv[u] = load_vec(x + at);
            } else {
#pragma unroll
                for (int i = 0; i < VEC; i++) {
                    gv[u][i] = c0 + i < d ? dout[at + i] : to_act(0.0f);
                    xv[u][i] = c0 + i < d ? x[at + i] : to_act(0.0f);
                }
            }
            mu[u] = mean[r];
            rs[u] = rstd[r];
        }
    }
    float sg[VEC], sb[VEC];
#pragma unroll
    for (int i = 0; i < VEC; i++) sg[i] = sb[i] = 0.0f;
#pragma unroll
    for (int u = 0; u < PER; u++) {
        if (r0 + y + u * LN_PARAMS_GROUPS < r1 && c0 < d) {
#pragma unroll
            for (int i = 0; i < VEC; i++) {
                const float g = to_f(gv[u][i]);
                const float p = __fmul_rn(__fmul_rn(g, __fsub_rn(to_f(xv[u][i]), mu[u])), rs[u]);
                sg[i] = __fadd_rn(sg[i], p);
                sb[i] = __fadd_rn(sb[i], g);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < VEC; i++) {
        sm[y][0][lane * VEC + i] = sg[i];
        sm[y][1][lane * VEC + i] = sb[i];
    }
    __syncthreads();
    // 2 x 32·VEC sums per block, each over the warps in order: thread t takes sums t, t + 256
    for (int k = threadIdx.x; k < 2 * 32 * VEC; k += blockDim.x) {
        const int which = k / (32 * VEC), j = k % (32 * VEC);
        const int c = blockIdx.x * 32 * VEC + j;
        if (c >= d) continue;
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < LN_PARAMS_GROUPS; w++) s = __fadd_rn(s, sm[w][which][j]);
        partial[(long)chunk * 2 * d + which * d + c] = s;
    }
}

// numpy twin: none — the second pass of k_layernorm_bwd_params' column sums (numpy sums all rows
// at once): dst[c] += sum over chunks of partial[chunk, c], chunks in order, into the float32
// dgamma, dbeta (adjacent in the flat gradient buffer); dst[c] = that sum when overwrite != 0
// (the fused step's first micro-batch writes its gradients instead of zeroing then adding).
extern "C" __global__ void k_colsum_reduce(float* dst, const float* partial, int nchunk, int n,
                                           int overwrite) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    float s = 0.0f;
    for (int k = 0; k < nchunk; k++) s = __fadd_rn(s, partial[(long)k * n + c]);
    dst[c] = overwrite ? s : __fadd_rn(dst[c], s);
}
