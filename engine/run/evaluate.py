"""Validation loss (config `eval`): the held-out windows of every source through the model's
forward pass, written as an `eval.jsonl` record (engine.records.EvalRecord).

The windows are fixed (engine.data.validation): every evaluation measures the same text, and
nothing is drawn from the sampler's or the bandit's random streams, so a run with evaluation
trains bit for bit as it would without the evaluations (the holdout itself is part of the run's
config and so of its checkpoints).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from engine.config import Config
from engine.data.shards import Shard
from engine.data.validation import validation_windows
from engine.records import EvalRecord


class Evaluator:
    """The validation windows of a run, and the loss of the model on them."""

    def __init__(self, cfg: Config, shards: list[Shard]) -> None:
        assert cfg.eval is not None
        self.every = cfg.eval.every_steps
        self.batch = cfg.train.batch_size
        rows = cfg.eval.batches * self.batch
        self.names = cfg.data.source_names
        self.windows = [validation_windows(sh, cfg.model.seq_len, cfg.eval.holdout, rows)
                        for sh in shards]

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def evaluate(self, trainer: Any, step: int) -> EvalRecord:
        """The validation loss of `trainer`'s model now (forward passes only)."""
        per: dict[str, float] = {}
        every = []
        for name, w in zip(self.names, self.windows, strict=True):
            rows = np.concatenate([trainer.eval_loss(w[i: i + self.batch])
                                   for i in range(0, len(w), self.batch)])
            per[name] = float(rows.mean())
            every.append(rows)
        return EvalRecord(step=step, t=time.time(), val_loss=float(np.concatenate(every).mean()),
                          src_val_loss=per)
