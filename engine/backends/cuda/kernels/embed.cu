// Token + position embedding (DESIGN §3 `embed_fwd` / `embed_bwd`).
// Activations are stored time-major: row r = t*B + b (see backend.py for why).
#include "common.cuh"

// numpy twin: ops.embed_fwd
// >   np.take(wte, tokens, axis=0, out=out, mode="clip")
// >   out += wpe[:T]
// tokens [B, T] as given; x row r = t*B + b (time-major), rounded to act_t.
extern "C" __global__ void k_embed_fwd(act_t* x, const int* tokens, const float* wte,
                                       const float* wpe, int B, int T, int d) {
    const long n = (long)B * T * d;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        const long r = i / d;
        const int c = (int)(i - r * d);
        const int t = (int)(r / B), b = (int)(r - (long)t * B);
        const int tok = tokens[(long)b * T + t];
        x[i] = to_act(wte[(long)tok * d + c] + wpe[(long)t * d + c]);
    }
}

// numpy twin: ops.embed_fwd (one warp a row)
// >   np.take(wte, tokens, axis=0, out=out, mode="clip")
// >   out += wpe[:T]
// k_embed_fwd's values, the same bits (each element the same float add, then the same
// to_act), for rows of whole 16-byte vectors (d % VEC == 0, x 16-byte aligned; Ops.embed_fwd
// checks): a warp a row, each lane VEC columns at a time, so that a thread does no 64-bit
// division per element and the stores are 16 bytes wide.
extern "C" __global__ void k_embed_fwd_rows(act_t* x, const int* tokens, const float* wte,
                                            const float* wpe, int B, int T, int d) {
    const int lane = threadIdx.x & 31;
    const long r = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= (long)B * T) return;
    const int t = (int)(r / B), b = (int)(r - (long)t * B);
    const float* we = wte + (long)tokens[(long)b * T + t] * d;
    const float* pe = wpe + (long)t * d;
    act_t* o = x + r * d;
    for (int c = lane * VEC; c < d; c += 32 * VEC) {
        float a[VEC], p[VEC];
        load_floats(a, we + c);
        load_floats(p, pe + c);
        Vec v;
#pragma unroll
        for (int i = 0; i < VEC; i++) v[i] = to_act(a[i] + p[i]);
        store_vec(o + c, v);
    }
}

#define EMBED_BATCH 8  // rows whose loads a thread of k_embed_bwd issues before adding them
// k_embed_bwd: 3 blocks of 256 threads an SM, at most 80 registers (the vector path's batch of
// loads), no spills.
#define EMBED_BOUNDS __launch_bounds__(256, 3)

// Column sums of k_embed_bwd's vector path: VEC columns c.. of the n rows row(0..n-1) of dx,
// each column added in row order (the scalar path's order, so the same bits), EMBED_BATCH
// loads in flight before they are added (a common token's bucket holds hundreds of rows).
template <typename RowOf>
__device__ __forceinline__ void embed_vec_sums(float (&s)[VEC], const act_t* dx, int d, int c,
                                               int n, RowOf row) {
#pragma unroll
    for (int i = 0; i < VEC; i++) s[i] = 0.0f;
    for (int k = 0; k < n; k += EMBED_BATCH) {
        Vec v[EMBED_BATCH];
#pragma unroll
        for (int u = 0; u < EMBED_BATCH; u++)
            if (k + u < n) v[u] = load_vec(dx + (long)row(k + u) * d + c);
#pragma unroll
        for (int u = 0; u < EMBED_BATCH; u++) {
            if (k + u < n) {
#pragma unroll
                for (int i = 0; i < VEC; i++) s[i] += to_f(v[u][i]);
            }
        }
    }
}

// numpy twin: ops.embed_bwd
// >   for b in range(B):
// >       dwpe[:T] += dout[b]
// >   np.add.at(dwte, tokens.reshape(-1), dout.reshape(B * T, d))
// += into the float32 dwte and dwpe; numpy's dout is `dx` here (time-major rows). With
// overwrite_pos != 0, dwpe[t] = the sum instead (the fused step's first micro-batch writes its
// gradients rather than zeroing and adding; dwte is always added to: the loss wrote it first).
// No atomics: blocks [0, R) each own one distinct token id (bucket u of a stable sort of the
// rows by token, done on the host) and add its rows in ascending row order; blocks [R, R+T) each
// own one position t and add the B rows of that position in order. Same inputs -> same bits.
//   n_unique[0]        number of distinct tokens (blocks past it return)
//   bucket_tok[u]      the token id of bucket u
//   bucket_start[u]    first index into `rows` of bucket u (bucket_start[n_unique] == R)
//   rows[k]            row indices sorted by token, ascending within a token
extern "C" __global__ void EMBED_BOUNDS k_embed_bwd(float* dwte, float* dwpe, const act_t* dx,
                                                   const int* n_unique, const int* bucket_tok,
                                                   const int* bucket_start, const int* rows,
                                                   int B, int T, int d, int overwrite_pos) {
    const int R = B * T;
    // rows of whole 16-byte vectors: a thread takes VEC columns (embed_vec_sums), same bits
    const bool vec = d % VEC == 0 && aligned16(dx);
    if (blockIdx.x < R) {
        const int u = blockIdx.x;
        if (u >= n_unique[0]) return;
        const int v = bucket_tok[u], k0 = bucket_start[u], k1 = bucket_start[u + 1];
        if (vec) {
            for (int c = threadIdx.x * VEC; c < d; c += blockDim.x * VEC) {
                float s[VEC];
                embed_vec_sums(s, dx, d, c, k1 - k0, [&](int k) { return rows[k0 + k]; });
#pragma unroll
                for (int i = 0; i < VEC; i++) dwte[(long)v * d + c + i] += s[i];
            }
            return;
        }
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            float s = 0.0f;
            for (int k = k0; k < k1; k++) s += to_f(dx[(long)rows[k] * d + c]);
            dwte[(long)v * d + c] += s;
        }
    } else {
        const int t = blockIdx.x - R;
        if (t >= T) return;
        if (vec) {
            for (int c = threadIdx.x * VEC; c < d; c += blockDim.x * VEC) {
                float s[VEC];
                embed_vec_sums(s, dx, d, c, B, [&](int b) { return t * B + b; });
                float* w = dwpe + (long)t * d + c;
#pragma unroll
                for (int i = 0; i < VEC; i++) w[i] = overwrite_pos ? s[i] : w[i] + s[i];
            }
            return;
        }
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            float s = 0.0f;
            for (int b = 0; b < B; b++) s += to_f(dx[((long)t * B + b) * d + c]);
            dwpe[(long)t * d + c] = overwrite_pos ? s : dwpe[(long)t * d + c] + s;
        }
    }
}
