"""Reads a run directory into a RunState: the history once, then whatever was appended.

Headless: no Textual. Built on engine.runfiles (JsonlTail tolerates torn lines, corrupt lines,
over-long lines, truncation and replacement). The app calls `poll()` whenever watchfiles reports a
change in the run directory (or on a fallback timer); `poll()` only reads bytes that are new, with
`changed` (the file names watchfiles reported) only looks at those files, and reads POLL_BYTES
of a file at a time for at most POLL_BUDGET_S: a poll runs on the UI thread and must stay short
whatever the files hold. What is left is `backlog`: the app reads it in a worker thread
(`read_history`) when it is the loss history, or at the next frames for the other files.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from andrea_tui.runstate import LossHistory, RunState
from engine.records import ResumeEvent, StepOrder
from engine.runfiles import JsonlTail, RunPaths, parse_lines, read_json, tail_lines

PREVIEW_BYTES = 2 << 20  # the tail of loss.jsonl shown while the whole history loads
POLL_BYTES = 256 << 10  # what one read of a file takes at most (about 800 step records)
POLL_BUDGET_S = 0.02  # a poll reads again the files with bytes left for this long at most
SYSTEM_TAIL_BYTES = 16 << 10  # only the newest telemetry is shown: read from the end


def _stat_key(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def load_history(path: Path, max_line: int, ema_alpha: float, resumes: list[ResumeEvent],
                 order: StepOrder | None = None) -> tuple[LossHistory, JsonlTail]:
    """The whole history of the loss file at `path` and the tail that reads on from its end;
    `order`: the run's step-sequence rule (engine.runfiles.step_order)."""
    tail = JsonlTail(path, max_line)
    return LossHistory.from_tail(tail, ema_alpha, resumes, order=order), tail


def _in_child(path: Path, max_line: int, ema_alpha: float, resumes: list[ResumeEvent],
              order: StepOrder | None = None) -> tuple[LossHistory, JsonlTail]:
    """`load_history` in a fresh interpreter (`python -m andrea_tui.runreader`): the arguments
    and the result travel pickled through its stdin and stdout."""
    from andrea_tui.launcher import child_env

    r = subprocess.run([sys.executable, "-m", "andrea_tui.runreader"], check=True,
                       input=pickle.dumps((path, max_line, ema_alpha, resumes, order)),
                       capture_output=True, env=child_env(), stdin=None)
    return pickle.loads(r.stdout)


class RunReader:
    """Incremental reader of one run directory feeding one RunState."""

    def __init__(self, run_dir: Path, state: RunState) -> None:
        self.paths = RunPaths(Path(run_dir))
        self.state = state
        self.loss = JsonlTail(self.paths.loss)
        self.events = JsonlTail(self.paths.events)
        self.samples = JsonlTail(self.paths.samples)
        self.evals = JsonlTail(self.paths.eval)
        self.system = JsonlTail(self.paths.system)
        self.system.skip_to_end(SYSTEM_TAIL_BYTES)
        self._json_keys: dict[str, tuple[int, int, int] | None] = {}
        self.backlog: set[str] = set()  # files with bytes left after the last poll
        self.loss_backlog = False  # loss.jsonl has more than a poll takes: load it in a thread
        self.child_error: str | None = None  # why the last history was not read in a child

    # ------------------------------------------------------------ first load

    def read_preview(self, max_bytes: int = PREVIEW_BYTES) -> list[dict[str, Any]]:
        """The complete records in the last `max_bytes` of loss.jsonl (fast first frame)."""
        lines = tail_lines(self.paths.loss, max_bytes)
        records, _ = parse_lines(ln for ln in lines if len(ln) <= self.loss.max_line)
        return records

    def read_history(self) -> LossHistory:
        """All of loss.jsonl, read from its start in bounded chunks and prepared for
        `RunState.set_history`, in a process of its own: parsing a large file holds Python's
        lock for seconds, which in a thread would stall every key the UI handles meanwhile.
        Call it from a worker thread (it blocks until the history is ready); polls leave the
        loss file alone until the app has installed the history and cleared `loss_backlog`."""
        args = (self.paths.loss, self.loss.max_line, self.state.series.ema_alpha,
                list(self.state.resumes), self.state.order.fresh())
        try:
            history, tail = _in_child(*args)
        except (OSError, subprocess.SubprocessError, pickle.UnpicklingError, EOFError,
                ValueError) as e:  # no child to be had: read it here (slower keys meanwhile)
            self.child_error = f"{type(e).__name__}: {e}"
            history, tail = load_history(*args)
        self.loss = tail  # goes on from where the history ends
        return history

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
        """Read what was appended since the last poll; True if anything changed. `changed`:
        names of the files known to have changed (from watchfiles); the others are not even
        stat'ed. None looks at every file (the fallback poll). A file is read POLL_BYTES at a
        time, again while bytes are left and the poll is within POLL_BUDGET_S (a file of
        junk is gone through quickly, and no poll holds the UI thread longer). A loss file
        that has more than one read takes, or was truncated or replaced, sets `loss_backlog`
        and is left for `read_history` (in a thread)."""
        st = self.state
        before = st.version
        deadline = time.monotonic() + POLL_BUDGET_S
        self.poll_small_files(changed)
        names = None if changed is None else {*changed, *self.backlog}
        while True:
            self._read_tails(include_loss, names)
            if not self.backlog or time.monotonic() >= deadline:
                break
            names = set(self.backlog)
        tails = (self.events, self.samples, self.evals, self.system)
        st.bad_lines = self.loss.bad_lines + sum(t.bad_lines for t in tails)
        return st.version != before

    def _read_tails(self, include_loss: bool, names: Collection[str] | None) -> None:
        """One read of each growing file named (None: all); sets `backlog`."""
        st = self.state

        def wanted(tail: JsonlTail) -> bool:
            return names is None or tail.path.name in names

        # Events first: a resume event must be known before the records that follow it, so
        # loss.jsonl waits while events.jsonl has bytes left.
        if wanted(self.events):
            st.add_events(self.events.read_new(POLL_BYTES))
        loss_waits = False
        if include_loss and not self.loss_backlog and wanted(self.loss):
            if self.events.more:
                loss_waits = True
            else:
                recs = self.loss.read_new(POLL_BYTES)
                if self.loss.reset:
                    st.reset_loss()
                    self.loss_backlog = True  # the file anew: rebuilt in a thread
                elif self.loss.more:
                    st.add_loss(recs)
                    self.loss_backlog = True
                else:
                    st.add_loss(recs)
        if wanted(self.samples):
            st.add_samples(self.samples.read_new(POLL_BYTES))
        if wanted(self.evals):
            st.add_evals(self.evals.read_new(POLL_BYTES))
        if wanted(self.system):
            st.add_system(self.system.read_new(POLL_BYTES))
        tails = (self.events, self.samples, self.evals, self.system)
        self.backlog = {t.path.name for t in tails if t.more} | (
            {self.loss.path.name} if loss_waits else set())

if __name__ == "__main__":  # the history reader's child (see RunReader.read_history)
    sys.stdout.buffer.write(pickle.dumps(load_history(*pickle.loads(sys.stdin.buffer.read()))))
