"""Which files of a run directory changed, told to the app as one coalescing Textual message.

watchfiles' synchronous `watch()` runs in a daemon thread of its own (not a Textual thread
worker: those run in the loop's default executor, which asyncio.run() joins at exit). Each
wake-up posts a `FilesChanged` message to the app, unless the last one posted has not been taken
yet (`take()`, which the app calls when it reads the files): then the new names are merged into
that message (toolong's pattern). However busy the run or slow the UI, at most one message
waits, and it names every file changed since the app last looked.
"""

from __future__ import annotations

import threading
from pathlib import Path

from textual.message import Message
from textual.message_pump import MessagePump


class FilesChanged(Message):
    """Files of the run directory changed; `take()` their names when reading them."""

    def __init__(self, names: set[str], lock: threading.Lock) -> None:
        super().__init__()
        self._names = set(names)
        self._lock = lock  # the watcher's: merging and taking never interleave
        self._taken = False

    def merge(self, names: set[str]) -> bool:
        """Add `names` while the message waits; False once it has been taken (too late)."""
        with self._lock:
            if self._taken:
                return False
            self._names |= names
            return True

    def take(self) -> set[str]:
        """The names changed, final from now on: later changes go into a new message."""
        with self._lock:
            self._taken = True
            return set(self._names)


class RunWatcher:
    """Watches `run_dir` (not recursively) and posts `FilesChanged` messages to `target`."""

    # watchfiles' loop sleeps STEP_MS, then takes Python's lock to look for changes, whether
    # files changed or not; a change is reported once a step passed without another (1-2 steps
    # after it). 50 ms (watchfiles' default): 20 wake-ups a second rather than 50 at 20 ms, and
    # a report within 100 ms, where the pacer holds a frame up to PANEL_MIN_INTERVAL anyway.
    # Following 10 steps/s (dev/bench_tui.py, paired runs): the thread's CPU 0.35-0.59% of
    # a core at 20 ms, 0.29-0.41% at 50 ms; append-to-screen latency the same (p50 ~110 ms,
    # p95 ~200 ms).
    STEP_MS = 50  # a wake-up waits this long for more changes...
    DEBOUNCE_MS = 200  # ...but groups them over this long at most

    def __init__(self, run_dir: Path, target: MessagePump) -> None:
        self.run_dir = Path(run_dir)
        self.target = target
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._waiting: FilesChanged | None = None  # the last message posted
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start watching in a daemon thread (once; never after `stop`)."""
        if self._thread is not None or self._stop.is_set():
            return
        self._thread = threading.Thread(target=self._watch, name="andrea-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the watching thread (within one STEP_MS); safe to call more than once."""
        self._stop.set()

    def report(self, names: set[str]) -> None:
        """Tell the target that `names` changed: merged into the waiting message if there is
        one, else a new message. Called from the watching thread (one caller at a time)."""
        if self._waiting is not None and self._waiting.merge(names):
            return
        self._waiting = FilesChanged(names, self._lock)
        self.target.post_message(self._waiting)

    def _watch(self) -> None:
        """The thread: no timeout wake-ups, the app's control tick polls every file anyway."""
        from watchfiles import watch

        try:
            # The directory, not the files: files that appear later or are replaced are seen.
            for changes in watch(self.run_dir, recursive=False, watch_filter=None,
                                 stop_event=self._stop, step=self.STEP_MS,
                                 debounce=self.DEBOUNCE_MS, rust_timeout=0,
                                 raise_interrupt=False):
                self.report({Path(path).name for _, path in changes})
        except Exception:  # a traceback from this thread would garble the screen
            # The loop closed (the app has gone), or the directory cannot be watched (e.g. it
            # was removed): the control tick's poll still follows whatever is left.
            return
