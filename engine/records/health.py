"""The engine's judgement of a run, as records: `alert` events (something a practitioner wants to
hear about at once) and `health` events, with the `Health` states that state.json also holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from engine.records.events import Event
from engine.records.parse import Unreadable, as_float, as_step, as_str

ALERT_KINDS = ("loss_spike", "grad_spike", "nonfinite", "stall", "slow", "diverging")


@dataclass(frozen=True)
class AlertEvent(Event):
    """Something a practitioner wants to hear about at once, raised by the engine: `alert` (the
    `kind` field on disk) is one of ALERT_KINDS; `value` is what was seen (a loss, a grad norm,
    seconds without a step, tok/s), `baseline` what was expected (the window's median, what the
    step's mixture predicts, ln(vocab_size), the best smoothed loss) and `threshold` the line
    `value` crossed; `message` says it in words: what happened, by how much, against what, and
    what a user might do."""

    KIND: ClassVar[str] = "alert"
    alert: str = ""
    step: int | None = None
    value: float = math.nan
    baseline: float = math.nan
    threshold: float = math.nan
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"t": self.t, "event": self.KIND, "kind": self.alert, "step": self.step,
                "value": self.value, "baseline": self.baseline, "threshold": self.threshold,
                "message": self.message}

    def details(self) -> dict[str, Any]:
        return {"kind": self.alert, "step": self.step, "value": self.value,
                "baseline": self.baseline, "threshold": self.threshold, "message": self.message}

    @classmethod
    def _read(cls, o: Mapping[str, Any], t: float) -> AlertEvent:
        return cls(t, as_str(o.get("kind"))[:32], as_step(o.get("step")),
                   as_float(o.get("value")), as_float(o.get("baseline")),
                   as_float(o.get("threshold")), as_str(o.get("message"))[:1000])


class Health(str, Enum):
    """A run's health as the engine judges it (engine.run.health), so that every viewer says
    the same: `healthy`; `warning` (a recent spike, slow throughput); `diverging` (the loss is
    running away); `stalled` (no step for far longer than the run's pace); `failed`."""

    HEALTHY = "healthy"
    WARNING = "warning"
    DIVERGING = "diverging"
    STALLED = "stalled"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


def as_health(x: Any) -> Health | None:
    """A Health from a run file's value; None for anything else (older runs have none)."""
    try:
        return Health(x)
    except ValueError:
        return None


@dataclass(frozen=True)
class HealthEvent(Event):
    """The engine's judgement of the run changed (engine.run.health): `state` now, from `step`,
    and why in words (`reason`: what happened, by how much, against what)."""

    KIND: ClassVar[str] = "health"
    state: Health = Health.HEALTHY
    step: int | None = None
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"t": self.t, "event": self.KIND, "state": self.state.value, "step": self.step,
                "reason": self.reason}

    def details(self) -> dict[str, Any]:
        return {"state": self.state.value, "step": self.step, "reason": self.reason}

    @classmethod
    def _read(cls, o: Mapping[str, Any], t: float) -> HealthEvent | Unreadable:
        state = as_health(o.get("state"))
        if state is None:
            return Unreadable("health event", f"unknown state {o.get('state')!r:.40}")
        return cls(t, state, as_step(o.get("step")), as_str(o.get("reason"))[:1000])
