"""The op twins on the GPU: each method mirrors the numpy function of the same name in
`engine/backends/numpy/ops.py`, on raw device pointers, with cuBLAS/cuBLASLt doing the GEMMs.

Differences from the numpy twins, all of layout, fusion or rounding, never of math:
- Activations are time-major: row r = t*B + b (numpy: b*T + t). Then the Q, K, V of head h of
  sequence b are one strided view (offset (b*H + h)*hd, row stride B*d), so attention is a
  single strided-batched GEMM over B*H with no permute kernels (and cuDNN reads them in place).
- Q, K, V in rows (CudaBackend.qkv_rows, with cuDNN): `attn_qkv_fwd_rows` writes them side by
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
loss and dlogits in one pass),
`grad_norm_ranges` (the norm's partials range by range, as the backward completes them),
`step_clip` (clip and non-finite skip on the device) and
`adamw_step` (AdamW over a range, as step_clip decided). GEMMs then go through gemm.LtGemm
(algorithms chosen by timing, GELU epilogue or kernel chosen per shape), and the weight-gradient
GEMMs and the LayerNorm parameter sums run on a second stream (`side`): see `_wgrad`, `_on_side`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from engine import env
from engine.backends.cuda.cublas import DTYPE_OF_PRECISION, R_32F, Cublas
from engine.backends.cuda.cublaslt import EPILOGUE_DGELU, EPILOGUE_GELU_AUX, OP_N, OP_T, CublasLt
from engine.backends.cuda.gemm import LtGemm, time_interleaved
from engine.config import GpuConfig
from engine.errors import RunError

THREADS = 256
ROWS_PER_BLOCK = THREADS // 32  # one warp per row
# k_layernorm_bwd's block (a warp a row): at 72 registers a thread, blocks of 128 fit 7 an SM
# (28 warps, against 24 in blocks of 256) and retire sooner beside the weight-gradient stream's
# GEMMs (faster alone on the H200; in the whole step within the spread between runs)
LN_BWD_THREADS = 128
LN_ROWS_PER_CHUNK = 64  # rows per column-sum chunk of the LayerNorm backward's parameter sums
LN_PARAMS_ROWS = 64  # the most k_layernorm_bwd_params takes per chunk (8 per warp, 8 warps)
# classic attention's queries per causal chunk (the config's gpu.attention_chunk: the chunks are
# its GEMMs' shapes, so its bits)
ATTN_CHUNK = GpuConfig().attention_chunk
NORM_BLOCKS = 1024
LOSS_ROW_MAX = 5 * 8 * THREADS  # kernels/loss.cu: a row held in registers (LOSS_OCTETS octets)
NORM_RANGE_BLOCKS = 256  # k_grad_norm_ranges' blocks per range (its partials: this many a range)
MAX_GRID = 8192
VEC_BYTES = 16


def _blocks(n: int, per: int = THREADS, cap: int = MAX_GRID) -> int:
    return max(1, min(cap, -(-n // per)))


class Ops:
    """Kernels + GEMMs + stream for one compute precision.

    GEMMs: `gemm` (an LtGemm, with `ws` its workspace on this stream) when given, else the
    plain cuBLAS handle `blas` with `lt` (cuBLASLt) for the MLP's GELU epilogues (None: the GELU
    kernels). `side`: a second stream (with workspace `ws2`, LtGemm only) for the weight-
    gradient GEMMs; `cudnn`: a cudnn_attn.CudnnAttention for attn_fwd_cudnn / attn_bwd_cudnn,
    with `cudnn_ws` its workspace; `flex`: a flex_attn.FlexAttention that attn_bwd_cudnn runs
    instead of cuDNN's backward where it fits the shape (gpu.flex_backward; None: cuDNN's).
    """

    def __init__(self, kernels: dict[str, Any], blas: Cublas | None, stream: Any, precision: str,
                 lt: CublasLt | None = None, *, gemm: LtGemm | None = None, ws: int = 0,
                 side: Any = None, ws2: int = 0, cudnn: Any = None, cudnn_ws: int = 0,
                 event: Callable[[], Any] | None = None, attn_chunk: int = ATTN_CHUNK) -> None:
        self.k, self.blas, self.stream, self.lt = kernels, blas, stream, lt
        self.gemm, self.ws, self.side, self.ws2, self.cudnn = gemm, ws, side, ws2, cudnn
        self.cudnn_ws = cudnn_ws
        self.flex: Any = None  # set by the backend once its buffers are bound (flex_attn.py)
        if side is not None and (gemm is None or event is None):
            raise ValueError("a weight-gradient stream needs LtGemm GEMMs and events")
        self._new_event = event
        self.fused_gelu_calls = 0  # how often the epilogue path ran (tests check it is used)
        self.act = DTYPE_OF_PRECISION[precision]
        self.esize = 4 if precision == "fp32" else 2  # bytes per activation element
        self.attn_chunk = attn_chunk  # classic attention's causal chunk (queries)
        self.ln_rows = LN_ROWS_PER_CHUNK  # chunk rows of the LayerNorm backward's sums
        # the fused step's single micro-batch WRITES the parameter gradients (GEMMs with beta 0,
        # the LayerNorm and position sums stored) instead of zeroing them and adding
        self.overwrite_grads = False
        # ... and writes the layers' weight gradients in the compute precision, into the
        # backend's grads_lp (CudaBackend.grads_lp; with overwrite_grads only)
        self.wgrad_lp = False
        # ANDREA_CUDA_SYNC=1: wait for every launch and name the one that fails (the backend then
        # runs without graphs): for finding an illegal address, not for speed
        self.debug = env.CUDA_SYNC.read()
        self._events: list[Any] = []
        self._used = 0
        self._side_reads: dict[int, Any] = {}  # buffer -> event after the side's last read

    def _go(self, name: str, grid: int | tuple[int, int], *args: Any, shared: int = 0,
            stream: Any = None, threads: int = THREADS) -> None:
        """Launch kernel `name` on the stream (or `stream`): grid blocks of `threads` threads
        (THREADS, except k_layernorm_bwd's LN_BWD_THREADS; other sizes only where a kernel
        allows them, for scripts/bench_kernels.py)."""
        g = grid if isinstance(grid, tuple) else (grid, 1)
        self.k[name].prepared_async_call(g, (threads, 1, 1), stream or self.stream, *args,
                                         shared_size=shared)
        if self.debug:
            self._sync(name)

    def _sync(self, what: str) -> None:
        try:
            self.stream.synchronize()
            if self.side is not None:
                self.side.synchronize()
        except Exception as e:
            raise RunError(f"{what}: {type(e).__name__}: {e}") from None

    def _mm(self, out: int, a: int, b: int, M: int, N: int, K: int, *, acc32: bool = False,
            out32: bool = False, side: bool = False, **kw: Any) -> None:
        """GEMM on activations/low-precision weights; acc32: += into a float32 gradient;
        `types` (a, b, out) instead of the precision's (the FP8 GEMMs, fp8.py)."""
        act = self.act
        cty = R_32F if (acc32 or out32) else act
        types = kw.pop("types", None) or (act, act, cty)
        beta = 1.0 if acc32 else kw.pop("beta", 0.0)
        if self.gemm is not None:
            stream, ws = (self.side, self.ws2) if side else (self.stream, self.ws)
            self.gemm.matmul(out, a, b, M, N, K, types=types, stream=stream.handle,
                             ws=ws, beta=beta, **kw)
        else:
            assert self.blas is not None
            self.blas.matmul(out, a, b, M, N, K, types=types, beta=beta, **kw)
        if self.debug:
            self._sync(f"GEMM {M}x{N}x{K} {kw}")

    # --- the weight-gradient stream ----------------------------------------------------------------
    def begin_pass(self) -> None:
        """Start a forward/backward pass: no side-stream reads outstanding."""
        self._used = 0
        self._side_reads.clear()

    def reserve_events(self, n: int) -> None:
        """Create the events a pass will use before any capture (none is created inside)."""
        assert self._new_event is not None
        while len(self._events) < n:
            self._events.append(self._new_event())

    def _event(self) -> Any:
        if self._used == len(self._events):
            assert self._new_event is not None
            self._events.append(self._new_event())
        ev = self._events[self._used]
        self._used += 1
        return ev

    def _wgrad(self, out: int, a: int, b: int, M: int, N: int, K: int, reads: tuple[int, ...],
               layer: bool = True, **kw: Any) -> None:
        """dW += op(a) @ op(b) into a float32 gradient; a layer's weight matrix (`layer`) with
        `wgrad_lp`: dW = op(a) @ op(b) in the compute precision (out points into grads_lp). With
        a side stream: after everything the main stream has queued so far, on the side stream,
        and the buffers in `reads` (gradient buffers the main stream rewrites later) are marked
        so that the main stream waits for this GEMM before it writes them (`_writes`). Same
        GEMM, same algorithm: same bits."""
        lp = self.wgrad_lp and layer
        if lp and not self.overwrite_grads:
            raise ValueError("Ops._wgrad: wgrad_lp writes the gradients, it needs overwrite_grads")
        beta = 0.0 if self.overwrite_grads else 1.0
        if self.side is None:
            self._mm(out, a, b, M, N, K, out32=not lp, beta=beta, **kw)
            return
        self._to_side()
        self._mm(out, a, b, M, N, K, out32=not lp, beta=beta, side=True, **kw)
        done = self._event()
        done.record(self.side)
        for ptr in reads:
            self._side_reads[ptr] = done

    def _on_side(self, issue: Callable[[Any], None], reads: tuple[int, ...]) -> None:
        """issue(stream) after everything the main stream has queued so far, on the side stream
        when there is one (work whose result only the gradient norm reads: the LayerNorm
        parameter sums), with `reads` marked as in `_wgrad`."""
        if self.side is None:
            issue(self.stream)
            return
        issue(self._to_side())
        done = self._event()
        done.record(self.side)
        for ptr in reads:
            self._side_reads[ptr] = done

    def _to_side(self) -> Any:
        """The side stream, made to wait for everything the main stream has queued so far."""
        fork = self._event()
        fork.record(self.stream)
        self.side.wait_for_event(fork)
        return self.side

    def _writes(self, *ptrs: int) -> None:
        """The main stream is about to write these buffers: wait for side-stream readers."""
        for ptr in ptrs:
            ev = self._side_reads.pop(ptr, None)
            if ev is not None:
                self.stream.wait_for_event(ev)

    def fork_to(self, other: Any) -> None:
        """`other` (a third stream) waits for everything queued so far on the main and the side
        stream: a gradient bucket's all-reduce after the layer whose backward completes it."""
        for s in (self.stream, self.side):
            if s is not None:
                ev = self._event()
                ev.record(s)
                other.wait_for_event(ev)

    def wait_for(self, other: Any) -> None:
        """The main stream waits for everything queued so far on `other`."""
        ev = self._event()
        ev.record(other)
        self.stream.wait_for_event(ev)

    def join(self) -> None:
        """The main stream waits for all the side stream's work (before the gradient norm, or
        anything that reads the gradients)."""
        if self.side is None:
            return
        done = self._event()
        done.record(self.side)
        self.stream.wait_for_event(done)
        self._side_reads.clear()

    # --- embedding -------------------------------------------------------------------------------
    def embed_fwd(self, tokens: int, wte: int, wpe: int, out: int, B: int, T: int, d: int) -> None:
        """out = wte[tokens] + wpe (time-major rows): a warp a row in 16-byte vectors where the
        rows are whole vectors (k_embed_fwd_rows), else an element a thread; the same bits."""
        if d % (VEC_BYTES // self.esize) == 0 and out % VEC_BYTES == 0:
            self._go("k_embed_fwd_rows", -(-B * T // ROWS_PER_BLOCK), out, tokens, wte, wpe, B,
                     T, d)
            return
        self._go("k_embed_fwd", _blocks(B * T * d), out, tokens, wte, wpe, B, T, d)

    def embed_bwd(self, dout: int, buckets: tuple[int, int, int, int], dwte: int, dwpe: int,
                  B: int, T: int, d: int) -> None:
        """buckets = device pointers (n_unique, bucket_tok, bucket_start, rows) from
        `token_buckets`; grid: one block per possible bucket, then one per position."""
        n_unique, tok, start, rows = buckets
        self._writes(dwte)  # the loss's dwte GEMM may still run on the side stream
        self._go("k_embed_bwd", B * T + T, dwte, dwpe, dout, n_unique, tok, start, rows, B, T, d,
                 int(self.overwrite_grads))

    # --- layer normalisation ---------------------------------------------------------------------
    def layernorm_fwd(self, x: int, gamma: int, beta: int, out: int, mean: int, rstd: int,
                      R: int, d: int) -> None:
        self._go("k_layernorm_fwd", -(-R // ROWS_PER_BLOCK), out, mean, rstd, x, gamma, beta, R, d)

    def residual_layernorm_fwd(self, a: int, b: int, xsum: int, gamma: int, beta: int, out: int,
                               mean: int, rstd: int, R: int, d: int) -> None:
        """xsum = a + b (residual_add), out = layernorm(xsum): one kernel, the same bits."""
        self._go("k_residual_layernorm_fwd", -(-R // ROWS_PER_BLOCK), xsum, out, mean, rstd, a, b,
                 gamma, beta, R, d)

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
        self._go("k_layernorm_bwd", -(-R // (LN_BWD_THREADS // 32)), dx, src, dout, x, mean,
                 rstd, gamma, R, d, int(accumulate), threads=LN_BWD_THREADS)
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
                self._go("k_mlp_gelu_fwd", _blocks(R * F), act, pre, R * F, 0)

            self._gelu_variant(f"mlp_fwd R={R} d={d} F={F}", epilogue, kernel)
        # column-major: actᵀ[F,R] = GELU(W_1ᵀ[F,d] · xᵀ[d,R]), preᵀ saved as the aux output
        elif self.lt and self.lt.gelu_gemm(EPILOGUE_GELU_AUX, OP_N, F, R, d, w1, F, x, d, act,
                                           pre, self.act):
            self.fused_gelu_calls += 1
        else:
            self._mm(pre, x, w1, R, F, d)
            self._go("k_mlp_gelu_fwd", _blocks(R * F), act, pre, R * F, 0)
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
                self._go("k_mlp_gelu_bwd", _blocks(R * F), dpre, dpre, pre, R * F, 0)

            self._gelu_variant(f"mlp_bwd R={R} d={d} F={F}", epilogue, kernel)
        elif self.lt and self.lt.gelu_gemm(EPILOGUE_DGELU, OP_T, F, R, d, w2, d, dout, d, dpre,
                                           pre, self.act):
            self.fused_gelu_calls += 1
        else:
            self._mm(dpre, dout, w2, R, F, d, tb=True)
            self._go("k_mlp_gelu_bwd", _blocks(R * F), dpre, dpre, pre, R * F, 0)
        self._wgrad(dw1, x, dpre, d, F, R, (dpre,), ta=True)
        self._writes(dx)
        self._mm(dx, dpre, w1, R, d, F, tb=True)

    def gelu_fwd(self, act: int, pre: int, n: int, amax: int = 0) -> None:
        """act = GELU(pre) over n elements (k_mlp_gelu_fwd); amax (a device word, or 0): the max
        |act| joins it, for act's FP8 copy."""
        self._go("k_mlp_gelu_fwd", _blocks(n), act, pre, n, amax)

    def gelu_bwd(self, dpre: int, pre: int, n: int, amax: int = 0) -> None:
        """dpre *= GELU'(pre), in place (k_mlp_gelu_bwd); amax as in gelu_fwd (of dpre)."""
        self._go("k_mlp_gelu_bwd", _blocks(n), dpre, dpre, pre, n, amax)

    def zero32(self, ptr: int, count: int) -> None:
        """count 4-byte words at ptr to zero, on the stream."""
        import pycuda.driver as drv

        drv.memset_d32_async(ptr, 0, count, self.stream)

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
    # lp: the logits in the compute precision (CudaBackend.logits_lp), else float32.
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

    # --- optimizer utilities ---------------------------------------------------------------------
    def grad_norm_partial(self, grads: int, n: int, partials: int, gs: float = 1.0) -> None:
        """gs: a pending gradient scale, applied on the fly (see CudaBackend.grad_scale)."""
        self._go("k_grad_norm_partial", NORM_BLOCKS, partials, grads, n, gs)

    def grad_norm_final(self, partials: int, norm: int, n: int = NORM_BLOCKS) -> None:
        """norm = sqrt of the sum of the n partials, in their order."""
        self._go("k_grad_norm_final", 1, norm, partials, n)

    def grad_norm_ranges(self, grads: int, cuts: int, first: int, count: int, partials: int,
                         gs: float = 1.0, gs_dev: int = 0, side: bool = False, *,
                         grads_lp: int = 0, kinds: int = 0) -> None:
        """The partials of ranges first .. first + count - 1 of the device table cuts (int64
        [ranges + 1], float4-aligned begins) into partials[r·NORM_RANGE_BLOCKS ...], for
        grad_norm_final over all of them once every range is in. gs_dev: a device float
        holding the gradient scale instead of gs (0: use gs). side: on the weight-gradient
        stream after everything queued so far on the main one (a range the backward has just
        completed), when there is one. grads_lp, kinds: the compute-precision gradients and the
        device table (int32 [ranges]) of the ranges read from there (0: all from grads)."""
        if bool(grads_lp) != bool(kinds):
            raise ValueError("grad_norm_ranges: grads_lp and kinds go together")
        stream = self._to_side() if side and self.side is not None else None
        self._go("k_grad_norm_ranges", (NORM_RANGE_BLOCKS, count), partials, grads, grads_lp,
                 cuts, kinds, first, gs, gs_dev, stream=stream)

    def grads_from_lp(self, grads: int, grads_lp: int, cuts: int, kinds: int,
                      count: int) -> None:
        """grads[i] = grads_lp[i] over the ranges 0 .. count - 1 of the norm's table whose kind
        is 1 (k_grads_from_lp): the fused bf16 step's weight gradients back in float32."""
        self._go("k_grads_from_lp", (NORM_RANGE_BLOCKS, count), grads, grads_lp, cuts, kinds, 0)

    def grad_scale(self, grads: int, n: int, s: float) -> None:
        self._go("k_grad_scale", _blocks(n), grads, n, s)

    def grad_add(self, grads: int, other: int, n: int) -> None:
        """grads += other (a micro-batch's own gradient into the sum)."""
        self._go("k_grad_add", _blocks(n), grads, other, n)

    @staticmethod
    def _check_lp_rows(seg_qkv: int, d: int) -> None:
        if seg_qkv and not 0 < d * d < 2**31:
            raise ValueError(f"seg_qkv needs the model width d (0 < d² < 2^31), got d={d}")

    def _check_lp(self, params_lp: int, seg_qkv: int, d: int, grads_lp: int = 0,
                  seg_glp: int = 0) -> None:
        """AdamW's arguments for the low-precision copies: seg_qkv's d, params_lp and grads_lp
        aligned for the kernel's 4-wide stores and loads (optim.cu store_lp, load4: 4 elements,
        8 or 16 bytes), grads_lp with its table and the copy it belongs beside."""
        self._check_lp_rows(seg_qkv, d)
        if bool(grads_lp) != bool(seg_glp) or (grads_lp and not params_lp):
            raise ValueError("AdamW: grads_lp needs seg_glp and params_lp (the bf16 step's)")
        for name, ptr in (("params_lp", params_lp), ("grads_lp", grads_lp)):
            if ptr % (4 * self.esize):
                raise ValueError(f"{name} {ptr:#x} is not aligned to {4 * self.esize} bytes "
                                 f"(AdamW stores and loads 4 elements at a time)")

    def adamw(self, params: int, params_lp: int, grads: int, m: int, v: int, seg_start: int,
              seg_decay: int, nseg: int, n: int, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, t: int, gs: float = 1.0, *, seg_qkv: int = 0,
              d: int = 0, grads_lp: int = 0, seg_glp: int = 0) -> None:
        """gs: a pending gradient scale (the clip), folded into the update. seg_qkv: the device
        table (int32 per tensor, buffers.qkv_seg_table) of the tensors that params_lp keeps in
        rows, with d the model width (0: params_lp in the flat layout, as params). grads_lp,
        seg_glp: the compute-precision gradients and the device table (int32 per tensor,
        buffers.grads_lp_table) of the tensors whose gradient is read from there (0: none)."""
        self._check_lp(params_lp, seg_qkv, d, grads_lp, seg_glp)
        bc1, bc2 = 1.0 - beta1**t, 1.0 - beta2**t
        self._go("k_adamw", _blocks(-(-n // 4), cap=2048), params, params_lp, grads, grads_lp,
                 m, v, seg_start, seg_decay, seg_qkv, seg_glp, nseg, d, n, lr, beta1, beta2,
                 eps, weight_decay, bc1, bc2, gs)

    def step_clip(self, upd: int, hp: int, norm: int, clip: int, skipped: int) -> None:
        """The step's clip factor (clip[0]) and non-finite skip (skipped[0]) from the norm of
        grad_norm, and into upd (buffers.UPD_WORDS floats) everything its update reads: hp
        (buffers.HP_FIELDS) included, so that the update may run after the io block is
        restaged (k_step_clip)."""
        self._go("k_step_clip", 1, upd, hp, norm, clip, skipped)

    def adamw_step(self, params: int, params_lp: int, grads: int, m: int, v: int,
                   seg_start: int, seg_decay: int, nseg: int, begin: int, end: int, upd: int,
                   stream: Any = None, *, seg_qkv: int = 0, d: int = 0, grads_lp: int = 0,
                   seg_glp: int = 0) -> None:
        """adamw over elements [begin, end) (begin a multiple of 4) as step_clip decided it
        (nothing when the step is skipped); the same bits whichever ranges a step is split
        into. seg_qkv, d, grads_lp, seg_glp: as in adamw."""
        assert begin % 4 == 0, f"adamw_step: begin {begin} is not a multiple of 4 (float4 groups)"
        self._check_lp(params_lp, seg_qkv, d, grads_lp, seg_glp)
        self._go("k_adamw_step", _blocks(-(-(end - begin) // 4), cap=2048), params, params_lp,
                 grads, grads_lp, m, v, seg_start, seg_decay, seg_qkv, seg_glp, nseg, d, begin,
                 end, upd, stream=stream)

    def step_hp(self, hp: int, skipped: int) -> None:
        """The bias corrections of hp as Adam's step count stands (k_step_hp)."""
        self._go("k_step_hp", 1, hp, skipped)

    def params_to_lp(self, params_lp: int, params: int, n: int, *, seg_start: int = 0,
                     seg_qkv: int = 0, nseg: int = 0, d: int = 0) -> None:
        """params_lp = params rounded to the compute precision; with seg_qkv (and the tensor
        table seg_start, nseg, and d, as in adamw) the tensors it names in rows."""
        self._check_lp_rows(seg_qkv, d)
        if seg_qkv and not (seg_start and nseg):
            raise ValueError("params_to_lp: seg_qkv needs the tensor table (seg_start, nseg)")
        self._go("k_params_to_lp", _blocks(n), params_lp, params, n, seg_start, seg_qkv, nseg, d)
