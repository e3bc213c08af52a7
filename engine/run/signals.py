"""Signal handling for the training loop (DESIGN §8): handlers only count; the loop acts.

Counting (instead of a bare flag) lets the loop tell how many requests arrived, so it can record
each one it noticed and coalesce those that came while a snapshot was pending or being written.

One exception: inside `interrupting()` (the start-up's long calls that have no step boundary to
wait for and nothing to save: reading a config from a pipe, building the trainer) a stop raises
KeyboardInterrupt at once, which ends the start with nothing trained.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


class SignalFlags:
    """Counts SIGUSR1 (snapshot) and SIGTERM/SIGINT/SIGHUP (stop) since the loop last looked."""

    def __init__(self) -> None:
        self.snapshot_requests = 0
        self.stop_signal: int | None = None
        # While starting up (data prep can take a while) a second stop signal aborts at once.
        self.starting = True
        self._interrupting = False  # inside interrupting(): a stop raises at once
        self._seen_snapshots = 0

    def install(self) -> None:
        # Only the main thread may install handlers; install before anything slow so an early
        # SIGUSR1 (whose default action is to kill) is never fatal.
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers must be installed from the main thread")
        signal.signal(signal.SIGUSR1, self._on_usr1)
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        # A closed terminal (SIGHUP) is a stop too: checkpoint and end, never lose the progress.
        signal.signal(signal.SIGHUP, self._on_stop)
        # A file-size limit must fail the write (EFBIG, reported as a checkpoint error), not kill us.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def _on_usr1(self, signum: int, frame: FrameType | None) -> None:
        self.snapshot_requests += 1

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        first = self.stop_signal is None
        if first:
            self.stop_signal = signum
        if self._interrupting or (self.starting and not first):
            self._interrupting = False  # one KeyboardInterrupt is enough
            raise KeyboardInterrupt  # nothing trained yet, nothing to save: give up now

    @contextlib.contextmanager
    def interrupting(self) -> Iterator[None]:
        """Within: a stop signal (or one that came before) raises KeyboardInterrupt at once,
        wherever the main thread is (between two bytecodes, or when a long C call returns). For
        work that can be abandoned at any point: allocating and initialising the trainer, a
        bounded wait for input."""
        if self.stop_signal is not None:
            raise KeyboardInterrupt
        self._interrupting = True
        try:
            yield
        finally:
            self._interrupting = False

    def take_snapshot_requests(self) -> int:
        """How many SIGUSR1 arrived since the last call."""
        n = self.snapshot_requests - self._seen_snapshots
        self._seen_snapshots += n
        return n

    @property
    def stop_requested(self) -> bool:
        return self.stop_signal is not None

    @property
    def stop_name(self) -> str:
        return signal.Signals(self.stop_signal).name if self.stop_signal else ""
