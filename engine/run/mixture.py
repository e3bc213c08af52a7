"""When the bandit's phases have moved the data mixture far enough to be an event of its own.

Each phase changes the weights a little; `MixtureWatch.observe` compares a phase's weights
with the mixture of the last `mixture` event (at first, the first phase's) and returns an
engine.records.MixtureEvent when one source's weight has moved by MIXTURE_SHIFT or more, so a
slow drift is told as well as a jump, once per move.
"""

from __future__ import annotations

from engine import records as rec


class MixtureWatch:
    def __init__(self, shift: float = rec.MIXTURE_SHIFT) -> None:
        self.shift = shift
        self.reference: dict[str, float] | None = None

    def observe(self, step: int, weights: dict[str, float]) -> rec.MixtureEvent | None:
        if not weights:
            return None
        if self.reference is None:
            self.reference = dict(weights)
            return None
        names = set(weights) | set(self.reference)
        moved = max(abs(weights.get(n, 0.0) - self.reference.get(n, 0.0)) for n in names)
        if moved < self.shift:
            return None
        event = rec.MixtureEvent(step=step, before=self.reference, after=dict(weights))
        self.reference = dict(weights)
        return event
