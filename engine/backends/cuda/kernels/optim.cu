// Gradient norm, clipping and AdamW over the flat fp32 buffers (DESIGN §3 utility kernels, §4),
// and the fused bf16 step's weight gradients kept in the compute precision (g_lp).
#include "common.cuh"

// The partial sum of squares of one block of the grid (see k_grad_norm_partial).
__device__ __forceinline__ float norm_partial(const float* g, long n, float gs, float* shared) {
    float s = 0.0f;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        const float x = g[i] * gs;
        s += x * x;
    }
    return block_sum(s, shared);
}

// The sum of n partials, thread i taking i, i + blockDim.x, ..., then the block tree: the
// second pass of k_grad_norm_partial and of k_grad_norm_ranges (k_grad_norm_final).
__device__ __forceinline__ float norm_final(const float* partials, int n, float* shared) {
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += __ldcg(partials + i);
    return sqrtf(block_sum(s, shared));
}

// numpy twin: ops.grad_norm_partial
// >   g = grads[j * block : (j + 1) * block]
// >   partials[j] = np.dot(g, g)
// numpy's partial j is a contiguous block of 65536 (float64); here partial blk is float and sums
// block blk's grid-stride share of the elements. gs: a gradient scale not yet applied to the
// buffer (CudaBackend.grad_scale defers it; numpy's grad_scale has already done `grads *= s`),
// so x = g*gs is rounded to float exactly as that pass would have stored it.
// Fixed grid and fixed per-thread order + fixed block tree: the same bits every run.
extern "C" __global__ void k_grad_norm_partial(float* partials, const float* g, long n,
                                               float gs) {
    __shared__ float shared[32];
    const float s = norm_partial(g, n, gs, shared);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// numpy twin: ops.grad_norm_final
// >   return float(np.sqrt(np.sum(partials)))
// One block, float sums in a fixed order; inf/nan propagate.
extern "C" __global__ void k_grad_norm_final(float* norm, const float* partials, int n) {
    __shared__ float shared[32];
    const float s = norm_final(partials, n, shared);
    if (threadIdx.x == 0) norm[0] = s;
}

// Four consecutive gradients as floats, in one load: a float4, or (the compute precision's
// g_lp) an Act4 of 8 bytes. p must be aligned for it (a multiple of 4 elements from a buffer
// of the memory plan, which aligns each to 256 bytes).
__device__ __forceinline__ void load4(float (&e)[4], const float* p) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    e[0] = v.x;
    e[1] = v.y;
    e[2] = v.z;
    e[3] = v.w;
}
#if ANDREA_ACT != 0
__device__ __forceinline__ void load4(float (&e)[4], const act_t* p) {
    const Act4 a = *reinterpret_cast<const Act4*>(p);
#pragma unroll
    for (int k = 0; k < 4; k++) e[k] = to_f(a.v[k]);
}
#endif

// The sum of the squares of g[0 .. n)·sc over this block's grid-stride share of the groups of
// four, then of the tail's elements (k_grad_norm_ranges).
template <typename G>
__device__ __forceinline__ float sum_squares(const G* g, long n, float sc) {
    const long nq = n / 4, stride = (long)gridDim.x * blockDim.x;
    float s = 0.0f;
    for (long q = blockIdx.x * (long)blockDim.x + threadIdx.x; q < nq; q += stride) {
        float e[4];
        load4(e, g + q * 4);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float x = e[k] * sc;
            s += x * x;
        }
    }
    for (long i = nq * 4 + blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += stride) {
        const float x = to_f(g[i]) * sc;
        s += x * x;
    }
    return s;
}

// numpy twin: ops.grad_norm_partial (over ranges of the flat buffer)
// >   g = grads[j * block : (j + 1) * block]
// >   partials[j] = np.dot(g, g)
// The fused backend's partials: range r = first + blockIdx.y is [cuts[r], cuts[r + 1]) (cuts
// int64, each range's begin a multiple of 4), and block (x, y) sums the squares of its
// grid-stride share of that range's groups of four (then of the tail's elements), into
// partials[r·gridDim.x + x]. A range's partials are the same bits whether it is launched alone
// (as the backward completes it: Network.backward) or with every other (grid.y = all
// ranges): the host-driven grad_norm and the one-graph step agree. gs as in
// k_grad_norm_partial, or gs_dev[0] when gs_dev is not null (the step's staged grad_mult).
// g_lp (may be null): the layers' weight gradients in the compute precision (the fused bf16
// step's, buffers.GRAD_LP_TENSORS), at the same flat indices as g; a range with kinds[r] != 0
// is read from there, as 8-byte groups of four (buffers.norm_ranges cuts the ranges where the
// kind changes). Then k_grad_norm_final over all ranges' partials, in order.
extern "C" __global__ void k_grad_norm_ranges(float* partials, const float* g, const act_t* g_lp,
                                              const long* cuts, const int* kinds, int first,
                                              float gs, const float* gs_dev) {
    __shared__ float shared[32];
    const int r = first + blockIdx.y;
    const long begin = cuts[r], n = cuts[r + 1] - begin;
    const float sc = gs_dev ? gs_dev[0] : gs;
    float s = g_lp && kinds[r] ? sum_squares(g_lp + begin, n, sc) : sum_squares(g + begin, n, sc);
    s = block_sum(s, shared);
    if (threadIdx.x == 0) partials[(long)r * gridDim.x + blockIdx.x] = s;
}

// numpy twin: none — numpy keeps every gradient in float (its ops run in one dtype). The fused
// bf16 step leaves the layers' weight gradients in g_lp (the compute precision, the flat layout
// of g); anything else that reads or adds to the gradients first has them written back here as
// floats (exact: every act_t is a float): g[i] = g_lp[i] over the ranges [cuts[r], cuts[r + 1])
// with kinds[r] != 0, r = first + blockIdx.y (the table of k_grad_norm_ranges).
extern "C" __global__ void k_grads_from_lp(float* g, const act_t* g_lp, const long* cuts,
                                           const int* kinds, int first) {
    const int r = first + blockIdx.y;
    if (!kinds[r]) return;
    for (long i = cuts[r] + blockIdx.x * (long)blockDim.x + threadIdx.x; i < cuts[r + 1];
         i += (long)gridDim.x * blockDim.x)
        g[i] = to_f(g_lp[i]);
}

// numpy twin: ops.grad_scale
// >   grads *= s
// The backend defers it when it can (CudaBackend.grad_scale): k_grad_norm_partial and k_adamw
// multiply by the pending scale as they read; this pass settles it before anything else reads
// or adds to the gradients.
extern "C" __global__ void k_grad_scale(float* g, long n, float s) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x)
        g[i] *= s;
}

// numpy twin: model.NumpyBackend.forward_backward
// >   self._grads += self._gsave
// A micro-batch's gradient formed on its own (separate=True) is added to the others' sum in one
// pass: gradient accumulation then adds whole micro-batch gradients, as an all-reduce does.
extern "C" __global__ void k_grad_add(float* g, const float* other, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x)
        g[i] = g[i] + other[i];
}

#define ADAMW_MAX_SEGS 1024
#define HP_MAX_NORM 8  // buffers.HP_FIELDS.index("max_norm")
#define UPD_GC 12      // k_step_clip's upd: HP_FIELDS (12 floats), then the clip factor,
#define UPD_SKIP 13    // then 1.0 when the step is skipped (buffers.UPD_WORDS = 14)
#define SEG_DECAY 1    // adamw_body's flags per tensor (seg_flag): bit 0 decay, bits 1-2 seg_qkv,
#define SEG_GLP 8      // bit 3: its gradient is read from g_lp

// Where the GEMM copy p_lp keeps the flat elements. A layer's W_Q, W_K, W_V are three [d,d]
// tensors one after the other from `base` (DESIGN §2); where the backend runs Q, K, V in rows
// (CudaBackend.qkv_rows), p_lp holds that 3d² range as one [d,3d] matrix W_QKV instead:
// W_j[r,c] at base + r·3d + j·d + c (j = 0, 1, 2: Q, K, V), so that one GEMM reads it
// (Ops.attn_qkv_fwd_rows, attn_qkv_bwd_rows). seg_qkv[s] (per tensor, like seg_decay) is j + 1
// for those tensors, 0 for every other (kept in place). buffers.lp_positions is the host's copy
// of this map; tests/test_qkv_rows.py compiles these functions for the host and compares.

// The segment s with starts[s] <= i < starts[s + 1] (starts[0] <= i < starts[nseg]).
__host__ __device__ __forceinline__ int seg_of(const long* starts, int nseg, long i) {
    int lo = 0, hi = nseg - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (starts[mid] <= i) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// p_lp's index of flat element i of a tensor that starts at `start` (qkv: its seg_qkv), and in
// col its column in W_j (the one division of a run: 32-bit, as d² < 2³¹, checked by the host).
__host__ __device__ __forceinline__ long lp_index(long i, long start, int qkv, int d, int* col) {
    *col = 0;
    if (qkv == 0) return i;
    const unsigned e = (unsigned)(i - start), r = e / (unsigned)d;
    const long j = qkv - 1;
    *col = (int)(e - r * (unsigned)d);
    return start + (long)r * 3 * d + j * (d - (long)d * d) + *col;
}

// p_lp's index of the flat element after the one at `at` (column col) of the same tensor: the
// next column, or the first of W_j's next row, 3d - (d - 1) elements on.
__host__ __device__ __forceinline__ long lp_next(long at, int qkv, int d, int* col) {
    if (qkv == 0 || ++*col < d) return at + 1;
    *col = 0;
    return at + 2L * d + 1;
}

// p_lp's index of flat element i of tensor s (flags: seg_flag's, per tensor), walking a run of
// consecutive elements: `at`, *seg and *col are the previous element's index, tensor and
// column (*seg = -1 at the start of a run). One lp_index per run (adamw_body's float4 group)
// and per tensor boundary inside it, then steps: the writes stay runs of d contiguous elements.
__host__ __device__ __forceinline__ long lp_walk(long i, int s, const long* starts,
                                                 const int* flags, int d, long at, int* seg,
                                                 int* col) {
    const int qkv = (flags[s] >> 1) & 3;  // bits 1-2 (seg_flag), not SEG_GLP's
    const bool fresh = *seg != s;
    *seg = s;
    return fresh ? lp_index(i, starts[s], qkv, d, col) : lp_next(at, qkv, d, col);
}

// Tensor s's flags for adamw_body: SEG_DECAY when it decays, seg_qkv << 1 (seg_qkv may be null:
// nothing permuted), SEG_GLP when seg_glp (may be null: none) says its gradient is in g_lp.
__host__ __device__ __forceinline__ int seg_flag(const int* seg_decay, const int* seg_qkv,
                                                 const int* seg_glp, int s) {
    return (seg_decay && seg_decay[s] ? SEG_DECAY : 0) | (seg_qkv ? seg_qkv[s] << 1 : 0) |
           (seg_glp && seg_glp[s] ? SEG_GLP : 0);
}

// The group's new values pa[0..3] rounded into p_lp at ats[0..3] (one value when !vec): one
// 4-wide store where the four places follow each other from a multiple of 4 (the common case:
// a layer's W_Q, W_K, W_V rows are d contiguous elements, d % 4 == 0 in the models), else one
// store each. The same values in the same places either way. p_lp itself must be aligned for
// an Act4 (Ops._check_lp checks it; the memory plan aligns every buffer to 256 bytes).
__device__ __forceinline__ void store_lp(act_t* p_lp, const long (&ats)[4], const float* pa,
                                         bool vec) {
    if (vec && (ats[0] & 3) == 0 && ats[1] == ats[0] + 1 && ats[2] == ats[0] + 2 &&
        ats[3] == ats[0] + 3) {
        Act4 o;
#pragma unroll
        for (int k = 0; k < 4; k++) o.v[k] = to_act(pa[k]);
        *reinterpret_cast<Act4*>(p_lp + ats[0]) = o;
        return;
    }
#pragma unroll
    for (int k = 0; k < 4; k++)
        if (k == 0 || vec) p_lp[ats[k]] = to_act(pa[k]);
}

// AdamW over elements [begin, end) of the flat buffers (begin a multiple of 4) with g·gm·gc
// as the gradient (each product rounded to float, as separate k_grad_scale passes would have
// stored it); the body of k_adamw and k_adamw_step. Each element's arithmetic is the same
// whichever range it falls in: a step split into ranges gives the bits of one launch. p_lp
// receives each new value where lp_walk says (seg_qkv, d: see lp_index). The gradient of a
// tensor that seg_glp names is read from g_lp (the compute precision, g's flat layout: the fused
// bf16 step's weight gradients), one 8-byte load for a group of four in one such tensor; g_lp
// and seg_glp null: every gradient from g.
__device__ __forceinline__ void adamw_body(float* p, act_t* p_lp, const float* g,
                                           const act_t* g_lp, float* m, float* v,
                                           const long* seg_start, const int* seg_decay,
                                           const int* seg_qkv, const int* seg_glp, int nseg,
                                           int d, long begin, long end, float lr, float b1,
                                           float b2, float eps, float wd, float bc1, float bc2,
                                           float gm, float gc) {
    __shared__ long starts[ADAMW_MAX_SEGS + 1];
    __shared__ int flags[ADAMW_MAX_SEGS];
    if (!g_lp) seg_glp = nullptr;
    for (int i = threadIdx.x; i <= nseg; i += blockDim.x) starts[i] = seg_start[i];
    for (int i = threadIdx.x; i < nseg; i += blockDim.x)
        flags[i] = seg_flag(seg_decay, seg_qkv, seg_glp, i);
    __syncthreads();
    const long n = end - begin;
    const long nq = n / 4;  // float4 groups; the tail (n % 4) goes element by element
    for (long q = blockIdx.x * (long)blockDim.x + threadIdx.x; q < nq + (n & 3);
         q += (long)gridDim.x * blockDim.x) {
        const bool vec = q < nq;
        const long i0 = begin + (vec ? q * 4 : nq * 4 + (q - nq));
        int lo = seg_of(starts, nseg, i0);
        long at = 0;  // where the group's elements go in p_lp (lp_walk)
        int seg = -1, col = 0;
        float4 g4, p4, m4, v4;
        // the group's gradients all in g_lp (one tensor, as where the tensors' sizes are
        // multiples of 4), all in g, or (a group across tensors of both kinds) element by element
        const bool lp0 = flags[lo] & SEG_GLP, one = i0 + 3 < starts[lo + 1];
        if (vec) {
            if (lp0 && one) {
                float e[4];
                load4(e, g_lp + i0);
                g4 = make_float4(e[0], e[1], e[2], e[3]);
            } else {
                g4 = *reinterpret_cast<const float4*>(g + i0);
            }
            p4 = *reinterpret_cast<const float4*>(p + i0);
            m4 = *reinterpret_cast<const float4*>(m + i0);
            v4 = *reinterpret_cast<const float4*>(v + i0);
        } else {
            g4.x = lp0 ? to_f(g_lp[i0]) : g[i0];
            p4.x = p[i0]; m4.x = m[i0]; v4.x = v[i0];
        }
        float* ga = &g4.x;
        float* pa = &p4.x;
        float* ma = &m4.x;
        float* va = &v4.x;
        long ats[4];  // the elements' places in p_lp
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (k > 0 && !vec) break;
            while (i0 + k >= starts[lo + 1]) lo++;  // a tensor boundary inside the group
            const float gr = vec && !one && (flags[lo] & SEG_GLP) ? to_f(g_lp[i0 + k]) : ga[k];
            const float gk = __fmul_rn(__fmul_rn(gr, gm), gc);
            const float mi = b1 * ma[k] + (1.0f - b1) * gk;
            const float vi = b2 * va[k] + (1.0f - b2) * gk * gk;
            const float pi = pa[k];
            ma[k] = mi;
            va[k] = vi;
            pa[k] = pi - lr * ((mi / bc1) / (sqrtf(vi / bc2) + eps) +
                               (flags[lo] & SEG_DECAY ? wd * pi : 0.0f));
            if (p_lp) ats[k] = at = lp_walk(i0 + k, lo, starts, flags, d, at, &seg, &col);
        }
        if (p_lp) store_lp(p_lp, ats, pa, vec);
        if (vec) {
            *reinterpret_cast<float4*>(p + i0) = p4;
            *reinterpret_cast<float4*>(m + i0) = m4;
            *reinterpret_cast<float4*>(v + i0) = v4;
        } else {
            p[i0] = p4.x; m[i0] = m4.x; v[i0] = v4.x;
        }
    }
}

// numpy twin: ops.adamw
// >   m = β1·m + (1-β1)·g;  v = β2·v + (1-β2)·g²;  m̂ = m/(1-β1ᵗ);  v̂ = v/(1-β2ᵗ);
// >   p -= lr·(m̂/(sqrt(v̂)+eps) + wd·p·decay)
// Here bc1 = 1-β1ᵗ, bc2 = 1-β2ᵗ and p -= lr·((m/bc1)/(sqrt(v/bc2)+eps) + wd·p·decay): the same
// formula, which numpy evaluates in another order (sqrt(v)·(1/sqrt(bc2)) + eps, then ·(1/bc1)).
// decay is per tensor: tensor i covers [seg_start[i], seg_start[i+1]) and decays (2-D tensors
// only) when seg_decay[i] != 0. Not in numpy, whose ops.adamw reads g as it is:
// - gs: a gradient scale (1/n_micro or the clip) that CudaBackend.grad_scale deferred; g*gs is
//   rounded to float exactly as a k_grad_scale pass (numpy: `grads *= s`) would have stored it,
//   and the pass over the gradients is saved (llm.c's way).
// - p_lp (may be null) receives the rounded low-precision copy of p that the GEMMs read, each
//   layer's W_Q, W_K, W_V side by side in rows where seg_qkv says so (lp_index; seg_qkv null:
//   every element in place, d unused): a layout of the GEMM copy, which numpy does not have.
// - g_lp, seg_glp (may be null): the tensors whose gradient is in g_lp (adamw_body).
// Four elements per thread (16-byte float loads).
extern "C" __global__ void k_adamw(float* p, act_t* p_lp, const float* g, const act_t* g_lp,
                                   float* m, float* v, const long* seg_start,
                                   const int* seg_decay, const int* seg_qkv, const int* seg_glp,
                                   int nseg, int d, long n, float lr, float b1, float b2,
                                   float eps, float wd, float bc1, float bc2, float gs) {
    adamw_body(p, p_lp, g, g_lp, m, v, seg_start, seg_decay, seg_qkv, seg_glp, nseg, d, 0, n,
               lr, b1, b2, eps, wd, bc1, bc2, gs, 1.0f);
}

// numpy twin: none — the trainer's clip and non-finite skip (engine/model/optim.py clip_scale,
// DESIGN §4) decided on the device for the fused step. After k_grad_norm_final, one thread: a norm
// that is not finite skips the step's update (skipped[0] = 1, and k_step_hp of the next step
// reads it); else the clip factor gc = max_norm/norm when norm > max_norm (else 1) goes to
// clip[0] for the step record (1 when skipped). upd receives what k_adamw_step needs, so that
// the update can run later, in the next step's graph, after the io block holds that step's
// values: the hyper-parameters hp (buffers.HP_FIELDS; hp[HP_MAX_NORM] is max_norm), then gc,
// then the skip flag.
extern "C" __global__ void k_step_clip(float* upd, const float* hp, const float* norm,
                                       float* clip, int* skipped) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const float nrm = norm[0], max_norm = hp[HP_MAX_NORM];
    const int skip = !isfinite(nrm);
    const float gc = skip ? 1.0f : nrm > max_norm ? max_norm / nrm : 1.0f;
    for (int i = 0; i < UPD_GC; i++) upd[i] = hp[i];
    upd[UPD_GC] = gc;
    upd[UPD_SKIP] = (float)skip;
    clip[0] = gc;
    skipped[0] = skip;
}

// numpy twin: ops.adamw (the update of DESIGN §4 as k_step_clip decided it, on the device)
// >   p -= lr·(m̂/(sqrt(v̂)+eps) + wd·p·decay)   (decay: 1 on 2-D tensors, 0 elsewhere; decoupled).
// The optimizer step inside the captured step graph, over elements [begin, end) (begin a
// multiple of 4): upd is k_step_clip's (lr, β1, β2, eps, wd, bc1, bc2, gm, max_norm, ..., gc,
// skip; gm = 1/(n_micro·loss_scale)). A skipped step writes nothing (the trainer counts and
// records the skip); else g·gm·gc is the gradient, rounded as the separate passes would round
// it. Split into ranges (one per layer), it runs in the next step's graph beside the forward.
// p_lp, seg_qkv, d: as in k_adamw (the permutation stays inside each layer's 3d² range, so a
// range that cuts a layer's W_Q, W_K, W_V writes its own elements' places, wherever they are);
// g_lp, seg_glp: as in k_adamw (the fused bf16 step's weight gradients).
extern "C" __global__ void k_adamw_step(float* p, act_t* p_lp, const float* g, const act_t* g_lp,
                                        float* m, float* v, const long* seg_start,
                                        const int* seg_decay, const int* seg_qkv,
                                        const int* seg_glp, int nseg, int d, long begin,
                                        long end, const float* upd) {
    if (upd[UPD_SKIP] != 0.0f) return;
    adamw_body(p, p_lp, g, g_lp, m, v, seg_start, seg_decay, seg_qkv, seg_glp, nseg, d, begin,
               end, upd[0], upd[1], upd[2], upd[3], upd[4], upd[5], upd[6], upd[7], upd[UPD_GC]);
}

// numpy twin: none — the host's Adam step count, kept right on the device when a step is
// queued before the one ahead of it has ended. The host stages bc1, bc2 (hp[5], hp[6]) for
// Adam's t as if that step applied, and bc1_alt, bc2_alt (hp[9], hp[10]) for t - 1; when it
// was skipped instead (skipped[0], from its k_step_clip), this step takes the alternatives.
// The first node of the fused step's graph; one thread.
extern "C" __global__ void k_step_hp(float* hp, const int* skipped) {
    if (threadIdx.x == 0 && blockIdx.x == 0 && hp[11] != 0.0f && skipped[0]) {
        hp[5] = hp[9];
        hp[6] = hp[10];
    }
}

// numpy twin: none — numpy computes in its one dtype and keeps no low-precision weights. This
// rounds (to nearest even) the float32 masters into the act_t copy the GEMMs read, at start and
// after load_params; k_adamw keeps the copy current after each update. seg_qkv (may be null:
// every element in place; seg_start, nseg and d are then not read): the tensors whose elements
// go where lp_index says (each layer's W_Q, W_K, W_V side by side in rows), the layout k_adamw
// writes. A thread per element: consecutive threads write runs of d consecutive elements.
extern "C" __global__ void k_params_to_lp(act_t* p_lp, const float* p, long n,
                                          const long* seg_start, const int* seg_qkv, int nseg,
                                          int d) {
    __shared__ long starts[ADAMW_MAX_SEGS + 1];
    __shared__ int qkv[ADAMW_MAX_SEGS];
    if (seg_qkv) {
        for (int i = threadIdx.x; i <= nseg; i += blockDim.x) starts[i] = seg_start[i];
        for (int i = threadIdx.x; i < nseg; i += blockDim.x) qkv[i] = seg_qkv[i];
    }
    __syncthreads();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        long at = i;
        if (seg_qkv) {
            const int s = seg_of(starts, nseg, i);
            int col;
            at = lp_index(i, starts[s], qkv[s], d, &col);
        }
        p_lp[at] = to_act(p[i]);
    }
}
