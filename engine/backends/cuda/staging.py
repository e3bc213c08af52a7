"""The host's side of each call: the token ids checked, staged in page-locked memory with
their embedding-gradient buckets and the loss scale (buffers.BatchBuffers.stage), and queued
to the device; the row losses and the sampled logits copied back."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.backends.cuda.buffers import BatchBuffers
from engine.errors import UserError
from engine.model.layout import ModelShapes


class Staging:
    """Page-locked host staging for the training and the sampling buffers."""

    def __init__(self, drv: Any, stream: Any, shapes: ModelShapes, micro_batch: int,
                 train: BatchBuffers, sample: BatchBuffers, ldv: int) -> None:
        self.drv, self.stream, self.shapes, self.B = drv, stream, shapes, micro_batch
        self.h_io = {b.p: drv.pagelocked_zeros(b.io_words, np.int32) for b in (train, sample)}
        self.h_losses = drv.pagelocked_zeros(train.R, np.float32)
        self.h_logits = drv.pagelocked_zeros(ldv, np.float32)

    def check_tokens(self, inputs: np.ndarray, what: str, B: int) -> np.ndarray:
        """int32 token ids [B, 1..seq_len] in [0, vocab); UserError naming `what` otherwise."""
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

    def xy(self, inputs: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A training micro-batch's inputs and targets, checked."""
        x = self.check_tokens(inputs, "inputs", self.B)
        y = self.check_tokens(targets, "targets", self.B)
        if y.shape != x.shape:
            raise UserError(f"targets: expected shape {x.shape}, got {y.shape}")
        return x, y

    def stage(self, b: BatchBuffers, inputs: np.ndarray, targets: np.ndarray | None,
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

    def row_means(self, b: BatchBuffers, T: int) -> np.ndarray:
        """Per-row mean loss [B] (float64) of the pass just queued on b, waited for."""
        R = b.B * T
        self.drv.memcpy_dtoh_async(self.h_losses[:R], b.at("losses"), self.stream)
        self.stream.synchronize()
        return self.h_losses[:R].reshape(T, b.B).astype(np.float64).mean(axis=0)

    def logits(self, b: BatchBuffers, V: int) -> np.ndarray:
        """The first V float32 logits of b's logits buffer, waited for."""
        self.drv.memcpy_dtoh_async(self.h_logits[:V], b.at("logits"), self.stream)
        self.stream.synchronize()
        return self.h_logits[:V].copy()
