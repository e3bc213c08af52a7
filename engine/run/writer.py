"""The engine's side of a run directory (DESIGN §7): log, step records, events, samples, status.

What each record holds is engine.records; where each file lives and how it is written safely is
engine.runfiles. This is the writer the training loop holds: typed records in, whole lines out.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from engine.records import Event, RunStatus, Sample, Status, StepRecord
from engine.runfiles import JsonlWriter, RunPaths, write_json_atomic

STATUS_EVERY_S = 0.5  # step-by-step status updates are throttled to this


def _same_file(stream: TextIO, path: Path) -> bool:
    """True when `stream` already writes into `path` (the TUI sends our stdout to engine.log)."""
    try:
        a, b = os.fstat(stream.fileno()), os.stat(path)
    except (OSError, ValueError, AttributeError):
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class RunWriter:
    """Holds the run directory's append-only files open and replaces `state.json` atomically."""

    def __init__(self, root: Path) -> None:
        self.paths = RunPaths(Path(root))
        self.paths.root.mkdir(parents=True, exist_ok=True)
        self._log = open(self.paths.log, "a", buffering=1, encoding="utf-8")
        self._echo = not _same_file(sys.stdout, self.paths.log)
        self._loss = JsonlWriter(self.paths.loss)
        self._events = JsonlWriter(self.paths.events)
        self._samples = JsonlWriter(self.paths.samples)
        self.status = RunStatus(Status.STARTING)
        self._status_written = 0.0

    def log(self, msg: str, *, echo: bool = True) -> None:
        """One human-readable line, to engine.log and (unless that is our stdout) the terminal."""
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        self._log.write(line + "\n")
        if self._echo and echo:
            print(line, flush=True)

    def event(self, event: Event) -> None:
        """Append an event, stamped with the time it is written."""
        self._events.write(dataclasses.replace(event, t=time.time()).to_json())

    def step(self, record: StepRecord) -> None:
        self._loss.write(record.to_json())

    def sample(self, sample: Sample) -> None:
        self._samples.write(sample.to_json())

    def set_status(self, *, durable: bool = True, **changes: Any) -> None:
        """Update `state.json` (fields of engine.records.RunStatus). Step-by-step updates
        (durable=False) are throttled and skip fsync."""
        self.status = dataclasses.replace(self.status, **changes)
        now = time.time()
        if not durable and now - self._status_written < STATUS_EVERY_S:
            return
        self._status_written = now
        record = dataclasses.replace(self.status, updated=now)
        write_json_atomic(self.paths.state, record.to_json(), durable=durable)

    def close(self) -> None:
        for w in (self._loss, self._events, self._samples):
            w.close()
        self._log.close()
