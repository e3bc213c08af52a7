"""The op twins on the GPU: each method mirrors the numpy function of the same name in
`engine/backends/numpy/ops.py`, on raw device pointers, with cuBLAS/cuBLASLt doing the GEMMs.

Differences from the numpy twins, all of layout, fusion or rounding, never of math:
- Activations are time-major: row r = t*B + b (numpy: b*T + t). Then the Q, K, V of head h of
  sequence b are one strided view (offset (b*H + h)*hd, row stride B*d), so attention is a
  single strided-batched GEMM over B*H with no permute kernels (and cuDNN reads them in place).
- Q, K, V in rows (CudaBuild.qkv_rows, with cuDNN): `attn_qkv_fwd_rows` writes them side by
  side in each row of qkv ([R,3d], numpy: [3,R,d]) with one GEMM over W_QKV = [W_Q | W_K | W_V]
  [d,3d], which the GEMM copy of the weights holds in that layout (kernels/optim.cu lp_index:
  numpy has no low-precision copy, and its flat masters keep the three [d,d] one after the
  other); cuDNN reads Q, K, V and writes dQ, dK, dV in rows; `attn_qkv_bwd_rows` takes them.
- `layernorm_bwd` can accumulate into dx (the skip path's `residual_add_bwd` fused in).
- `attn_bwd` writes dS over the saved probabilities (they are not needed after the backward).
- `loss_fwd` keeps float logits and the log-sum-exp; `loss_bwd` writes dlogits separately.
Backward ops accumulate (+=) into float32 parameter gradients, like numpy's.

The fused step (CudaBackend with fusions on) adds, each next to the unfused ops it replaces and
with their bits: `residual_layernorm_fwd` (residual_add + layernorm_fwd), `loss_fwd_bwd` (the
loss and dlogits in one pass), and among the optimizer's kernels (optim_ops.py)
`grad_norm_ranges` (the norm's partials range by range, as the backward completes them),
`step_clip` (clip and non-finite skip on the device) and `adamw_step` (AdamW over a range, as
step_clip decided). GEMMs then go through gemm.LtGemm (algorithms chosen by timing, GELU
epilogue or kernel chosen per shape), and the weight-gradient GEMMs and the LayerNorm parameter
sums run on a second stream (`side`): see launch.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from engine.backends.cuda.cublas import Cublas
from engine.backends.cuda.cublaslt import EPILOGUE_DGELU, EPILOGUE_GELU_AUX, OP_N, OP_T, CublasLt
from engine.backends.cuda.gemm import LtGemm, time_interleaved
from engine.backends.cuda.launch import ROWS_PER_BLOCK, THREADS, VEC_BYTES, blocks
from engine.backends.cuda.optim_ops import OptimizerOps
from engine.config import GpuConfig
from engine.errors import RunError

# k_layernorm_bwd's block (a warp a row): at 72 registers a thread, blocks of 128 fit 7 an SM
# (28 warps, against 24 in blocks of 256) and retire sooner beside the weight-gradient stream's
# GEMMs (faster alone on the H200; in the whole step within the spread between runs)
LN_BWD_THREADS = 128
# kernels/layernorm.cu: the 16-byte vectors of a row each lane of a row's warp holds in
# registers, in the row kernels (LN_MAXV) and in their _wide twins (LN_MAXV_WIDE)
LN_ROW_VECS, LN_ROW_VECS_WIDE = 4, 8
LN_ROWS_PER_CHUNK = 64  # rows per column-sum chunk of the LayerNorm backward's parameter sums
LN_PARAMS_ROWS = 64  # the most k_layernorm_bwd_params takes per chunk (8 per warp, 8 warps)
# classic attention's queries per causal chunk (the config's gpu.attention_chunk: the chunks are
# its GEMMs' shapes, so its bits)
ATTN_CHUNK = GpuConfig().attention_chunk
LOSS_ROW_MAX = 5 * 8 * THREADS  # kernels/loss.cu: a row held in registers (LOSS_OCTETS octets)


class Ops(OptimizerOps):
    """The op twins for one compute precision, on Launcher's kernels, GEMMs and streams (and
    OptimizerOps' optimizer kernels).

    `cudnn`: a cudnn_attn.CudnnAttention for attn_fwd_cudnn / attn_bwd_cudnn, with `cudnn_ws`
    its workspace; `flex`: a flex_attn.FlexAttention that attn_bwd_cudnn runs instead of cuDNN's
    backward where it fits the shape (gpu.flex_backward; None: cuDNN's).
    """

    def __init__(self, kernels: dict[str, Any], blas: Cublas | None, stream: Any, precision: str,
                 lt: CublasLt | None = None, *, gemm: LtGemm | None = None, ws: int = 0,
                 side: Any = None, ws2: int = 0, cudnn: Any = None, cudnn_ws: int = 0,
                 event: Callable[[], Any] | None = None, attn_chunk: int = ATTN_CHUNK) -> None:
        super().__init__(kernels, blas, stream, precision, lt, gemm=gemm, ws=ws, side=side,
                         ws2=ws2, event=event)
        self.cudnn, self.cudnn_ws = cudnn, cudnn_ws
        self.flex: Any = None  # set by the backend once its buffers are bound (flex_attn.py)
        self.fused_gelu_calls = 0  # how often the epilogue path ran (tests check it is used)
        self.attn_chunk = attn_chunk  # classic attention's causal chunk (queries)
        self.ln_rows = LN_ROWS_PER_CHUNK  # chunk rows of the LayerNorm backward's sums

    # --- embedding -------------------------------------------------------------------------------
    def embed_fwd(self, tokens: int, wte: int, wpe: int, out: int, B: int, T: int, d: int) -> None:
        """out = wte[tokens] + wpe (time-major rows): a warp a row in 16-byte vectors where the
        rows are whole vectors (k_embed_fwd_rows), else an element a thread; the same bits."""
        if d % (VEC_BYTES // self.esize) == 0 and out % VEC_BYTES == 0:
            self._go("k_embed_fwd_rows", -(-B * T // ROWS_PER_BLOCK), out, tokens, wte, wpe, B,
                     T, d)
            return
        self._go("k_embed_fwd", blocks(B * T * d), out, tokens, wte, wpe, B, T, d)

    def embed_bwd(self, dout: int, buckets: tuple[int, int, int, int], dwte: int, dwpe: int,
                  B: int, T: int, d: int) -> None:
        """buckets = device pointers (n_unique, bucket_tok, bucket_start, rows) from
        `token_buckets`; grid: one block per possible bucket, then one per position."""
        n_unique, tok, start, rows = buckets
        self._writes(dwte)  # the loss's dwte GEMM may still run on the side stream
        self._go("k_embed_bwd", B * T + T, dwte, dwpe, dout, n_unique, tok, start, rows, B, T, d,
                 int(self.overwrite_grads))

    # --- layer normalisation ---------------------------------------------------------------------
    def ln_kernel(self, name: str, d: int) -> str:
        """The LayerNorm row kernel `name` for rows of d elements: its _wide twin where a row is
        too long for the kernel's registers but fits the twin's (kernels/layernorm.cu)."""
        row = d * self.esize
        return (f"{name}_wide" if 32 * VEC_BYTES * LN_ROW_VECS < row <= 32 * VEC_BYTES
                * LN_ROW_VECS_WIDE else name)

    def layernorm_fwd(self, x: int, gamma: int, beta: int, out: int, mean: int, rstd: int,
                      R: int, d: int) -> None:
        self._go(self.ln_kernel("k_layernorm_fwd", d), -(-R // ROWS_PER_BLOCK), out, mean, rstd,
                 x, gamma, beta, R, d)

    def residual_layernorm_fwd(self, a: int, b: int, xsum: int, gamma: int, beta: int, out: int,
                               mean: int, rstd: int, R: int, d: int) -> None:
        """xsum = a + b (residual_add), out = layernorm(xsum): one kernel, the same bits."""
        self._go(self.ln_kernel("k_residual_layernorm_fwd", d), -(-R // ROWS_PER_BLOCK), xsum,
                 out, mean, rstd, a, b, gamma, beta, R, d)

    def layernorm_bwd(self, dout: int, x: int, gamma: int, mean: int, rstd: int, dx: int,
                      dgamma_beta: int, partial: int, R: int, d: int, accumulate: bool,
                      resid: int = 0) -> None:
        """dgamma_beta: the float32 gradient of gamma, followed by beta's (adjacent in the flat
        buffer). partial: float32 scratch [ceil(R/ln_rows), 2d]. resid: the residual gradient
        added when accumulating (0: dx itself, in place). dx by k_layernorm_bwd; dγ, dβ by
        k_layernorm_bwd_params over chunks of ln_rows rows, then k_colsum_reduce."""
        self._writes(dx)
        src = resid or dx
        ow = int(self.overwrite_grads)
        rows = self.ln_rows
        self._go(self.ln_kernel("k_layernorm_bwd", d), -(-R // (LN_BWD_THREADS // 32)), dx, src,
                 dout, x, mean, rstd, gamma, R, d, int(accumulate), threads=LN_BWD_THREADS)
        nchunk = -(-R // rows)
        assert rows <= LN_PARAMS_ROWS, rows
        tile = 32 * VEC_BYTES // self.esize  # columns per block: a warp's 16-byte vectors

        def sums(stream: Any) -> None:  # dγ, dβ: read by nothing before the gradient norm
            self._go("k_layernorm_bwd_params", (-(-d // tile), nchunk), partial, dout, x, mean,
                     rstd, R, d, rows, stream=stream)
            self._go("k_colsum_reduce", -(-2 * d // THREADS), dgamma_beta, partial, nchunk,
                     2 * d, ow, stream=stream)

        self._on_side(sums, (dout, partial))

    # --- attention -------------------------------------------------------------------------------
    def attn_qkv_fwd(self, x: int, w_qkv: int, out: int, R: int, d: int, slab: int = 0) -> None:
        """out[j] = x @ W_j, j = Q, K, V: one GEMM batched over the 3 weights. slab: elements
        between out's Q, K, V slabs (default R·d)."""
        self._mm(out, x, w_qkv, R, d, d, batch=3, sa=0, sb=d * d, sc=slab or R * d)

    def attn_qkv_fwd_rows(self, x: int, w_rows: int, out: int, R: int, d: int) -> None:
        """attn_qkv_fwd with Q, K, V side by side in each row of out ([R,3d]: what cuDNN reads
        when built with rows) and W_Q, W_K, W_V side by side in w_rows ([d,3d], the GEMM copy's
        rows layout): out = x @ w_rows, one GEMM with N = 3d where the slabs take three d×d
        problems batched."""
        self._mm(out, x, w_rows, R, 3 * d, d)

    def attn_qkv_bwd(self, dqkv: int, x: int, w_qkv: int, dx: int, dw_qkv: int, R: int,
                     d: int, slab: int = 0) -> None:
        """dW_j += xᵀ @ dqkv[j] (batched);  dx = Σ_j dqkv[j] @ W_jᵀ (overwritten)."""
        slab = slab or R * d
        self._wgrad(dw_qkv, x, dqkv, d, d, R, (dqkv,), ta=True, batch=3, sa=0, sb=slab,
                    sc=d * d)
        es = self.esize
        self._writes(dx)
        for j in range(3):
            self._mm(dx, dqkv + j * slab * es, w_qkv + j * d * d * es, R, d, d, tb=True,
                     beta=0.0 if j == 0 else 1.0)

    def attn_qkv_bwd_rows(self, dqkv: int, x: int, w_rows: int, dx: int, dw_qkv: int, R: int,
                          d: int) -> None:
        """attn_qkv_bwd with dQ, dK, dV side by side in each row of dqkv ([R,3d]: cuDNN's
        backward writes them so when built with rows) and W_Q, W_K, W_V side by side in
        w_rows ([d,3d], the GEMM copy's rows layout): dW_j += xᵀ @ dqkv[:, j·d:(j+1)·d]
        (batched over the three column blocks, into the flat gradient as it lies: the float32
        gradients keep the layout of §2); dx = dqkv @ w_rowsᵀ, one GEMM over K = 3d
        (overwritten), where the slabs take three that add up."""
        self._wgrad(dw_qkv, x, dqkv, d, d, R, (dqkv,), ta=True, ldb=3 * d, batch=3, sa=0, sb=d,
                    sc=d * d)
        self._writes(dx)
        self._mm(dx, dqkv, w_rows, R, d, 3 * d, tb=True)

    def attn_fwd(self, qkv: int, n_head: int, probs: int, out: int, scores: int, B: int, T: int,
                 d: int, slab: int = 0) -> None:
        """S = Q Kᵀ/sqrt(hd) (scratch `scores`), P = causal softmax (saved in `probs`,
        [B*H, T, T] rows, causal chunks only), out = P V, time-major [T, B, d]."""
        hd, BH, ld, es = d // n_head, B * n_head, B * d, self.esize
        q, k, v = (qkv + j * (slab or B * T * d) * es for j in range(3))
        chunks = self._chunks(T)
        for q0, nq, kend in chunks:
            self._mm(scores + q0 * T * es, q + q0 * ld * es, k, nq, kend, hd, tb=True, lda=ld,
                     ldb=ld, ldc=T, alpha=1.0 / math.sqrt(hd), batch=BH, sa=hd, sb=hd, sc=T * T)
        self._go("k_attn_fwd", -(-BH * T // ROWS_PER_BLOCK), probs, scores, BH, T,
                 self.attn_chunk)
        for q0, nq, kend in chunks:
            self._mm(out + q0 * ld * es, probs + q0 * T * es, v, nq, hd, kend, lda=T, ldb=ld,
                     ldc=ld, batch=BH, sa=T * T, sb=hd, sc=hd)

    def attn_bwd(self, dout: int, qkv: int, probs: int, n_head: int, dqkv: int, dscores: int,
                 B: int, T: int, d: int, slab: int = 0) -> None:
        """dP = dY Vᵀ; dV = Pᵀ dY; dS = P⊙(dP - rowsum(dP⊙P)) (over `probs`);
        dQ = dS K/sqrt(hd); dK = dSᵀ Q/sqrt(hd). dqkv overwritten. dV and dK sum over the
        query chunks: the last chunk (all keys) writes, earlier ones add, in a fixed order."""
        hd, BH, ld, es = d // n_head, B * n_head, B * d, self.esize
        slab = slab or B * T * d
        q, k, v = (qkv + j * slab * es for j in range(3))
        dq, dk, dv = (dqkv + j * slab * es for j in range(3))
        self._writes(dqkv)
        scale = 1.0 / math.sqrt(hd)
        chunks = self._chunks(T)[::-1]
        for i, (q0, nq, kend) in enumerate(chunks):
            dy, pc, dpc = dout + q0 * ld * es, probs + q0 * T * es, dscores + q0 * T * es
            self._mm(dpc, dy, v, nq, kend, hd, tb=True, lda=ld, ldb=ld, ldc=T, batch=BH, sa=hd,
                     sb=hd, sc=T * T)
            self._mm(dv, pc, dy, kend, hd, nq, ta=True, lda=T, ldb=ld, ldc=ld, batch=BH,
                     sa=T * T, sb=hd, sc=hd, beta=0.0 if i == 0 else 1.0)
        self._go("k_attn_bwd", -(-BH * T // ROWS_PER_BLOCK), probs, probs, dscores, BH, T,
                 self.attn_chunk)
        for i, (q0, nq, kend) in enumerate(chunks):
            ds = probs + q0 * T * es
            self._mm(dq + q0 * ld * es, ds, k, nq, hd, kend, lda=T, ldb=ld, ldc=ld, alpha=scale,
                     batch=BH, sa=T * T, sb=hd, sc=hd)
            self._mm(dk, ds, q + q0 * ld * es, kend, hd, nq, ta=True, lda=T, ldb=ld, ldc=ld,
                     alpha=scale, batch=BH, sa=T * T, sb=hd, sc=hd, beta=0.0 if i == 0 else 1.0)

    def _chunks(self, T: int) -> list[tuple[int, int, int]]:
        """(first query, query count, key end) per causal chunk of `attn_chunk` queries."""
        C = self.attn_chunk
        return [(q0, min(C, T - q0), min(T, q0 + C)) for q0 in range(0, T, C)]

    def _qkv_apart(self, d: int, slab: int) -> int:
        """Elements between Q, K and V (and between dQ, dK, dV) in cuDNN's layout: d where its
        graphs were built for rows (CudnnAttention.rows: [R,3d]), else a slab."""
        return d if self.cudnn.rows else slab

    def attn_fwd_cudnn(self, qkv: int, out: int, stats: int, B: int, T: int, d: int,
                       slab: int) -> None:
        """attn_fwd through cuDNN's fused attention (cudnn_attn.py): out = P V, with each row's
        log-sum-exp saved in `stats` instead of P. T: the length its graph was built for. qkv:
        slabs `slab` elements apart, or rows (see _qkv_apart)."""
        es, apart = self.esize, self._qkv_apart(d, slab)
        q, k, v = (qkv + j * apart * es for j in range(3))
        self.cudnn.fwd(q, k, v, out, stats, B, T, self.cudnn_ws)
        if self.debug:
            self._sync("cuDNN attention forward")

    def attn_bwd_cudnn(self, dout: int, qkv: int, out: int, stats: int, dqkv: int, B: int,
                       T: int, d: int, slab: int) -> None:
        """attn_bwd through cuDNN (deterministic): dqkv overwritten, from dY = dout and the
        forward's out and stats; dqkv laid out as qkv: slabs, or Q, K, V (dQ, dK, dV) side by
        side in each row ([R,3d]) where the graphs were built so (CudnnAttention.rows). With
        `flex` (rows only) and (B, T) its plan's, the flex deterministic backward instead, on
        the same stream and buffers (flex_attn.py)."""
        es, apart = self.esize, self._qkv_apart(d, slab)
        q, k, v = (qkv + j * apart * es for j in range(3))
        dq, dk, dv = (dqkv + j * apart * es for j in range(3))
        self._writes(dqkv)
        if self.flex is not None and self.cudnn.rows and self.flex.fits(B, T):
            self.flex.bwd(dout=dout, qkv=qkv, out=out, stats=stats, dqkv=dqkv, B=B, T=T,
                          stream=self.stream.handle)
            if self.debug:
                self._sync("flex attention backward")
            return
        self.cudnn.bwd(q, k, v, out, dout, stats, dq, dk, dv, B, T, self.cudnn_ws)
        if self.debug:
            self._sync("cuDNN attention backward")

    def attn_out_fwd(self, y: int, w_o: int, out: int, R: int, d: int) -> None:
        """out = y @ W_O."""
        self._mm(out, y, w_o, R, d, d)

    def attn_out_bwd(self, dout: int, y: int, w_o: int, dy: int, dw_o: int, R: int,
                     d: int) -> None:
        self._wgrad(dw_o, y, dout, d, d, R, (dout,), ta=True)
        self._writes(dy)
        self._mm(dy, dout, w_o, R, d, d, tb=True)

    # --- MLP -------------------------------------------------------------------------------------
    def _gelu_variant(self, name: str, epilogue: Callable[[], None],
                      kernel: Callable[[], None]) -> None:
        """Run the MLP GEMM with GELU in its epilogue or as the plain GEMM + the GELU kernel,
        whichever is faster for this shape (decided once, timed while tuning; then recorded in
        the GEMM plan). Both variants leave the same outputs, to rounding: the epilogue's GELU is
        cuBLASLt's, the kernel's ours."""
        assert self.gemm is not None
        choice = self.gemm.choices.get(name)
        if choice is None and self.gemm.tuning and self.gemm.timer is not None:
            try:  # each runs once (picking its GEMM's algorithm), then both are timed in turn
                epilogue()
                kernel()
                t_epi, t_ker = time_interleaved(self.gemm.timer, [epilogue, kernel])
            except RunError:  # cuBLASLt runs no GELU epilogue for this shape
                kernel()
                t_epi, (t_ker,) = math.inf, time_interleaved(self.gemm.timer, [kernel])
            choice = "epilogue" if t_epi <= t_ker else "kernel"
            self.gemm.choices[name] = choice
            self.gemm.choice_ms[name] = (t_epi, t_ker)
        if choice is None:
            try:
                epilogue()
                self.gemm.choices[name] = "epilogue"
                self.fused_gelu_calls += 1
                return
            except RunError:
                choice = self.gemm.choices[name] = "kernel"
        (epilogue if choice == "epilogue" else kernel)()
        if choice == "epilogue":
            self.fused_gelu_calls += 1

    def mlp_fwd(self, x: int, w1: int, w2: int, pre: int, act: int, out: int, R: int, d: int,
                F: int) -> None:
        """pre = x @ W_1; act = GELU(pre) (in the GEMM's epilogue when cuBLASLt has one for
        this shape and it is the faster, else k_mlp_gelu_fwd); out = act @ W_2."""
        if self.gemm is not None:
            def epilogue() -> None:
                self._mm(act, x, w1, R, F, d, epilogue=EPILOGUE_GELU_AUX, aux=pre)

            def kernel() -> None:
                self._mm(pre, x, w1, R, F, d)
                self._go("k_mlp_gelu_fwd", blocks(R * F), act, pre, R * F, 0)

            self._gelu_variant(f"mlp_fwd R={R} d={d} F={F}", epilogue, kernel)
        # column-major: actᵀ[F,R] = GELU(W_1ᵀ[F,d] · xᵀ[d,R]), preᵀ saved as the aux output
        elif self.lt and self.lt.gelu_gemm(EPILOGUE_GELU_AUX, OP_N, F, R, d, w1, F, x, d, act,
                                           pre, self.act):
            self.fused_gelu_calls += 1
        else:
            self._mm(pre, x, w1, R, F, d)
            self._go("k_mlp_gelu_fwd", blocks(R * F), act, pre, R * F, 0)
        self._mm(out, act, w2, R, d, F)

    def mlp_bwd(self, dout: int, x: int, w1: int, w2: int, pre: int, act: int, dx: int, dw1: int,
                dw2: int, dpre: int, R: int, d: int, F: int) -> None:
        self._wgrad(dw2, act, dout, F, d, R, (dout,), ta=True)
        self._writes(dpre)
        # dpre = (dout @ W_2ᵀ) ⊙ GELU'(pre): column-major dpreᵀ[F,R] = W_2[F,d] · doutᵀ[d,R]
        if self.gemm is not None:
            def epilogue() -> None:
                self._mm(dpre, dout, w2, R, F, d, tb=True, epilogue=EPILOGUE_DGELU, aux=pre)

            def kernel() -> None:
                self._mm(dpre, dout, w2, R, F, d, tb=True)
                self._go("k_mlp_gelu_bwd", blocks(R * F), dpre, dpre, pre, R * F, 0)

            self._gelu_variant(f"mlp_bwd R={R} d={d} F={F}", epilogue, kernel)
        elif self.lt and self.lt.gelu_gemm(EPILOGUE_DGELU, OP_T, F, R, d, w2, d, dout, d, dpre,
                                           pre, self.act):
            self.fused_gelu_calls += 1
        else:
            self._mm(dpre, dout, w2, R, F, d, tb=True)
            self._go("k_mlp_gelu_bwd", blocks(R * F), dpre, dpre, pre, R * F, 0)
        self._wgrad(dw1, x, dpre, d, F, R, (dpre,), ta=True)
        self._writes(dx)
        self._mm(dx, dpre, w1, R, d, F, tb=True)

    def gelu_fwd(self, act: int, pre: int, n: int, amax: int = 0) -> None:
        """act = GELU(pre) over n elements (k_mlp_gelu_fwd); amax (a device word, or 0): the max
        |act| joins it, for act's FP8 copy."""
        self._go("k_mlp_gelu_fwd", blocks(n), act, pre, n, amax)

    def gelu_bwd(self, dpre: int, pre: int, n: int, amax: int = 0) -> None:
        """dpre *= GELU'(pre), in place (k_mlp_gelu_bwd); amax as in gelu_fwd (of dpre)."""
        self._go("k_mlp_gelu_bwd", blocks(n), dpre, dpre, pre, n, amax)

    def zero32(self, ptr: int, count: int) -> None:
        """count 4-byte words at ptr to zero, on the stream."""
        import pycuda.driver as drv

        drv.memset_d32_async(ptr, 0, count, self.stream)

    # --- residual --------------------------------------------------------------------------------
    def residual_add(self, x: int, y: int, out: int, n: int) -> None:
        self._go("k_residual_add", blocks(n), out, x, y, n)

    def residual_add_bwd(self, dout: int, dx: int, n: int) -> None:
        self._go("k_residual_add_bwd", blocks(n), dx, 0, dout, n)

    # --- loss ------------------------------------------------------------------------------------
    # V = 8449 is odd: GEMMs with an odd dimension fall back to slow unaligned kernels. So when
    # the wte buffer has at least ldv readable rows (the flat parameter buffer continues after
    # it), the logits GEMM computes ldv columns (the padding ones are never read) and the dx GEMM
    # runs over K = ldv (dlogits is 0 there). dwte's GEMM keeps M = V: it writes gradients.
    # lp: the logits in the compute precision (CudaBuild.logits_lp), else float32.
    @staticmethod
    def _check_ldv(V: int, ldv: int) -> None:
        """The loss kernels read and write rows in octets of 8 columns, 16-byte aligned."""
        if ldv < V or ldv % 8:
            raise ValueError(f"logits rows of ldv={ldv} columns for V={V}: the loss kernels want "
                             f"ldv >= V and a multiple of 8 (buffers.logits_ld)")

    def loss_fwd(self, x: int, wte: int, targets: int, logits: int, lse: int, losses: int,
                 B: int, T: int, V: int, ldv: int, d: int, wte_rows: int,
                 lp: bool = False) -> None:
        self._check_ldv(V, ldv)
        R = B * T
        vg = ldv if wte_rows >= ldv else V
        self._mm(logits, x, wte, R, vg, d, tb=True, out32=not lp, ldc=ldv)
        self._go("k_loss_fwd_lp" if lp else "k_loss_fwd", R, losses, lse, logits, targets, B, T,
                 V, ldv)

    def loss_fwd_bwd(self, x: int, wte: int, targets: int, logits: int, lse: int, losses: int,
                     scale: int, dlogits: int, B: int, T: int, V: int, ldv: int, d: int,
                     wte_rows: int, lp: bool = False) -> None:
        """loss_fwd and the first half of loss_bwd (dlogits) in one pass over the logits: for a
        training step, whose loss scale is known before the forward. Then loss_bwd_gemms.
        With lp, dlogits may be the logits buffer (k_loss_fwd_bwd_lp reads each row before it
        writes it, for rows of up to LOSS_ROW_MAX columns)."""
        self._check_ldv(V, ldv)
        R = B * T
        vg = ldv if wte_rows >= ldv else V
        if dlogits == logits and not (lp and ldv <= LOSS_ROW_MAX):
            raise ValueError(f"loss_fwd_bwd: dlogits in place of the logits needs lp and rows of "
                             f"at most {LOSS_ROW_MAX} columns, got lp={lp}, ldv={ldv}")
        self._writes(dlogits)  # before the GEMM, which may write the same buffer
        self._mm(logits, x, wte, R, vg, d, tb=True, out32=not lp, ldc=ldv)
        self._go("k_loss_fwd_bwd_lp" if lp else "k_loss_fwd_bwd", R, losses, lse, dlogits, logits,
                 targets, scale, B, T, V, ldv)

    def loss_bwd(self, x: int, wte: int, targets: int, logits: int, lse: int, scale: int,
                 dx: int, dwte: int, dlogits: int, B: int, T: int, V: int, ldv: int, d: int,
                 wte_rows: int) -> None:
        """scale: device pointer to loss_scale/(B*T). dx overwritten, dwte += dzᵀ @ x."""
        self._check_ldv(V, ldv)
        R = B * T
        self._writes(dlogits)
        self._go("k_loss_bwd", R, dlogits, logits, lse, targets, scale, B, T, V, ldv)
        self.loss_bwd_gemms(x, wte, dx, dwte, dlogits, B, T, V, ldv, d, wte_rows)

    def loss_bwd_gemms(self, x: int, wte: int, dx: int, dwte: int, dlogits: int, B: int, T: int,
                       V: int, ldv: int, d: int, wte_rows: int, pad_rows: int = 0) -> None:
        """dx = dz @ wte (overwritten); dwte += dzᵀ @ x (on the side stream when there is one).
        With cuBLASLt GEMMs, dwte's GEMM also runs over the aligned ldv rows (M = V = 8449 is
        odd: the heuristic then falls back to a slow sm80 kernel) when the ldv - V rows past V
        are within the next tensor, wpe (`pad_rows`: wpe's row count; embed_bwd, which writes
        wpe's gradients, waits for this GEMM): dz is 0 in those columns, so they get + 0 (or,
        when the step writes its gradients, 0, before embed_bwd writes them)."""
        R = B * T
        vg = ldv if wte_rows >= ldv else V
        mg = ldv if self.gemm is not None and ldv - V <= pad_rows else V
        self._wgrad(dwte, dlogits, x, mg, d, R, (dlogits, dwte), layer=False, ta=True,
                    lda=ldv)
        self._writes(dx)
        self._mm(dx, dlogits, wte, R, d, vg, lda=ldv)

