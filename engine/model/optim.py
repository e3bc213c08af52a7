"""Learning-rate schedule and gradient clipping (DESIGN §4), independent of any backend."""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, warmup_steps: int, max_steps: int, min_lr_frac: float) -> float:
    """The learning rate for optimizer step `step` (1-based).

    Linear warmup from 0: step s <= warmup_steps gets lr·s/warmup_steps (ANDREA-120M: 3e-4 with
    2000 warmup steps gives 1.5e-7 at step 1). Then cosine from lr down to min_lr_frac·lr, reached
    at max_steps and held after it.
    """
    if step < 1:
        raise ValueError(f"lr_at: step is 1-based, got {step}")
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    min_lr = min_lr_frac * lr
    span = max_steps - warmup_steps
    if span <= 0 or step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / span
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def clip_scale(norm: float, max_norm: float) -> float:
    """1.0 when norm <= max_norm, else max_norm/norm (global L2 clipping before AdamW)."""
    if norm <= max_norm:
        return 1.0
    return max_norm / norm
