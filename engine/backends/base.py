"""The backend interface: every call the trainer (engine.train.trainer) and the training loop
(engine.run.loop) make of a backend, implemented by the numpy and the CUDA backends.

The trainer and the loop depend on this interface only (DESIGN §1), so backends are
interchangeable and a new one is an addition; which backend runs is chosen by name in one place
(engine.backends.resolve_backend). Every buffer (params, grads, Adam m and v, saved activations,
scratch) is allocated once in `__init__` (DESIGN §5); the step loop allocates nothing large. The
order of calls for one optimizer step is DESIGN §4's: `zero_grads` → per micro-batch
`forward_backward` → `scale_grads(1/n_micro)` → `grad_norm` → (skip if not finite) →
`grad_scale(clip)` when clipping → `adamw`. A backend that runs that whole step on its device
(the CUDA backend's one-graph step) hands out a `DeviceStep` (`device_step()`), and the trainer
then takes its steps through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import numpy as np

from engine.config import GpuConfig
from engine.model.fp8 import AmaxHistory
from engine.model.layout import ModelShapes


class StepOutcome(NamedTuple):
    """One optimizer step taken on the device: the per-row mean loss of its micro-batch
    (float64 [B]), the global gradient norm before clipping (nan/inf: the update was skipped),
    and the clip factor used (1.0 when none, or skipped). A tuple, so `rows, norm, clip = ...`
    reads it too."""

    rows: np.ndarray
    grad_norm: float
    clip: float


class DeviceStep(Protocol):
    """A whole optimizer step of DESIGN §4 on the device, with one host read: zero_grads →
    forward, backward (loss_scale) → grads·grad_mult → norm → when finite, clip (max_norm) and
    AdamW (lr, Adam's 1-based step t); else nothing changes. Up to two steps may be queued."""

    def prepare_step(self, inputs: np.ndarray, targets: np.ndarray) -> None:
        """Stage the next `launch_step(None, None, ...)`'s tokens (int [B, T]) while the steps
        before it may still run."""

    def launch_step(self, inputs: np.ndarray | None, targets: np.ndarray | None, *,
                    loss_scale: float, grad_mult: float, lr: float, beta1: float, beta2: float,
                    eps: float, weight_decay: float, t: int, max_norm: float,
                    reducer: Any = None) -> None:
        """Queue one step (inputs None: the tokens given to `prepare_step`) and return. reducer:
        one rank of a data-parallel job, its gradients summed over the ranks inside the step
        (grad_mult then includes 1/world)."""

    def step_result(self) -> StepOutcome:
        """Wait for the oldest step `launch_step` queued."""

    def optimizer_step(self, *, grad_mult: float, lr: float, beta1: float, beta2: float,
                       eps: float, weight_decay: float, t: int, max_norm: float
                       ) -> tuple[float, float]:
        """The end of that step (grads·grad_mult → norm → clip and AdamW when finite) on the
        gradients accumulated since `zero_grads`: (the norm, the clip factor used)."""


@runtime_checkable
class Backend(Protocol):
    """A training backend for the DESIGN §2 model."""

    name: ClassVar[str]  # "numpy" | "cuda": the name it is chosen by
    on_gpu: ClassVar[bool]  # whether it computes on a GPU (then one process a device)
    device: str  # e.g. "cpu (numpy 2.4, 2 threads)"
    precision: str  # what it computes in: fp32 (or fp64) on numpy; fp32, bf16 or fp16 on a GPU
    # what start-up decided and anything it adds later (a graph captured at its first step),
    # for the run's log, in order
    notes: list[str]
    # the config's gpu section as it runs: where the GPU could not honour a choice, what runs
    # instead ({} for a backend that ignores the section)
    resolved: Mapping[str, bool | int | str]
    attention_info: str  # which attention runs and why ("" where there is no choice)
    fp8_gemms: list[str]  # the GEMMs that run in FP8 (train.precision fp8; [] otherwise)
    gemm_plan: dict[str, Any] | None  # the GEMM algorithms to keep in gemm_plan.json, or None

    def __init__(self, shapes: ModelShapes, micro_batch: int, precision: str = "fp32",
                 dtype: type = np.float32, *, gpu: GpuConfig = ...,
                 gemm_plan: Mapping[str, Any] | None = None,
                 separate_micro: bool = False) -> None:
        """Allocate everything for micro-batches of `micro_batch` rows of up to seq_len tokens.
        `dtype` is for the numpy backend only (float64 for gradient checks). `gpu`: the config's
        gpu section; `gemm_plan`: the GEMM algorithms a run recorded (gemm_plan.json), to use
        instead of timing (both ignored where they mean nothing). `separate_micro` also
        allocates the buffer `forward_backward(separate=True)` needs."""

    @staticmethod
    def host_plan(shapes: ModelShapes, micro_batch: int, separate_micro: bool = False
                  ) -> dict[str, int]:
        """Host bytes by group this backend allocates for the model ({} when its buffers live
        on a device): checked against the host's memory before anything is built."""

    def describe(self) -> str:
        """One line for the run's log: what computes and how."""

    def device_step(self) -> DeviceStep | None:
        """The whole optimizer step on the device, where this backend has one (else None: the
        trainer drives the step call by call)."""

    def load_params(self, params: np.ndarray) -> None:
        """Copy a flat float32 host array (tensor_table order) into the weights."""

    def load_optimizer(self, m: np.ndarray, v: np.ndarray) -> None:
        """Copy flat float32 Adam moments in."""

    def read_params(self) -> np.ndarray:
        """The weights as a flat host array (numpy: a read-only view of the live buffer)."""

    def read_grads(self) -> np.ndarray:
        """The gradients as a flat host array (numpy: a read-only view of the live buffer)."""

    def read_optimizer(self) -> tuple[np.ndarray, np.ndarray]:
        """Adam (m, v) as flat host arrays (numpy: read-only views)."""

    def copy_state_into(self, params: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
        """Copy weights, Adam m and v into caller-owned flat float32 host arrays: the one copy a
        checkpoint costs the training loop (no temporary host arrays)."""

    def fp8_history(self) -> AmaxHistory | None:
        """The amax history of the delayed FP8 scales as it stands after the last training pass
        (engine.model.fp8), for a checkpoint; None where no FP8 GEMM runs."""

    def load_fp8_history(self, history: AmaxHistory | None) -> None:
        """Go on from a checkpoint's amax history; None starts it afresh (each tensor scaled by
        its own amax until it has one). ValueError when it does not fit this model. Nothing
        where no FP8 GEMM runs."""

    def zero_grads(self) -> None:
        """grads = 0."""

    def forward_backward(
        self, inputs: np.ndarray, targets: np.ndarray, loss_scale: float = 1.0,
        separate: bool = False,
    ) -> np.ndarray:
        """inputs/targets int [B, T] (B == micro_batch, T <= seq_len). Accumulates (+=)
        loss_scale · d(mean CE over B·T)/dθ into the grads; returns per-row mean CE, float64 [B].
        separate: this micro-batch's gradient is formed on its own and then added with one add
        (grads = grads + g_micro), as a data-parallel all-reduce adds whole micro-batch
        gradients: so gradient accumulation over k micro-batches and k ranks give the same bits
        (for two; beyond, the sums' order decides)."""

    def forward_loss(self, inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """Per-row mean CE, float64 [B]; grads untouched."""

    def scale_grads(self, s: float) -> None:
        """grads *= s (1/n_micro after accumulation, or 1/loss_scale)."""

    def grad_norm(self) -> float:
        """Global L2 norm of the grads (grad_norm_partial + grad_norm_final); nan/inf when any
        gradient is not finite."""

    def grad_scale(self, s: float) -> None:
        """The clip op: grads *= s."""

    def adamw(
        self,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        t: int,
    ) -> None:
        """One AdamW update, t the 1-based step; decoupled decay on 2-D tensors only:
        p -= lr · (m̂/(sqrt(v̂)+eps) + wd · p · mask)."""

    def logits_last(self, tokens: np.ndarray) -> np.ndarray:
        """tokens int [t], 1 <= t <= seq_len: float32 [V] logits of the last position (sampling).
        Uses its own buffers: training buffers and grads are left as they were."""

    def memory_plan(self) -> dict[str, int]:
        """Bytes per group: weights, grads, adam_m, adam_v, activations, scratch, and total."""
