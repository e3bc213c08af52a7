"""The in-memory model of one run, fed with records from the run directory (DESIGN §7).

Headless: no Textual. The app owns one `RunState`; `RunReader` (runreader.py) feeds it. Every
field tolerates missing or malformed input: a bad record is skipped, never raised.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from andrea_tui.series import StepSeries, eta_seconds, valid_step
from andrea_tui.textfmt import as_number
from engine.runfiles import drop_abandoned

EVENT_TAIL = 200
RECENT_RECORDS = 512  # raw loss records kept to find the newest survivor after a resume


def _dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _float(x: Any) -> float | None:
    f = as_number(x)
    return f if f is not None and math.isfinite(f) else None


def _ints(d: dict[str, Any], *keys: str) -> None:
    """Replace each key's value by itself when an int, else None (in place)."""
    for k in keys:
        if k in d and _int(d[k]) is None:
            d[k] = None


def _numbers(d: dict[str, Any], *keys: str) -> None:
    """Replace each key's value by itself when a real number, else None (in place)."""
    for k in keys:
        if k in d and (isinstance(d[k], bool) or not isinstance(d[k], (int, float))):
            d[k] = None


def clean_loss_record(r: dict[str, Any]) -> dict[str, Any]:
    """A loss record with the fields the panels read type-checked (bad values become None)."""
    out = dict(r)
    _ints(out, "phase", "phase_step", "phase_len")
    w = out.get("weights")
    out["weights"] = ({str(k): v for k, v in w.items() if _float(v) is not None}
                      if isinstance(w, dict) else {})
    return out


def clean_event(e: dict[str, Any]) -> dict[str, Any]:
    """An event with its known numeric fields type-checked (bad values become None)."""
    out = dict(e)
    _ints(out, "step", "max_steps", "n_params", "pid", "phase", "phase_len", "count")
    _numbers(out, "t", "seconds", "bytes", "grad_norm", "tokens_per_step")
    if "memory_plan" in out and not isinstance(out["memory_plan"], dict):
        out["memory_plan"] = {}
    return out


def clean_state(d: dict[str, Any]) -> dict[str, Any]:
    """state.json with its fields type-checked (bad values become None)."""
    out = dict(d)
    _ints(out, "step", "max_steps", "pid")
    _numbers(out, "updated")
    lc = out.get("last_checkpoint")
    if isinstance(lc, dict):
        lc = dict(lc)
        _ints(lc, "step")
        out["last_checkpoint"] = lc
    else:
        out["last_checkpoint"] = None
    return out


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
    resumes: list[tuple[float, int]] = field(default_factory=list)  # (t, step) of resume events
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_RECORDS))
    bad_lines: int = 0
    version: int = 0  # bumped on every change; the app redraws when it moved

    # ------------------------------------------------------------ feeding

    def _resume_events(self) -> list[dict[str, Any]]:
        return [{"event": "resume", "t": t, "step": k} for t, k in self.resumes]

    def add_loss(self, records: list[dict[str, Any]]) -> None:
        records = [r for r in records if valid_step(r.get("step"))]
        if self.resumes:
            records = drop_abandoned(records, self._resume_events())
        if not records:
            return
        self.series.add(records)
        self.recent.extend(records)
        prev_phase = _int(self.last_record.get("phase"))
        for r in records:
            if not self.last_record or r["step"] >= self.last_record.get("step", -1):
                r = clean_loss_record(r)
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
        self.recent = deque(history.recent, maxlen=RECENT_RECORDS)
        self.src_loss = dict(history.src_loss)
        for pc in history.phase_changes:
            self._note_phase(pc.step, pc.phase, pc.t)
        for t, k in self.resumes:  # resume events read before this history was
            self._drop_abandoned(t, k)
        self.version += 1

    def _drop_abandoned(self, t: float, k: int) -> None:
        """A resume from step k at time t: forget what was logged past k before t."""
        def gone(step: int, rt: float | None) -> bool:
            return step > k and rt is not None and rt < t

        self.series.drop_abandoned(k, t)
        self.phase_changes = [pc for pc in self.phase_changes if not gone(pc.step, pc.t)]
        self.recent = deque((r for r in self.recent if not gone(r["step"], _float(r.get("t")))),
                            maxlen=RECENT_RECORDS)
        last = self.last_record
        if last and gone(last["step"], _float(last.get("t"))):
            # The newest surviving record (a later one wins a tie), else a bare step.
            best: dict[str, Any] = {}
            for r in self.recent:
                if not best or r["step"] >= best["step"]:
                    best = r
            if not best and self.series.n:
                best = {"step": self.series.last_step}
            self.last_record = clean_loss_record(best) if best else {}

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
            e = clean_event(e)
            self.events.append(e)
            t = _float(e.get("t"))
            if kind == "start":
                self.start_event = e
                if self.first_start_t is None:
                    self.first_start_t = t
            elif kind == "ready":
                self.ready = e
            elif kind == "checkpoint":
                if e.get("step") is not None:
                    self.checkpoints.append(e)
            elif kind == "resume":
                step = _int(e.get("step"))
                if step is not None and t is not None and (t, step) not in self.resumes:
                    self.resumes.append((t, step))
                    self._drop_abandoned(t, step)
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
        if isinstance(state, dict):
            state = clean_state(state)
        for name, value in (("config", config), ("engine", engine), ("state", state)):
            if isinstance(value, dict) and value != getattr(self, name):
                setattr(self, name, value)
                changed = True
        if changed:
            self.version += 1

    def reset_loss(self) -> None:
        """loss.jsonl was truncated or replaced: forget what it said."""
        self.series.clear()
        self.last_record = {}
        self.recent.clear()
        self.version += 1

    # ------------------------------------------------------------ derived values

    @property
    def name(self) -> str:
        return str(self.config.get("name") or self.start_event.get("name") or "?")

    @property
    def status(self) -> str:
        return str(self.state.get("status") or ("running" if self.series.n else "starting"))

    @property
    def live(self) -> bool:
        return self.status in ("starting", "running", "stopping")

    @property
    def step(self) -> int | None:
        """The newest step logged; for a run that has ended, the step state.json reports (the
        engine's own word, which also covers records of an abandoned timeline)."""
        s = self.series.last_step
        st = _int(self.state.get("step"))
        if st is not None and (s is None or not self.live):
            return st
        return s

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
        end = now if self.live else _float(self.state.get("updated")) or self.series.last("t")
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
        if self.checkpoints:
            ev = self.checkpoints[-1]  # only events with an int step are kept
            if not lc or ev["step"] >= (_int(lc.get("step")) or 0):
                return ev
        return lc


@dataclass
class LossHistory:
    """A loss.jsonl history prepared in a worker thread: columns, last record, phase changes."""

    series: StepSeries
    last_record: dict[str, Any]
    phase_changes: list[PhaseChange]
    src_loss: dict[str, float]
    recent: list[dict[str, Any]]

    @classmethod
    def build(cls, records: list[dict[str, Any]], ema_alpha: float = 0.9,
              resumes: list[tuple[float, int]] | None = None) -> LossHistory:
        """`resumes`: (t, step) of the resume events known so far (abandoned records dropped)."""
        records = [r for r in records if valid_step(r.get("step"))]
        if resumes:
            records = drop_abandoned(
                records, [{"event": "resume", "t": t, "step": k} for t, k in resumes])
        series = StepSeries.from_records(records, ema_alpha)
        series.ema()  # the O(n) pass happens here, in the worker, not in the first redraw
        last: dict[str, Any] = {}
        changes: list[PhaseChange] = []
        prev = None
        src: dict[str, float] = {}
        for r in records:
            step = r["step"]
            if last and step < last.get("step", -1):
                continue
            ph = _int(r.get("phase"))
            if ph is not None and prev is not None and ph != prev:
                changes.append(PhaseChange(step, ph, _float(r.get("t"))))
            prev = ph if ph is not None else prev
            last = r
            _merge_src_loss(src, r)
        return cls(series, clean_loss_record(last) if last else {}, changes[-20:], src,
                   records[-RECENT_RECORDS:])
