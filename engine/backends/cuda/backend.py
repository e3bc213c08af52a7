"""CudaBackend: the DESIGN §2 model trained on one NVIDIA GPU (engine/backends/base.py interface).

A facade over the objects it is made of:
- CudaBuild (build.py): the config's gpu section resolved against the GPU, the memory plan
  allocated, the GEMM libraries and kernels (Ops); the attention's choices in
  attention_choice.py;
- Network (network.py): the forward and backward, with the implementation of each op picked
  once (layers.py);
- StepGraph (step_graph.py): the calls that run passes, captured once per shape as CUDA graphs
  and replayed, the fused one-graph step and its queue of slots;
- DeviceOptimizer (optimizer.py): norm, clip, AdamW, and the work left deferred on the
  gradients and weights;
- StateIO (state_io.py): the state between host and device;
- warm_up (warmup.py): the start-up pass that times the GEMMs.

Precision: float32 master weights, gradients and Adam moments always; activations and the GEMM
weight copy in `precision` (bf16 default, fp16, or fp32; fp8: bf16 with the linear maps' GEMMs
in FP8).
What the GPU could not honour of the config is said in `attention_info` / `describe()` and
`notes`, and kept in `resolved`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from engine import env
from engine.backends.base import StepOutcome
from engine.backends.cuda.build import CudaBuild
from engine.backends.cuda.network import Network
from engine.backends.cuda.optimizer import DeviceOptimizer
from engine.backends.cuda.staging import Staging
from engine.backends.cuda.state_io import StateIO
from engine.backends.cuda.step_graph import GraphCache, StepGraph
from engine.backends.cuda.warmup import warm_up
from engine.config import ATTENTIONS, GpuConfig
from engine.model.fp8 import AmaxHistory
from engine.model.layout import ModelShapes

DEFAULT_GPU = GpuConfig()


class CudaBackend:
    """The interface of engine/backends/base.py on one GPU (and base.DeviceStep where fusions
    are on)."""

    name = "cuda"
    on_gpu = True

    @staticmethod
    def host_plan(shapes: ModelShapes, micro_batch: int, separate_micro: bool = False
                  ) -> dict[str, int]:
        """{}: the buffers live on the device (checked against its free memory at start)."""
        return {}

    def __init__(self, shapes: ModelShapes, micro_batch: int, precision: str = "bf16",
                 dtype: type = np.float32, *, gpu: GpuConfig = DEFAULT_GPU,
                 gemm_plan: Mapping[str, Any] | None = None,
                 separate_micro: bool = False) -> None:
        """gpu: the config's gpu section (engine.config.GpuConfig: attention, fusions, ...);
        gemm_plan: a recorded GEMM plan (gemm_plan.GemmPlan.to_json()) to use instead of timing;
        separate_micro: the buffer that forward_backward(separate=True) needs (gradient
        accumulation, see the interface)."""
        b = self.build = CudaBuild(shapes, micro_batch, precision, dtype, gpu, gemm_plan,
                                   separate_micro)
        self.shapes, self.micro_batch = shapes, micro_batch
        self.precision, self.device = b.precision, b.device
        self.notes, self.resolved = b.notes, b.resolved
        self.drv, self.stream, self.gemm = b.drv, b.stream, b.gemm
        self.fused_step = b.fused_step
        self.net = Network(b.ops, b.flat, shapes, train=b.train, attention=b.attention,
                           qkv_rows=b.qkv_rows, fused=b.fusions, fp8=b.fp8_ops, drv=b.drv,
                           stream=b.stream, es=b.es, ldv=b.ldv)
        self.graphs = GraphCache(b.gpu, b.stream, b.precision, b.notes,
                                 env.CUDA_GRAPHS.read() and not env.CUDA_SYNC.read())
        self.optim = DeviceOptimizer(b.ops, b.flat, b.plan, b.norm, b.update_ranges, b.train,
                                     self.graphs.run, b.drv, b.stream, b.fusions)
        self.state = StateIO(b.flat, b.ops, self.optim, b.plan, b.drv, b.stream)
        staging = Staging(b.drv, b.stream, shapes, micro_batch, b.train, b.sample, b.ldv)
        self.steps = StepGraph(b, self.net, self.optim, self.graphs, staging)
        self.state.zero_state()
        warm_up(b, self.net, staging, self.state, gpu.gemm_tune and b.fusions,
                self.graphs.capture if self.graphs.use_graphs else None)
        self.state.zero_state()
        if b.fp8_ops is not None:  # the start-up pass's amaxes are not the run's
            b.fp8_ops.load_history(None)
        b.stream.synchronize()

    # --- what runs -----------------------------------------------------------------------------
    @property
    def attention(self) -> str:
        """"cudnn" | "classic"."""
        return self.build.attention

    @property
    def attention_info(self) -> str:
        return self.build.attention_info

    @property
    def qkv_rows(self) -> bool:
        """Q, K, V side by side in rows (attention_choice.py)."""
        return self.build.qkv_rows

    @property
    def logits_lp(self) -> bool:
        """The training logits in the compute precision (build.py)."""
        return self.build.logits_lp

    @property
    def grads_lp(self) -> bool:
        """The fused step's weight gradients in bf16 (build.py)."""
        return self.build.grads_lp

    @property
    def fp8_gemms(self) -> list[str]:
        """The GEMMs that run in FP8 (train/precision "fp8"; [] otherwise)."""
        return self.build.fp8_gemms

    @property
    def gemm_plan(self) -> dict[str, Any] | None:
        """The GEMM algorithms in use (gemm_plan.GemmPlan.to_json()), None without fusions:
        the run directory keeps it so that --resume runs the same ones."""
        return self.gemm.export_plan() if self.gemm is not None else None

    @property
    def use_graphs(self) -> bool:
        """Whether work runs through captured graphs (off: launch by launch, for debugging)."""
        return self.graphs.use_graphs

    @use_graphs.setter
    def use_graphs(self, on: bool) -> None:
        self.graphs.use_graphs = on

    @property
    def defer_update(self) -> bool:
        """Whether a fused step leaves its AdamW to the next step's graph (optimizer.py)."""
        return self.steps.defer_update

    @defer_update.setter
    def defer_update(self, on: bool) -> None:
        self.steps.defer_update = on

    def describe(self) -> str:
        """One line: attention, GEMMs and fusions as they run."""
        return self.build.describe()

    def memory_plan(self) -> dict[str, int]:
        return self.build.plan.totals()

    def grad_buckets(self) -> list[tuple[int, int]]:
        """(first, count) float32 ranges of the flat gradient in the order the backward
        completes them (FlatBuffers.grad_buckets)."""
        return self.build.flat.grad_buckets()

    def graph_nodes(self, kind: str = "step") -> dict[str, int]:
        """Node counts by type of the captured graph of `kind` ("step", "fb", "f") at the
        longest sequence length captured so far; {} when there is none. Its memset nodes that
        became k_fill nodes count as kernel nodes (graph_fills says how many)."""
        graph = self.graphs.latest(kind)
        return graph.node_counts() if graph is not None else {}

    def graph_fills(self, kind: str = "step") -> int:
        """How many of graph_nodes(kind)'s kernel nodes are k_fill nodes (memsets before)."""
        graph = self.graphs.latest(kind)
        return len(graph.fills) if graph is not None else 0

    # --- the fused step (base.DeviceStep) ------------------------------------------------------
    def device_step(self) -> CudaBackend | None:
        """This backend, whose `launch_step` runs the whole optimizer step in one graph, where
        fusions are on; else None."""
        return self if self.fused_step else None

    def prepare_step(self, inputs: np.ndarray, targets: np.ndarray) -> None:
        """Stage the next `launch_step(None, None, ...)`'s tokens while steps before it may
        still run (StepGraph.prepare_step)."""
        self.steps.prepare_step(inputs, targets)

    def launch_step(self, inputs: np.ndarray | None, targets: np.ndarray | None, *,
                    loss_scale: float, grad_mult: float, lr: float, beta1: float, beta2: float,
                    eps: float, weight_decay: float, t: int, max_norm: float,
                    reducer: Any = None) -> None:
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
        self.steps.launch_step(inputs, targets, loss_scale=loss_scale, grad_mult=grad_mult,
                               lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                               weight_decay=weight_decay, t=t, max_norm=max_norm,
                               reducer=reducer)

    def step_result(self) -> StepOutcome:
        """Wait for the oldest step `launch_step` queued (not for any queued after it)."""
        return self.steps.step_result()

    @property
    def queued_steps(self) -> int:
        """Steps `launch_step` queued that `step_result` has not returned yet."""
        return self.steps.queued_steps

    def train_step(self, inputs: np.ndarray, targets: np.ndarray, *, loss_scale: float,
                   grad_mult: float, lr: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, t: int, max_norm: float, reducer: Any = None
                   ) -> StepOutcome:
        """`launch_step` then `step_result`: one optimizer step, waited for."""
        self.launch_step(inputs, targets, loss_scale=loss_scale, grad_mult=grad_mult, lr=lr,
                         beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, t=t,
                         max_norm=max_norm, reducer=reducer)
        return self.step_result()

    def optimizer_step(self, *, grad_mult: float, lr: float, beta1: float, beta2: float,
                       eps: float, weight_decay: float, t: int, max_norm: float
                       ) -> tuple[float, float]:
        """The end of `train_step` on the gradients accumulated since `zero_grads` (after
        several micro-batches, or a data-parallel all-reduce outside the step): grads·grad_mult
        → norm → clip and AdamW when finite, on the device, in one graph, with train_step's
        very kernels, and its bits where train_step keeps float32 gradients (not with
        `grads_lp`). Returns (the norm, the clip factor used)."""
        return self.steps.optimizer_step(grad_mult=grad_mult, lr=lr, beta1=beta1, beta2=beta2,
                                         eps=eps, weight_decay=weight_decay, t=t,
                                         max_norm=max_norm)

    def grad_device(self) -> tuple[int, int, Any]:
        """(device pointer, float32 count, stream) of the live gradient buffer, every deferred
        scale settled: what a data-parallel all-reduce sums in place, on this stream."""
        self.optim.settle()
        return self.build.flat.g, self.build.flat.n, self.stream

    # --- the interface: passes -----------------------------------------------------------------
    def forward_backward(self, inputs: np.ndarray, targets: np.ndarray,
                         loss_scale: float = 1.0, separate: bool = False) -> np.ndarray:
        return self.steps.forward_backward(inputs, targets, loss_scale, separate)

    def forward_loss(self, inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
        return self.steps.forward_loss(inputs, targets)

    def logits_last(self, tokens: np.ndarray) -> np.ndarray:
        return self.steps.logits_last(tokens)

    # --- the interface: the host-driven step ---------------------------------------------------
    def zero_grads(self) -> None:
        self.optim.zero_grads()

    def scale_grads(self, s: float) -> None:
        self.optim.grad_scale(s)

    def grad_scale(self, s: float) -> None:
        """grads *= s, deferred (DeviceOptimizer.grad_scale)."""
        self.optim.grad_scale(s)

    def grad_norm(self) -> float:
        return self.optim.grad_norm()

    def adamw(self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              t: int) -> None:
        self.optim.adamw(lr, beta1, beta2, eps, weight_decay, t)

    # --- the interface: state in and out -------------------------------------------------------
    def load_params(self, params: np.ndarray) -> None:
        self.state.load_params(params)

    def load_optimizer(self, m: np.ndarray, v: np.ndarray) -> None:
        self.state.load_optimizer(m, v)

    def read_params(self) -> np.ndarray:
        return self.state.read_params()

    def read_params_lp(self) -> np.ndarray:
        """The GEMM copy of the weights as float32 values in the flat layout of DESIGN §2 (each
        layer's W_Q, W_K, W_V taken back from rows where `qkv_rows`, buffers.lp_positions):
        equal to read_params() rounded to the compute precision (the masters in fp32). For
        checking the copy; nothing in a run reads it."""
        return self.state.read_params_lp()

    def read_grads(self) -> np.ndarray:
        return self.state.read_grads()

    def read_optimizer(self) -> tuple[np.ndarray, np.ndarray]:
        return self.state.read_optimizer()

    def copy_state_into(self, params: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
        self.state.copy_state_into(params, m, v)

    def fp8_history(self) -> AmaxHistory | None:
        if self.build.fp8_ops is None:
            return None
        self.optim.settle_update()
        return self.build.fp8_ops.read_history()

    def load_fp8_history(self, history: AmaxHistory | None) -> None:
        if self.build.fp8_ops is not None:
            self.build.fp8_ops.load_history(history)

    def synchronize(self) -> None:
        """Wait for all queued GPU work (for timing; the interface calls sync where needed)."""
        self.stream.synchronize()

    def close(self) -> None:
        """Free the graphs, the cuBLAS handles, cuDNN and the device memory now (tests make
        many)."""
        self.stream.synchronize()
        for s in (self.build.side, self.steps.comm):
            if s is not None:
                s.synchronize()
        self.graphs.close()
        self.build.close()


__all__ = ["ATTENTIONS", "CudaBackend"]
