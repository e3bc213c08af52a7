"""The runs under a directory, one summary row each: what `andrea-tui runs` lists.

Headless: no Textual. Reading many runs stays quick because each refresh reads little:
- the small JSON files (state.json, config.json; engine.json through engine.run.control for a run
  that says it is live), each bounded by engine.runfiles;
- the last TAIL_BYTES of loss.jsonl (the newest step, its loss and tok/s) and of eval.jsonl,
  the first TAIL_BYTES of events.jsonl (when the run started, its `ready` event);
- events.jsonl, loss.jsonl and eval.jsonl in full only once per run, in bounded chunks, for
  what needs the whole file (its resumes, its best validation and smoothed loss); later
  refreshes read only the bytes appended since (a JsonlTail per run), and a new resume event
  starts the best losses over with the abandoned-timeline rule;
- the user's notes.json (andrea_tui.notes);
- nothing but a few stat calls for a run that is not live and whose files did not change.
`RunScanner.scan()` is meant for a worker thread: it can take a while the first time on long runs.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from andrea_tui import settings as user_settings
from andrea_tui.notes import NOTES, RunNotes, read_notes
from andrea_tui.runstate import newest_health, read_config
from andrea_tui.series import EmaFold
from andrea_tui.valloss import parse_eval, surviving
from engine import records as rec
from engine.config import Config
from engine.run.control import engine_alive, lock_held
from engine.runfiles import (
    CHECKPOINTS,
    CONFIG,
    ENGINE,
    EVENTS,
    LOSS,
    STATE,
    JsonlTail,
    RunPaths,
    parse_lines,
    read_json,
    tail_lines,
)

TAIL_BYTES = 64 << 10  # of loss.jsonl: a hundred or more step records
CHUNK_BYTES = 256 << 10  # what one read of a whole-file pass takes
MAX_DEPTH = 3  # runs/<name>, runs/<group>/<name>, runs/<a>/<b>/<name>
MAX_DIRS = 20_000  # directories looked at, at most, under the root
RUN_FILES = (ENGINE, STATE, CONFIG, LOSS, EVENTS)

LIVE, DEAD = "live", "dead"


def is_run_dir(path: Path) -> bool:
    """A directory that holds any of a run's files."""
    return any((path / f).is_file() for f in RUN_FILES)


def find_runs(root: Path, max_depth: int = MAX_DEPTH) -> list[Path]:
    """The run directories under `root` (itself, when it is one), sorted by path. Checkpoint
    directories and hidden ones are not entered; a run's own subdirectories are not either."""
    root = Path(root)
    if is_run_dir(root):
        return [root]
    found: list[Path] = []
    stack = [(root, 0)]
    seen = 0
    while stack and seen < MAX_DIRS:
        d, depth = stack.pop()
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        for e in entries:
            if e.name.startswith(".") or e.name == CHECKPOINTS:
                continue
            try:
                if not e.is_dir(follow_symlinks=False):
                    continue
            except OSError:
                continue
            seen += 1
            p = Path(e.path)
            if is_run_dir(p):
                found.append(p)
            elif depth + 1 < max_depth:
                stack.append((p, depth + 1))
    return sorted(found)


def tail_objects(path: Path, max_bytes: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The complete JSON objects in the last `max_bytes` of a JSONL file (none when missing)."""
    objects, _ = parse_lines(tail_lines(path, max_bytes))
    return objects


def head_objects(path: Path, max_bytes: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The complete JSON objects in the first `max_bytes` of a JSONL file (none when missing)."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes)
    except OSError:
        return []
    objects, _ = parse_lines(data.split(b"\n")[:-1])  # the last piece is empty or cut short
    return objects


def _head(paths: RunPaths) -> tuple[float | None, rec.ReadyEvent | None]:
    """(when the run first started, its first `ready` event) from the files' heads."""
    events, _ = rec.parse_all(rec.Event, head_objects(paths.events))
    started = next((e.t for e in events if isinstance(e, rec.StartEvent) and math.isfinite(e.t)),
                   None)
    ready = next((e for e in events if isinstance(e, rec.ReadyEvent)), None)
    if started is None:
        steps, _ = rec.parse_all(rec.StepRecord, head_objects(paths.loss))
        started = next((r.t for r in steps if math.isfinite(r.t)), None)
    return started, ready


@dataclass
class RunSummary:
    """One row of the runs browser."""

    path: Path
    name: str
    status: str  # live, dead, finished, stopped, failed, or what state.json lacks
    note: str = ""  # the engine's word (starting, stopping), why dead, what is unreadable
    step: int | None = None
    max_steps: int | None = None
    last_loss: float = math.nan
    best_loss: float = math.nan  # the lowest single step loss
    best_ema: float = math.nan  # the lowest smoothed (EMA) loss
    best_val: float = math.nan  # the lowest validation loss (NaN: the run has none)
    val_loss: float = math.nan
    tok_s: float = math.nan
    tokens: int | None = None
    started: float | None = None
    backend: str = ""
    updated: float | None = None  # the newest write we know of (for "most recent first")
    health: str = ""  # the engine's judgement (engine.records.Health), "" when it said none
    health_reason: str = ""
    lr: float = math.nan  # optim.lr: the peak learning rate
    batch_size: int | None = None
    grad_accum: int | None = None
    seq_len: int | None = None
    world_size: int = 1
    tokens_per_step: int | None = None  # the whole job's
    n_params: int | None = None
    precision: str = ""
    notes: RunNotes = field(default_factory=RunNotes)  # the user's (notes.json)

    @property
    def live(self) -> bool:
        return self.status == LIVE

    @property
    def best(self) -> tuple[float, str]:
        """(the run's best loss, which: "val" or "ema"): the best validation loss where the
        run has evaluations, else the best smoothed loss (NaN, "" before either is known)."""
        if math.isfinite(self.best_val):
            return self.best_val, "val"
        if math.isfinite(self.best_ema):
            return self.best_ema, "ema"
        return math.nan, ""


@dataclass
class _Follow:
    """What a run's whole files told so far, and the tails that read on from there."""

    events: JsonlTail
    loss: JsonlTail
    evals: JsonlTail
    ema: Ema
    resumes: list[rec.ResumeEvent] = field(default_factory=list)
    ready: rec.ReadyEvent | None = None
    start: rec.StartEvent | None = None
    health: rec.HealthEvent | None = None  # the newest health event
    best: float = math.nan
    order: rec.StepOrder = field(default_factory=rec.StepOrder)  # loss.jsonl's sequence rule
    val_points: list[tuple[int, float, float]] = field(default_factory=list)  # (step, t, loss)

    @classmethod
    def of(cls, run_dir: Path, ema_alpha: float) -> _Follow:
        paths = RunPaths(run_dir)
        return cls(JsonlTail(paths.events), JsonlTail(paths.loss), JsonlTail(paths.eval),
                   Ema(ema_alpha))

    def best_val(self) -> float:
        """The lowest validation loss of the run's timeline (abandoned ones left out)."""
        _, _, vals = surviving(self.val_points, self.resumes)
        finite = vals[np.isfinite(vals)]
        return float(finite.min()) if finite.size else math.nan


class Ema:
    """The loss's EMA as the dashboard smooths it (andrea_tui.series.EmaFold), folded record by
    record, and its lowest value so far."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self._fold = EmaFold(alpha)
        self.best = math.nan

    def fold(self, records: list[rec.StepRecord]) -> None:
        for r in records:
            if math.isfinite(r.loss) and not (self._fold.add(r.loss) >= self.best):
                self.best = self._fold.value

    def reset(self) -> Ema:
        return Ema(self.alpha)


def _all_new(tail: JsonlTail) -> Iterator[list[dict[str, Any]]]:
    """What `tail` has left to read, chunk by chunk (each chunk bounded); `tail.reset` is True
    while the chunk it goes with began a file that was replaced or truncated."""
    while True:
        yield tail.read_new(CHUNK_BYTES)
        if not tail.more:
            return
        time.sleep(0)  # let the UI thread in between chunks


def _min_loss(best: float, records: list[rec.StepRecord]) -> float:
    for r in records:
        if math.isfinite(r.loss) and not (r.loss >= best):
            best = r.loss
    return best


class RunScanner:
    """Summaries of the runs under a root, kept up to date cheaply across calls. The smoothed
    loss is the dashboard's EMA at `ema_alpha` (default: the user's smoothing setting)."""

    def __init__(self, root: Path, ema_alpha: float | None = None) -> None:
        self.root = Path(root)
        self.ema_alpha = user_settings.load().smoothing if ema_alpha is None else ema_alpha
        self._follow: dict[Path, _Follow] = {}
        # run -> (its files' stat keys, its summary, whether whole files were read for it)
        self._done: dict[Path, tuple[tuple, RunSummary, bool]] = {}

    def scan(self, whole_files: bool = True) -> list[RunSummary]:
        """Every run under the root. `whole_files=False` reads only the bounded parts (a first
        quick table); True also follows events.jsonl and loss.jsonl for the start time and the
        best loss."""
        runs = find_runs(self.root)
        for gone in set(self._follow) - set(runs):
            del self._follow[gone]
        for gone in set(self._done) - set(runs):
            del self._done[gone]
        return [self.summary(p, whole_files) for p in runs]

    def summary(self, run_dir: Path, whole_files: bool = True) -> RunSummary:
        """One run's row. A run that is not live and whose files have not changed since the
        last call costs a few stat calls: its row is the one made then."""
        key = _stat_keys(RunPaths(run_dir))
        done = self._done.get(run_dir)
        if done is not None and done[0] == key and not done[1].live and \
                (done[2] or not whole_files):
            return done[1]
        s = self._summarize(run_dir, whole_files)
        self._done[run_dir] = (key, s, whole_files)
        return s

    def _summarize(self, run_dir: Path, whole_files: bool) -> RunSummary:
        paths = RunPaths(run_dir)
        notes: list[str] = []
        config_obj = read_json(paths.config)
        cfg = read_config(config_obj) if config_obj is not None else None
        if paths.config.exists() and cfg is None:
            notes.append("config.json unreadable")
        state_obj = read_json(paths.state)
        state = rec.RunStatus.from_json(state_obj) if state_obj is not None else None
        if isinstance(state, rec.Unreadable) or (state is None and paths.state.exists()):
            notes.append(f"state.json: {state.reason}" if isinstance(state, rec.Unreadable)
                         else "state.json unreadable")
            state = None
        elif state is None:
            notes.append("no state.json")
        limits = (cfg.train.max_steps if cfg else None, state.max_steps if state else None)
        follow = self._follow.get(run_dir)
        if whole_files:
            if follow is None:
                follow = self._follow[run_dir] = _Follow.of(run_dir, self.ema_alpha)
            follow.order.limit(*limits)
            self._read_on(follow)
        start = follow.start if follow else None
        name = cfg.name if cfg else (start.name if start and start.name else run_dir.name)
        s = RunSummary(run_dir, name, "?")
        s.status, why = _status(run_dir, state)
        if why:
            notes.insert(0, why)
        tail, _ = rec.parse_all(rec.StepRecord, tail_objects(paths.loss))
        # The newest record written that the step-sequence rule keeps (a forged last line is
        # not the run's step).
        order = follow.order.fresh() if follow else rec.StepOrder()
        order.limit(*limits)
        tail = order.admit(rec.drop_abandoned(tail, follow.resumes) if follow else tail)
        last = tail[-1] if tail else None
        s.step = last.step if last else None
        if state is not None and (s.step is None or not state.status.live):
            s.step = state.step  # the engine's word (it also covers an abandoned timeline)
        s.max_steps = ((state.max_steps if state else None)
                       or (follow.ready.max_steps if follow and follow.ready else None)
                       or (cfg.train.max_steps if cfg else None))
        if last is not None:
            s.tok_s, s.tokens = last.tok_s, last.tokens
            finite = [r.loss for r in tail if math.isfinite(r.loss)]  # a skipped step logs NaN
            s.last_loss = finite[-1] if finite else math.nan
        s.best_loss = follow.best if follow else math.nan
        s.best_ema = follow.ema.best if follow else math.nan
        s.best_val = follow.best_val() if follow else math.nan
        s.val_loss = _last_val_loss(paths.eval)
        s.started, first_ready = _head(paths)
        ready = (follow.ready if follow else None) or first_ready
        s.backend = ((state.backend if state else "")
                     or (ready.backend if ready else "")
                     or (start.backend if start else ""))
        health = newest_health(state, follow.health if follow else None)
        if health is not None:
            s.health, s.health_reason = health.state.value, health.reason
        _hyperparameters(s, cfg, ready)
        s.notes = read_notes(run_dir)
        s.updated = _newest_mtime(paths)
        s.note = "; ".join(notes)
        return s

    def _read_on(self, f: _Follow) -> None:
        """Fold what was appended to events.jsonl and loss.jsonl since the last call."""
        new_resume = False
        for objects in _all_new(f.events):
            if f.events.reset:  # a new file: what the old one said is gone
                f.resumes, f.ready, f.start, f.health, new_resume = [], None, None, None, True
                f.order = rec.StepOrder(f.order.max_steps)
            events, _ = rec.parse_all(rec.Event, objects)
            f.order.note(events)
            for e in events:
                if isinstance(e, rec.StartEvent):
                    f.start = e
                elif isinstance(e, rec.ReadyEvent):
                    f.ready = e
                elif isinstance(e, rec.ResumeEvent):
                    f.resumes.append(e)
                    new_resume = True
                elif isinstance(e, rec.HealthEvent):
                    f.health = e
        if new_resume:  # records already folded may belong to a timeline it abandoned
            f.loss = JsonlTail(f.loss.path)
            f.best = math.nan
            f.ema = f.ema.reset()
            f.order = f.order.fresh()
        for objects in _all_new(f.loss):
            if f.loss.reset:
                f.best = math.nan
                f.ema = f.ema.reset()
                f.order = f.order.fresh()
            records, _ = rec.parse_all(rec.StepRecord, objects)
            if f.resumes:
                records = rec.drop_abandoned(records, f.resumes)
            kept = f.order.admit(records)
            f.best = _min_loss(f.best, kept)
            f.ema.fold(kept)
        for objects in _all_new(f.evals):
            if f.evals.reset:
                f.val_points = []
            f.val_points += [p for p in map(parse_eval, objects) if p is not None]


def _hyperparameters(s: RunSummary, cfg: Config | None, ready: rec.ReadyEvent | None) -> None:
    """The run's settings a table compares runs by: the config's, and what the engine said it
    trains with where it said (precision after --precision, parameters, the job's tokens)."""
    if cfg is not None:
        s.lr = cfg.optim.lr
        s.batch_size, s.grad_accum = cfg.train.batch_size, cfg.train.grad_accum
        s.seq_len = cfg.model.seq_len
        s.precision = cfg.train.precision
        s.tokens_per_step = cfg.tokens_per_step
    if ready is not None:
        s.world_size = ready.world_size
        s.precision = ready.precision or s.precision
        s.n_params = ready.n_params or None
        s.tokens_per_step = ready.tokens_per_step or s.tokens_per_step


def _status(run_dir: Path, state: rec.RunStatus | None) -> tuple[str, str]:
    """(status, note): live only with an engine verified behind it (engine.run.control)."""
    if state is None:
        if lock_held(run_dir):
            return LIVE, "starting"
        alive, _ = engine_alive(run_dir)
        return (LIVE, "") if alive else ("?", "")
    if not state.status.live:
        return state.status.value, ""
    alive, why = engine_alive(run_dir)
    if alive:
        word = state.status.value
        return LIVE, "" if word == rec.Status.RUNNING.value else word
    why = why.replace(f"{run_dir}{os.sep}", "")
    return DEAD, f"state.json says {state.status.value}, but {why}"


def _last_val_loss(path: Path) -> float:
    """The validation loss of the newest evaluation (NaN when the run has none)."""
    points = [p for p in map(parse_eval, tail_objects(path)) if p is not None]
    if not points:
        return math.nan
    return max(points, key=lambda p: p[0])[2]


def _stat_keys(paths: RunPaths) -> tuple:
    """What tells whether a run's files changed: (inode, size, mtime) of each."""
    out = []
    for p in (paths.state, paths.config, paths.engine, paths.loss, paths.events,
              paths.eval, paths.root / NOTES):
        try:
            st = p.stat()
        except OSError:
            out.append(None)
            continue
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _newest_mtime(paths: RunPaths) -> float | None:
    times = []
    for p in (paths.state, paths.loss, paths.events, paths.config):
        try:
            times.append(p.stat().st_mtime)
        except OSError:
            pass
    return max(times) if times else None
