"""The engine's side of a run directory (DESIGN §7): log, step records, events, samples,
validation records, system telemetry, status.

What each record holds is engine.records; where each file lives and how it is written safely is
engine.runfiles. This is the writer the training loop holds: typed records in, whole lines out.

Two promises to the user:
- A refusal changes nothing: the writer remembers what the run's files held when it opened them,
  and `rollback()` puts them back (appended lines cut off, replaced files restored, files it
  created removed), so a `--resume` refused for bad input leaves the run exactly as it was.
- Lines are appended with one write each (unbuffered, O_APPEND), so the telemetry sampler and
  the stall watchdog, threads of their own, append events and samples beside the loop safely;
  a file an earlier engine left ending mid-line (a crash, a full disk) gets that line ended
  first (engine.runfiles.open_append), so a resume's first records stay whole.
- A run directory that stops being writable (a full disk, the directory deleted under the engine)
  never turns into a traceback: the first failed write is reported once on stderr, `failed` is
  set for the loop to stop on, and later writes are attempted quietly.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from engine.records import (
    EvalRecord,
    Event,
    Health,
    HealthEvent,
    RunStatus,
    Sample,
    Status,
    StepRecord,
    SystemRecord,
)
from engine.runfiles import (
    JsonlWriter,
    RunPaths,
    open_append,
    read_json,
    write_bytes_atomic,
    write_json_atomic,
)

STATUS_EVERY_S = 0.5  # step-by-step status updates are throttled to this


def _same_file(stream: TextIO, path: Path) -> bool:
    """True when `stream` already writes into `path` (the TUI sends our stdout to engine.log)."""
    try:
        a, b = os.fstat(stream.fileno()), os.stat(path)
    except (OSError, ValueError, AttributeError):
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _content(path: Path) -> bytes | None:
    """A run file's bytes; None when missing, unreadable or not a regular file (a FIFO in its
    place is never opened: the atomic write that follows replaces it)."""
    from engine.infile import read_regular

    try:
        return read_regular(path)
    except OSError:
        return None


class RunWriter:
    """Holds the run directory's append-only files open and replaces `state.json` atomically."""

    def __init__(self, root: Path, status: RunStatus | None = None) -> None:
        self.paths = p = RunPaths(Path(root))
        p.root.mkdir(parents=True, exist_ok=True)
        self._appended = {f: _size(f) for f in (p.log, p.loss, p.events, p.samples, p.eval,
                                                p.system)}
        self._replaced = {f: _content(f) for f in (p.state, p.engine, p.config, p.gemm_plan)}
        self.failed: OSError | None = None  # the first write that failed
        self._log: TextIO | None = None
        self._files: list[JsonlWriter] = []
        try:
            log_fd, self._log_torn = open_append(p.log)
            self._log = open(log_fd, "a", buffering=1, encoding="utf-8")
            self._loss, self._events, self._samples, self._eval, self._system = (
                self._open(f) for f in (p.loss, p.events, p.samples, p.eval, p.system))
        except OSError:
            self.rollback()  # what it created goes again: a refusal leaves no trace
            raise
        self._echo = not _same_file(sys.stdout, p.log)
        self.status = status or RunStatus(Status.STARTING)
        self._status_written = 0.0
        # state.json changes from the loop and from the watchdog's thread (a stall's health)
        self._status_lock = threading.RLock()

    def _open(self, path: Path) -> JsonlWriter:
        w = JsonlWriter(path)
        self._files.append(w)
        return w

    def _failed(self, what: Path, e: OSError) -> None:
        if self.failed is None:
            self.failed = e
            print(f"error: cannot write {what}: {e.strerror or e}; the run directory is not "
                  "writable (disk full or removed?): stopping. Checkpoints already written "
                  "stay valid: `--resume` continues from the newest once it is writable again.",
                  file=sys.stderr, flush=True)

    def log(self, msg: str, *, echo: bool = True) -> None:
        """One human-readable line, to engine.log and (unless that is our stdout) the terminal."""
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        if self._echo and echo:
            print(line, flush=True)
        if self._log_torn:  # the torn line's end could not be written at open: it goes first
            line = "\n" + line
        try:
            self._log.write(line + "\n")
            self._log_torn = False
        except OSError as e:
            self._failed(self.paths.log, e)
        except ValueError:  # closed after a failure
            pass

    def _append(self, w: JsonlWriter, obj: dict[str, Any]) -> None:
        try:
            w.write(obj)
        except OSError as e:
            self._failed(w.path, e)

    def event(self, event: Event) -> None:
        """Append an event, stamped with the time it is written."""
        self._append(self._events, dataclasses.replace(event, t=time.time()).to_json())

    def step(self, record: StepRecord) -> None:
        self._append(self._loss, record.to_json())

    def sample(self, sample: Sample) -> None:
        self._append(self._samples, sample.to_json())

    def eval_record(self, record: EvalRecord) -> None:
        self._append(self._eval, record.to_json())

    def system(self, record: SystemRecord) -> None:
        self._append(self._system, record.to_json())

    def set_status(self, *, durable: bool = True, **changes: Any) -> None:
        """Update `state.json` (fields of engine.records.RunStatus). Step-by-step updates
        (durable=False) are throttled and skip fsync."""
        with self._status_lock:
            self.status = dataclasses.replace(self.status, **changes)
            now = time.time()
            if not durable and now - self._status_written < STATUS_EVERY_S:
                return
            self._status_written = now
            if self._removed():
                return
            record = dataclasses.replace(self.status, updated=now)
            try:
                write_json_atomic(self.paths.state, record.to_json(), durable=durable)
            except OSError as e:
                self._failed(self.paths.state, e)

    def set_health(self, event: HealthEvent, new_state: bool) -> bool:
        """The engine's judgement of the run changed (engine.run.health): state.json's
        `health` and `health_reason` at once, and, when the state itself changed
        (`new_state`), a `health` event. A failed run keeps saying so: False, nothing written."""
        with self._status_lock:  # (the watchdog's thread tells a stall, the loop the rest)
            if self.status.status is Status.FAILED:
                return False
            if new_state:
                self.event(event)
            self.set_status(health=event.state, health_reason=event.reason)
            return True

    def set_failed(self, error: str, **changes: Any) -> None:
        """The run failed: `state.json` says `failed` and why (`error`), its health `failed`
        with the same words (and a `health` event), fsynced. Where it cannot be replaced (the
        full disk that ended the run), stderr says so, since the file still says what it said
        before."""
        with self._status_lock:
            self.status = dataclasses.replace(self.status, status=Status.FAILED, error=error,
                                              health=Health.FAILED, health_reason=error,
                                              **changes)
            self._status_written = now = time.time()
            status = self.status
        self.event(HealthEvent(state=Health.FAILED, step=status.step, reason=error))
        if self._removed():
            return
        try:
            write_json_atomic(self.paths.state, dataclasses.replace(status,
                                                                    updated=now).to_json())
        except OSError as e:
            was = RunStatus.from_json(read_json(self.paths.state))
            said = f"it still says {was.status}" if isinstance(was, RunStatus) else \
                "it does not say so"
            print(f"warning: {self.paths.state} could not be replaced ({e.strerror or e}): "
                  f"{said}, but the run failed", file=sys.stderr, flush=True)

    def _removed(self) -> bool:
        """The run directory was deleted under us (our open engine.log has no name left): a
        write now would only land in files nobody can see, or in a directory made anew."""
        try:
            gone = os.fstat(self._log.fileno()).st_nlink == 0
        except (OSError, ValueError):
            gone = False
        if gone:
            self._failed(self.paths.root, FileNotFoundError(2, "the run directory was removed"))
        return gone

    def write_json(self, path: Path, obj: Any) -> None:
        """Replace one of the run's JSON files (config.json, engine.json) atomically."""
        try:
            write_json_atomic(path, obj)
        except OSError as e:
            self._failed(path, e)

    def rollback(self) -> None:
        """Put every file back as it was when this writer opened the run (see the module doc)."""
        self.close()
        for path, size in self._appended.items():
            try:
                if size is None:
                    path.unlink(missing_ok=True)
                elif _size(path) != size:
                    os.truncate(path, size)
            except OSError:
                pass
        for path, data in self._replaced.items():
            try:
                if data is None:
                    path.unlink(missing_ok=True)
                elif _content(path) != data:
                    write_bytes_atomic(path, data)
            except OSError:
                pass

    def close(self) -> None:
        for w in self._files:
            try:
                w.close()
            except OSError:
                pass
        try:
            if self._log is not None:
                self._log.close()
        except OSError:
            pass


class QuietWriter(RunWriter):
    """The writer of a rank other than 0: rank 0 owns the run directory, so this one writes
    nothing there (its errors still reach stderr)."""

    def __init__(self, root: Path) -> None:  # not super().__init__: that opens the files
        self.paths = RunPaths(Path(root))
        self.failed = None
        self.status = RunStatus(Status.STARTING)

    def log(self, msg: str, *, echo: bool = True) -> None:
        pass

    def _append(self, w: JsonlWriter, obj: dict[str, Any]) -> None:
        pass

    def event(self, event: Event) -> None:
        pass

    def step(self, record: StepRecord) -> None:
        pass

    def sample(self, sample: Sample) -> None:
        pass

    def eval_record(self, record: EvalRecord) -> None:
        pass

    def system(self, record: SystemRecord) -> None:
        pass

    def set_status(self, *, durable: bool = True, **changes: Any) -> None:
        self.status = dataclasses.replace(self.status, **changes)

    def set_health(self, event: HealthEvent, new_state: bool) -> bool:
        return False

    def set_failed(self, error: str, **changes: Any) -> None:
        self.status = dataclasses.replace(self.status, status=Status.FAILED, error=error,
                                          health=Health.FAILED, health_reason=error, **changes)

    def write_json(self, path: Path, obj: Any) -> None:
        pass

    def rollback(self) -> None:
        pass

    def close(self) -> None:
        pass
