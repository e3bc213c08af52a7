"""How the CUDA ops run their work: kernels launched by name on the main stream (or another),
GEMMs through LtGemm (algorithms chosen by timing) or plain cuBLAS, and the weight-gradient
stream (`side`): a GEMM whose result only later work reads runs there after everything the main
stream has queued so far, and the main stream waits for it only before it rewrites a buffer that
GEMM reads (`_wgrad`, `_on_side`, `_writes`), or at a join. Same GEMM, same algorithm: same bits
on either stream. Ops (ops.py) builds the op twins on this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine import env
from engine.backends.cuda.cublas import DTYPE_OF_PRECISION, R_32F, Cublas
from engine.backends.cuda.cublaslt import CublasLt
from engine.backends.cuda.gemm import LtGemm
from engine.errors import RunError

THREADS = 256
ROWS_PER_BLOCK = THREADS // 32  # one warp per row
MAX_GRID = 8192
VEC_BYTES = 16


def blocks(n: int, per: int = THREADS, cap: int = MAX_GRID) -> int:
    """Blocks of `per` threads for n elements, at least 1 and at most `cap`."""
    return max(1, min(cap, -(-n // per)))


class Launcher:
    """Kernels + GEMMs + streams for one compute precision.

    GEMMs: `gemm` (an LtGemm, with `ws` its workspace on this stream) when given, else the
    plain cuBLAS handle `blas` with `lt` (cuBLASLt) for the MLP's GELU epilogues (None: the GELU
    kernels). `side`: a second stream (with workspace `ws2`, LtGemm only) for the weight-
    gradient GEMMs, with `event` making the events that order the two streams.
    """

    def __init__(self, kernels: dict[str, Any], blas: Cublas | None, stream: Any, precision: str,
                 lt: CublasLt | None = None, *, gemm: LtGemm | None = None, ws: int = 0,
                 side: Any = None, ws2: int = 0,
                 event: Callable[[], Any] | None = None) -> None:
        self.k, self.blas, self.stream, self.lt = kernels, blas, stream, lt
        self.gemm, self.ws, self.side, self.ws2 = gemm, ws, side, ws2
        if side is not None and (gemm is None or event is None):
            raise ValueError("a weight-gradient stream needs LtGemm GEMMs and events")
        self._new_event = event
        self.act = DTYPE_OF_PRECISION[precision]
        self.esize = 4 if precision == "fp32" else 2  # bytes per activation element
        # the fused step's single micro-batch WRITES the parameter gradients (GEMMs with beta 0,
        # the LayerNorm and position sums stored) instead of zeroing them and adding
        self.overwrite_grads = False
        # ... and writes the layers' weight gradients in the compute precision, into the
        # backend's grads_lp (CudaBuild.grads_lp; with overwrite_grads only)
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
        allows them, for dev/bench_kernels.py)."""
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
        GEMM, same algorithm: same bits. `types`: the operands' types (a, b) where they are not
        the precision's (the FP8 GEMMs, fp8.py); the output's is always the gradient buffer's."""
        lp = self.wgrad_lp and layer
        if lp and not self.overwrite_grads:
            raise ValueError("Ops._wgrad: wgrad_lp writes the gradients, it needs overwrite_grads")
        if "types" in kw:
            kw["types"] = (*kw["types"][:2], self.act if lp else R_32F)
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
