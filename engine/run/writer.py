"""The engine's side of a run directory (DESIGN §7): log, records, events and status.

The formats live in `engine.runfiles`; this module is the writer the training loop holds.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from engine.runfiles import JsonlWriter, RunPaths, write_json_atomic


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
        self.loss = JsonlWriter(self.paths.loss)
        self.events_w = JsonlWriter(self.paths.events)
        self.samples = JsonlWriter(self.paths.samples)
        self.status: dict[str, Any] = {"status": "starting", "step": 0, "last_checkpoint": None}
        self._status_written = 0.0

    def log(self, msg: str, *, echo: bool = True) -> None:
        """One human-readable line, to engine.log and (unless that is our stdout) the terminal."""
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        self._log.write(line + "\n")
        if self._echo and echo:
            print(line, flush=True)

    def event(self, kind: str, **fields: Any) -> None:
        self.events_w.write({"t": time.time(), "event": kind, **fields})

    def set_status(self, *, durable: bool = True, **fields: Any) -> None:
        """Update `state.json`. Step-by-step updates are throttled and skip fsync."""
        self.status.update(fields)
        now = time.time()
        if not durable and now - self._status_written < 0.5:
            return
        self._status_written = now
        write_json_atomic(self.paths.state, {**self.status, "updated": now}, durable=durable)

    def close(self) -> None:
        for w in (self.loss, self.events_w, self.samples):
            w.close()
        self._log.close()
