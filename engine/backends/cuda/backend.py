"""CudaBackend: the DESIGN §2 model trained on one NVIDIA GPU (engine/backends/base.py interface).

Everything is allocated in `__init__` (memory.Plan); `forward_backward`, `forward_loss` and the
fused `train_step` are captured once per sequence length as CUDA graphs (graphs.py) and
replayed, so a step costs a few host copies and one graph launch. Precision: float32 master
weights, gradients and Adam moments always; activations and the GEMM weight copy in `precision`
(bf16 default, fp16, or fp32).

The config's gpu section (engine.config.GpuConfig) says what to run; what runs, where the GPU
cannot honour it, is decided once at start, said in `attention_info` / `describe()` and `notes`,
and kept in `resolved`. The two main choices:
- attention: "cudnn" (cuDNN's fused flash attention, cudnn_attn.py: no [B,H,T,T] buffers) or
  "classic" (ops.attn_fwd / attn_bwd: chunked GEMMs and a softmax kernel). "auto" takes cuDNN
  when the frontend is installed, the precision is bf16/fp16 and cuDNN accepts the shapes; else
  classic, with the reason. With cuDNN, Q, K, V stand side by side in rows ([R,3d]): one GEMM
  with N = 3d computes them, cuDNN reads them and writes dQ, dK, dV so, and their input
  gradient is one GEMM over K = 3d; the GEMM copy of the weights keeps each layer's W_Q, W_K,
  W_V side by side for that ([d,3d], see `qkv_rows`). The slabs and three GEMMs where cuDNN
  refuses the rows, or with gpu.qkv_rows false.
- fusions (gpu.fusions, default on): every GEMM through gemm.LtGemm with algorithms chosen by timing at start
  (or taken from a recorded plan: `gemm_plan`), weight-gradient GEMMs and the LayerNorm parameter
  sums on a second stream, the fused kernels (residual + LayerNorm, loss forward and backward in
  one pass), and `train_step`: zero, forward, backward, gradient norm, clip, non-finite skip and
  AdamW in one graph with one host read (the AdamW left to the next step's graph, beside its
  forward: see `_apply_update`). Off: plain cuBLAS, separate kernels, the optimizer launched
  from the host: the unfused reference the fused kernels are checked against.

Activation rows are time-major (row r = t*B + b): see ops.py for why. Buffers are named, sized
and laid out by buffers.py (the saved activations by engine/backends/activations.py, the
names the numpy backend uses too).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from engine import env
from engine.backends.base import StepOutcome
from engine.backends.cuda import flex_attn, graphs
from engine.backends.cuda.buffers import (
    HP_FIELDS,
    BatchBuffers,
    grads_lp_table,
    layer_ranges,
    logits_ld,
    lp_positions,
    norm_ranges,
    plan_memory,
    qkv_seg_table,
)
from engine.backends.cuda.cublas import WORKSPACE_BYTES, Cublas
from engine.backends.cuda.cublaslt import CublasLt
from engine.backends.cuda.fp8 import GEMMS as FP8_GEMMS
from engine.backends.cuda.fp8 import Fp8Mlp, plan_fp8
from engine.backends.cuda.memory import format_plan
from engine.backends.cuda.ops import NORM_RANGE_BLOCKS, Ops
from engine.backends.cuda.runtime import ACT_BYTES, Gpu
from engine.config import ATTENTIONS, GpuConfig
from engine.errors import RunError, UserError
from engine.model.layout import ModelShapes, init_params, n_params, tensor_table

ADAMW_MAX_SEGS = 1024  # the same cap as kernels/optim.cu
STEP_SLOTS = 2  # fused steps that can be queued at once (launch_step before step_result)
SAFETY_BYTES = 256 << 20  # left free for the driver, cuBLAS's own state and graph instantiation
DEFAULT_GPU = GpuConfig()


class CudaBackend:
    """The interface of engine/backends/base.py on one GPU."""

    name = "cuda"
    on_gpu = True

    @staticmethod
    def host_plan(shapes: ModelShapes, micro_batch: int, separate_micro: bool = False
                  ) -> dict[str, int]:
        """{}: the buffers live on the device (checked against its free memory at start)."""
        return {}

    def device_step(self) -> CudaBackend | None:
        """This backend, whose `launch_step` runs the whole optimizer step in one graph, where
        fusions are on; else None."""
        return self if self.fused_step else None

    def __init__(self, shapes: ModelShapes, micro_batch: int, precision: str = "bf16",
                 dtype: type = np.float32, *, gpu: GpuConfig = DEFAULT_GPU,
                 gemm_plan: Mapping[str, Any] | None = None,
                 separate_micro: bool = False) -> None:
        """gpu: the config's gpu section (engine.config.GpuConfig: attention, fusions, ...);
        gemm_plan: a recorded GEMM plan (gemm_plan.GemmPlan.to_json()) to use instead of timing;
        separate_micro: the buffer that forward_backward(separate=True) needs (gradient
        accumulation, see the interface)."""
        if precision not in (*ACT_BYTES, "fp8"):
            raise UserError(f"train/precision: expected fp32, bf16, fp16 or fp8, got "
                            f"{precision!r}")
        # fp8: bf16 activations with the MLP's GEMMs in FP8 (fp8.py)
        self.fp8 = precision == "fp8"
        named, precision = precision, ("bf16" if self.fp8 else precision)
        if np.dtype(dtype) != np.float32:
            raise UserError("the CUDA backend computes in float32 masters; dtype must be float32")
        if micro_batch < 1:
            raise UserError(f"train/batch_size: expected a positive integer, got {micro_batch}")
        if gpu.attention not in ATTENTIONS:
            raise UserError(f"gpu.attention: expected auto, cudnn or classic, got "
                            f"{gpu.attention!r}")
        self.gpu_config = gpu
        self.notes: list[str] = []  # what the start-up decided, for the run's log
        self.fusions = gpu.fusions
        if self.fp8 and not self.fusions:
            raise UserError("train/precision fp8: the FP8 GEMMs are the fused path's, and the "
                            "config's gpu.fusions is false")
        self.shapes, self.B, self.precision = shapes, micro_batch, precision
        self.gpu = gpu_ = Gpu.get()
        self.drv = drv = gpu_.drv
        self.device = gpu_.describe(named)
        if self.fp8 and gpu_.dev.compute_capability() < (8, 9):
            major, minor = gpu_.dev.compute_capability()
            raise UserError(f"train/precision fp8: {gpu_.dev.name()} (sm_{major}{minor}) has no "
                            f"FP8 tensor cores; FP8 needs compute capability 8.9 or newer "
                            f"(Ada, Hopper): use bf16")
        if precision == "bf16" and gpu_.dev.compute_capability() < (8, 0):
            raise RunError(f"bf16 needs compute capability 8.0 or newer, {self.device} has not")
        self.stream = gpu_.stream
        self.table = tensor_table(shapes)
        self.n = n = n_params(shapes)
        self.off = {t.name: t.offset for t in self.table}
        self.es = ACT_BYTES[precision]
        self.ldv = logits_ld(shapes.vocab_size)  # aligned logits rows
        self.wte_rows = n // shapes.d_model  # rows readable from wte on (see ops.loss_fwd)
        self.use_graphs = env.CUDA_GRAPHS.read() and not env.CUDA_SYNC.read()
        # the captured graphs' memset nodes (cuDNN's, cuBLASLt's) as k_fill kernel nodes
        # (graphs.py; the same bytes), unless the fill kernel does not load
        self._memset_kernels = True
        self.S = shapes.seq_len

        self.cudnn: Any = None
        # Q, K, V side by side in rows ([R,3d]): computed by one GEMM with N = 3d, read by
        # cuDNN, which writes dQ, dK, dV so, and their input gradient one GEMM over K = 3d,
        # instead of slabs and three GEMMs each way: cuDNN attention and fusions only
        # (gpu.qkv_rows false: the slabs). The GEMM copy of the weights (plp) then keeps each
        # layer's W_Q, W_K, W_V as one [d,3d] W_QKV in their 3d² range (kernels/optim.cu
        # lp_index, buffers.lp_positions); the float32 masters, gradients, m and v, and so the
        # checkpoint, keep the flat layout of DESIGN §2. It changes the bits (the input
        # gradient's sum rounded once instead of three times).
        # (d² < 2³¹: the optimizer kernels' 32-bit division, buffers.qkv_seg_table)
        self._want_qkv_rows = (self.fusions and shapes.d_model ** 2 < 2**31 and gpu.qkv_rows)
        self.attention, self.attention_info = self._pick_attention(gpu.attention)
        # the layout cuDNN's graphs were built for decides (one place, before the GEMM copy is
        # first written): the GEMMs and the GEMM copy follow it
        self.qkv_rows = self.attention == "cudnn" and self.cudnn.rows
        # classic attention's causal chunks: its GEMMs' shapes, so its bits
        chunk = gpu.attention_chunk
        # the flex deterministic attention backward instead of cuDNN's (flex_attn.py): it
        # changes the bits; where it cannot run, cuDNN's does, and a note says why
        self.flex = self._pick_flex() if gpu.flex_backward else None
        cudnn_ws = (max(self.cudnn.workspace_bytes(self.B, self.S),
                        self.cudnn.workspace_bytes(1, self.S)) if self.cudnn else 0)
        # The training logits in the compute precision (fusions, bf16/fp16): the logits GEMM
        # rounds z as PyTorch's autocast does, the loss kernel reads half the bytes and writes
        # dlogits over them (ops.loss_fwd_bwd). It changes the bits.
        self.logits_lp = self.fusions and precision != "fp32" and gpu.logits_low_precision
        # The layers' weight gradients in the compute precision (fusions, bf16, no FP8, d_model
        # a multiple of 4, buffers.GRAD_LP_TENSORS): where a fused step writes its gradients
        # (one micro-batch at full length, one rank), its weight-gradient GEMMs round them to
        # bf16 as PyTorch's autocast does, and the norm and AdamW read half the bytes; every
        # other path keeps float32 (`_settle_glp`). It changes the bits.
        # Not in fp8 (its precision here is bf16, but its MLP writes its own float32
        # gradients). The setting also cuts the norm's ranges where the kind would change
        # (`norm_by_kind`) wherever it is on: with gradient accumulation (separate_micro, whose
        # steps add float32 gradients and keep no bf16 ones) as well, so that one GPU of two
        # micro-batches sums the norm in the order two GPUs of one do (DESIGN §11).
        norm_by_kind = (self.fusions and precision == "bf16" and not self.fp8
                        and shapes.d_model % 4 == 0 and gpu.grads_low_precision)
        self.grads_lp = norm_by_kind and not separate_micro
        # what runs, where the GPU could not honour the config: what the ranks of a job compare
        self.resolved: dict[str, bool | int | str] = {
            "attention": self.attention, "fusions": self.fusions, "qkv_rows": self.qkv_rows,
            "flex_backward": False, "logits_low_precision": self.logits_lp,
            "grads_low_precision": norm_by_kind,
            **({"attention_chunk": chunk} if self.attention == "classic" else {}),
            **({} if self.fusions else {"gelu_in_gemm": gpu.gelu_in_gemm})}
        plan, self.train, self.sample = plan_memory(shapes, micro_batch, precision,
                                                    self.attention, self.fusions, cudnn_ws,
                                                    separate_micro, self.qkv_rows,
                                                    self.logits_lp, self.grads_lp, norm_by_kind)
        if self.fp8:
            plan_fp8(plan, shapes.n_layer, shapes.d_model, shapes.d_ff, self.train.R)
        if self.flex is not None:  # its scratch and plan arrays, at the backward's one shape
            flex_attn.plan_buffers(plan, self.flex.B, self.flex.T, self.flex.H)
        self.separate_micro = separate_micro
        self._plan = plan
        nseg = len(self.table)
        if nseg > ADAMW_MAX_SEGS:  # k_adamw keeps the tensor table in shared memory
            raise UserError(f"model.n_layer: the CUDA backend handles at most "
                            f"{(ADAMW_MAX_SEGS - 4) // 10} layers, got {shapes.n_layer}")
        free, _total = drv.mem_get_info()
        totals = plan.totals()
        if totals["total"] + SAFETY_BYTES > free:
            raise RunError(
                f"the model does not fit on {self.device}: memory plan {format_plan(totals)}; "
                f"free device memory {free / 2**20:.1f} MiB (of which {SAFETY_BYTES >> 20} MiB "
                f"is kept in reserve). Use a smaller batch_size, seq_len or model.")
        plan.allocate(drv)
        cws = plan["cudnn_ws"] if self.cudnn else 0

        plan_refused = ""
        self.blas: Cublas | None = None
        self.lt: CublasLt | None = None
        self.gemm: Any = None
        self.side: Any = None
        self.comm: Any = None  # the data-parallel step's all-reduce stream (train_step)
        if self.fusions:
            from engine.backends.cuda.gemm import LtGemm

            self.gemm = LtGemm(WORKSPACE_BYTES, self.device, gpu.gemm_candidates)
            plan_refused = self.gemm.import_plan(gemm_plan)  # "" or why it is not used
            if plan_refused:
                self.notes.append(plan_refused)
            self.side = drv.Stream(flags=1)  # the weight-gradient stream (non-blocking)
            self.ops = Ops(gpu_.kernels(precision), None, self.stream, precision,
                           gemm=self.gemm, ws=plan["cublas_ws"], side=self.side,
                           ws2=plan["cublas_ws2"], cudnn=self.cudnn, cudnn_ws=cws,
                           event=lambda: drv.Event(drv.event_flags.DISABLE_TIMING),
                           attn_chunk=chunk)
            # two per weight-gradient GEMM (fork, done; 4 a layer, dwte) and per LayerNorm
            # parameter sum (2 a layer, the final one), one per layer's deferred update and per
            # range of the gradient norm (a layer's, the embeddings'), the joins
            self.ops.reserve_events(14 * shapes.n_layer + 26)
        else:
            self.blas = Cublas(self.stream.handle, plan["cublas_ws"], WORKSPACE_BYTES)
            # GELU in the MLP GEMMs' epilogues (gpu.gelu_in_gemm false: separate GELU kernels)
            self.lt = (CublasLt(self.stream.handle, plan["cublas_ws"], WORKSPACE_BYTES)
                       if gpu.gelu_in_gemm else None)
            self.ops = Ops(gpu_.kernels(precision), self.blas, self.stream, precision, self.lt,
                           cudnn=self.cudnn, cudnn_ws=cws, attn_chunk=chunk)
        self._set_stream_priorities()
        self.fp8_mlp = (Fp8Mlp(self.ops, plan, shapes.n_layer, shapes.d_model, shapes.d_ff,
                               self.ops.act, self.train.R) if self.fp8 else None)
        self.fused_step = self.fusions
        # A fused step may leave its AdamW update pending (k_step_clip recorded it): the next
        # step's graph applies it layer by layer on the weight-gradient stream while its
        # forward runs, each layer's forward waiting for its own range; anything else that
        # touches the state applies it first (_settle_update). Not with FP8 (its weight copies
        # are made at the start of the pass) nor data-parallel steps.
        self.defer_update = self.fused_step and not self.fp8
        self._update_pending = False
        self.p, self.g = plan["params"], plan["grads"]
        self.glp = plan["grads_lp"] if self.grads_lp else 0
        # the gradients of GRAD_LP_TENSORS are in grads_lp, not in grads (after a step that
        # wrote them so, until `_settle_glp`)
        self._glp_live = False
        self.plp = plan["params_lp"] if precision != "fp32" else self.p
        # the kernels' table of the tensors the GEMM copy keeps in rows (0: none; cuDNN, and so
        # the rows, never run in fp32, where the GEMMs read the masters)
        assert not (self.qkv_rows and precision == "fp32")
        self.seg_qkv = qkv_seg_table(shapes) if self.qkv_rows else None
        self._seg_qkv_dev = plan["seg_qkv"] if self.qkv_rows else 0
        self.m, self.v = plan["m"], plan["v"]
        self.nseg = nseg
        # page-locked host staging for the per-call inputs and outputs
        self.h_io = {b.p: drv.pagelocked_zeros(b.io_words, np.int32)
                     for b in (self.train, self.sample)}
        self.h_losses = drv.pagelocked_zeros(self.train.R, np.float32)
        self.h_norm = drv.pagelocked_zeros(2, np.float32)  # norm, clip
        self.h_logits = drv.pagelocked_zeros(self.ldv, np.float32)
        self._graphs: dict[tuple[Any, ...], graphs.CudaGraph] = {}
        # A gradient scale (clip, 1/n_micro) not yet written into the buffer: grad_norm and
        # adamw apply it on the fly, saving a pass over 4·n bytes; anything else settles it.
        self._pending_scale = 1.0
        # the fused step's slots (prepare_step): page-locked io block and results [R + 2] (row
        # losses, norm, clip) and an event after the copies; the steps queued (slot, T), oldest
        # first; the slot staged next
        self.h_step = [drv.pagelocked_zeros(self.train.io_words, np.int32)
                       for _ in range(STEP_SLOTS)]
        self.h_res = [drv.pagelocked_zeros(self.train.R + 2, np.float32)
                      for _ in range(STEP_SLOTS)]
        self._done = [drv.Event(drv.event_flags.DISABLE_TIMING) for _ in range(STEP_SLOTS)]
        self._queued: collections.deque[tuple[int, int]] = collections.deque()
        self._prepared: tuple[int, int] | None = None  # (slot, T)
        self._update_ranges = layer_ranges(shapes)
        self._norm = norm_ranges(shapes, norm_by_kind)  # the gradient norm's ranges
        # Everything starts at zero: rows past a short sequence are then finite (cuDNN's
        # full-length graphs read them; see cudnn_attn.py).
        for group in ("activations", "scratch") + (("flex",) if self.flex is not None else ()):
            base, size = plan.span(group)
            drv.memset_d8_async(base, 0, size, self.stream)
        # The optimizer's tensor table lives in "scratch" too: written only after that zeroing
        # (a table of zeros sends k_adamw's segment search past its shared arrays).
        self.stream.synchronize()
        self.seg_start = np.array([t.offset for t in self.table] + [n], dtype=np.int64)
        self.seg_decay = np.array([len(t.shape) == 2 for t in self.table], dtype=np.int32)
        drv.memcpy_htod(plan["seg_start"], self.seg_start)
        if self.fusions:  # the gradient norm's ranges: the update's (embeddings, each layer),
            # each cut where its gradients' kind changes (grads_lp)
            drv.memcpy_htod(plan["norm_cuts"], self._norm.cuts)
            drv.memcpy_htod(plan["norm_kinds"], self._norm.kinds)
        if self.grads_lp:
            drv.memcpy_htod(plan["seg_glp"], grads_lp_table(shapes))
        drv.memcpy_htod(plan["seg_decay"], self.seg_decay)
        if self.seg_qkv is not None:
            drv.memcpy_htod(plan["seg_qkv"], self.seg_qkv)
        if self.flex is not None:
            self._bind_flex(plan)
        self.resolved["flex_backward"] = self.flex is not None
        drv.Context.synchronize()  # pageable copies may still be in flight for our stream
        self._zero_state()
        tune = gpu.gemm_tune
        self.gemm_source = ("from the recorded plan" if gemm_plan and not plan_refused else
                            "timed at start" if tune else "cuBLASLt's first choices")
        self._warm_up(tune and self.fusions)
        self._zero_state()
        self.stream.synchronize()

    # --- start-up ---------------------------------------------------------------------------------
    def _pick_attention(self, want: str) -> tuple[str, str]:
        """("cudnn" | "classic", what runs and why), building cuDNN's graphs when it is used:
        with Q, K, V and dQ, dK, dV side by side in rows when gpu.qkv_rows wants it, else (or
        where cuDNN refuses any of those graphs, with a note) as slabs."""
        if want == "classic":
            return "classic", "classic (requested)"
        why = ""
        if self.precision == "fp32":
            why = "fp32 precision keeps the classic attention"
        else:
            from engine.backends.cuda.cudnn_attn import CudnnAttention, cudnn_available

            ok, why = cudnn_available()
            # Q, K, V in rows first when wanted; where cuDNN refuses one of those graphs (the
            # training forward, its backward, the sampling forward), the slabs
            layouts = (True, False) if self._want_qkv_rows else (False,)
            for rows in layouts if ok else ():
                s = self.shapes
                try:
                    # this backend's own graphs and handle: a cuDNN graph captured into a CUDA
                    # graph after it ran on another backend's buffers used those (freed) buffers
                    # (seen on the H200: wrong values, then an illegal address), so graphs are
                    # never shared
                    att = CudnnAttention(self.precision, s.n_head, s.d_model // s.n_head,
                                         self.stream.handle, rows=rows)
                    self.cudnn = att
                    att.build(self.B, self.S, backward=True)
                    att.build(1, self.S, backward=False)  # sampling (logits_last)
                    if self._want_qkv_rows and not rows:
                        self.notes.append(f"gpu.qkv_rows: cuDNN refuses Q, K, V in rows "
                                          f"({why}); the slabs and three GEMMs run instead")
                    return "cudnn", f"cudnn ({att.version}; deterministic backward)"
                except RunError as e:
                    why = str(e)
                except Exception as e:  # a frontend that imports but cannot start
                    why = f"cuDNN did not start: {type(e).__name__}: {e}"
                if self.cudnn is not None:
                    self.cudnn.close()
                    self.cudnn = None
        if want == "cudnn":
            raise UserError(f"gpu.attention cudnn: {why}")
        return "classic", f"classic ({why})"

    def _pick_flex(self) -> flex_attn.FlexAttention | None:
        """The flex deterministic backward (gpu.flex_backward) where it can run
        (flex_attn.refusal, then its library loads), with `attention_info` saying so; else
        None, cuDNN's backward runs and a note says why."""
        s = self.shapes
        hd = s.d_model // s.n_head
        why = flex_attn.refusal(self.attention, self.qkv_rows, self.precision, hd, self.S,
                                self.gpu.dev.compute_capability(), rows_off=self._rows_off())
        if why:
            self._flex_off(why)
            return None
        try:
            # the one shape the backward runs at: the micro-batch at full length (_backward)
            fb = flex_attn.open_backward(self.B, self.S, s.n_head, self.gpu.ordinal)
        except (RunError, UserError) as e:
            self._flex_off(str(e))
            return None
        finally:  # a build's note, whether or not its library then loads
            self.notes.extend(flex_attn.build_notes)
            flex_attn.build_notes.clear()
        self.attention_info = f"cudnn ({self.cudnn.version}; flex deterministic backward)"
        return flex_attn.FlexAttention(fb, self.cudnn.scale)  # cuDNN's forward's

    def _rows_off(self) -> str:
        """Why Q, K, V are not in rows (`qkv_rows` false; "" where they are), as __init__
        decides it: fusions off, d² ≥ 2³¹, gpu.qkv_rows false, or cuDNN refusing the rows (its
        note says why)."""
        if self.qkv_rows:
            return ""
        if not self.fusions:
            return "the rows are the fused path's, and gpu.fusions is false"
        if self.shapes.d_model ** 2 >= 2**31:
            return "d_model² ≥ 2³¹: the optimizer kernels' 32-bit division keeps the slabs"
        if not self._want_qkv_rows:
            return "gpu.qkv_rows is false"
        if self.attention != "cudnn":
            return f"the {self.attention} attention runs"
        return "cuDNN refuses them in rows: see the gpu.qkv_rows note"

    def _flex_off(self, why: str) -> None:
        """The flex backward refused (`why`): a note saying why and what runs instead."""
        then = ("cuDNN's deterministic backward runs" if self.attention == "cudnn"
                else "it is not used")
        self.notes.append(f"gpu.flex_backward: {why}; {then}")

    def _bind_flex(self, plan: Any) -> None:
        """Once the plan is allocated and zeroed: the flex backward's plan arrays uploaded, then
        its first call (which loads its cubin), eager, on layer 0's training buffers (zeros:
        finite), before any graph is captured; then Ops runs it. Where either fails with a
        RunError: cuDNN's deterministic backward, as `_pick_flex` refuses (`_flex_off`), with
        `attention_info` back to cuDNN's. Only a fault the call reports is caught: one that
        kills the context (an illegal address) is a RunError that says so, and a kernel that
        never ends is not caught."""
        assert self.flex is not None
        b = self.train
        a = b.layer(0)
        step = "its plan did not upload"
        try:
            self.flex.bind(plan, self.drv)
            step = "its first call failed"
            self.flex.bwd(dout=b.at("datt"), qkv=a["qkv"], out=a["att"], stats=a["attn_stats"],
                          dqkv=b.at("dqkv"), B=self.B, T=self.S, stream=self.stream.handle)
        except RunError as e:
            self.flex = self.ops.flex = None
            self.attention_info = f"cudnn ({self.cudnn.version}; deterministic backward)"
            self._flex_off(f"{step}: {e}")
            return
        try:
            self.stream.synchronize()
        except Exception as e:  # pycuda's own error: a fault the context does not survive
            raise RunError(f"gpu.flex_backward: its first call faulted ({type(e).__name__}: "
                           f"{e}); the CUDA context is lost: start with \"flex_backward\": "
                           f"false in the config's gpu section") from None
        self.ops.flex = self.flex

    def _time_ms(self, fn: Callable[[], None]) -> float:
        """GPU time of one fn() on the stream (CUDA events); gemm.time_interleaved repeats it."""
        e0, e1 = self.drv.Event(), self.drv.Event()
        e0.record(self.stream)
        fn()
        e1.record(self.stream)
        e1.synchronize()
        return e1.time_since(e0)

    def _zero_state(self) -> None:
        drv, n = self.drv, self.n
        for ptr in (self.p, self.g, self.m, self.v):
            drv.memset_d32_async(ptr, 0, n, self.stream)
        if self.glp:
            drv.memset_d16_async(self.glp, 0, n, self.stream)
        self._glp_live = False
        self._params_to_lp()

    def _params_to_lp(self) -> None:
        """The GEMM copy from the masters (rounded; each layer's W_Q, W_K, W_V in rows where
        `qkv_rows`); nothing in fp32, where the GEMMs read the masters."""
        if self.precision != "fp32":
            self.ops.params_to_lp(self.plp, self.p, self.n, seg_start=self._plan["seg_start"],
                                  nseg=self.nseg, **self._lp_rows())

    def _lp_rows(self) -> dict[str, int]:
        """The arguments that tell the optimizer kernels which tensors the GEMM copy keeps in
        rows (Ops.adamw's seg_qkv, d): none, unless `qkv_rows`."""
        d = self.shapes.d_model if self._seg_qkv_dev else 0
        return {"seg_qkv": self._seg_qkv_dev, "d": d}

    def _warm_up(self, tune: bool) -> None:
        """One eager forward + backward at full length (and a sampling forward): cuDNN's first
        execution of each graph does host set-up that must not happen under graph capture, and,
        with `tune`, every GEMM's algorithm is chosen by timing (on random weights: timing on
        zeros is not representative). The caller zeroes the state afterwards."""
        if tune:
            w = init_params(self.shapes, seed=12345)
            self.drv.memcpy_htod(self.p, w)
            self.drv.Context.synchronize()
            self._params_to_lp()
        rng = np.random.default_rng(0)
        tok = rng.integers(0, self.shapes.vocab_size, (self.B, self.S + 1)).astype(np.int32)
        b = self.train
        T = self._stage(b, tok[:, :-1], tok[:, 1:], 1.0)
        side = self.ops.side
        if self.gemm is not None:
            self.gemm.tuning = tune
            self.gemm.timer = self._time_ms  # only while tuning (no reference cycle after)
            self.ops.side = None  # timed on the main stream (the choice holds for both)
        try:
            self.ops.begin_pass()
            # as train_step runs at full length (the weight-gradient GEMMs with beta 0): those
            # are the problems to time
            self.ops.overwrite_grads = self.fused_step
            self.ops.wgrad_lp = self.ops.overwrite_grads and self.grads_lp
            self._forward(b, T, loss=True, train=True)
            self._backward(b, T)
            if self.ops.wgrad_lp and tune:  # a data-parallel step's float32 weight gradients
                self.ops.wgrad_lp = False
                self._backward(b, T)
            self.ops.overwrite_grads = self.ops.wgrad_lp = False
            self.ops.join()
            s = self.sample
            Ts = self._stage(s, tok[:1, :-1], None, 1.0)
            self._forward(s, Ts, loss=False)
            self.stream.synchronize()
        finally:
            self.ops.side = side
            self.ops.overwrite_grads = self.ops.wgrad_lp = False
            if self.gemm is not None:
                self.gemm.tuning = False
                self.gemm.timer = None
        if self.fp8_mlp is not None:
            self.notes.extend(self.fp8_mlp.notes)
        if self.gemm is not None:
            self.notes.extend(self.gemm.warnings)
            timed, best, first = self.gemm.timing_summary()
            if timed:
                self.notes.append(f"GEMMs: {timed} problems timed ({best:.3f} ms with the "
                                  f"fastest candidates, {first:.3f} ms with cuBLASLt's first "
                                  f"choices, once each)")

    @property
    def gemm_plan(self) -> dict[str, Any] | None:
        """The GEMM algorithms in use (engine.records.GemmPlan.to_json()), None without
        fusions: the run directory keeps it so that --resume runs the same ones."""
        return self.gemm.export_plan() if self.gemm is not None else None

    def _set_stream_priorities(self) -> None:
        """The weight-gradient stream at the least priority, below the main stream (which runs
        at the greatest: runtime.Gpu): where both have blocks waiting for SMs, the main stream's
        (the step's chain) are served first; the kernel nodes of a graph keep the priority of
        the stream they were captured from (graphs.py)."""
        if self.side is not None:
            least, _greatest = self.gpu.stream_priorities
            graphs.set_stream_priority(self.side.handle, least)

    def describe(self) -> str:
        """One line: attention, GEMMs and fusions as they run."""
        gemm = "cuBLAS (heuristic choices)"
        if self.gemm is not None:
            gemm = f"cuBLASLt, algorithms {self.gemm_source}"
        fp8 = ""
        if self.fp8_mlp is not None:
            on = self.fp8_gemms
            fp8 = (f"; FP8 (E4M3 forward, E5M2 gradients, current scaling): "
                   f"{', '.join(on) if on else 'none'}"
                   + (f" (bf16: {', '.join(g for g in FP8_GEMMS if g not in on)})"
                      if len(on) < len(FP8_GEMMS) else ""))
        rows = ("; Q, K, V in rows, one GEMM forward and one for their input gradient"
                if self.qkv_rows else "")
        over = ", dlogits over them" if self.train.dlogits_in_logits else ""
        logits = (f"; logits in {'fp16' if self.precision == 'fp16' else 'bf16'}{over}"
                  if self.logits_lp else "")
        glp = "; the layers' weight gradients in bf16" if self.grads_lp else ""
        prio = ("; the main stream's kernels before the weight-gradient stream's"
                if self.side is not None else "")
        return (f"attention {self.attention_info}; GEMMs {gemm}; fusions "
                f"{'on' if self.fusions else 'off'}{prio}{rows}{logits}{glp}{fp8}")

    @property
    def fp8_gemms(self) -> list[str]:
        """The MLP GEMMs that run in FP8 (train/precision "fp8"; [] otherwise)."""
        return self.fp8_mlp.fp8_gemms if self.fp8_mlp is not None else []

    # --- pointers ---------------------------------------------------------------------------------
    def _w(self, name: str) -> int:
        """The GEMM copy (low precision, or the fp32 master in fp32 mode) of a tensor. With
        `qkv_rows`, "h.{l}.attn.W_Q" is where layer l's W_QKV [d,3d] begins (its W_K and W_V
        have no address of their own there)."""
        return self.plp + self.off[name] * self.es

    def _p32(self, name: str) -> int:
        return self.p + self.off[name] * 4

    def _g32(self, name: str) -> int:
        return self.g + self.off[name] * 4

    def _gw(self, name: str) -> int:
        """Where the backward writes a layer matrix's weight gradient: grads_lp (the compute
        precision, the flat layout of grads) in a step that keeps them there (Ops.wgrad_lp),
        else the float32 buffer."""
        return self.glp + self.off[name] * self.es if self.ops.wgrad_lp else self._g32(name)

    # --- the model --------------------------------------------------------------------------------
    def _attention_fwd(self, b: BatchBuffers, a: dict[str, int], T: int) -> None:
        s, o = self.shapes, self.ops
        d, slab = s.d_model, b.qkv_slab()
        if self.attention == "cudnn":  # the full-length graph: causal, rows past T unused
            o.attn_fwd_cudnn(a["qkv"], a["att"], a["attn_stats"], b.B, self.S, d, slab)
        else:
            o.attn_fwd(a["qkv"], s.n_head, a["probs"], a["att"], b.at("scores"), b.B, T, d, slab)

    def _forward(self, b: BatchBuffers, T: int, loss: bool, train: bool = False,
                 ready: Callable[[int], None] | None = None) -> None:
        """train: a training step's forward (fusions: the loss kernel writes dlogits too).
        ready(l): called before layer l's parameters are first read (l = L: the final
        LayerNorm's), where the previous step's update is still being applied.

        Each residual add, x + branch, then a LayerNorm of the sum: one residual_layernorm_fwd
        with fusions, else residual_add and layernorm_fwd."""
        s, o = self.shapes, self.ops
        d, F, L = s.d_model, s.d_ff, s.n_layer
        B, R = b.B, b.B * T
        fused = self.fusions
        io = b.io()
        proj = b.at("proj")
        fp8 = self.fp8_mlp if train and b is self.train else None
        if fp8 is not None:  # this pass's FP8 weight copies, from the masters
            fp8.begin_pass(lambda layer, name: self._p32(f"h.{layer}.{name}"))
        o.embed_fwd(io["tokens"], self._p32("wte"), self._p32("wpe"), b.at("x", 0), B, T, d)
        if ready is not None:
            ready(0)
        a0 = b.layer(0)
        o.layernorm_fwd(b.at("x", 0), self._p32("h.0.ln1.gamma"), self._p32("h.0.ln1.beta"),
                        a0["ln1"], a0["ln1_stats"], a0["ln1_stats"] + R * 4, R, d)
        for l in range(L):
            h = f"h.{l}."
            a = b.layer(l)  # layer l's saved activations, by name
            st2 = a["ln2_stats"]  # mean [R] floats, then rstd [R]
            if self.qkv_rows:  # [R,3d] = ln1 @ W_QKV: the GEMM copy holds W_QKV [d,3d]
                o.attn_qkv_fwd_rows(a["ln1"], self._w(h + "attn.W_Q"), a["qkv"], R, d)
            else:
                o.attn_qkv_fwd(a["ln1"], self._w(h + "attn.W_Q"), a["qkv"], R, d,
                               b.qkv_slab())
            self._attention_fwd(b, a, T)
            # xmid = x[l] + att @ W_O; ln2 = LayerNorm(xmid)
            g2, b2 = self._p32(h + "ln2.gamma"), self._p32(h + "ln2.beta")
            o.attn_out_fwd(a["att"], self._w(h + "attn.W_O"), proj, R, d)
            if fused:
                o.residual_layernorm_fwd(b.at("x", l), proj, a["xmid"], g2, b2, a["ln2"],
                                         st2, st2 + R * 4, R, d)
            else:
                o.residual_add(b.at("x", l), proj, a["xmid"], R * d)
                o.layernorm_fwd(a["xmid"], g2, b2, a["ln2"], st2, st2 + R * 4, R, d)
            if fp8 is not None:
                fp8.forward(l, a["ln2"], self._w(h + "mlp.W_1"), self._w(h + "mlp.W_2"),
                            a["pre"], a["act"], proj, R)
            else:
                o.mlp_fwd(a["ln2"], self._w(h + "mlp.W_1"), self._w(h + "mlp.W_2"), a["pre"],
                          a["act"], proj, R, d, F)
            # x[l+1] = xmid + mlp; then the next LayerNorm: layer l+1's ln1, or lnf
            if ready is not None:
                ready(l + 1)
            if l + 1 < L:
                nxt = b.layer(l + 1)
                h1 = f"h.{l + 1}."
                gn, bn = self._p32(h1 + "ln1.gamma"), self._p32(h1 + "ln1.beta")
                out, st = nxt["ln1"], nxt["ln1_stats"]
            else:
                gn, bn = self._p32("lnf.gamma"), self._p32("lnf.beta")
                out, st = b.at("lnf"), b.at("lnf_stats")
            if fused:
                o.residual_layernorm_fwd(a["xmid"], proj, b.at("x", l + 1), gn, bn, out, st,
                                         st + R * 4, R, d)
            else:
                o.residual_add(a["xmid"], proj, b.at("x", l + 1), R * d)
                o.layernorm_fwd(b.at("x", l + 1), gn, bn, out, st, st + R * 4, R, d)
        if not loss:
            return
        args = (b.at("lnf"), self._w("wte"), io["targets"], b.at("logits"), b.at("lse"),
                b.at("losses"))
        if fused and train:
            o.loss_fwd_bwd(*args, io["scale"], b.at("dlogits"), B, T, s.vocab_size, self.ldv, d,
                           self.wte_rows, lp=b.logits_lp)
        else:
            o.loss_fwd(*args, B, T, s.vocab_size, self.ldv, d, self.wte_rows, lp=b.logits_lp)

    def _backward(self, b: BatchBuffers, T: int,
                  completed: Callable[[int], None] | None = None) -> None:
        """After `_forward(b, T, loss=True, train=True)`. Fusions: the residual gradient
        alternates between two buffers (dres, dres2; each LayerNorm backward reads one and
        writes the other), and dpre, dqkv between two by layer parity, so the weight-gradient
        GEMMs on the side stream can read one while the main stream writes the other.
        completed(i): called once the work queued so far completes bucket i of `grad_buckets`
        (a data-parallel step starts that bucket's all-reduce there)."""
        s, o = self.shapes, self.ops
        d, F, H, L = s.d_model, s.d_ff, s.n_head, s.n_layer
        B, R = b.B, b.B * T
        fused = self.fusions
        io = b.io()
        dln, datt = b.at("dln"), b.at("datt")
        part = b.at("ln_partial")
        res = [b.at("dres"), b.at("dres2") if fused else b.at("dres")]
        dpre = [b.at("dpre"), b.at("dpre2") if fused else b.at("dpre")]
        dqkv = [b.at("dqkv"), b.at("dqkv2") if fused else b.at("dqkv")]
        slab = b.qkv_slab()
        if fused:  # dlogits came with the forward (loss_fwd_bwd)
            o.loss_bwd_gemms(b.at("lnf"), self._w("wte"), dln, self._g32("wte"),
                             b.at("dlogits"), B, T, s.vocab_size, self.ldv, d, self.wte_rows,
                             pad_rows=self.S)
        else:
            o.loss_bwd(b.at("lnf"), self._w("wte"), io["targets"], b.at("logits"), b.at("lse"),
                       io["scale"], dln, self._g32("wte"), b.at("dlogits"), B, T, s.vocab_size,
                       self.ldv, d, self.wte_rows)
        stf = b.at("lnf_stats")
        cur, nxt = res
        o.layernorm_bwd(dln, b.at("x", L), self._p32("lnf.gamma"), stf, stf + R * 4, cur,
                        self._g32("lnf.gamma"), part, R, d, accumulate=False)
        for l in reversed(range(L)):
            h = f"h.{l}."
            a = b.layer(l)
            st1, st2 = a["ln1_stats"], a["ln2_stats"]
            # x[l+1] = xmid + mlp(ln2(xmid)); cur holds d x[l+1]
            mlp = (cur, a["ln2"], self._w(h + "mlp.W_1"), self._w(h + "mlp.W_2"), a["pre"],
                   a["act"], dln, self._gw(h + "mlp.W_1"), self._gw(h + "mlp.W_2"),
                   dpre[l % 2])
            if self.fp8_mlp is not None:
                self.fp8_mlp.backward(l, *mlp, R)
            else:
                o.mlp_bwd(*mlp, R, d, F)
            o.layernorm_bwd(dln, a["xmid"], self._p32(h + "ln2.gamma"), st2, st2 + R * 4, nxt,
                            self._g32(h + "ln2.gamma"), part, R, d, accumulate=True,
                            resid=cur)
            # xmid = x[l] + attn(ln1(x[l])); nxt holds d xmid
            o.attn_out_bwd(nxt, a["att"], self._w(h + "attn.W_O"), datt,
                           self._gw(h + "attn.W_O"), R, d)
            dq = dqkv[l % 2]
            if self.attention == "cudnn":
                if R < b.R:  # the full-length graph: rows past T must add nothing (dO = 0)
                    self._memset_act(datt + R * d * self.es, (b.R - R) * d)
                o.attn_bwd_cudnn(datt, a["qkv"], a["att"], a["attn_stats"], dq, B, self.S, d,
                                 slab)
            else:
                o.attn_bwd(datt, a["qkv"], a["probs"], H, dq, b.at("scores"), B, T, d, slab)
            if self.qkv_rows:
                o.attn_qkv_bwd_rows(dq, a["ln1"], self._w(h + "attn.W_Q"), dln,
                                    self._gw(h + "attn.W_Q"), R, d)
            else:
                o.attn_qkv_bwd(dq, a["ln1"], self._w(h + "attn.W_Q"), dln,
                               self._gw(h + "attn.W_Q"), R, d, slab)
            o.layernorm_bwd(dln, b.at("x", l), self._p32(h + "ln1.gamma"), st1, st1 + R * 4,
                            cur, self._g32(h + "ln1.gamma"), part, R, d, accumulate=True,
                            resid=nxt)
            if completed is not None:
                completed(L - 1 - l)
        o.embed_bwd(cur, (io["n_unique"], io["bucket_tok"], io["bucket_start"], io["rows"]),
                    self._g32("wte"), self._g32("wpe"), B, T, d)
        if completed is not None:
            completed(L)

    def grad_buckets(self) -> list[tuple[int, int]]:
        """(first, count) float32 ranges of the flat gradient in the order the backward
        completes them: the last layer with the final LayerNorm, the layers down to the first,
        then wte and wpe (the tied wte's gradient is complete only after the embedding's)."""
        L = self.shapes.n_layer
        first = [self.off[f"h.{l}.ln1.gamma"] for l in range(L)] + [self.n]
        out = [(first[L - 1], self.n - first[L - 1])]
        out += [(first[l], first[l + 1] - first[l]) for l in reversed(range(L - 1))]
        return [*out, (0, first[0])]

    def _memset_act(self, ptr: int, count: int) -> None:
        if self.es == 2:
            self.drv.memset_d16_async(ptr, 0, count, self.stream)
        else:
            self.drv.memset_d32_async(ptr, 0, count, self.stream)

    # --- per-call plumbing ------------------------------------------------------------------------
    def _check_tokens(self, inputs: np.ndarray, what: str, B: int) -> np.ndarray:
        a = np.asarray(inputs)
        if a.ndim != 2 or a.shape[0] != B or not 1 <= a.shape[1] <= self.shapes.seq_len:
            raise UserError(f"{what}: expected int [{B}, 1..{self.shapes.seq_len}], got shape "
                            f"{a.shape}")
        if not np.issubdtype(a.dtype, np.integer):
            raise UserError(f"{what}: expected integer token ids, got {a.dtype}")
        if a.size and (a.min() < 0 or a.max() >= self.shapes.vocab_size):
            raise UserError(f"{what}: token ids must be in [0, {self.shapes.vocab_size}), got "
                            f"[{a.min()}, {a.max()}]")
        return a.astype(np.int32, copy=False)

    def _stage(self, b: BatchBuffers, inputs: np.ndarray, targets: np.ndarray | None,
               loss_scale: float, hp: dict[str, float] | None = None) -> int:
        """Fill the page-locked io block (tokens, targets, embedding-gradient buckets, loss
        scale, the fused step's hyper-parameters: buffers.io_fields) and queue its copy to the
        device. Returns T."""
        h = self.h_io[b.p]
        T = b.stage(h, inputs, targets, loss_scale)
        if hp is not None:
            b.stage_hp(h, hp)
        self.drv.memcpy_htod_async(b.at("io"), h, self.stream)
        return T

    def prepare_step(self, inputs: np.ndarray, targets: np.ndarray) -> None:
        """The host's share of the next `launch_step(None, None, ...)`: the tokens checked and
        staged with their embedding-gradient buckets, while steps before may still run on the
        device. Each queued step has its own page-locked slot (its io block, sent from there,
        and its results, copied back there); this stages into a slot no queued step holds."""
        x, y = self._xy(inputs, targets)
        busy = {slot for slot, _ in self._queued}
        free = [s for s in range(STEP_SLOTS) if s not in busy]
        if not free:
            raise RunError(f"prepare_step(): {STEP_SLOTS} steps queued; step_result() first")
        slot = free[0]
        T = self.train.stage(self.h_step[slot], x, y, 1.0)
        self._prepared = (slot, T)

    def _run(self, key: tuple[Any, ...], issue: Callable[[], None]) -> None:
        """Issue the work directly, or through a graph captured on first use per key (kind, T,
        and for a step whether an update is pending before it and left pending after it)."""
        if not self.use_graphs:
            issue()
            return
        graph = self._graphs.get(key)
        if graph is None:
            fill = None
            if self._memset_kernels:
                try:
                    fill = graphs.FillKernel.of(str(self.gpu.cubin(self.precision, "fill")))
                except RunError as e:  # the graphs keep their memset nodes
                    self._memset_kernels = False
                    self.notes.append(f"the graphs' memset nodes stay memsets: {e}")
            graph = self._graphs[key] = graphs.capture(self.stream.handle, issue, fill)
            if graph.fill_note and graph.fill_note not in self.notes:
                self.notes.append(graph.fill_note)
        graph.launch()

    def _row_means(self, b: BatchBuffers, T: int) -> np.ndarray:
        R = b.B * T
        self.drv.memcpy_dtoh_async(self.h_losses[:R], b.at("losses"), self.stream)
        self.stream.synchronize()
        return self.h_losses[:R].reshape(T, b.B).astype(np.float64).mean(axis=0)

    def _xy(self, inputs: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = self._check_tokens(inputs, "inputs", self.B)
        y = self._check_tokens(targets, "targets", self.B)
        if y.shape != x.shape:
            raise UserError(f"targets: expected shape {x.shape}, got {y.shape}")
        return x, y

    # --- the interface ----------------------------------------------------------------------------
    def forward_backward(self, inputs: np.ndarray, targets: np.ndarray,
                         loss_scale: float = 1.0, separate: bool = False) -> np.ndarray:
        self._settle_update()
        self._settle_glp()  # the float32 buffer whole before it is added to
        if separate:
            # This micro-batch's gradient on its own, then one add (see the interface).
            if not self.separate_micro:
                raise RunError("separate micro-batch gradients need separate_micro=True")
            self._settle_scale()
            save = self._plan["grads_save"]
            self.drv.memcpy_dtod_async(save, self.g, self.n * 4, self.stream)
            self.drv.memset_d32_async(self.g, 0, self.n, self.stream)
            rows = self._forward_backward(inputs, targets, loss_scale)
            self.ops.grad_add(self.g, save, self.n)
            return rows
        return self._forward_backward(inputs, targets, loss_scale)

    def grad_device(self) -> tuple[int, int, Any]:
        """(device pointer, float32 count, stream) of the live gradient buffer, every deferred
        scale settled: what a data-parallel all-reduce sums in place, on this stream."""
        self._settle_update()
        self._settle_glp()
        self._settle_scale()
        return self.g, self.n, self.stream

    def _forward_backward(self, inputs: np.ndarray, targets: np.ndarray,
                          loss_scale: float) -> np.ndarray:
        b = self.train
        x, y = self._xy(inputs, targets)
        T = self._stage(b, x, y, loss_scale)

        def issue() -> None:
            self.ops.begin_pass()
            self._forward(b, T, loss=True, train=True)
            self._backward(b, T)
            self.ops.join()

        self._settle_scale()  # accumulating onto scaled gradients
        self._run(("fb", T), issue)
        return self._row_means(b, T)

    def train_step(self, inputs: np.ndarray, targets: np.ndarray, *, loss_scale: float,
                   grad_mult: float, lr: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, t: int, max_norm: float, reducer: Any = None
                   ) -> StepOutcome:
        """`launch_step` then `step_result`: one optimizer step, waited for."""
        self.launch_step(inputs, targets, loss_scale=loss_scale, grad_mult=grad_mult, lr=lr,
                         beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, t=t,
                         max_norm=max_norm, reducer=reducer)
        return self.step_result()

    def launch_step(self, inputs: np.ndarray | None, targets: np.ndarray | None, *,
                    loss_scale: float,
                    grad_mult: float, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, t: int, max_norm: float, reducer: Any = None) -> None:
        """One whole optimizer step of DESIGN §4 for one micro-batch, in one captured graph,
        queued and not waited for (the host may do other work meanwhile; `step_result` waits;
        inputs None: the tokens given to `prepare_step`):
        zero_grads → forward, backward (loss_scale) → grads·grad_mult → grad norm → when the
        norm is finite: clip (max_norm) and AdamW (lr, t); else nothing changes. One host read.
        The AdamW may be left pending to the next step's graph (`defer_update`); whatever reads
        or uses the state applies it first, so callers see the stepped state either way.
        `step_result` returns (per-row mean loss [B], the norm, the clip factor used: 1.0
        when none or skipped). Needs fusions (`fused_step`).

        reducer: one rank of a data-parallel job (`all_reduce_sum(ptr, count, stream)`, NCCL):
        each bucket of `grad_buckets` is summed over the ranks on a third stream as soon as the
        backward has completed it, overlapping the layers still to go; the norm waits for the
        last. grad_mult then includes 1/world. Every rank must call this alike."""
        if not self.fused_step:
            raise RunError("train_step needs the fused step (fusions on)")
        if t < 1:
            raise ValueError(f"train_step: t is the 1-based Adam step, got {t}")
        b = self.train
        if len(self._queued) >= STEP_SLOTS:
            raise RunError(f"launch_step(): {STEP_SLOTS} steps queued; step_result() first")
        if inputs is not None:
            self.prepare_step(inputs, targets)
        elif self._prepared is None:
            raise RunError("launch_step(None, None, ...) without prepare_step()")
        (slot, T), self._prepared = self._prepared, None
        h = self.h_step[slot]
        b.stage_scale(h, loss_scale, b.B * T)
        # A step queued behind another guesses that one applies its update (Adam's t); the
        # device corrects the guess when it was skipped (k_step_hp)
        b.stage_hp(h, self._hp(grad_mult, lr, beta1, beta2, eps, weight_decay, t, max_norm,
                               behind=bool(self._queued)))
        self.drv.memcpy_htod_async(b.at("io"), h, self.stream)
        self._pending_scale = 1.0  # the step zeroes the gradients first

        # At full length every parameter's gradient is written by this micro-batch (GEMMs with
        # beta 0, the LayerNorm and position sums stored): no zeroing pass over the 4·n bytes.
        # A shorter sequence leaves position rows unwritten: zero, then add, as usual.
        write = T == self.S
        # ... and with grads_lp, on one rank, the layers' weight gradients into grads_lp
        lp = self.grads_lp and write and reducer is None
        if reducer is not None or not write:
            # the gradients are summed eagerly before a data-parallel capture, or zeroed first:
            # the update still pending (it reads them) goes before, on its own
            self._settle_update()
            self._glp_live = False  # float32 gradients, written or zeroed whole by this step
        pending = self._update_pending  # the step ahead left its update to this graph
        # (a deferred update is a step's with `write` on one rank: its gradients' kind is lp's)
        assert not pending or self._glp_live == lp
        defer = self.defer_update and reducer is None and write
        key = ("step" if reducer is None else "step-ddp", T, pending, defer, lp)
        if reducer is not None:
            self._ready_to_reduce(reducer, key)
        buckets = self.grad_buckets()

        def reduce_bucket(i: int) -> None:
            first, count = buckets[i]
            self.ops.fork_to(self.comm)
            reducer.all_reduce_sum(self.g + 4 * first, count, self.comm)

        def norm_range(i: int) -> None:  # bucket i complete: its range's share of the norm
            L = self.shapes.n_layer  # (beside the backward, after the side's gradient work)
            self._norm_ranges(*self._norm.groups[L - i if i < L else 0], side=True, lp=lp)

        def issue() -> None:
            o = self.ops
            o.step_hp(b.io()["hp"], self._plan["skipped"])
            o.begin_pass()
            # the pending update beside the forward needs the gradients it reads left alone
            # until the backward (written, not zeroed first)
            ready = self._apply_update(beside=write) if pending else None
            if pending and not self.use_graphs:
                self._update_pending = False  # applied now: a failure below must not repeat it
            if not write:
                self.drv.memset_d32_async(self.g, 0, self.n, self.stream)
            o.overwrite_grads, o.wgrad_lp = write, lp
            try:
                self._forward(b, T, loss=True, train=True, ready=ready)
                # the gradient norm's partials as the backward completes each range, beside it;
                # data parallel: after the all-reduce, at the end
                self._backward(b, T, reduce_bucket if reducer is not None else norm_range)
            finally:
                o.overwrite_grads = o.wgrad_lp = False
            o.join()
            if reducer is not None:
                o.wait_for(self.comm)
            self._optimizer_tail(b, apply=not defer, partials=reducer is not None, lp=lp)

        self._run(key, issue)
        self._glp_live = lp
        self._update_pending = defer
        self._copy_results(self.h_res[slot], T)
        self._done[slot].record(self.stream)
        self._queued.append((slot, T))

    def _copy_results(self, h: np.ndarray, T: int) -> None:
        """Queue the copies of a step's row losses, norm and clip factor into h [R + 2]."""
        R = self.train.B * T
        self.drv.memcpy_dtoh_async(h[:R], self.train.at("losses"), self.stream)
        self.drv.memcpy_dtoh_async(h[R : R + 1], self._plan["norm"], self.stream)
        self.drv.memcpy_dtoh_async(h[R + 1 : R + 2], self._plan["clip"], self.stream)

    @property
    def queued_steps(self) -> int:
        """Steps `launch_step` queued that `step_result` has not returned yet."""
        return len(self._queued)

    def step_result(self) -> StepOutcome:
        """Wait for the oldest step `launch_step` queued (not for any queued after it)."""
        if not self._queued:
            raise RunError("step_result() without launch_step()")
        slot, T = self._queued.popleft()
        self._done[slot].synchronize()
        h, R = self.h_res[slot], self.train.B * T
        rows = h[:R].reshape(T, self.train.B).astype(np.float64).mean(axis=0)
        return StepOutcome(rows, float(h[R]), float(h[R + 1]))

    def optimizer_step(self, *, grad_mult: float, lr: float, beta1: float, beta2: float,
                       eps: float, weight_decay: float, t: int, max_norm: float
                       ) -> tuple[float, float]:
        """The end of `train_step` on the gradients accumulated since `zero_grads` (after
        several micro-batches, or a data-parallel all-reduce outside the step): grads·grad_mult
        → norm → clip and AdamW when finite, on the device, in one graph, with train_step's
        very kernels, and its bits where train_step keeps float32 gradients (not with
        `grads_lp`). Returns (the norm, the clip factor used)."""
        if not self.fused_step:
            raise RunError("optimizer_step needs the fused step (fusions on)")
        if t < 1:
            raise ValueError(f"optimizer_step: t is the 1-based Adam step, got {t}")
        b = self.train
        self._settle_update()
        self._settle_glp()
        self._settle_scale()
        h = self.h_io[b.p]
        b.stage_hp(h, self._hp(grad_mult, lr, beta1, beta2, eps, weight_decay, t, max_norm))
        at, n = b.io_fields["hp"], len(HP_FIELDS)
        self.drv.memcpy_htod_async(b.at("io") + 4 * at, h[at : at + n], self.stream)
        self._run(("opt", 0), lambda: self._optimizer_tail(b))
        self.drv.memcpy_dtoh_async(self.h_norm[:1], self._plan["norm"], self.stream)
        self.drv.memcpy_dtoh_async(self.h_norm[1:], self._plan["clip"], self.stream)
        self.stream.synchronize()
        return float(self.h_norm[0]), float(self.h_norm[1])

    @staticmethod
    def _hp(grad_mult: float, lr: float, beta1: float, beta2: float, eps: float,
            weight_decay: float, t: int, max_norm: float, behind: bool = False
            ) -> dict[str, float]:
        """HP_FIELDS' values. behind: queued behind a step not yet ended, which t - 1 assumes
        applied (bc*_alt: Adam's step t - 1, for when it was skipped)."""
        alt = max(t - 1, 1)
        return {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps,
                "weight_decay": weight_decay, "bc1": 1.0 - beta1**t, "bc2": 1.0 - beta2**t,
                "grad_mult": grad_mult, "max_norm": max_norm, "bc1_alt": 1.0 - beta1**alt,
                "bc2_alt": 1.0 - beta2**alt, "alt_if_skipped": 1.0 if behind else 0.0}

    def _norm_ranges(self, first: int, count: int, side: bool = False, gs: float = 1.0,
                     staged: bool = True, lp: bool = False) -> None:
        """The gradient norm's partials of its ranges first .. first + count - 1 (buffers.
        norm_ranges: the update's, embeddings then each layer, cut where the kind changes),
        scaled by the training buffers' staged grad_mult (staged) or by gs; lp: the layers'
        weight gradients read from grads_lp."""
        gm = self.train.io()["hp"] + 4 * HP_FIELDS.index("grad_mult") if staged else 0
        glp = {"grads_lp": self.glp, "kinds": self._plan["norm_kinds"]} if lp else {}
        self.ops.grad_norm_ranges(self.g, self._plan["norm_cuts"], first, count,
                                  self._plan["norm_partials"], gs=gs, gs_dev=gm, side=side,
                                  **glp)

    def _norm_final(self) -> None:
        self.ops.grad_norm_final(self._plan["norm_partials"], self._plan["norm"],
                                 NORM_RANGE_BLOCKS * len(self._norm))

    def _optimizer_tail(self, b: BatchBuffers, apply: bool = True, partials: bool = True,
                        lp: bool = False) -> None:
        """grads·grad_mult → norm → clip (or skip) → AdamW, reading the hyper-parameters staged
        in b's io block; the norm and the clip factor stay in the plan's `norm` and `clip`, and
        the update's values in `update`. apply False: the update is left pending. partials
        False: the norm's partials are already there (the backward queued them). lp: the
        layers' weight gradients are in grads_lp."""
        o, io = self.ops, b.io()
        norm = self._plan["norm"]
        if partials:
            self._norm_ranges(0, len(self._norm), lp=lp)
        self._norm_final()
        o.step_clip(self._plan["update"], io["hp"], norm, self._plan["clip"],
                    self._plan["skipped"])
        if apply:
            self._adamw_range(0, self.n, lp=lp)

    def _adamw_range(self, begin: int, end: int, stream: Any = None, lp: bool = False) -> None:
        """The step's AdamW (k_step_clip's record) over [begin, end); lp: the layers' weight
        gradients read from grads_lp."""
        plp = self.plp if self.precision != "fp32" else 0
        glp = {"grads_lp": self.glp, "seg_glp": self._plan["seg_glp"]} if lp else {}
        self.ops.adamw_step(self.p, plp, self.g, self.m, self.v, self._plan["seg_start"],
                            self._plan["seg_decay"], self.nseg, begin, end,
                            self._plan["update"], stream=stream, **self._lp_rows(), **glp)

    def _apply_update(self, beside: bool) -> Callable[[int], None] | None:
        """Queue the pending update (k_step_clip's record). beside: the layers' ranges on the
        weight-gradient stream, returning the `ready` of `_forward` (layer l's forward waits for
        its range); else one launch on the main stream. Same bits either way."""
        o, lp = self.ops, self._glp_live  # where the pending step left its gradients
        if not beside or o.side is None:
            self._adamw_range(0, self.n, lp=lp)
            return None
        o._to_side()
        done = []
        for begin, end in self._update_ranges[1:]:
            self._adamw_range(begin, end, stream=o.side, lp=lp)
            ev = o._event()
            ev.record(o.side)
            done.append(ev)
        self._adamw_range(*self._update_ranges[0], lp=lp)  # the embeddings, read first
        return lambda l: self.stream.wait_for_event(done[min(l, len(done) - 1)])

    def _settle_update(self) -> None:
        """Apply a step's pending update now (before the state is read or used)."""
        if self._update_pending:
            self._run(("update", self._glp_live), lambda: self._apply_update(beside=False))
            self._update_pending = False

    def _settle_glp(self) -> None:
        """The layers' weight gradients a step left in grads_lp written into the float32
        buffer (exact), before anything else reads or adds to it: read_grads, the host-driven
        norm and AdamW, accumulation, an all-reduce see the very gradients the step used.
        After `_settle_update` (the update pending reads grads_lp)."""
        if self._glp_live:
            self.ops.grads_from_lp(self.g, self.glp, self._plan["norm_cuts"],
                                   self._plan["norm_kinds"], len(self._norm))
            self._glp_live = False

    def _ready_to_reduce(self, reducer: Any, key: tuple[Any, ...]) -> None:
        """Before the data-parallel step's graph is captured: the all-reduce stream, events for
        its forks, and the very all-reduces the graph will hold run once eagerly (NCCL connects
        its channels, per algorithm, on first use, which must not happen under capture; the
        gradients they sum are then overwritten or zeroed by the step)."""
        if self.comm is None:
            self.comm = self.drv.Stream(flags=1)
            graphs.set_stream_priority(self.comm.handle, self.gpu.stream_priorities[1])
            self.ops.reserve_events(16 * self.shapes.n_layer + 32)
        if key not in self._graphs and self.use_graphs:
            self.stream.synchronize()
            for first, count in self.grad_buckets():
                reducer.all_reduce_sum(self.g + 4 * first, count, self.comm)
            self.comm.synchronize()

    def forward_loss(self, inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
        self._settle_update()
        b = self.train
        x, y = self._xy(inputs, targets)
        T = self._stage(b, x, y, 1.0)
        self._run(("f", T), lambda: self._forward(b, T, loss=True))
        return self._row_means(b, T)

    def logits_last(self, tokens: np.ndarray) -> np.ndarray:
        self._settle_update()
        b, s = self.sample, self.shapes
        x = self._check_tokens(np.asarray(tokens).reshape(1, -1), "tokens", 1)
        T = self._stage(b, x, None, 1.0)
        self.ops.begin_pass()
        self._forward(b, T, loss=False)  # own buffers; no graph: every prompt length differs
        last = b.at("lnf") + (T - 1) * s.d_model * self.es
        self.ops._mm(b.at("logits"), last, self._w("wte"), 1, s.vocab_size, s.d_model, tb=True,
                     out32=True)
        V = s.vocab_size
        self.drv.memcpy_dtoh_async(self.h_logits[:V], b.at("logits"), self.stream)
        self.stream.synchronize()
        return self.h_logits[:V].copy()

    def _put(self, ptr: int, a: np.ndarray, what: str) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        if a.shape != (self.n,):
            raise UserError(f"{what}: expected a flat float32 array of {self.n}, got {a.shape}")
        self.stream.synchronize()
        self.drv.memcpy_htod(ptr, a)
        # A pageable copy can return before its DMA lands, and our stream does not wait for the
        # legacy stream: make sure the kernels launched next read the new values.
        self.drv.Context.synchronize()

    def _get(self, ptr: int) -> np.ndarray:
        out = np.empty(self.n, dtype=np.float32)
        self.stream.synchronize()
        self.drv.memcpy_dtoh(out, ptr)
        return out

    def load_params(self, params: np.ndarray) -> None:
        self._settle_update()
        self._put(self.p, params, "params")
        self._params_to_lp()
        self.stream.synchronize()

    def load_optimizer(self, m: np.ndarray, v: np.ndarray) -> None:
        self._settle_update()
        self._put(self.m, m, "adam m")
        self._put(self.v, v, "adam v")

    def read_params(self) -> np.ndarray:
        self._settle_update()
        return self._get(self.p)

    def read_params_lp(self) -> np.ndarray:
        """The GEMM copy of the weights as float32 values in the flat layout of DESIGN §2 (each
        layer's W_Q, W_K, W_V taken back from rows where `qkv_rows`, buffers.lp_positions):
        equal to read_params() rounded to the compute precision (the masters in fp32). For
        checking the copy; nothing in a run reads it."""
        self._settle_update()
        if self.precision == "fp32":
            return self._get(self.p)
        raw = np.empty(self.n, dtype=np.uint16)
        self.stream.synchronize()
        self.drv.memcpy_dtoh(raw, self.plp)
        vals = ((raw.astype(np.uint32) << 16).view(np.float32) if self.precision == "bf16"
                else raw.view(np.float16).astype(np.float32))
        if self.seg_qkv is None:
            return vals
        return vals[lp_positions(self.seg_start, self.seg_qkv, self.shapes.d_model)]

    def read_grads(self) -> np.ndarray:
        self._settle_update()
        self._settle_glp()
        self._settle_scale()
        return self._get(self.g)

    def read_optimizer(self) -> tuple[np.ndarray, np.ndarray]:
        self._settle_update()
        return self._get(self.m), self._get(self.v)

    def copy_state_into(self, params: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
        self._settle_update()
        self.stream.synchronize()
        for out, ptr in ((params, self.p), (m, self.m), (v, self.v)):
            if out.dtype != np.float32 or out.shape != (self.n,) or not out.flags.c_contiguous:
                raise ValueError(f"copy_state_into: expected contiguous float32 [{self.n}]")
            self.drv.memcpy_dtoh(out, ptr)

    def zero_grads(self) -> None:
        self._settle_update()
        self.drv.memset_d32_async(self.g, 0, self.n, self.stream)
        self._pending_scale = 1.0
        self._glp_live = False

    def _settle_scale(self) -> None:
        if self._pending_scale != 1.0:
            self.ops.grad_scale(self.g, self.n, self._pending_scale)
            self._pending_scale = 1.0

    def scale_grads(self, s: float) -> None:
        self.grad_scale(s)

    def grad_scale(self, s: float) -> None:
        """grads *= s, deferred: the next grad_norm or adamw multiplies as it reads, rounding
        g·s to float exactly as a separate pass would have stored it (same bits). A second
        scale while one is pending settles the first, so s1 then s2 stays fl(fl(g·s1)·s2)."""
        self._settle_update()
        self._settle_glp()
        if float(s) == 1.0:
            return
        self._settle_scale()
        self._pending_scale = float(s)

    def grad_norm(self) -> float:
        self._settle_update()
        self._settle_glp()
        partials, norm = self._plan["norm_partials"], self._plan["norm"]
        if self.fusions:
            self._norm_ranges(0, len(self._norm), gs=self._pending_scale, staged=False)
            self._norm_final()
        else:
            self.ops.grad_norm_partial(self.g, self.n, partials, self._pending_scale)
            self.ops.grad_norm_final(partials, norm)
        self.drv.memcpy_dtoh_async(self.h_norm[:1], norm, self.stream)
        self.stream.synchronize()
        return float(self.h_norm[0])

    def adamw(self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              t: int) -> None:
        self._settle_update()
        self._settle_glp()
        lp = self.plp if self.precision != "fp32" else 0
        self.ops.adamw(self.p, lp, self.g, self.m, self.v, self._plan["seg_start"],
                       self._plan["seg_decay"], self.nseg, self.n, float(lr), float(beta1),
                       float(beta2), float(eps), float(weight_decay), int(t),
                       self._pending_scale, **self._lp_rows())

    def memory_plan(self) -> dict[str, int]:
        return self._plan.totals()

    def graph_nodes(self, kind: str = "step") -> dict[str, int]:
        """Node counts by type of the captured graph of `kind` ("step", "fb", "f") at the
        longest sequence length captured so far; {} when there is none. Its memset nodes that
        became k_fill nodes count as kernel nodes (graph_fills says how many)."""
        graph = self._latest_graph(kind)
        return graph.node_counts() if graph is not None else {}

    def graph_fills(self, kind: str = "step") -> int:
        """How many of graph_nodes(kind)'s kernel nodes are k_fill nodes (memsets before)."""
        graph = self._latest_graph(kind)
        return len(graph.fills) if graph is not None else 0

    def _latest_graph(self, kind: str) -> graphs.CudaGraph | None:
        keys = sorted(k for k in self._graphs if k[0] == kind)
        return self._graphs[keys[-1]] if keys else None

    def synchronize(self) -> None:
        """Wait for all queued GPU work (for timing; the interface calls sync where needed)."""
        self.stream.synchronize()

    def close(self) -> None:
        """Free the graphs, the cuBLAS handles, cuDNN and the device memory now (tests make
        many)."""
        self.stream.synchronize()
        for s in (self.side, self.comm):
            if s is not None:
                s.synchronize()
        for g in self._graphs.values():
            g.close()
        self._graphs.clear()
        for lib in (self.blas, self.lt, self.gemm):
            if lib is not None:
                lib.close()
        if self.cudnn is not None:
            self.cudnn.close()
            self.cudnn = None
        self.flex = self.ops.flex = None  # its argument structs point into the plan's memory
        self._plan.free()


__all__ = ["ATTENTIONS", "CudaBackend"]
