"""Alerts the engine raises while it trains (`alert` events, engine.records.AlertEvent).

- `AlertMonitor.observe(record)`, on the loop's thread after each step:
  - `diverging` (`Divergence`), with no baseline needed: the loss above ln(vocab_size) plus a
    margin (the loss of a uniform guess; at once), or `start_factor` times the first loss this
    process saw, or `jump_factor` times the smoothed loss before it (each for two steps in a
    row: one odd batch is a spike, not a divergence), or a sustained rise: the median of the
    last `rise_steps` losses `rise_sigmas` noise SDs (and at least RISE_FLOOR) above the best
    smoothed loss. One alert per divergence: it lasts until that median is back under the line.
  - `loss_spike`: the loss above what this step's mixture predicts (each source's recent
    median loss, weighted by the step's mixture weights, `SourceLosses`) by more than
    `spike_mads` robust standard deviations (1.4826·MAD) of the recent differences; so a
    bandit phase that moves weight onto a harder source is no spike. Without per-source
    losses, against the median of the last WINDOW losses.
  - `grad_spike`: the gradient norm above the median of the last WINDOW steps by `spike_mads`
    robust SDs; `nonfinite`: a non-finite step (its update skipped); `slow`: tok/s under
    SLOW_FRACTION of the window's median for SLOW_STEPS steps in a row.
- `Watchdog`, a daemon thread: a stall, when no step has come for `stall_factor` times the
  median step time (and at least `stall_min_s` seconds); a gap the thread could not see (the
  whole process was stopped) is told when the next step comes.
- `AlertSink.emit`: the alert into events.jsonl and engine.log, and, with `alerts.command`, to
  a `CommandRunner` thread that runs the user's command with the alert as JSON on its stdin
  (a bounded queue: alerts beyond it are dropped and counted, training never waits).

A kind that just alerted is quiet for `cooldown_steps` steps, so a recurring problem says so
once, not at every step; a value `breakthrough` times as far off as the one that began the
quiet period is raised anyway. Every message says what happened, by how much, against what,
and what a user might do. Nothing here touches the training state or its random streams.
"""

from __future__ import annotations

import json
import math
import queue
import statistics
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from engine.config import AlertsConfig, OptimConfig
from engine.records import AlertEvent, StepRecord

WINDOW = 100  # steps the robust baselines look back over
MIN_POINTS = 20  # steps a baseline needs before it judges
SLOW_FRACTION = 0.5
SLOW_STEPS = 10
MAD_SIGMA = 1.4826  # MAD x this estimates a normal distribution's standard deviation
QUEUE_MAX = 16
SOURCE_WINDOW = 50  # losses of each source the mixture's prediction looks back over
SOURCE_MIN = 3  # losses a source needs before its median counts
FAST_BETA = 0.9  # the smoothed loss a one-step jump is measured against (EMA)
SLOW_BETA = 0.98  # the smoothed loss whose best a rise is measured from (EMA)
RISE_FLOOR = 0.05  # a rise's margin is at least this share of the best smoothed loss
IN_A_ROW = 2  # steps the start and jump rules need in a row
GRAD_RATIO = 3.0  # a gradient-norm spike is at least this many times the median


def _fmt(x: float) -> str:
    """A loss or gradient norm in a message: 4 significant digits, thousands separated."""
    return f"{x:,.4g}" if math.isfinite(x) else str(x)


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
        med = statistics.median(self.values)  # (plain Python: faster than numpy this small)
        return med, statistics.median([abs(x - med) for x in self.values])


class SourceLosses:
    """Each source's recent losses (the step records' `src_loss`): what a mixture predicts."""

    def __init__(self, window: int = SOURCE_WINDOW) -> None:
        self.window = window
        self.recent: dict[str, deque[float]] = {}
        self._medians: dict[str, float] | None = None  # until the next add

    def add(self, src_loss: Mapping[str, float | None]) -> None:
        for name, x in src_loss.items():
            if x is not None and math.isfinite(x):
                self.recent.setdefault(name, deque(maxlen=self.window)).append(x)
                self._medians = None

    def medians(self) -> dict[str, float]:
        """{source: median of its recent losses}, for sources with SOURCE_MIN of them."""
        if self._medians is None:
            self._medians = {n: statistics.median(v) for n, v in self.recent.items()
                             if len(v) >= SOURCE_MIN}
        return self._medians

    def predict(self, weights: Mapping[str, float]) -> float | None:
        """The loss this mixture is expected to have: each source's recent median weighted by
        its mixture weight; None until the sources known hold at least half the weight."""
        meds = self.medians()
        total = sum(w for w in weights.values() if w > 0)
        known = {n: w for n, w in weights.items() if w > 0 and n in meds}
        held = sum(known.values())
        if not known or held < 0.5 * total:
            return None
        return sum(w * meds[n] for n, w in known.items()) / held

    def known(self, weights: Mapping[str, float]) -> frozenset[str]:
        """The sources of `weights` whose median counts."""
        return frozenset(n for n, v in self.recent.items() if len(v) >= SOURCE_MIN
                         and n in weights)

    def offset(self, weights: Mapping[str, float], known: frozenset[str] | None = None) -> float:
        """How far this mixture's expected loss lies above an even mixture of the `known`
        sources (by default those whose median counts; 0 with fewer than two): a step's loss
        less this does not move when the mixture does."""
        meds = self.medians()
        names = self.known(weights) if known is None else known
        known_w = {n: weights[n] for n in names if n in meds and n in weights}
        held = sum(known_w.values())
        if len(known_w) < 2 or held <= 0:
            return 0.0
        return sum((w / held - 1.0 / len(known_w)) * meds[n] for n, w in known_w.items())


@dataclass(frozen=True)
class Quiet:
    """A kind's quiet period after an alert: until `until`, begun at `step` by an alert
    `severity` off (see _severity)."""

    until: int
    step: int
    severity: float


def _severity(a: AlertEvent) -> float:
    """How far off an alert's value is: above its baseline, or, for `slow`, how many times
    under it."""
    if a.alert == "slow":
        return a.baseline / a.value if a.value > 0 else math.inf
    return a.value - a.baseline


class Divergence:
    """The loss running away (see the module doc). `observe` returns the `diverging` alert
    when a divergence begins; `active` holds its message while it lasts."""

    def __init__(self, cfg: AlertsConfig, vocab_size: int | None, advice: str) -> None:
        self.cfg, self.advice = cfg, advice
        self.uniform = math.log(vocab_size) if vocab_size else None
        self.start: tuple[int, float] | None = None  # (step, loss) first seen by this process
        self.start_adj = math.nan  # that loss, mixture-adjusted
        self.fast: float | None = None
        self.slow: float | None = None
        self.best: tuple[int, float] | None = None  # (step, lowest slow EMA)
        self.recent: deque[float] = deque(maxlen=cfg.rise_steps)
        self.noise = RobustBaseline()  # the loss less the smoothed loss before it
        self.start_run = 0
        self.jump_run, self.jump_base = 0, math.nan
        self.active: str | None = None  # the ongoing divergence's message
        self.active_step: int | None = None
        self._line_sigma = 0.0  # the noise SD when it began (the line it must come back under)
        self.under = 0  # steps in a row under that line, while diverging
        self.recovered: str | None = None  # set by the step that ended a divergence

    def shift(self, delta: float) -> None:
        """The mixture-adjusted loss is measured from another even mixture from now on (a
        source's median began to count): what was measured in it moves by `delta`."""
        if self.fast is not None:
            self.fast += delta
        if self.slow is not None:
            self.slow += delta
        if self.best is not None:
            self.best = (self.best[0], self.best[1] + delta)
        self.recent = deque((x + delta for x in self.recent), maxlen=self.recent.maxlen)
        self.jump_base += delta
        self.start_adj += delta

    def sigma(self) -> float:
        if len(self.noise) < MIN_POINTS:
            return 0.0
        return MAD_SIGMA * self.noise.median_mad()[1]

    def line(self, sigma: float) -> float:
        """The level the recent losses' median must stay above to be a rise."""
        assert self.best is not None
        best = self.best[1]
        return best + max(self.cfg.rise_sigmas * sigma, RISE_FLOOR * abs(best))

    def observe(self, step: int, loss: float, adj: float, offset: float) -> AlertEvent | None:
        """One finite step: its loss, and `adj`, its loss less the mixture's offset."""
        c = self.cfg
        self.recovered = None
        if self.start is None:
            self.start, self.start_adj = (step, loss), adj
        before = self.fast
        if before is not None:
            self.noise.add(adj - before)
        self.fast = adj if before is None else FAST_BETA * before + (1 - FAST_BETA) * adj
        self.slow = adj if self.slow is None else SLOW_BETA * self.slow + (1 - SLOW_BETA) * adj
        if self.best is None or (self.slow < self.best[1] and self.active is None):
            self.best = (step, self.slow)
        self.recent.append(adj)
        median = statistics.median(self.recent)
        sigma = self.sigma()
        if self.active is not None:
            # back when the smoothed loss and the recent median both stay under the line
            line = self.line(self._line_sigma)
            ok = max(median, self.slow) < line and \
                (self.uniform is None or loss <= self.uniform + c.diverge_margin)
            self.under = self.under + 1 if ok else 0
            if self.under >= c.rise_steps:
                self.recovered = (f"the loss came back: its smoothed value {_fmt(self.slow)} and "
                                  f"the median of the last {len(self.recent)} steps, "
                                  f"{_fmt(median)}, stayed under {_fmt(line)} for {self.under} "
                                  f"steps to step {step} (diverging since step "
                                  f"{self.active_step})")
                self.active = self.active_step = None
            return None
        alert = self._uniform(step, loss, adj) or self._start(step, loss, adj) or \
            self._jump(step, loss, before, offset) or self._rise(step, median, sigma)
        if alert is not None:
            self.active, self.active_step = alert.message, step
            self._line_sigma, self.under = sigma, 0
        return alert

    def _alert(self, step: int, value: float, baseline: float, line: float,
               what: str) -> AlertEvent:
        return AlertEvent(alert="diverging", step=step, value=value, baseline=baseline,
                          threshold=line, message=f"{what}: the run is diverging; {self.advice}")

    def _uniform(self, step: int, loss: float, adj: float) -> AlertEvent | None:
        # (and at an even mixture: a source of noise may be above the line on its own)
        line = None if self.uniform is None else self.uniform + self.cfg.diverge_margin
        if line is None or loss <= line or adj <= line:
            return None
        v = round(math.exp(self.uniform))
        return self._alert(step, loss, self.uniform, self.uniform + self.cfg.diverge_margin,
                           f"loss {_fmt(loss)} at step {step} is above ln({v}) = "
                           f"{self.uniform:.2f}, the loss of a uniform guess (alert line "
                           f"{self.uniform + self.cfg.diverge_margin:.2f})")

    def _start(self, step: int, loss: float, adj: float) -> AlertEvent | None:
        assert self.start is not None
        s_step, s_loss = self.start
        if not s_loss > 0:  # a start at zero loss (a memorised set): no multiple to judge by
            return None
        line = self.cfg.start_factor * s_loss
        # (and at an even mixture: a mixture of harder sources is no divergence)
        up = loss > line and adj > self.cfg.start_factor * self.start_adj
        self.start_run = self.start_run + 1 if up else 0
        if self.start_run < IN_A_ROW:
            return None
        return self._alert(step, loss, s_loss, line,
                           f"loss {_fmt(loss)} at step {step} is {loss / s_loss:.1f}x the first "
                           f"loss of this run, {_fmt(s_loss)} at step {s_step}, for "
                           f"{self.start_run} steps in a row (alert line {_fmt(line)})")

    def _jump(self, step: int, loss: float, before: float | None,
              offset: float) -> AlertEvent | None:
        if before is None:
            return None
        base = (self.jump_base if self.jump_run else before) + offset
        if not (base > 0 and loss > self.cfg.jump_factor * base):
            self.jump_run = 0
            return None
        if not self.jump_run:
            self.jump_base = before
        self.jump_run += 1
        if self.jump_run < IN_A_ROW:
            return None
        line = self.cfg.jump_factor * base
        return self._alert(step, loss, base, line,
                           f"loss {_fmt(loss)} at step {step} is {loss / base:.1f}x the smoothed "
                           f"loss before it, {_fmt(base)}, for {self.jump_run} steps in a row "
                           f"(alert line {_fmt(line)}, {self.cfg.jump_factor:g}x)")

    def _rise(self, step: int, median: float, sigma: float) -> AlertEvent | None:
        if len(self.recent) < self.cfg.rise_steps or sigma <= 0:
            return None
        line = self.line(sigma)
        if median <= line:
            return None
        assert self.best is not None
        b_step, best = self.best
        return self._alert(step, median, best, line,
                           f"the median loss of the last {len(self.recent)} steps, "
                           f"{_fmt(median)} at step {step} (mixture-adjusted), is "
                           f"{median - best:.3g} above the best smoothed loss, {_fmt(best)} at "
                           f"step {b_step}: more than {self.cfg.rise_sigmas:g} noise SDs "
                           f"({sigma:.3g}) and {RISE_FLOOR:.0%} (alert line {_fmt(line)})")


class AlertMonitor:
    """Judges each step record against the steps before it; returns the alerts it raises.
    `diverging` is the message of the divergence going on (None when none is)."""

    def __init__(self, config: AlertsConfig | None = None, *, vocab_size: int | None = None,
                 optim: OptimConfig | None = None, spike_mads: float | None = None,
                 window: int = WINDOW) -> None:
        c = config or AlertsConfig()
        if spike_mads is not None:
            c = replace(c, spike_mads=spike_mads)
        self.cfg, self.optim = c, optim
        self.spike_mads = c.spike_mads
        self.loss = RobustBaseline(window)
        self.resid = RobustBaseline(window)  # the loss less what its mixture predicted
        self.grad = RobustBaseline(window)
        self.tok_s = RobustBaseline(window)
        self.sources = SourceLosses()
        self.divergence = Divergence(c, vocab_size, self._divergence_advice())
        self.slow_run = 0
        self.nonfinite_run = 0  # non-finite steps in a row, up to the last one
        self.quiet: dict[str, Quiet] = {}
        self._known: frozenset[str] = frozenset()  # the sources the offset was measured over

    @property
    def diverging(self) -> str | None:
        return self.divergence.active

    @property
    def recovered(self) -> str | None:
        """How a divergence that ended at the last step observed ended (else None)."""
        return self.divergence.recovered

    def _divergence_advice(self) -> str:
        o = self.optim
        if o is None:
            return "lower optim.lr or raise optim.warmup_steps"
        return (f"lower optim.lr (now {o.lr:g}) or raise optim.warmup_steps (now "
                f"{o.warmup_steps}), and resume from a checkpoint before it went up")

    def _loss_spike(self, r: StepRecord, predicted: float | None) -> AlertEvent | None:
        if predicted is not None and len(self.resid) >= MIN_POINTS:
            med, mad = self.resid.median_mad()
            base = predicted + med
            against = (f"{_fmt(base)}, what this step's mixture predicts from each source's "
                       f"recent loss")
        elif len(self.loss) >= MIN_POINTS:
            base, mad = self.loss.median_mad()
            against = f"{_fmt(base)}, the median of the last {len(self.loss)} steps"
        else:
            return None
        # A floor under the spread: a flat series (MAD 0) must not alert on a rounding.
        sigma = max(MAD_SIGMA * mad, 0.01 * abs(base), 1e-12)
        line = base + self.spike_mads * sigma
        if r.loss <= line:
            return None
        return AlertEvent(alert="loss_spike", step=r.step, value=r.loss, baseline=base,
                          threshold=line, message=f"loss {_fmt(r.loss)} at step {r.step} is "
                          f"{(r.loss - base) / sigma:.0f} robust SDs above {against} (alert "
                          f"line {_fmt(line)}); one spike is often one odd batch: if spikes "
                          "recur, lower optim.lr")

    def _grad_spike(self, r: StepRecord) -> AlertEvent | None:
        x = r.grad_norm
        if len(self.grad) < MIN_POINTS or not math.isfinite(x):
            return None
        med, mad = self.grad.median_mad()
        # heavy-tailed: a spike is also GRAD_RATIO times the median
        line = max(med + self.spike_mads * max(MAD_SIGMA * mad, 1e-12), GRAD_RATIO * med)
        if x <= line:
            return None
        clip = (f"; clipping scaled its update by {r.clip_scale:.2g}"
                if math.isfinite(r.clip_scale) and r.clip_scale < 1 else "")
        return AlertEvent(alert="grad_spike", step=r.step, value=x, baseline=med, threshold=line,
                          message=f"gradient norm {_fmt(x)} at step {r.step} is "
                          f"{x / med if med > 0 else math.inf:,.0f}x the median of the last "
                          f"{len(self.grad)} steps, {_fmt(med)} (alert line {_fmt(line)}){clip}; "
                          "if spikes recur, lower optim.lr or optim.max_grad_norm")

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
                          f"step {r.step}, under {SLOW_FRACTION:.0%} of {med:,.0f} tok/s, the "
                          f"median of the last {len(self.tok_s)} steps: is something else "
                          "using the CPU or GPU, or the data slow to read?")

    def _nonfinite(self, r: StepRecord) -> AlertEvent:
        what = "loss" if not math.isfinite(r.loss) else "gradient norm"
        return AlertEvent(
            alert="nonfinite", step=r.step,
            value=r.grad_norm if not math.isfinite(r.grad_norm) else r.loss,
            message=f"non-finite {what} at step {r.step}"
            + (": its update was skipped" if r.skipped else "")
            + "; one such step is harmless, a run of them means the weights or the lr are "
            "broken: lower optim.lr, or resume from the last checkpoint")

    def observe(self, r: StepRecord) -> list[AlertEvent]:
        found: list[AlertEvent | None] = []
        self.divergence.recovered = None
        if r.skipped or not (math.isfinite(r.loss) and math.isfinite(r.grad_norm)):
            self.nonfinite_run += 1
            found.append(self._nonfinite(r))
        else:
            self.nonfinite_run = 0
            predicted = self.sources.predict(r.weights)
            known = self.sources.known(r.weights)
            offset = self.sources.offset(r.weights, known)
            if known != self._known:
                self.divergence.shift(self.sources.offset(r.weights, self._known) - offset)
                self._known = known
            diverging = self.divergence.observe(r.step, r.loss, r.loss - offset, offset)
            if diverging is not None:
                found.append(diverging)
            elif self.divergence.active is None:  # a spike says nothing new in a divergence
                found.append(self._loss_spike(r, predicted))
                found.append(self._grad_spike(r))
            self.loss.add(r.loss)
            if predicted is not None:
                self.resid.add(r.loss - predicted)
            self.grad.add(r.grad_norm)
            self.sources.add(r.src_loss)
        found.append(self._slow(r))
        self.tok_s.add(r.tok_s)
        told = (self._after_quiet(a, r.step) for a in found if a is not None)
        return [a for a in told if a is not None]

    def _after_quiet(self, a: AlertEvent, step: int) -> AlertEvent | None:
        """The alert as raised (None when its kind is quiet): a kind is quiet for
        cooldown_steps after it alerted, unless this one is `breakthrough` times as far off.
        A divergence is told once by its own rule."""
        if a.alert == "diverging":
            return a
        sev = _severity(a)
        q = self.quiet.get(a.alert)
        if q is not None and step < q.until:
            if not (q.severity > 0 and sev > self.cfg.breakthrough * q.severity):
                return None
            a = replace(a, message=f"{a.message} (inside the quiet period after the alert at "
                        f"step {q.step}, but {sev / q.severity:,.0f}x as far off)")
        self.quiet[a.alert] = Quiet(step + self.cfg.cooldown_steps, step, sev)
        return a


class Watchdog:
    """A daemon thread that raises a `stall` alert when `beat()` has not been called for
    `factor` x the median step time (and at least `min_s`); once per stall. A gap the thread
    did not see end (the whole process was stopped, SIGSTOP) is told by the `beat()` after it."""

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
        self._lock = threading.Lock()  # one stall, one alert: the thread and beat() both tell
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, step: int, step_s: float | None = None) -> None:
        """A step (of `step_s` seconds) was done, or the loop did other expected work."""
        late = None
        with self._lock:
            if step_s is not None and step != self.step:
                late = self._due(f"; the process did not run meanwhile (stopped, or starved of "
                                 f"CPU), and went on at step {step}")
            if step_s is not None and math.isfinite(step_s):
                self.step_s.append(step_s)
            self.step = step
            self.last_beat = self.clock()
            self.told = False
        if late is not None:
            self.emit(late)

    def _due(self, then: str) -> AlertEvent | None:
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
                          f"{self.step} (median step {median:.3g} s, alert after {line:.0f} s)"
                          + then)

    def check(self) -> AlertEvent | None:
        """The stall alert when one is due now (the thread calls this every poll_s)."""
        with self._lock:
            return self._due("; if no step comes, the engine may be hung: stop it and resume "
                             "from its newest checkpoint")

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
