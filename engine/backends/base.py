"""The backend interface: what the trainer may call, implemented by the numpy and CUDA backends.

The trainer depends on this interface only (DESIGN §1), so backends are interchangeable and a
new one (several GPUs, FP8) is an addition. Every buffer (params, grads, Adam m and v, saved
activations, scratch) is allocated once in `__init__` (DESIGN §5); the step loop allocates nothing
large. The order of calls for one optimizer step is DESIGN §4's: `zero_grads` → per micro-batch
`forward_backward` → `scale_grads(1/n_micro)` → `grad_norm` → (skip if not finite) →
`grad_scale(clip)` when clipping → `adamw`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from engine.model.layout import ModelShapes


@runtime_checkable
class Backend(Protocol):
    """A training backend for the DESIGN §2 model."""

    name: str  # "numpy" | "cuda"
    device: str  # e.g. "cpu (numpy 2.4, 2 threads)"

    def __init__(
        self,
        shapes: ModelShapes,
        micro_batch: int,
        precision: str = "fp32",
        dtype: type = np.float32,
        separate_micro: bool = False,
    ) -> None:
        """Allocate everything for micro-batches of `micro_batch` rows of up to seq_len tokens.
        `dtype` is for the numpy backend only (float64 for gradient checks). `separate_micro`
        also allocates the buffer `forward_backward(separate=True)` needs."""

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
