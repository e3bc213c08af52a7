"""When the dashboard reads the run directory and redraws its text panels.

Text panels update at once, but at most one frame per `min_interval`: changes that come sooner
wait for the end of that interval, so a run logging 10 steps/s costs 5 frames/s, not 10+.
Reading waits for the frame too, so one frame reads what several wake-ups reported, and only
the files they named. The names are taken from their report (watcher.FilesChanged) only then:
until the frame, the watcher adds later changes to that report instead of posting another, so
the UI loop hears of a busy run about once a frame, not once a change. Headless: a frame is the
`read` and `draw` callbacks given to it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Collection
from typing import Protocol

PANEL_MIN_INTERVAL = 0.2  # seconds between text-panel frames while data streams in


class ChangedNames(Protocol):
    """A report of changed file names, still growing until taken (watcher.FilesChanged)."""

    def take(self) -> set[str]: ...


class FramePacer:
    """Paces frames: `read(files)` reads the named files (None: every file) and says whether
    the state changed; `draw()` rebuilds the panels. Runs on the event loop's thread."""

    def __init__(self, read: Callable[[Collection[str] | None], bool], draw: Callable[[], None],
                 min_interval: float = PANEL_MIN_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read = read
        self._draw = draw
        self.min_interval = min_interval
        self._clock = clock
        # False until the whole history is in place: reading loss.jsonl earlier would race
        # the thread that loads it. Changes reported meanwhile stay pending.
        self.reading = False
        self._unread: list[ChangedNames] = []  # reports not taken yet (one, normally)
        self._read_all = False  # the next read looks at every file
        self._due = False  # the state changed (or time passed) since the panels were drawn
        self._drawn_at = -math.inf
        self._timer: asyncio.TimerHandle | None = None
        self._in_read = False  # inside `read`: a change reported now waits for a later frame

    def files_changed(self, changes: ChangedNames) -> None:
        """Files changed: read the ones `changes` names in the next frame (now, if one is
        allowed, and not from inside a read: a backlog the read left is read at a frame of
        its own, scheduled on the loop, so keys are answered in between), taking the names
        only then."""
        self._unread.append(changes)
        self._schedule()

    def poll_all(self) -> bool:
        """Read every file for what was appended (the fallback for missed wake-ups); draw soon
        if anything changed. True if the state changed."""
        self._read_all = True
        changed = self.read_pending()
        if changed:
            self.request()
        return changed

    def request(self) -> None:
        """Draw the panels now, or at the end of the current interval."""
        self._due = True
        self._schedule()

    def read_pending(self) -> bool:
        """Read the files reported changed since the last read; True if the state changed."""
        if not self.reading:
            return False
        files: set[str] | None = None if self._read_all else set()
        self._read_all = False
        for changes in self._unread:
            names = changes.take()  # final now: later changes come in a new report
            if files is not None:
                files |= names
        self._unread.clear()
        if files is not None and not files:
            return False
        self._in_read = True
        try:
            changed = self._read(files)
        finally:
            self._in_read = False
        if changed:
            self._due = True
        return changed

    def draw_now(self) -> None:
        """Draw at once, with the freshest state there is (a frame's interval starts now)."""
        self.cancel()
        self.read_pending()
        self._due = False
        self._drawn_at = self._clock()
        self._draw()

    def cancel(self) -> None:
        """Drop a frame scheduled for later (a bare loop callback: nothing else stops it)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self) -> None:
        if self._timer is not None:
            return  # a frame is already due; it will read and show this change too
        wait = self._drawn_at + self.min_interval - self._clock()
        if wait <= 0 and not self._in_read:
            self._frame()
        else:
            # A bare loop callback: a Textual Timer is a task of its own, several times dearer,
            # and this runs up to 1/min_interval times a second.
            self._timer = asyncio.get_running_loop().call_later(max(0.0, wait), self._frame)

    def _frame(self) -> None:
        """Read what changed; draw if the state moved or a frame was asked for, and the last
        frame is at least `min_interval` old (else at the end of that interval)."""
        self._timer = None
        self.read_pending()
        if not self._due:
            return
        if self._clock() - self._drawn_at >= self.min_interval:
            self.draw_now()
        else:
            self._schedule()
