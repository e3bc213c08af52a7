"""Reads a run directory into a RunState: the history once, then whatever was appended.

Headless: no Textual. Built on engine.runfiles (JsonlTail tolerates torn lines, corrupt lines,
truncation and replacement). The app calls `poll()` whenever watchfiles reports a change in the
run directory (or on a fallback timer); `poll()` only reads bytes that are new, and with
`changed` (the file names watchfiles reported) only looks at those files.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from andrea_tui.runstate import LossHistory, RunState
from engine.runfiles import JsonlTail, RunPaths, parse_lines, read_json

PREVIEW_BYTES = 2 << 20  # the tail of loss.jsonl shown while the whole history loads


def _stat_key(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class RunReader:
    """Incremental reader of one run directory feeding one RunState."""

    def __init__(self, run_dir: Path, state: RunState) -> None:
        self.paths = RunPaths(Path(run_dir))
        self.state = state
        self.loss = JsonlTail(self.paths.loss)
        self.events = JsonlTail(self.paths.events)
        self.samples = JsonlTail(self.paths.samples)
        self._json_keys: dict[str, tuple[int, int, int] | None] = {}

    # ------------------------------------------------------------ first load

    def read_preview(self, max_bytes: int = PREVIEW_BYTES) -> list[dict[str, Any]]:
        """The complete records in the last `max_bytes` of loss.jsonl (fast first frame)."""
        try:
            with open(self.paths.loss, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                start = max(0, size - max_bytes)
                f.seek(start)
                data = f.read()
        except OSError:
            return []
        lines = data.split(b"\n")[:-1]  # the last piece is empty or a torn line
        if start > 0 and lines:
            lines = lines[1:]  # the first piece may be the end of a line cut by the seek
        records, _ = parse_lines(lines)
        return records

    def read_history(self) -> LossHistory:
        """Everything in loss.jsonl so far, prepared for `RunState.set_history` (thread-safe:
        touches only the loss tail, which nothing else reads until this returns)."""
        records = self.loss.read_new()
        while self.loss.more:
            records += self.loss.read_new()
        return LossHistory.build(records, self.state.series.ema_alpha, list(self.state.resumes))

    # ------------------------------------------------------------ following

    def poll_small_files(self, changed: Collection[str] | None = None) -> bool:
        """Re-read config/engine/state JSON when they changed (only those named in `changed`,
        when given); True if the state changed."""
        values: dict[str, dict | None] = {}
        for name, path in (("config", self.paths.config), ("engine", self.paths.engine),
                           ("state", self.paths.state)):
            if changed is not None and path.name not in changed:
                continue
            key = _stat_key(path)
            if key is not None and key != self._json_keys.get(name):
                values[name] = read_json(path)
                if values[name] is not None:  # a half-replaced file is read again next time
                    self._json_keys[name] = key
        if not values:
            return False
        before = self.state.version
        self.state.set_files(values.get("config"), values.get("engine"), values.get("state"))
        return self.state.version != before

    def poll(self, include_loss: bool = True, changed: Collection[str] | None = None) -> bool:
        """Read what was appended since the last poll; True if anything changed.

        `changed`: names of the files known to have changed (from watchfiles); the others are
        not even stat'ed. None looks at every file (the fallback poll)."""
        st = self.state
        before = st.version

        def wanted(tail: JsonlTail) -> bool:
            return changed is None or tail.path.name in changed

        self.poll_small_files(changed)
        # Events first: a resume event must be known before the records that follow it.
        if wanted(self.events):
            st.add_events(self.events.read_new())
        if include_loss and wanted(self.loss):
            recs = self.loss.read_new()
            if self.loss.reset:
                st.reset_loss()
            st.add_loss(recs)
        if wanted(self.samples):
            st.add_samples(self.samples.read_new())
        st.bad_lines = self.loss.bad_lines + self.events.bad_lines + self.samples.bad_lines
        return st.version != before
