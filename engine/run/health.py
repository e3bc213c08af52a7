"""The run's health as the engine judges it (engine.records.Health), from its step records and
alerts (engine.run.alerts), so that every viewer says the same:

- `healthy`: nothing to say.
- `warning`: an alert (a spike, a non-finite step, slow throughput, a stall that ended, a
  divergence that ended) in the last `quiet_steps` steps; back to healthy after a quiet stretch.
- `diverging`: a divergence is going on (AlertMonitor.diverging, until the loss is back under
  its best plus the margin), or NONFINITE_RUN steps in a row were non-finite.
- `stalled`: the watchdog's stall, until the next step.
- `failed`: the run failed (RunWriter.set_failed says so; nothing follows it).

`HealthMonitor` calls `report(event, changed)` when the state or its reason changes: `changed`
when the state did (the loop then writes a `health` event; state.json either way). The loop's
thread calls `observe` after each step; the watchdog's thread calls `stalled`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

from engine.records import AlertEvent, Health, HealthEvent, StepRecord

NONFINITE_RUN = 5  # non-finite steps in a row that make a run diverging


class HealthMonitor:
    """The health state machine (see the module doc)."""

    def __init__(self, report: Callable[[HealthEvent, bool], None],
                 quiet_steps: int = 100) -> None:
        self.report, self.quiet_steps = report, quiet_steps
        self.state, self.reason, self.step = Health.HEALTHY, "", None
        self.last_alert: tuple[int, str] | None = None  # (step, why) of the newest warning
        self.nonfinite_run = 0
        self._lock = threading.Lock()

    def _set(self, state: Health, step: int | None, reason: str) -> HealthEvent | None:
        """Move to `state` (the lock held); the event when the state or its reason changed."""
        if state is self.state and reason == self.reason:
            return None
        changed = state is not self.state
        self.state, self.reason, self.step = state, reason, step
        event = HealthEvent(state=state, step=step, reason=reason)
        self.report(event, changed)
        return event

    def observe(self, r: StepRecord, alerts: list[AlertEvent], diverging: str | None,
                recovered: str | None = None) -> HealthEvent | None:
        """After step `r` and the alerts it raised; `diverging`: the ongoing divergence's
        message (AlertMonitor.diverging), None when there is none; `recovered`: how the one
        that ended at this step ended (AlertMonitor.recovered)."""
        with self._lock:
            if self.state is Health.FAILED:
                return None
            finite = not r.skipped and math.isfinite(r.loss) and math.isfinite(r.grad_norm)
            self.nonfinite_run = 0 if finite else self.nonfinite_run + 1
            for a in alerts:
                if a.alert != "diverging" and a.step is not None:
                    self.last_alert = (a.step, a.message)
            if self.state is Health.STALLED:  # a step came: the stall ended
                self.last_alert = (r.step, f"{self.reason}; steps went on at step {r.step}")
            if self.state is Health.DIVERGING and diverging is None and \
                    self.nonfinite_run < NONFINITE_RUN:
                self.last_alert = (r.step, recovered or f"recovered at step {r.step} from: "
                                   f"{self.reason}")
            if diverging is not None:
                return self._set(Health.DIVERGING, r.step, diverging)
            if self.nonfinite_run >= NONFINITE_RUN:
                return self._set(Health.DIVERGING, r.step, f"the last {self.nonfinite_run} "
                                 f"steps, to step {r.step}, were non-finite (their updates "
                                 "skipped): the run makes no progress; lower optim.lr and "
                                 "resume from a checkpoint before it began")
            if self.last_alert is not None and r.step - self.last_alert[0] < self.quiet_steps:
                return self._set(Health.WARNING, r.step, self.last_alert[1])
            return self._set(Health.HEALTHY, r.step, "")

    def stalled(self, alert: AlertEvent) -> HealthEvent | None:
        """The watchdog saw no step for too long."""
        with self._lock:
            if self.state is Health.FAILED:
                return None
            return self._set(Health.STALLED, alert.step, alert.message)

    def failed(self, step: int | None, reason: str) -> HealthEvent | None:
        with self._lock:
            return self._set(Health.FAILED, step, reason)
