// Residual connection (DESIGN §3 `residual_add` / `residual_add_bwd`).
// 16-byte vectors where the buffers allow it, scalars for the tail.
#include "common.cuh"

// numpy twin: ops.residual_add
// >   np.add(x, y, out=out)
// (x, y are a, b here.)
extern "C" __global__ void k_residual_add(act_t* out, const act_t* a, const act_t* b, long n) {
    const long i0 = blockIdx.x * (long)blockDim.x + threadIdx.x, step = (long)gridDim.x * blockDim.x;
    const long nv = (aligned16(out) && aligned16(a) && aligned16(b)) ? n / VEC : 0;
    for (long v = i0; v < nv; v += step) {
        const Vec x = load_vec(a + v * VEC), y = load_vec(b + v * VEC);
        Vec o;
#pragma unroll
        for (int k = 0; k < VEC; k++) o[k] = to_act(to_f(x[k]) + to_f(y[k]));
        store_vec(out + v * VEC, o);
    }
    for (long i = nv * VEC + i0; i < n; i += step) out[i] = to_act(to_f(a[i]) + to_f(b[i]));
}

// numpy twin: ops.residual_add_bwd
// >   dx += dout
// numpy adds into one buffer, dx (`da` here): the branch output's gradient is dout itself, which
// the caller hands to the branch. `db` is a second destination that no caller uses
// (Ops.residual_add_bwd passes null). The backend's step does not launch this kernel at all:
// k_layernorm_bwd with accumulate=1 does this add (see layernorm.cu).
extern "C" __global__ void k_residual_add_bwd(act_t* da, act_t* db, const act_t* dout, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        const float g = to_f(dout[i]);
        if (da) da[i] = to_act(to_f(da[i]) + g);
        if (db) db[i] = to_act(to_f(db[i]) + g);
    }
}
