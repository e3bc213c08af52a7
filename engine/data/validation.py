"""The held-out split of each source, and the fixed validation windows drawn from it.

With `eval` in the config, the last `holdout` share of every source's tokens is validation data:
the sampler never draws a training window that reaches into it (`train_length`), and the
validation windows (`validation_windows`) lie wholly inside it. The split is a pure function of
the shard's length and the share, so it is the same on every run, rank and resume; the windows
are evenly spaced and fixed, so successive evaluations measure the same text and draw nothing
from any random stream.
"""

from __future__ import annotations

import numpy as np

from engine.data.shards import Shard
from engine.errors import UserError


def held_out(n_tokens: int, holdout: float) -> int:
    """Tokens at the end of a source of `n_tokens` kept for validation (0 when off)."""
    return int(n_tokens * holdout) if holdout > 0 else 0


def train_length(n_tokens: int, holdout: float) -> int:
    """Tokens at the start of a source that training may read."""
    return n_tokens - held_out(n_tokens, holdout)


def check_split(shard: Shard, seq_len: int, holdout: float) -> None:
    """Both parts of a split source must hold at least one window of seq_len+1 tokens."""
    n, need = len(shard), seq_len + 1
    if holdout <= 0:
        return
    held = held_out(n, holdout)
    if held < need or n - held < need:
        raise UserError(f"{shard.path}: eval.holdout {holdout:g} of {n} tokens leaves "
                        f"{n - held} for training and {held} for validation; each needs at "
                        f"least seq_len+1 = {need} (a larger source, or another holdout)")


def validation_windows(shard: Shard, seq_len: int, holdout: float, rows: int) -> np.ndarray:
    """`rows` windows of seq_len+1 tokens (int32 [rows, seq_len+1]), evenly spaced over the
    held-out part of `shard` (overlapping when it is short)."""
    check_split(shard, seq_len, holdout)
    lo = train_length(len(shard), holdout)
    hi = len(shard) - (seq_len + 1)  # the last valid start
    starts = np.linspace(lo, hi, rows).astype(np.int64) if rows > 1 else np.array([lo])
    out = np.empty((rows, seq_len + 1), dtype=np.int32)
    for i, s in enumerate(starts):
        out[i] = shard.tokens[int(s): int(s) + seq_len + 1]
    return out
