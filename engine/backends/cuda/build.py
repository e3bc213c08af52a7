"""What a CudaBackend is made of, built once at start: the config's gpu section resolved against
the GPU (what runs where the GPU cannot honour it, said in `notes` and kept in `resolved`), the
memory plan checked against the device's free memory and allocated, the GEMM libraries and the
kernels (Ops), and the tables the kernels read, uploaded. CudaBuild does no training work: the
warm-up pass (warmup.py) and the step (step_graph.py) run on what it built.

The choices, beside the attention's (attention_choice.py):
- fusions (gpu.fusions, default on): every GEMM through gemm.LtGemm with algorithms chosen by
  timing at start (or taken from a recorded plan), weight-gradient GEMMs and the LayerNorm
  parameter sums on a second stream, the fused kernels (residual + LayerNorm, loss forward and
  backward in one pass), and the one-graph step (step_graph.py). Off: plain cuBLAS, separate
  kernels, the optimizer launched from the host: the unfused reference the fused kernels are
  checked against.
- the training logits in the compute precision (gpu.logits_low_precision; fusions, bf16/fp16):
  the logits GEMM rounds z as PyTorch's autocast does, the loss kernel reads half the bytes and
  writes dlogits over them (Ops.loss_fwd_bwd). It changes the bits.
- the layers' weight gradients in bf16 (gpu.grads_low_precision; fusions, bf16 or fp8, d_model
  a multiple of 4, buffers.GRAD_LP_TENSORS): where a fused step writes its gradients (one
  micro-batch at full length, one rank), its weight-gradient GEMMs (the FP8 ones too) round
  them to bf16 as PyTorch's autocast does, and the norm and AdamW read half the bytes; every
  other path keeps float32 (DeviceOptimizer.settle_glp). It changes the bits. The setting also
  cuts the norm's ranges where the kind would change (`norm_by_kind`) wherever it is on: with
  gradient accumulation (separate_micro, whose steps add float32 gradients and keep no bf16
  ones) as well, so that one GPU of two micro-batches sums the norm in the order two GPUs of one
  do (DESIGN §11).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from engine.backends.cuda import flex_attn, graphs
from engine.backends.cuda.attention_choice import AttentionChoice
from engine.backends.cuda.buffers import (
    grads_lp_table,
    layer_ranges,
    logits_ld,
    norm_ranges,
    plan_memory,
)
from engine.backends.cuda.cublas import WORKSPACE_BYTES, Cublas
from engine.backends.cuda.cublaslt import CublasLt
from engine.backends.cuda.flat_buffers import FlatBuffers
from engine.backends.cuda.fp8 import GEMMS as FP8_GEMMS
from engine.backends.cuda.fp8 import Fp8Gemms, plan_fp8
from engine.backends.cuda.memory import format_plan
from engine.backends.cuda.ops import Ops
from engine.backends.cuda.runtime import ACT_BYTES, Gpu
from engine.config import ATTENTIONS, GpuConfig
from engine.errors import RunError, UserError
from engine.model.fp8 import HISTORY
from engine.model.layout import ModelShapes, tensor_table

ADAMW_MAX_SEGS = 1024  # the same cap as kernels/optim.cu
SAFETY_BYTES = 256 << 20  # left free for the driver, cuBLAS's own state and graph instantiation


def compute_precision(precision: str, dtype: type, micro_batch: int, gpu: GpuConfig) -> str:
    """The activations' precision for train/precision `precision` (fp8: bf16 activations with
    the layers' linear maps' GEMMs in FP8, fp8.py); UserError for what the CUDA backend cannot
    run."""
    if precision not in (*ACT_BYTES, "fp8"):
        raise UserError(f"train/precision: expected fp32, bf16, fp16 or fp8, got {precision!r}")
    if np.dtype(dtype) != np.float32:
        raise UserError("the CUDA backend computes in float32 masters; dtype must be float32")
    if micro_batch < 1:
        raise UserError(f"train/batch_size: expected a positive integer, got {micro_batch}")
    if gpu.attention not in ATTENTIONS:
        raise UserError(f"gpu.attention: expected auto, cudnn or classic, got {gpu.attention!r}")
    if precision == "fp8" and not gpu.fusions:
        raise UserError("train/precision fp8: the FP8 GEMMs are the fused path's, and the "
                        "config's gpu.fusions is false")
    return "bf16" if precision == "fp8" else precision


class CudaBuild:
    """The resolved choices, the allocated buffers and the libraries of one backend."""

    def __init__(self, shapes: ModelShapes, micro_batch: int, precision: str, dtype: type,
                 gpu: GpuConfig, gemm_plan: Mapping[str, Any] | None,
                 separate_micro: bool) -> None:
        compute = compute_precision(precision, dtype, micro_batch, gpu)
        self.fp8 = precision == "fp8"
        self.gpu_config, self.fusions = gpu, gpu.fusions
        self.notes: list[str] = []  # what the start-up decided, for the run's log
        self.shapes, self.B, self.S, self.precision = shapes, micro_batch, shapes.seq_len, compute
        self.separate_micro = separate_micro
        self.gpu = Gpu.get()
        self.drv, self.stream = self.gpu.drv, self.gpu.stream
        self.device = self.gpu.describe(precision)
        self._check_device()
        self.es = ACT_BYTES[compute]
        self.ldv = logits_ld(shapes.vocab_size)  # aligned logits rows
        self._resolve()
        self._allocate()
        self.flat = FlatBuffers(shapes, self.plan, compute, self.es, self.qkv_rows,
                                self.grads_lp)
        self.norm = norm_ranges(shapes, self.norm_by_kind)  # the gradient norm's ranges
        self.update_ranges = layer_ranges(shapes)  # a deferred update's, layer by layer
        self._load_libraries(gemm_plan)
        self.fused_step = self.fusions  # train_step, launch_step, optimizer_step
        self._upload()

    # --- what runs -----------------------------------------------------------------------------
    def _check_device(self) -> None:
        capability = self.gpu.dev.compute_capability()
        if self.fp8 and capability < (8, 9):
            major, minor = capability
            raise UserError(f"train/precision fp8: {self.gpu.dev.name()} (sm_{major}{minor}) "
                            f"has no FP8 tensor cores; FP8 needs compute capability 8.9 or "
                            f"newer (Ada, Hopper): use bf16")
        if self.precision == "bf16" and capability < (8, 0):
            raise RunError(f"bf16 needs compute capability 8.0 or newer, {self.device} has not")

    def _resolve(self) -> None:
        """The attention path, the low-precision logits and gradients, and `resolved`: what
        runs, where the GPU could not honour the config (what the ranks of a job compare)."""
        gpu, shapes = self.gpu_config, self.shapes
        self.attn = AttentionChoice(shapes, self.B, self.precision, self.fusions, gpu.qkv_rows,
                                    self.gpu, self.stream, self.notes)
        self.attn.choose(gpu.attention, gpu.flex_backward)
        self.logits_lp = self.fusions and self.precision != "fp32" and gpu.logits_low_precision
        self.norm_by_kind = (self.fusions and self.precision == "bf16"
                             and shapes.d_model % 4 == 0 and gpu.grads_low_precision)
        # one micro-batch's own bf16 gradients: not where steps accumulate (separate_micro)
        self.grads_lp = self.norm_by_kind and not self.separate_micro
        self.resolved: dict[str, bool | int | str] = {
            "attention": self.attention, "fusions": self.fusions, "qkv_rows": self.qkv_rows,
            "flex_backward": False, "logits_low_precision": self.logits_lp,
            "grads_low_precision": self.norm_by_kind,
            **({"attention_chunk": gpu.attention_chunk} if self.attention == "classic" else {}),
            **({} if self.fusions else {"gelu_in_gemm": gpu.gelu_in_gemm})}

    @property
    def attention(self) -> str:
        """"cudnn" | "classic"."""
        return self.attn.attention

    @property
    def attention_info(self) -> str:
        """Which attention runs and why."""
        return self.attn.info

    @property
    def qkv_rows(self) -> bool:
        """Q, K, V side by side in rows (attention_choice.py)."""
        return self.attn.qkv_rows

    @property
    def cudnn(self) -> Any:
        """cuDNN's attention (cudnn_attn.CudnnAttention), or None."""
        return self.attn.cudnn

    @property
    def flex(self) -> flex_attn.FlexAttention | None:
        """The flex attention backward, or None."""
        return self.attn.flex

    # --- memory --------------------------------------------------------------------------------
    def _allocate(self) -> None:
        """The memory plan (buffers.plan_memory, the FP8 and flex buffers), checked against the
        device's free memory, allocated."""
        shapes = self.shapes
        plan, self.train, self.sample = plan_memory(
            shapes, self.B, self.precision, self.attention, self.fusions,
            self.attn.workspace_bytes(), self.separate_micro, self.qkv_rows, self.logits_lp,
            self.grads_lp, self.norm_by_kind)
        if self.fp8:
            plan_fp8(plan, shapes.n_layer, shapes.d_model, shapes.d_ff, self.train.R,
                     qkv=self.qkv_rows)
        if self.flex is not None:  # its scratch and plan arrays, at the backward's one shape
            flex_attn.plan_buffers(plan, self.flex.B, self.flex.T, self.flex.H)
        self.plan = plan
        # k_adamw keeps the tensor table in shared memory
        if len(tensor_table(shapes)) > ADAMW_MAX_SEGS:
            raise UserError(f"model.n_layer: the CUDA backend handles at most "
                            f"{(ADAMW_MAX_SEGS - 4) // 10} layers, got {shapes.n_layer}")
        free, _total = self.drv.mem_get_info()
        totals = plan.totals()
        if totals["total"] + SAFETY_BYTES > free:
            raise RunError(
                f"the model does not fit on {self.device}: memory plan {format_plan(totals)}; "
                f"free device memory {free / 2**20:.1f} MiB (of which {SAFETY_BYTES >> 20} MiB "
                f"is kept in reserve). Use a smaller batch_size, seq_len or model.")
        plan.allocate(self.drv)

    # --- libraries and kernels -----------------------------------------------------------------
    def _load_libraries(self, gemm_plan: Mapping[str, Any] | None) -> None:
        """The GEMM libraries and Ops: with fusions, LtGemm (the recorded plan where it is
        usable) with a weight-gradient stream; else plain cuBLAS (and cuBLASLt for the GELU
        epilogues, gpu.gelu_in_gemm). Then the FP8 GEMMs."""
        gpu, plan, drv, shapes = self.gpu_config, self.plan, self.drv, self.shapes
        cws = plan["cudnn_ws"] if self.cudnn else 0
        plan_refused = ""
        self.blas: Cublas | None = None
        self.lt: CublasLt | None = None
        self.gemm: Any = None
        self.side: Any = None
        if self.fusions:
            from engine.backends.cuda.gemm import LtGemm

            if not gpu.gelu_in_gemm:
                self.notes.append("gpu.gelu_in_gemm false applies to the unfused path: the "
                                  "fused step places GELU per shape by the start-up timing")

            self.gemm = LtGemm(WORKSPACE_BYTES, self.device, gpu.gemm_candidates)
            plan_refused = self.gemm.import_plan(gemm_plan)  # "" or why it is not used
            if plan_refused:
                self.notes.append(plan_refused)
            self.side = drv.Stream(flags=1)  # the weight-gradient stream (non-blocking)
            self.ops = Ops(self.gpu.kernels(self.precision), None, self.stream, self.precision,
                           gemm=self.gemm, ws=plan["cublas_ws"], side=self.side,
                           ws2=plan["cublas_ws2"],
                           cudnn=self.cudnn, cudnn_ws=cws,
                           event=lambda: drv.Event(drv.event_flags.DISABLE_TIMING),
                           attn_chunk=gpu.attention_chunk)
            # two per weight-gradient GEMM (fork, done; 4 a layer, dwte) and per LayerNorm
            # parameter sum (2 a layer, the final one), one per layer's deferred update and per
            # range of the gradient norm (a layer's, the embeddings'), the joins
            self.ops.reserve_events(14 * shapes.n_layer + 26)
        else:
            self.blas = Cublas(self.stream.handle, plan["cublas_ws"], WORKSPACE_BYTES)
            # GELU in the MLP GEMMs' epilogues (gpu.gelu_in_gemm false: separate GELU kernels)
            self.lt = (CublasLt(self.stream.handle, plan["cublas_ws"], WORKSPACE_BYTES)
                       if gpu.gelu_in_gemm else None)
            self.ops = Ops(self.gpu.kernels(self.precision), self.blas, self.stream,
                           self.precision, self.lt, cudnn=self.cudnn, cudnn_ws=cws,
                           attn_chunk=gpu.attention_chunk)
        self.flat.ops = self.ops
        self._set_stream_priorities()
        # the FP8 GEMMs and casts of a training pass (train/precision fp8)
        self.fp8_ops = (Fp8Gemms(self.ops, self.drv, plan, shapes.n_layer, shapes.d_model,
                                 shapes.d_ff, self.ops.act, self.train.R, qkv=self.qkv_rows)
                        if self.fp8 else None)
        self.gemm_source = ("from the recorded plan" if gemm_plan and not plan_refused else
                            "timed at start" if gpu.gemm_tune else "cuBLASLt's first choices")

    def _set_stream_priorities(self) -> None:
        """The weight-gradient stream at the least priority, below the main stream (which runs
        at the greatest: runtime.Gpu): where both have blocks waiting for SMs, the main stream's
        (the step's chain) are served first; the kernel nodes of a graph keep the priority of
        the stream they were captured from (graphs.py)."""
        if self.side is not None:
            least, _greatest = self.gpu.stream_priorities
            graphs.set_stream_priority(self.side.handle, least)

    def _upload(self) -> None:
        """Everything zeroed, then the kernels' tables uploaded, then the flex backward bound
        (attention_choice.AttentionChoice.bind_flex)."""
        drv, plan, flat = self.drv, self.plan, self.flat
        # Everything starts at zero: rows past a short sequence are then finite (cuDNN's
        # full-length graphs read them; see cudnn_attn.py).
        for group in ("activations", "scratch") + (("flex",) if self.flex is not None else ()):
            base, size = plan.span(group)
            drv.memset_d8_async(base, 0, size, self.stream)
        # The optimizer's tensor table lives in "scratch" too: written only after that zeroing
        # (a table of zeros sends k_adamw's segment search past its shared arrays).
        self.stream.synchronize()
        drv.memcpy_htod(plan["seg_start"], flat.seg_start)
        if self.fusions:  # the gradient norm's ranges: the update's (embeddings, each layer),
            # each cut where its gradients' kind changes (grads_lp)
            drv.memcpy_htod(plan["norm_cuts"], self.norm.cuts)
            drv.memcpy_htod(plan["norm_kinds"], self.norm.kinds)
        if self.grads_lp:
            drv.memcpy_htod(plan["seg_glp"], grads_lp_table(self.shapes))
        drv.memcpy_htod(plan["seg_decay"], flat.seg_decay)
        if flat.seg_qkv is not None:
            drv.memcpy_htod(plan["seg_qkv"], flat.seg_qkv)
        if self.flex is not None:
            self.attn.bind_flex(plan, drv, self.ops, self.train)
        self.resolved["flex_backward"] = self.flex is not None
        drv.Context.synchronize()  # pageable copies may still be in flight for our stream

    # --- what it says --------------------------------------------------------------------------
    @property
    def fp8_gemms(self) -> list[str]:
        """The GEMMs that run in FP8 (train/precision "fp8"; [] otherwise)."""
        return self.fp8_ops.fp8_gemms if self.fp8_ops is not None else []

    def describe(self) -> str:
        """One line: attention, GEMMs and fusions as they run."""
        gemm = "cuBLAS (heuristic choices)"
        if self.gemm is not None:
            gemm = f"cuBLASLt, algorithms {self.gemm_source}"
        fp8 = ""
        if self.fp8_ops is not None:
            on = self.fp8_gemms
            fp8 = (f"; FP8 (E4M3 forward, E5M2 gradients; weights, activations and "
                   f"gradients scaled by their last {HISTORY} passes' amax): "
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

    def close(self) -> None:
        """Free the GEMM libraries, cuDNN and the device memory (after the graphs)."""
        for lib in (self.blas, self.lt, self.gemm):
            if lib is not None:
                lib.close()
        if self.attn.cudnn is not None:
            self.attn.cudnn.close()
            self.attn.cudnn = None
        self.attn.flex = self.ops.flex = None  # its argument structs point into the plan
        self.plan.free()
