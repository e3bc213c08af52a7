"""What watches a training run beside its loop, on rank 0: the alerts (engine.run.alerts), the
run's health that follows them (engine.run.health), the stall watchdog and the telemetry sampler
(engine.run.telemetry), these two daemon threads of their own.

The loop hands each step's record to `observe` and calls `beat` after the expected work between
steps (validation, text samples, checkpoints), so that none of it is told as a stall.
"""

from __future__ import annotations

import collections
import socket
from collections.abc import Callable

from engine import env
from engine import records as rec
from engine.config import AlertsConfig, Config
from engine.run.alerts import AlertMonitor, AlertSink, CommandRunner, Watchdog
from engine.run.health import HealthMonitor
from engine.run.telemetry import SystemSampler
from engine.run.writer import RunWriter

ALERTED_KEPT = 8  # the last alerts' messages, so that a health change they explain is not told twice


class RunMonitors:
    """Alerts, health, the stall watchdog and telemetry of one run, writing through `out`;
    `step_now` tells the step the run has reached, `gpus` the CUDA ordinals to sample."""

    def __init__(self, cfg: Config, out: RunWriter, step_now: Callable[[], int],
                 gpus: list[int]) -> None:
        a = cfg.alerts or AlertsConfig()
        self.out = out
        self.alerted: collections.deque[str] = collections.deque(maxlen=ALERTED_KEPT)
        runner = CommandRunner(list(a.command), a.timeout_s, out.log) if a.command else None
        self.sink = AlertSink(out.event, out.log, runner)
        self.alerts = AlertMonitor(a, vocab_size=cfg.model.vocab_size, optim=cfg.optim)
        self.health = HealthMonitor(self._report_health, a.quiet_steps)
        self.watchdog = Watchdog(self._stalled, a.stall_factor, a.stall_min_s)
        self.telemetry = SystemSampler(out.system, step_now, gpus)
        self._stopped = False

    def start(self) -> None:
        """The watchdog's and the telemetry's threads."""
        self.watchdog.start()
        self.telemetry.start()

    def observe(self, record: rec.StepRecord) -> None:
        """A step's record: its alerts told, the watchdog fed its time, the health judged."""
        alerts = self.alerts.observe(record)
        for alert in alerts:
            self.sink.emit(alert)
            self.alerted.append(alert.message)
        self.watchdog.beat(record.step, record.step_ms / 1e3)  # may tell a stall it could not see
        self.health.observe(record, alerts, self.alerts.diverging, self.alerts.recovered)

    def beat(self, step: int) -> None:
        """The loop is done with the expected work after `step`: the stall clock starts over."""
        self.watchdog.beat(step)

    def stop(self) -> None:
        """Stop the threads and let the alert command's queue go out (once)."""
        if self._stopped:
            return
        self._stopped = True
        for part in (self.watchdog, self.telemetry, self.sink):
            part.stop()

    def _stalled(self, alert: rec.AlertEvent) -> None:
        """The watchdog's thread (or a late beat) tells a stall."""
        self.sink.emit(alert)
        self.alerted.append(alert.message)
        self.health.stalled(alert)

    def _report_health(self, event: rec.HealthEvent, changed: bool) -> None:
        """The health changed (engine.run.health): into state.json and events.jsonl
        (RunWriter.set_health), and a line in the log when its state did."""
        if self.out.set_health(event, changed) and changed:
            told = event.reason in self.alerted  # its alert's line is in the log already
            self.out.log(f"health {event.state} at step {event.step}"
                         + (f": {event.reason}" if event.reason and not told else ""))


def gpus_on_this_host(ranks: list[rec.RankInfo]) -> list[int]:
    """CUDA ordinals of the job's GPUs on this host (rank 0 samples them all); this process's
    own GPU when the job has no other ranks."""
    host = socket.gethostname()
    ords = sorted({int(r.device.split(":")[1]) for r in ranks
                   if r.host == host and r.device.startswith("cuda:")
                   and r.device.split(":")[1].isdigit()})
    return ords or [env.CUDA_DEVICE.read()]
