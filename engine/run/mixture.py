"""When the bandit's phases have moved the data mixture far enough to be an event of its own.

Each phase changes the weights a little; `MixtureWatch.observe` compares a phase's weights
with the mixture of the last `mixture` event (at first, the first phase's) and returns an
engine.records.MixtureEvent when one source's weight has moved by MIXTURE_SHIFT or more, so a
slow drift is told as well as a jump, once per move.
"""

from __future__ import annotations

import math

from engine import records as rec

TOLERANCE = 1e-9  # a move of MIXTURE_SHIFT less float rounding is a move of MIXTURE_SHIFT


class MixtureWatch:
    """`reference` is kept in a checkpoint (`state_dict`), so a resumed run measures its moves
    from the mixture of the last event before the checkpoint, as an uninterrupted run does."""

    def __init__(self, shift: float = rec.MIXTURE_SHIFT) -> None:
        self.shift = shift
        self.reference: dict[str, float] | None = None

    def observe(self, step: int, weights: dict[str, float]) -> rec.MixtureEvent | None:
        unknown = {n for n, w in weights.items() if not math.isfinite(w)}  # judged by nothing
        weights = {n: w for n, w in weights.items() if n not in unknown}
        if not weights:
            return None
        if self.reference is None:
            self.reference = dict(weights)
            return None
        names = sorted((set(weights) | set(self.reference)) - unknown)
        moved = max(abs(weights.get(n, 0.0) - self.reference.get(n, 0.0)) for n in names)
        if moved < self.shift - TOLERANCE:
            return None
        event = rec.MixtureEvent(step=step, before=self.reference, after=dict(weights))
        self.reference = dict(weights)
        return event

    def state_dict(self) -> dict[str, float] | None:
        return None if self.reference is None else dict(self.reference)

    def load_state_dict(self, state: object) -> None:
        """A checkpoint's reference (None, or one written before it was kept: the next step's
        mixture becomes the reference)."""
        if isinstance(state, dict):
            ref = {str(n): float(w) for n, w in state.items()
                   if isinstance(w, (int, float)) and not isinstance(w, bool)
                   and math.isfinite(w)}
            self.reference = ref or None
