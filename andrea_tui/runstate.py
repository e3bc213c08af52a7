"""The in-memory model of one run, fed with records from the run directory (DESIGN §7).

Headless: no Textual. The app owns one `RunState`; `RunReader` (runreader.py) feeds it the JSON
objects it reads, and every one of them goes through its typed record of engine.records: a record
that cannot be used is counted and skipped, a bad field becomes a neutral value, nothing raises.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from andrea_tui.series import Columns, StepSeries, columns, eta_seconds
from engine import records as rec
from engine.config import Config, ConfigError, parse_config
from engine.records import Status
from engine.runfiles import JsonlTail

EVENT_TAIL = 200
HEALTH_KEPT = 100  # health changes a state holds (the newest)
ALERTS_KEPT = 1000  # alerts a state holds (the newest)
EVALS_KEPT = 100_000  # validation records a state holds (the newest steps)
TOK_S_WINDOW_S = 10.0  # the header's tok/s: tokens over the last this many seconds
PEAK_FLOPS = (("H100", 989e12), ("H200", 989e12))  # dense bf16 per GPU, by device name
RECENT_RECORDS = 512  # step records kept to find the newest survivor after a resume
MAX_ROWS = 1_000_000  # steps a history holds (the newest): about 100 MB of columns
HISTORY_CHUNK_BYTES = 4 << 20  # what a history load parses at a time


def read_config(obj: Any) -> Config | None:
    """A run's `config.json` for display (its data paths may not exist here), or None."""
    try:
        return parse_config(obj, "config.json", ".", check_paths=False)
    except ConfigError:
        return None


def _merge_src_loss(into: dict[str, float], r: rec.StepRecord) -> None:
    for name, v in r.src_loss.items():
        if v is not None:
            into[name] = v


def _steps(objects: Iterable[Any]) -> tuple[list[rec.StepRecord], int]:
    return rec.parse_all(rec.StepRecord, objects)


def peak_flops(device: str) -> float | None:
    """A GPU's dense bf16 peak (FLOP/s) from its name, or None when unknown."""
    for key, peak in PEAK_FLOPS:
        if key in device.upper():
            return peak
    return None


@dataclass(frozen=True)
class HealthNow:
    """The engine's current judgement of the run (engine.records.Health), why, and from which
    step (None when the engine did not say)."""

    state: rec.Health
    reason: str = ""
    step: int | None = None


def newest_health(state: rec.RunStatus | None, event: rec.HealthEvent | None) -> HealthNow | None:
    """The engine's newest word on a run's health: state.json's, or its newest `health` event
    when that was written after state.json; None while the engine has said nothing (runs of
    engines that never judged their health). The dashboard and the runs browser both ask here."""
    if state is not None and state.health is not None and (
            event is None or state.updated is None or not math.isfinite(event.t)
            or state.updated >= event.t):
        same = event is not None and event.state == state.health
        return HealthNow(state.health, state.health_reason or (event.reason if same and event
                                                               else ""),
                         event.step if same and event else None)
    if event is not None:
        return HealthNow(event.state, event.reason, event.step)
    return None


@dataclass
class PhaseChange:
    step: int
    phase: int
    t: float


@dataclass
class RunState:
    """Everything the dashboard shows, as typed records."""

    series: StepSeries = field(default_factory=StepSeries)
    config: Config | None = None
    engine: rec.EngineInfo | None = None
    state: rec.RunStatus | None = None
    events: deque[rec.Event] = field(default_factory=lambda: deque(maxlen=EVENT_TAIL))
    last_record: rec.StepRecord | None = None
    start_event: rec.StartEvent | None = None
    ready: rec.ReadyEvent | None = None
    first_start_t: float | None = None
    last_sample: rec.Sample | None = None
    checkpoints: list[rec.CheckpointEvent] = field(default_factory=list)
    phase_changes: list[PhaseChange] = field(default_factory=list)
    last_stop: rec.StopEvent | None = None
    src_loss: dict[str, float] = field(default_factory=dict)  # latest non-null loss per source
    errors: list[str] = field(default_factory=list)
    resumes: list[rec.ResumeEvent] = field(default_factory=list)
    recent: deque[rec.StepRecord] = field(default_factory=lambda: deque(maxlen=RECENT_RECORDS))
    evals: dict[int, rec.EvalRecord] = field(default_factory=dict)  # by step, later wins
    system: rec.SystemRecord | None = None  # the newest telemetry sample
    alerts: deque[rec.AlertEvent] = field(default_factory=lambda: deque(maxlen=ALERTS_KEPT))
    alerts_seen: int = 0  # every alert read so far, also those the bounded `alerts` let go
    # the engine's health changes (events.jsonl `health`), the newest last
    health_events: deque[rec.HealthEvent] = field(
        default_factory=lambda: deque(maxlen=HEALTH_KEPT))
    runs: list[tuple[float, float | None]] = field(default_factory=list)  # (start, end) times
    # loss.jsonl's step sequence (engine.records.StepOrder): what may come next, what it skipped
    order: rec.StepOrder = field(default_factory=rec.StepOrder)
    bad_lines: int = 0  # lines that were not JSON objects
    unreadable: int = 0  # JSON objects of the other files that were not usable records
    loss_unreadable: int = 0  # step records skipped: unusable or out of sequence
    version: int = 0  # bumped on every change; the app redraws when it moved

    # ------------------------------------------------------------ feeding

    @property
    def skipped_lines(self) -> int:
        """Lines of the run's files skipped: not JSON, not a usable record, out of sequence."""
        return self.bad_lines + self.unreadable + self.loss_unreadable

    def add_loss(self, objects: list[Any]) -> None:
        """Step records as read from loss.jsonl (JSON objects); those out of sequence
        (engine.records.StepOrder) are skipped and counted."""
        records, bad = _steps(objects)
        if self.resumes:
            records = rec.drop_abandoned(records, self.resumes)
        skipped = self.order.skipped
        records = self.order.admit(records)
        self.loss_unreadable += bad + self.order.skipped - skipped
        self._add_steps(records)

    def _add_steps(self, records: list[rec.StepRecord]) -> None:
        """Step records let in by the sequence rule, in file order, into the series."""
        if not records:
            return
        self.series.add(records)
        if self.series.n > MAX_ROWS + MAX_ROWS // 10:
            self.series.trim(MAX_ROWS)
        self.recent.extend(records)
        last = self.last_record
        prev_phase = last.phase if last else None
        for r in records:
            if last is None or r.step >= last.step:
                if r.phase is not None and prev_phase is not None and r.phase != prev_phase:
                    self._note_phase(r.step, r.phase, r.t)
                prev_phase = r.phase if r.phase is not None else prev_phase
                last = r
                _merge_src_loss(self.src_loss, r)
        self.last_record = last
        self.version += 1

    def set_history(self, history: LossHistory) -> None:
        """Install a whole loss history built off the UI thread (replaces what was there)."""
        self.series = history.series
        self.last_record = history.last_record
        self.recent = deque(history.recent, maxlen=RECENT_RECORDS)
        self.src_loss = dict(history.src_loss)
        self.loss_unreadable = history.unreadable  # the file's, from its start
        # Where the history's reading ended, with the restarts and limits known since.
        order = history.order
        order.restarts, order.max_steps = self.order.restarts, self.order.max_steps
        self.order = order
        for pc in history.phase_changes:
            self._note_phase(pc.step, pc.phase, pc.t)
        for resume in self.resumes:  # resume events read before this history was
            self._drop_abandoned(resume)
        self.version += 1

    def _drop_abandoned(self, resume: rec.ResumeEvent) -> None:
        """Forget what was logged on the timeline a resume abandoned."""
        def gone(step: int, t: float) -> bool:
            return bool(rec.abandoned(step, t, resume.step, resume.t))

        self.series.drop_abandoned(resume)
        self.evals = {k: e for k, e in self.evals.items() if not gone(e.step, e.t)}
        self.phase_changes = [pc for pc in self.phase_changes if not gone(pc.step, pc.t)]
        self.health_events = deque((h for h in self.health_events
                                    if h.step is None or not gone(h.step, h.t)),
                                   maxlen=HEALTH_KEPT)
        self.recent = deque((r for r in self.recent if not gone(r.step, r.t)),
                            maxlen=RECENT_RECORDS)
        last = self.last_record
        if last is not None and gone(last.step, last.t):
            # The newest surviving record (a later one wins a tie), else none.
            best: rec.StepRecord | None = None
            for r in self.recent:
                if best is None or r.step >= best.step:
                    best = r
            self.last_record = best

    def _note_phase(self, step: int, phase: int, t: float) -> None:
        if self.phase_changes and self.phase_changes[-1].phase == phase:
            return
        self.phase_changes.append(PhaseChange(step, phase, t))
        del self.phase_changes[:-20]

    def add_events(self, objects: list[Any]) -> None:
        """Events as read from events.jsonl (JSON objects)."""
        events, bad = rec.parse_all(rec.Event, objects)
        self.unreadable += bad
        restarted = self.order.note(events)
        for e in events:
            self.events.append(e)
            t = e.t if math.isfinite(e.t) else None
            if isinstance(e, rec.StartEvent):
                self.start_event = e
                if self.first_start_t is None:
                    self.first_start_t = t
                if t is not None:
                    self.runs.append((t, None))
            elif isinstance(e, rec.AlertEvent):
                self.alerts.append(e)
                self.alerts_seen += 1
            elif isinstance(e, rec.HealthEvent):
                self.health_events.append(e)
            elif isinstance(e, rec.ReadyEvent):
                self.ready = e
            elif isinstance(e, rec.CheckpointEvent):
                self.checkpoints.append(e)
            elif isinstance(e, rec.ResumeEvent):
                if all((r.t, r.step) != (e.t, e.step) for r in self.resumes):
                    self.resumes.append(e)
                    self._drop_abandoned(e)
            elif isinstance(e, rec.PhaseEvent):
                self._note_phase(e.step, e.phase, e.t)
            elif isinstance(e, rec.FinishedEvent):
                self._end_run(t)
            elif isinstance(e, rec.StopEvent):
                self.last_stop = e
                self._end_run(t)
            elif isinstance(e, rec.ErrorEvent):
                self.errors.append(e.message)
                self._end_run(t)
            elif isinstance(e, rec.CheckpointErrorEvent):
                self.errors.append(e.error)
        if restarted:  # step records read before the restart that explains them
            late = self.order.readmit()
            self.loss_unreadable = max(0, self.loss_unreadable - len(late))
            self._add_steps(rec.drop_abandoned(late, self.resumes))
        if objects:
            self.version += 1

    def _end_run(self, t: float | None) -> None:
        """The engine's process ended at `t`: its running interval closes."""
        if t is not None and self.runs and self.runs[-1][1] is None:
            self.runs[-1] = (self.runs[-1][0], t)

    def add_evals(self, objects: list[Any]) -> None:
        """Validation records as read from eval.jsonl."""
        evals, bad = rec.parse_all(rec.EvalRecord, objects)
        self.unreadable += bad
        for e in rec.drop_abandoned(evals, self.resumes) if self.resumes else evals:
            self.evals[e.step] = e
        if len(self.evals) > EVALS_KEPT:
            for k in sorted(self.evals)[: len(self.evals) - EVALS_KEPT]:
                del self.evals[k]
        if evals:
            self.version += 1

    def add_system(self, objects: list[Any]) -> None:
        """Telemetry samples as read from system.jsonl: the newest is what is shown."""
        samples, bad = rec.parse_all(rec.SystemRecord, objects)
        self.unreadable += bad
        if samples:
            self.system = max(samples, key=lambda s: s.t)
            self.version += 1

    def add_samples(self, objects: list[Any]) -> None:
        samples, bad = rec.parse_all(rec.Sample, objects)
        self.unreadable += bad  # shown at the next frame: junk alone asks for none
        if samples:
            self.last_sample = samples[-1]
            self.version += 1

    def set_files(self, config: Any = None, engine: Any = None, state: Any = None) -> None:
        """The small JSON files' contents as read (JSON objects, or None when missing); one that
        cannot be read keeps the value it replaces."""
        changed = False
        new = {"config": read_config(config) if config is not None else None,
               "engine": rec.EngineInfo.from_json(engine) if engine is not None else None,
               "state": rec.RunStatus.from_json(state) if state is not None else None}
        for name, value in new.items():
            if value and value != getattr(self, name):
                setattr(self, name, value)
                changed = True
        if changed:
            self.order.limit(self.config.train.max_steps if self.config else None,
                             self.state.max_steps if self.state else None)
            self.version += 1

    def reset_loss(self) -> None:
        """loss.jsonl was truncated or replaced: forget what it said."""
        self.series.clear()
        self.last_record = None
        self.recent.clear()
        self.order = self.order.fresh()
        self.loss_unreadable = 0
        self.version += 1

    # ------------------------------------------------------------ derived values

    @property
    def name(self) -> str:
        if self.config is not None:
            return self.config.name
        return (self.start_event.name if self.start_event else "") or "?"

    @property
    def status(self) -> str:
        if self.state is not None:
            return self.state.status.value
        return Status.RUNNING.value if self.series.n else Status.STARTING.value

    @property
    def live(self) -> bool:
        return Status(self.status).live

    @property
    def step(self) -> int | None:
        """The newest step logged; for a run that has ended, the step state.json reports (the
        engine's own word, which also covers records of an abandoned timeline)."""
        s = self.series.last_step
        if self.state is not None and (s is None or not self.live):
            return self.state.step
        return s

    @property
    def max_steps(self) -> int | None:
        for v in (self.state.max_steps if self.state else None,
                  self.ready.max_steps if self.ready else None,
                  self.config.train.max_steps if self.config else None):
            if v:
                return v
        return None

    @property
    def world_size(self) -> int:
        """Ranks of a data-parallel job (1 for one process)."""
        return max(self.ready.world_size if self.ready else 1,
                   self.engine.world_size if self.engine else 1)

    @property
    def backend(self) -> str:
        return ((self.state.backend if self.state else "")
                or (self.ready.backend if self.ready else "")
                or (self.start_event.backend if self.start_event else "") or "?")

    @property
    def device(self) -> str:
        return ((self.state.device if self.state else "")
                or (self.ready.device if self.ready else "")
                or (self.start_event.device if self.start_event else "") or "?")

    @property
    def max_grad_norm(self) -> float | None:
        return self.config.optim.max_grad_norm if self.config else None

    @property
    def tokens(self) -> float:
        return self.series.last("tokens")

    @property
    def tok_s(self) -> float:
        return self.series.last("tok_s")

    @property
    def updated(self) -> float | None:
        """When the engine last wrote state.json (None when unknown)."""
        return self.state.updated if self.state else None

    def elapsed(self, now: float) -> float | None:
        """Time the run has been running: the sum of its engines' running intervals (from each
        start event to its stop, finish or error event), so the hours a run sat stopped do not
        count. An interval with no end: to `now` for the live engine, else to its last step
        record (a crash). Frozen at the last record once not live."""
        end = now if self.live else self.updated or self.series.last("t")
        if not self.runs:
            t0 = float(self.series.col("t")[0]) if self.series.n else None
            if t0 is None or end is None or not math.isfinite(t0) or not math.isfinite(end):
                return None
            return max(0.0, end - t0)
        total = 0.0
        for i, (start, stop) in enumerate(self.runs):
            if stop is None:
                last = i == len(self.runs) - 1
                stop = end if last else self._last_record_before(self.runs[i + 1][0])
            if stop is not None and math.isfinite(stop):
                total += max(0.0, stop - start)
        return total

    def _last_record_before(self, t: float) -> float | None:
        ts = self.series.col("t")
        before = ts[ts < t]
        return float(before.max()) if before.size else None

    def eta(self) -> float | None:
        """Time left at the rate since the engine last started (a stop's gap is no step)."""
        if self.status not in (Status.STARTING.value, Status.RUNNING.value):
            return None
        since = self.runs[-1][0] if self.runs else None
        return eta_seconds(self.step, self.max_steps,
                           self.series.steps_per_second(since_t=since))

    def smooth_tok_s(self, window_s: float = TOK_S_WINDOW_S) -> float:
        """Tokens per second over the last `window_s` seconds of records (the last step's own
        tok/s jumps with every checkpoint, sample or hiccup); the last step's when too few."""
        return self.series.rate("tokens", window_s, since_t=self.runs[-1][0] if self.runs
                                else None, fallback=self.tok_s)

    @property
    def gpu_name(self) -> str:
        gpus = self.system.gpus if self.system else []
        return gpus[0].name if gpus and gpus[0].name else self.device

    def flops_per_token(self) -> float | None:
        """Training FLOPs per token: 6·N + 6·L·d·T (weights, then attention scores)."""
        n = self.ready.n_params if self.ready else None
        if n is None or self.config is None:
            return None
        m = self.config.model
        return 6.0 * n + 6.0 * m.n_layer * m.d_model * m.seq_len

    def mfu(self) -> float | None:
        """Model FLOPs utilization against the GPUs' dense bf16 peak (None when unknown)."""
        peak, fpt = peak_flops(self.gpu_name), self.flops_per_token()
        tok_s = self.smooth_tok_s()
        if peak is None or fpt is None or not math.isfinite(tok_s):
            return None
        return tok_s * fpt / (peak * self.world_size)

    @property
    def health(self) -> HealthNow | None:
        """The engine's newest word on the run's health: state.json's, or the newest health
        event when that was written after state.json; None while the engine has said nothing
        (runs of engines that never judged their health)."""
        return newest_health(self.state, self.health_events[-1] if self.health_events else None)

    @property
    def val_loss(self) -> rec.EvalRecord | None:
        return self.evals[max(self.evals)] if self.evals else None

    @property
    def memory_plan(self) -> dict[str, int]:
        return self.ready.memory_plan if self.ready else {}

    @property
    def last_checkpoint(self) -> rec.CheckpointEvent | rec.CheckpointRef | None:
        lc = self.state.last_checkpoint if self.state else None
        if self.checkpoints:
            ev = self.checkpoints[-1]
            if lc is None or ev.step >= lc.step:
                return ev
        return lc


@dataclass
class LossHistory:
    """A loss.jsonl history prepared in a worker thread: columns, last record, phase changes."""

    series: StepSeries
    last_record: rec.StepRecord | None
    phase_changes: list[PhaseChange]
    src_loss: dict[str, float]
    recent: list[rec.StepRecord]
    unreadable: int = 0  # step records skipped: unusable or out of sequence
    order: rec.StepOrder = field(default_factory=rec.StepOrder)  # where the reading ended

    @classmethod
    def build(cls, objects: list[Any], ema_alpha: float = 0.9,
              resumes: list[rec.ResumeEvent] | None = None,
              order: rec.StepOrder | None = None) -> LossHistory:
        """`objects`: loss.jsonl's JSON objects; `resumes`: the resume events known so far
        (records of the timelines they abandoned are dropped); `order`: the run's step
        sequence rule (engine.records.StepOrder, nothing read yet)."""
        builder = _HistoryBuilder(resumes or [], order)
        builder.add(objects)
        return builder.finish(ema_alpha)

    @classmethod
    def from_tail(cls, tail: JsonlTail, ema_alpha: float = 0.9,
                  resumes: list[rec.ResumeEvent] | None = None,
                  chunk_bytes: int = HISTORY_CHUNK_BYTES,
                  order: rec.StepOrder | None = None) -> LossHistory:
        """Everything `tail` has left to read, in bounded chunks: what is held is column arrays
        (about 100 bytes a step, at most MAX_ROWS steps) and one chunk of records at a time,
        whatever the size of the file."""
        builder = _HistoryBuilder(resumes or [], order)
        while True:
            builder.add(tail.read_new(chunk_bytes))
            if not tail.more:
                return builder.finish(ema_alpha)


class _HistoryBuilder:
    """Folds chunks of loss-file objects, in file order, into a LossHistory."""

    def __init__(self, resumes: list[rec.ResumeEvent], order: rec.StepOrder | None) -> None:
        self.resumes = resumes
        self.order = order or rec.StepOrder()
        self.blocks: list[Columns] = []
        self.last: rec.StepRecord | None = None
        self.changes: list[PhaseChange] = []
        self.prev: int | None = None
        self.src: dict[str, float] = {}
        self.recent: deque[rec.StepRecord] = deque(maxlen=RECENT_RECORDS)
        self.bad = 0

    def add(self, objects: list[Any]) -> None:
        records, bad = _steps(objects)
        self.bad += bad
        if self.resumes:
            records = rec.drop_abandoned(records, self.resumes)
        records = self.order.admit(records)
        if not records:
            return
        self.blocks.append(columns(records))
        self.recent.extend(records)
        for r in records:
            if self.last is not None and r.step < self.last.step:
                continue
            if r.phase is not None and self.prev is not None and r.phase != self.prev:
                self.changes.append(PhaseChange(r.step, r.phase, r.t))
                del self.changes[:-20]
            self.prev = r.phase if r.phase is not None else self.prev
            self.last = r
            _merge_src_loss(self.src, r)

    def finish(self, ema_alpha: float) -> LossHistory:
        series = StepSeries.from_columns(self.blocks, ema_alpha, MAX_ROWS)
        series.ema()  # the O(n) pass happens here, in the worker, not in the first redraw
        return LossHistory(series, self.last, self.changes, self.src, list(self.recent),
                           self.bad + self.order.skipped, self.order)
