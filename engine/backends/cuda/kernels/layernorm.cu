// Layer normalisation (DESIGN §3 `layernorm_fwd` / `layernorm_bwd`), eps 1e-5, one warp per row.
#include "common.cuh"

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
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= R) return;
    const act_t* xr = x + (long)r * d;
    float s = 0.0f;
    for (int c = lane; c < d; c += 32) s += to_f(xr[c]);
    const float mu = warp_sum(s) / d;
    float ss = 0.0f;
    for (int c = lane; c < d; c += 32) {
        const float z = to_f(xr[c]) - mu;
        ss += z * z;
    }
    const float rs = rsqrtf(warp_sum(ss) / d + 1e-5f);
    act_t* o = out + (long)r * d;
    for (int c = lane; c < d; c += 32) o[c] = to_act((to_f(xr[c]) - mu) * rs * gamma[c] + beta[c]);
    if (lane == 0) {
        mean[r] = mu;
        rstd[r] = rs;
    }
}

#define LN_MAXV 4  // 16-byte vectors cached per lane: rows up to 32*VEC*LN_MAXV elements

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
// dx += that instead: numpy's next call in model.py, ops.residual_add_bwd (`dx += dout`, the skip
// path's gradient), fused in, so one residual-gradient buffer runs down the layers.
// Fast path: the row's dout and x are read once, as 16-byte vectors kept in registers.
extern "C" __global__ void k_layernorm_bwd(act_t* dx, const act_t* dout, const act_t* x,
                                           const float* mean, const float* rstd,
                                           const float* gamma, int R, int d, int accumulate) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= R) return;
    const act_t* xr = x + (long)r * d;
    const act_t* g = dout + (long)r * d;
    act_t* o = dx + (long)r * d;
    const float mu = mean[r], rs = rstd[r];
    if (d % VEC == 0 && d <= 32 * VEC * LN_MAXV && aligned16(dx) && aligned16(dout) &&
        aligned16(x)) {
        Vec gv[LN_MAXV], xv[LN_MAXV];
        float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
        for (int k = 0; k < LN_MAXV; k++) {
            const int c = (k * 32 + lane) * VEC;
            if (c < d) {
                gv[k] = load_vec(g + c);
                xv[k] = load_vec(xr + c);
#pragma unroll
                for (int i = 0; i < VEC; i++) {
                    const float dn = to_f(gv[k][i]) * gamma[c + i];
                    s1 += dn;
                    s2 += dn * (to_f(xv[k][i]) - mu) * rs;
                }
            }
        }
        const float m1 = warp_sum(s1) / d, m2 = warp_sum(s2) / d;
#pragma unroll
        for (int k = 0; k < LN_MAXV; k++) {
            const int c = (k * 32 + lane) * VEC;
            if (c < d) {
                Vec ov;
                if (accumulate) ov = load_vec(o + c);
#pragma unroll
                for (int i = 0; i < VEC; i++) {
                    const float dn = to_f(gv[k][i]) * gamma[c + i];
                    const float xh = (to_f(xv[k][i]) - mu) * rs;
                    const float v = rs * (dn - m1 - xh * m2);
                    ov[i] = to_act(accumulate ? to_f(ov[i]) + v : v);
                }
                store_vec(o + c, ov);
            }
        }
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
        o[c] = to_act(accumulate ? to_f(o[c]) + v : v);
    }
}

// numpy twin: ops.layernorm_bwd (dgamma and dbeta, first pass)
// >   dgamma += np.einsum("ij,ij->j", dout, xhat)
// >   dbeta += dout.sum(axis=0)
// Column sums in two fixed-order passes, no atomics: this one sums chunks of rows, then
// k_colsum_reduce adds the chunks (+=) into the gradients.
// Block (column tile, chunk): each thread owns one column and sums its chunk's rows in order.
// partial[chunk, c] = dgamma part, partial[chunk, d + c] = dbeta part (gamma and beta are
// adjacent in the flat gradient buffer, so one k_colsum_reduce over 2*d columns adds both).
extern "C" __global__ void k_layernorm_bwd_params(float* partial, const act_t* dout,
                                                  const act_t* x, const float* mean,
                                                  const float* rstd, int R, int d,
                                                  int rows_per_chunk) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int chunk = blockIdx.y;
    if (c >= d) return;
    const int r0 = chunk * rows_per_chunk;
    const int r1 = min(R, r0 + rows_per_chunk);
    float sg = 0.0f, sb = 0.0f;
    for (int r = r0; r < r1; r++) {
        const float g = to_f(dout[(long)r * d + c]);
        sg += g * (to_f(x[(long)r * d + c]) - mean[r]) * rstd[r];
        sb += g;
    }
    partial[(long)chunk * 2 * d + c] = sg;
    partial[(long)chunk * 2 * d + d + c] = sb;
}

// numpy twin: none — the second pass of k_layernorm_bwd_params' column sums (numpy sums all rows
// at once): dst[c] += sum over chunks of partial[chunk, c], chunks in order, into the float32
// dgamma, dbeta (adjacent in the flat gradient buffer).
extern "C" __global__ void k_colsum_reduce(float* dst, const float* partial, int nchunk, int n) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    float s = 0.0f;
    for (int k = 0; k < nchunk; k++) s += partial[(long)k * n + c];
    dst[c] += s;
}
