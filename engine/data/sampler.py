"""Training batches: each row picks its source by the mixture weights, then a random window.

With a validation holdout (config `eval.holdout`), windows come only from the training part of
each source (engine.data.validation); without one, from the whole source.
"""

from __future__ import annotations

import numpy as np

from engine.data.shards import Shard
from engine.data.validation import check_split, train_length
from engine.errors import UserError


class Sampler:
    """Draws `[B, T+1]` token windows from shards with its own PCG64 stream (checkpointable)."""

    def __init__(self, shards: list[Shard], seq_len: int, seed: int,
                 holdout: float = 0.0) -> None:
        if not shards:
            raise UserError("data.sources: expected at least one source, got none")
        for shard in shards:
            if len(shard) < seq_len + 1:
                raise UserError(
                    f"{shard.path}: expected at least seq_len+1 = {seq_len + 1} tokens, "
                    f"got {len(shard)}"
                )
            check_split(shard, seq_len, holdout)
        self.shards = shards
        self.seq_len = seq_len
        self.seed = seed
        self.rng = np.random.Generator(np.random.PCG64(seed))
        # Highest valid start + 1 for a window of T+1 tokens in each shard's training part.
        self._start_bound = np.array([train_length(len(s), holdout) - seq_len for s in shards],
                                     dtype=np.int64)

    def sample(self, batch: int, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return (tokens int32 [batch, seq_len+1], source index int32 [batch])."""
        w = np.asarray(weights, dtype=np.float64)
        k = len(self.shards)
        if w.shape != (k,) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
            raise ValueError(f"weights: expected {k} finite non-negative values, got {weights!r}")
        src = self.rng.choice(k, size=batch, p=w / w.sum())
        starts = self.rng.integers(0, self._start_bound[src])
        out = np.empty((batch, self.seq_len + 1), dtype=np.int32)
        for row in range(batch):
            s = int(starts[row])
            out[row] = self.shards[src[row]].tokens[s : s + self.seq_len + 1]
        return out, src.astype(np.int32)

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "seq_len": self.seq_len,
            "n_sources": len(self.shards),
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("n_sources") != len(self.shards) or state.get("seq_len") != self.seq_len:
            raise UserError(
                f"sampler state: expected {len(self.shards)} sources and seq_len {self.seq_len}, "
                f"got {state.get('n_sources')} and {state.get('seq_len')}"
            )
        self.seed = state["seed"]
        self.rng.bit_generator.state = state["rng"]
