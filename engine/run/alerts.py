"""Alerts the engine raises while it trains (`alert` events, engine.records.AlertEvent).

- `AlertMonitor.observe(record)`, on the loop's thread after each step: a loss or grad-norm
  spike (above the median of the last WINDOW steps by more than `spike_mads` robust standard
  deviations, 1.4826·MAD), a non-finite step (its update skipped), a throughput drop (tok/s
  under SLOW_FRACTION of the window's median for SLOW_STEPS steps in a row).
- `Watchdog`, a daemon thread: a stall, when no step has come for `stall_factor` times the
  median step time (and at least `stall_min_s` seconds).
- `AlertSink.emit`: the alert into events.jsonl and engine.log, and, with `alerts.command`, to
  a `CommandRunner` thread that runs the user's command with the alert as JSON on its stdin
  (a bounded queue: alerts beyond it are dropped and counted, training never waits).

A kind that just alerted is quiet for COOLDOWN steps, so a diverging run says so once, not at
every step. Nothing here touches the training state or its random streams.
"""

from __future__ import annotations

import json
import math
import queue
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from engine.records import AlertEvent, StepRecord

WINDOW = 100  # steps the robust baselines look back over
MIN_POINTS = 20  # steps a baseline needs before it judges
COOLDOWN = 50  # steps a kind stays quiet after it alerted
SLOW_FRACTION = 0.5
SLOW_STEPS = 10
MAD_SIGMA = 1.4826  # MAD x this estimates a normal distribution's standard deviation
QUEUE_MAX = 16


class RobustBaseline:
    """Median and MAD of the last `window` finite values."""

    def __init__(self, window: int = WINDOW) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def add(self, x: float) -> None:
        if math.isfinite(x):
            self.values.append(x)

    def __len__(self) -> int:
        return len(self.values)

    def median_mad(self) -> tuple[float, float]:
        v = np.fromiter(self.values, dtype=float, count=len(self.values))
        med = float(np.median(v))
        return med, float(np.median(np.abs(v - med)))


class AlertMonitor:
    """Judges each step record against the steps before it; returns the alerts it raises."""

    def __init__(self, spike_mads: float = 8.0, window: int = WINDOW) -> None:
        self.spike_mads = spike_mads
        self.loss = RobustBaseline(window)
        self.grad = RobustBaseline(window)
        self.tok_s = RobustBaseline(window)
        self.slow_run = 0
        self.quiet_until: dict[str, int] = {}

    def _spike(self, kind: str, what: str, base: RobustBaseline, x: float,
               step: int) -> AlertEvent | None:
        if len(base) < MIN_POINTS or not math.isfinite(x):
            return None
        med, mad = base.median_mad()
        # A floor under the spread: a flat series (MAD 0) must not alert on a rounding.
        sigma = max(MAD_SIGMA * mad, 0.01 * abs(med), 1e-12)
        line = med + self.spike_mads * sigma
        if x <= line:
            return None
        return AlertEvent(alert=kind, step=step, value=x, baseline=med, threshold=line,
                          message=f"{what} {x:.4g} at step {step}: median of the last "
                          f"{len(base)} steps {med:.4g}, alert line {line:.4g}")

    def _slow(self, r: StepRecord) -> AlertEvent | None:
        if len(self.tok_s) < MIN_POINTS or not math.isfinite(r.tok_s):
            return None
        med, _ = self.tok_s.median_mad()
        line = SLOW_FRACTION * med
        self.slow_run = self.slow_run + 1 if r.tok_s < line else 0
        if self.slow_run < SLOW_STEPS:
            return None
        self.slow_run = 0
        return AlertEvent(alert="slow", step=r.step, value=r.tok_s, baseline=med, threshold=line,
                          message=f"throughput {r.tok_s:,.0f} tok/s for {SLOW_STEPS} steps to "
                          f"step {r.step}: median of the last {len(self.tok_s)} steps "
                          f"{med:,.0f} tok/s")

    def observe(self, r: StepRecord) -> list[AlertEvent]:
        found: list[AlertEvent | None] = []
        if r.skipped or not (math.isfinite(r.loss) and math.isfinite(r.grad_norm)):
            found.append(AlertEvent(
                alert="nonfinite", step=r.step, value=r.grad_norm if not
                math.isfinite(r.grad_norm) else r.loss, message=f"non-finite "
                f"{'loss' if not math.isfinite(r.loss) else 'gradient norm'} at step {r.step}"
                + (": its update was skipped" if r.skipped else "")))
        else:
            found.append(self._spike("loss_spike", "loss", self.loss, r.loss, r.step))
            found.append(self._spike("grad_spike", "grad norm", self.grad, r.grad_norm, r.step))
            self.loss.add(r.loss)
            self.grad.add(r.grad_norm)
        found.append(self._slow(r))
        self.tok_s.add(r.tok_s)
        out = []
        for a in found:
            if a is None or r.step < self.quiet_until.get(a.alert, -1):
                continue
            self.quiet_until[a.alert] = r.step + COOLDOWN
            out.append(a)
        return out


class Watchdog:
    """A daemon thread that raises a `stall` alert when `beat()` has not been called for
    `factor` x the median step time (and at least `min_s`); once per stall."""

    def __init__(self, emit: Callable[[AlertEvent], None], factor: float = 20.0,
                 min_s: float = 60.0, poll_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.emit = emit
        self.factor, self.min_s, self.poll_s = factor, min_s, poll_s
        self.clock = clock
        self.step_s: deque[float] = deque(maxlen=WINDOW)
        self.last_beat: float | None = None
        self.step: int | None = None
        self.told = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, step: int, step_s: float | None = None) -> None:
        """A step (of `step_s` seconds) was done, or the loop did other expected work."""
        if step_s is not None and math.isfinite(step_s):
            self.step_s.append(step_s)
        self.step = step
        self.last_beat = self.clock()
        self.told = False

    def check(self) -> AlertEvent | None:
        """The stall alert when one is due now (the thread calls this every poll_s)."""
        if self.last_beat is None or self.told or len(self.step_s) < 3:
            return None
        median = float(np.median(np.fromiter(self.step_s, dtype=float)))
        line = max(self.factor * median, self.min_s)
        waited = self.clock() - self.last_beat
        if waited <= line:
            return None
        self.told = True
        return AlertEvent(alert="stall", step=self.step, value=waited, baseline=median,
                          threshold=line, message=f"no step for {waited:.0f} s after step "
                          f"{self.step} (median step {median:.3g} s, alert after {line:.0f} s)")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="andrea-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                alert = self.check()
                if alert is not None:
                    self.emit(alert)
            except Exception:  # the watchdog never takes the run down
                pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class CommandRunner:
    """Runs `argv` once per alert, the alert's JSON on stdin, killed after `timeout_s`; in a
    daemon thread fed by a bounded queue (`offer` never blocks)."""

    def __init__(self, argv: list[str], timeout_s: float,
                 log: Callable[[str], None]) -> None:
        self.argv, self.timeout_s, self.log = argv, timeout_s, log
        self.queue: queue.Queue[dict | None] = queue.Queue(maxsize=QUEUE_MAX)
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="andrea-alert-cmd", daemon=True)
        self._thread.start()

    def offer(self, alert: dict) -> bool:
        try:
            self.queue.put_nowait(alert)
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def _run(self) -> None:
        while (alert := self.queue.get()) is not None:
            try:
                r = subprocess.run(self.argv, input=json.dumps(alert).encode(),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   timeout=self.timeout_s, check=False)
                if r.returncode != 0:
                    err = r.stderr.decode(errors="replace").strip().splitlines()[-1:]
                    self.log(f"alerts.command exited {r.returncode}"
                             + (f": {err[0][:200]}" if err else ""))
            except subprocess.TimeoutExpired:
                self.log(f"alerts.command killed after {self.timeout_s:g} s")
            except OSError as e:
                self.log(f"alerts.command could not run: {e.strerror or e}")

    def close(self, wait_s: float = 2.0) -> None:
        """Let queued alerts go out for up to `wait_s`, then leave (a daemon thread)."""
        try:
            self.queue.put(None, timeout=wait_s)
        except queue.Full:
            return
        self._thread.join(timeout=wait_s)


class AlertSink:
    """Where an alert goes: events.jsonl, engine.log and the user's command. Called from the
    loop and from the watchdog thread (each write is one whole line)."""

    def __init__(self, event: Callable[[AlertEvent], None], log: Callable[[str], None],
                 runner: CommandRunner | None = None) -> None:
        self._event, self._log, self.runner = event, log, runner
        self._lock = threading.Lock()
        self.count = 0

    def emit(self, alert: AlertEvent) -> None:
        with self._lock:
            stamped = replace(alert, t=time.time())
            self._event(stamped)
            self._log(f"alert {alert.alert}: {alert.message}")
            self.count += 1
            if self.runner is not None:
                self.runner.offer(stamped.to_json())

    def stop(self) -> None:
        if self.runner is not None:
            self.runner.close()
