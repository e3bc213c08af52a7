"""The op twins on the GPU: each method mirrors the numpy function of the same name in
`engine/backends/numpy/ops.py`, on raw device pointers, with cuBLAS doing the GEMMs.

Differences from the numpy twins, all of layout or fusion, never of math:
- Activations are time-major: row r = t*B + b (numpy: b*T + t). Then the Q, K, V of head h of
  sequence b are one strided view (offset (b*H + h)*hd, row stride B*d), so attention is a
  single strided-batched GEMM over B*H with no permute kernels.
- `layernorm_bwd` can accumulate into dx (the skip path's `residual_add_bwd` fused in).
- `attn_bwd` writes dS over the saved probabilities (they are not needed after the backward).
- `loss_fwd` keeps float logits and the log-sum-exp; `loss_bwd` writes dlogits separately.
Backward ops accumulate (+=) into float32 parameter gradients, like numpy's.
"""

from __future__ import annotations

import math
import os
from typing import Any

from engine.backends.cuda.cublas import DTYPE_OF_PRECISION, R_32F, Cublas
from engine.backends.cuda.cublaslt import EPILOGUE_DGELU, EPILOGUE_GELU_AUX, OP_N, OP_T, CublasLt

THREADS = 256
ROWS_PER_BLOCK = THREADS // 32  # one warp per row
LN_ROWS_PER_CHUNK = 64
NORM_BLOCKS = 1024
MAX_GRID = 8192


def _blocks(n: int, per: int = THREADS, cap: int = MAX_GRID) -> int:
    return max(1, min(cap, -(-n // per)))


class Ops:
    """Kernels + cuBLAS + stream for one compute precision."""

    def __init__(self, kernels: dict[str, Any], blas: Cublas, stream: Any, precision: str,
                 lt: CublasLt | None = None):
        """lt: cuBLASLt for the MLP's GELU epilogues; None runs the GELU kernels instead."""
        self.k, self.blas, self.stream, self.lt = kernels, blas, stream, lt
        self.fused_gelu_calls = 0  # how often the epilogue path ran (tests check it is used)
        self.act = DTYPE_OF_PRECISION[precision]
        self.esize = 4 if precision == "fp32" else 2  # bytes per activation element
        self.attn_chunk = int(os.environ.get("ANDREA_ATTN_CHUNK", "256"))

    def _go(self, name: str, grid: int | tuple[int, int], *args: Any) -> None:
        g = grid if isinstance(grid, tuple) else (grid, 1)
        self.k[name].prepared_async_call(g, (THREADS, 1, 1), self.stream, *args)

    def _mm(self, out: int, a: int, b: int, M: int, N: int, K: int, *, acc32: bool = False,
            out32: bool = False, **kw: Any) -> None:
        """GEMM on activations/low-precision weights; acc32: += into a float32 gradient."""
        act = self.act
        c = R_32F if (acc32 or out32) else act
        self.blas.matmul(out, a, b, M, N, K, types=(act, act, c),
                         beta=1.0 if acc32 else kw.pop("beta", 0.0), **kw)

    # --- embedding -------------------------------------------------------------------------------
    def embed_fwd(self, tokens: int, wte: int, wpe: int, out: int, B: int, T: int, d: int) -> None:
        self._go("k_embed_fwd", _blocks(B * T * d), out, tokens, wte, wpe, B, T, d)

    def embed_bwd(self, dout: int, buckets: tuple[int, int, int, int], dwte: int, dwpe: int,
                  B: int, T: int, d: int) -> None:
        """buckets = device pointers (n_unique, bucket_tok, bucket_start, rows) from
        `token_buckets`; grid: one block per possible bucket, then one per position."""
        n_unique, tok, start, rows = buckets
        self._go("k_embed_bwd", B * T + T, dwte, dwpe, dout, n_unique, tok, start, rows, B, T, d)

    # --- layer normalisation ---------------------------------------------------------------------
    def layernorm_fwd(self, x: int, gamma: int, beta: int, out: int, mean: int, rstd: int,
                      R: int, d: int) -> None:
        self._go("k_layernorm_fwd", -(-R // ROWS_PER_BLOCK), out, mean, rstd, x, gamma, beta, R, d)

    def layernorm_bwd(self, dout: int, x: int, gamma: int, mean: int, rstd: int, dx: int,
                      dgamma_beta: int, partial: int, R: int, d: int, accumulate: bool) -> None:
        """dgamma_beta: the float32 gradient of gamma, followed by beta's (adjacent in the flat
        buffer). partial: float32 scratch [ceil(R/64), 2d]."""
        self._go("k_layernorm_bwd", -(-R // ROWS_PER_BLOCK), dx, dout, x, mean, rstd, gamma, R, d,
                 int(accumulate))
        nchunk = -(-R // LN_ROWS_PER_CHUNK)
        self._go("k_layernorm_bwd_params", (-(-d // THREADS), nchunk), partial, dout, x, mean,
                 rstd, R, d, LN_ROWS_PER_CHUNK)
        self._go("k_colsum_reduce", -(-2 * d // THREADS), dgamma_beta, partial, nchunk, 2 * d)

    # --- attention -------------------------------------------------------------------------------
    def attn_qkv_fwd(self, x: int, w_qkv: int, out: int, R: int, d: int) -> None:
        """out[j] = x @ W_j, j = Q, K, V: one GEMM batched over the 3 weights."""
        self._mm(out, x, w_qkv, R, d, d, batch=3, sa=0, sb=d * d, sc=R * d)

    def attn_qkv_bwd(self, dqkv: int, x: int, w_qkv: int, dx: int, dw_qkv: int, R: int,
                     d: int) -> None:
        """dW_j += xᵀ @ dqkv[j] (batched);  dx = Σ_j dqkv[j] @ W_jᵀ (overwritten)."""
        self._mm(dw_qkv, x, dqkv, d, d, R, ta=True, acc32=True, batch=3, sa=0, sb=R * d,
                 sc=d * d)
        for j in range(3):
            es = self.esize
            self._mm(dx, dqkv + j * R * d * es, w_qkv + j * d * d * es, R, d, d, tb=True,
                     beta=0.0 if j == 0 else 1.0)

    def attn_fwd(self, qkv: int, n_head: int, probs: int, out: int, scores: int, B: int, T: int,
                 d: int) -> None:
        """S = Q Kᵀ/sqrt(hd) (scratch `scores`), P = causal softmax (saved in `probs`,
        [B*H, T, T] rows, causal chunks only), out = P V, time-major [T, B, d]."""
        hd, BH, ld, es = d // n_head, B * n_head, B * d, self.esize
        q, k, v = (qkv + j * B * T * d * es for j in range(3))
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
                 B: int, T: int, d: int) -> None:
        """dP = dY Vᵀ; dV = Pᵀ dY; dS = P⊙(dP - rowsum(dP⊙P)) (over `probs`);
        dQ = dS K/sqrt(hd); dK = dSᵀ Q/sqrt(hd). dqkv overwritten. dV and dK sum over the
        query chunks: the last chunk (all keys) writes, earlier ones add, in a fixed order."""
        hd, BH, ld, es = d // n_head, B * n_head, B * d, self.esize
        q, k, v = (qkv + j * B * T * d * es for j in range(3))
        dq, dk, dv = (dqkv + j * B * T * d * es for j in range(3))
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

    def attn_out_fwd(self, y: int, w_o: int, out: int, R: int, d: int) -> None:
        self._mm(out, y, w_o, R, d, d)

    def attn_out_bwd(self, dout: int, y: int, w_o: int, dy: int, dw_o: int, R: int,
                     d: int) -> None:
        self._mm(dw_o, y, dout, d, d, R, ta=True, acc32=True)
        self._mm(dy, dout, w_o, R, d, d, tb=True)

    # --- MLP -------------------------------------------------------------------------------------
    def mlp_fwd(self, x: int, w1: int, w2: int, pre: int, act: int, out: int, R: int, d: int,
                F: int) -> None:
        """pre = x @ W_1; act = GELU(pre) (in the GEMM's epilogue when cuBLASLt has one for
        this shape, else k_mlp_gelu_fwd); out = act @ W_2."""
        # column-major: actᵀ[F,R] = GELU(W_1ᵀ[F,d] · xᵀ[d,R]), preᵀ saved as the aux output
        if self.lt and self.lt.gelu_gemm(EPILOGUE_GELU_AUX, OP_N, F, R, d, w1, F, x, d, act, pre,
                                         self.act):
            self.fused_gelu_calls += 1
        else:
            self._mm(pre, x, w1, R, F, d)
            self._go("k_mlp_gelu_fwd", _blocks(R * F), act, pre, R * F)
        self._mm(out, act, w2, R, d, F)

    def mlp_bwd(self, dout: int, x: int, w1: int, w2: int, pre: int, act: int, dx: int, dw1: int,
                dw2: int, dpre: int, R: int, d: int, F: int) -> None:
        self._mm(dw2, act, dout, F, d, R, ta=True, acc32=True)
        # dpre = (dout @ W_2ᵀ) ⊙ GELU'(pre): column-major dpreᵀ[F,R] = W_2[F,d] · doutᵀ[d,R]
        if self.lt and self.lt.gelu_gemm(EPILOGUE_DGELU, OP_T, F, R, d, w2, d, dout, d, dpre, pre,
                                         self.act):
            self.fused_gelu_calls += 1
        else:
            self._mm(dpre, dout, w2, R, F, d, tb=True)
            self._go("k_mlp_gelu_bwd", _blocks(R * F), dpre, dpre, pre, R * F)
        self._mm(dw1, x, dpre, d, F, R, ta=True, acc32=True)
        self._mm(dx, dpre, w1, R, d, F, tb=True)

    # --- residual --------------------------------------------------------------------------------
    def residual_add(self, x: int, y: int, out: int, n: int) -> None:
        self._go("k_residual_add", _blocks(n), out, x, y, n)

    def residual_add_bwd(self, dout: int, dx: int, n: int) -> None:
        self._go("k_residual_add_bwd", _blocks(n), dx, 0, dout, n)

    # --- loss ------------------------------------------------------------------------------------
    # V = 8449 is odd: GEMMs with an odd dimension fall back to slow unaligned kernels. So when
    # the wte buffer has at least ldv readable rows (the flat parameter buffer continues after
    # it), the logits GEMM computes ldv columns (the padding ones are never read) and the dx GEMM
    # runs over K = ldv (dlogits is 0 there). dwte's GEMM keeps M = V: it writes gradients.
    def loss_fwd(self, x: int, wte: int, targets: int, logits: int, lse: int, losses: int,
                 B: int, T: int, V: int, ldv: int, d: int, wte_rows: int) -> None:
        R = B * T
        vg = ldv if wte_rows >= ldv else V
        self._mm(logits, x, wte, R, vg, d, tb=True, out32=True, ldc=ldv)
        self._go("k_loss_fwd", R, losses, lse, logits, targets, B, T, V, ldv)

    def loss_bwd(self, x: int, wte: int, targets: int, logits: int, lse: int, scale: int,
                 dx: int, dwte: int, dlogits: int, B: int, T: int, V: int, ldv: int, d: int,
                 wte_rows: int) -> None:
        """scale: device pointer to loss_scale/(B*T). dx overwritten, dwte += dzᵀ @ x."""
        R = B * T
        vg = ldv if wte_rows >= ldv else V
        self._go("k_loss_bwd", R, dlogits, logits, lse, targets, scale, B, T, V, ldv)
        self._mm(dx, dlogits, wte, R, d, vg, lda=ldv)
        self._mm(dwte, dlogits, x, V, d, R, ta=True, acc32=True, lda=ldv)

    # --- optimizer utilities ---------------------------------------------------------------------
    def grad_norm_partial(self, grads: int, n: int, partials: int, gs: float = 1.0) -> None:
        """gs: a pending gradient scale, applied on the fly (see CudaBackend.grad_scale)."""
        self._go("k_grad_norm_partial", NORM_BLOCKS, partials, grads, n, gs)

    def grad_norm_final(self, partials: int, norm: int) -> None:
        self._go("k_grad_norm_final", 1, norm, partials, NORM_BLOCKS)

    def grad_scale(self, grads: int, n: int, s: float) -> None:
        self._go("k_grad_scale", _blocks(n), grads, n, s)

    def grad_add(self, grads: int, other: int, n: int) -> None:
        """grads += other (a micro-batch's own gradient into the sum)."""
        self._go("k_grad_add", _blocks(n), grads, other, n)

    def adamw(self, params: int, params_lp: int, grads: int, m: int, v: int, seg_start: int,
              seg_decay: int, nseg: int, n: int, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, t: int, gs: float = 1.0) -> None:
        """gs: a pending gradient scale (the clip), folded into the update."""
        bc1, bc2 = 1.0 - beta1**t, 1.0 - beta2**t
        self._go("k_adamw", _blocks(-(-n // 4), cap=2048), params, params_lp, grads, m, v,
                 seg_start, seg_decay, nseg, n, lr, beta1, beta2, eps, weight_decay, bc1, bc2,
                 gs)

    def params_to_lp(self, params_lp: int, params: int, n: int) -> None:
        self._go("k_params_to_lp", _blocks(n), params_lp, params, n)
