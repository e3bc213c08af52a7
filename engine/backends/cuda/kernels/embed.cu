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
extern "C" __global__ void k_embed_bwd(float* dwte, float* dwpe, const act_t* dx,
                                       const int* n_unique, const int* bucket_tok,
                                       const int* bucket_start, const int* rows, int B, int T,
                                       int d, int overwrite_pos) {
    const int R = B * T;
    if (blockIdx.x < R) {
        const int u = blockIdx.x;
        if (u >= n_unique[0]) return;
        const int v = bucket_tok[u], k0 = bucket_start[u], k1 = bucket_start[u + 1];
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            float s = 0.0f;
            for (int k = k0; k < k1; k++) s += to_f(dx[(long)rows[k] * d + c]);
            dwte[(long)v * d + c] += s;
        }
    } else {
        const int t = blockIdx.x - R;
        if (t >= T) return;
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            float s = 0.0f;
            for (int b = 0; b < B; b++) s += to_f(dx[((long)t * B + b) * d + c]);
            dwpe[(long)t * d + c] = overwrite_pos ? s : dwpe[(long)t * d + c] + s;
        }
    }
}
