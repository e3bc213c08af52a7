"""The in-memory model of one run, fed with records from the run directory (DESIGN §7).

Headless: no Textual. The app owns one `RunState`; `RunReader` (runreader.py) feeds it. Every
field tolerates missing or malformed input: a bad record is skipped, never raised.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from andrea_tui.series import StepSeries, eta_seconds

EVENT_TAIL = 200


def _dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _float(x: Any) -> float | None:
    if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
        return float(x)
    return None


def _merge_src_loss(into: dict[str, float], rec: dict[str, Any]) -> None:
    for name, v in _dict(rec.get("src_loss")).items():
        fv = _float(v)
        if fv is not None:
            into[str(name)] = fv


@dataclass
class PhaseChange:
    step: int
    phase: int
    t: float | None


@dataclass
class RunState:
    """Everything the dashboard shows, as plain data."""

    series: StepSeries = field(default_factory=StepSeries)
    config: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    events: deque = field(default_factory=lambda: deque(maxlen=EVENT_TAIL))
    last_record: dict[str, Any] = field(default_factory=dict)
    start_event: dict[str, Any] = field(default_factory=dict)
    ready: dict[str, Any] = field(default_factory=dict)
    first_start_t: float | None = None
    last_sample: dict[str, Any] = field(default_factory=dict)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)  # checkpoint events
    phase_changes: list[PhaseChange] = field(default_factory=list)
    last_stop: dict[str, Any] = field(default_factory=dict)
    src_loss: dict[str, float] = field(default_factory=dict)  # latest non-null loss per source
    errors: list[str] = field(default_factory=list)
    bad_lines: int = 0
    version: int = 0  # bumped on every change; the app redraws when it moved

    # ------------------------------------------------------------ feeding

    def add_loss(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        self.series.add(records)
        prev_phase = _int(self.last_record.get("phase"))
        for r in records:
            if _int(r.get("step")) is None:
                continue
            if not self.last_record or r["step"] >= self.last_record.get("step", -1):
                ph = _int(r.get("phase"))
                if ph is not None and prev_phase is not None and ph != prev_phase:
                    self._note_phase(r["step"], ph, _float(r.get("t")))
                prev_phase = ph if ph is not None else prev_phase
                self.last_record = r
                _merge_src_loss(self.src_loss, r)
        self.version += 1

    def set_history(self, history: LossHistory) -> None:
        """Install a whole loss history built off the UI thread (replaces what was there)."""
        self.series = history.series
        self.last_record = history.last_record
        self.src_loss = dict(history.src_loss)
        for pc in history.phase_changes:
            self._note_phase(pc.step, pc.phase, pc.t)
        self.version += 1

    def _note_phase(self, step: int, phase: int, t: float | None) -> None:
        if self.phase_changes and self.phase_changes[-1].phase == phase:
            return
        self.phase_changes.append(PhaseChange(step, phase, t))
        del self.phase_changes[:-20]

    def add_events(self, records: list[dict[str, Any]]) -> None:
        for e in records:
            kind = e.get("event")
            if not isinstance(kind, str):
                continue
            self.events.append(e)
            t = _float(e.get("t"))
            if kind == "start":
                self.start_event = e
                if self.first_start_t is None:
                    self.first_start_t = t
            elif kind == "ready":
                self.ready = e
            elif kind == "checkpoint":
                self.checkpoints.append(e)
            elif kind == "phase":
                step, ph = _int(e.get("step")), _int(e.get("phase"))
                if step is not None and ph is not None:
                    self._note_phase(step, ph, t)
            elif kind == "stop":
                self.last_stop = e
            elif kind in ("error", "checkpoint_error"):
                self.errors.append(str(e.get("message") or e.get("error") or e))
        if records:
            self.version += 1

    def add_samples(self, records: list[dict[str, Any]]) -> None:
        for s in records:
            if isinstance(s.get("text"), str):
                self.last_sample = s
        if records:
            self.version += 1

    def set_files(self, config: dict | None, engine: dict | None, state: dict | None) -> None:
        """Replace the small JSON files' contents (a missing/corrupt file keeps the old value)."""
        changed = False
        for name, value in (("config", config), ("engine", engine), ("state", state)):
            if value is not None and value != getattr(self, name):
                setattr(self, name, value)
                changed = True
        if changed:
            self.version += 1

    def reset_loss(self) -> None:
        """loss.jsonl was truncated or replaced: forget what it said."""
        self.series.clear()
        self.last_record = {}
        self.version += 1

    # ------------------------------------------------------------ derived values

    @property
    def name(self) -> str:
        return str(self.config.get("name") or self.start_event.get("name") or "?")

    @property
    def status(self) -> str:
        return str(self.state.get("status") or ("running" if self.series.n else "starting"))

    @property
    def step(self) -> int | None:
        s = self.series.last_step
        st = _int(self.state.get("step"))
        if s is None:
            return st
        return s if st is None else max(s, st) if self.status != "running" else s

    @property
    def max_steps(self) -> int | None:
        for src in (self.state.get("max_steps"), self.ready.get("max_steps"),
                    _dict(self.config.get("train")).get("max_steps")):
            v = _int(src)
            if v:
                return v
        return None

    @property
    def backend(self) -> str:
        return str(self.state.get("backend") or self.ready.get("backend")
                   or self.start_event.get("backend") or "?")

    @property
    def device(self) -> str:
        return str(self.state.get("device") or self.ready.get("device")
                   or self.start_event.get("device") or "?")

    @property
    def max_grad_norm(self) -> float | None:
        return _float(_dict(self.config.get("optim")).get("max_grad_norm"))

    @property
    def tokens(self) -> float:
        return self.series.last("tokens")

    @property
    def tok_s(self) -> float:
        return self.series.last("tok_s")

    def elapsed(self, now: float) -> float | None:
        """Wall time since the run first started; frozen at the last record once not live."""
        t0 = self.first_start_t
        if t0 is None and self.series.n:
            t0 = float(self.series.col("t")[0])
        if t0 is None or not math.isfinite(t0):
            return None
        live = self.status in ("starting", "running", "stopping")
        end = now if live else _float(self.state.get("updated")) or self.series.last("t")
        return max(0.0, end - t0) if end is not None and math.isfinite(end) else None

    def eta(self) -> float | None:
        if self.status not in ("starting", "running"):
            return None
        return eta_seconds(self.step, self.max_steps, self.series.steps_per_second())

    @property
    def memory_plan(self) -> dict[str, Any]:
        return _dict(self.ready.get("memory_plan"))

    @property
    def last_checkpoint(self) -> dict[str, Any]:
        lc = _dict(self.state.get("last_checkpoint"))
        if self.checkpoints and _int(self.checkpoints[-1].get("step")) is not None:
            ev = self.checkpoints[-1]
            if not lc or (ev.get("step") or 0) >= (lc.get("step") or 0):
                return ev
        return lc


@dataclass
class LossHistory:
    """A loss.jsonl history prepared in a worker thread: columns, last record, phase changes."""

    series: StepSeries
    last_record: dict[str, Any]
    phase_changes: list[PhaseChange]
    src_loss: dict[str, float]

    @classmethod
    def build(cls, records: list[dict[str, Any]], ema_alpha: float = 0.9) -> LossHistory:
        series = StepSeries.from_records(records, ema_alpha)
        series.ema()  # the O(n) pass happens here, in the worker, not in the first redraw
        last: dict[str, Any] = {}
        changes: list[PhaseChange] = []
        prev = None
        src: dict[str, float] = {}
        for r in records:
            step = _int(r.get("step"))
            if step is None or (last and step < last.get("step", -1)):
                continue
            ph = _int(r.get("phase"))
            if ph is not None and prev is not None and ph != prev:
                changes.append(PhaseChange(step, ph, _float(r.get("t"))))
            prev = ph if ph is not None else prev
            last = r
            _merge_src_loss(src, r)
        return cls(series, last, changes[-20:], src)
