"""Who the engine is (DESIGN §7/§8): boot id, process start time, the run lock, engine.json.

A controller signals a pid only if the process behind it is provably the engine that wrote
`engine.json`: same boot, same start time (clock ticks since boot, /proc/PID/stat field 22), and
`engine.lock` held. Standard library only: engine.run.control, which the TUI signals
through, imports this.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import UserError
from engine.records import EngineInfo, RankInfo, Unreadable

if TYPE_CHECKING:
    from engine.run.world import World
from engine.runfiles import LOCK, RunPaths, read_json, write_json_atomic

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    """This machine's current boot id ('' where the kernel does not provide one)."""
    try:
        with open(BOOT_ID_FILE) as f:
            return f.read().strip()
    except OSError:
        return ""


def _proc_stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat from field 3 (state) on, or None when there is no such process. comm
    (field 2) may hold spaces and ')': the fields after it start after the LAST ')'."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :].split()


def proc_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None when there is no such process."""
    rest = _proc_stat_fields(pid)
    try:
        return int(rest[22 - 3]) if rest is not None else None  # rest[0] is field 3
    except (IndexError, ValueError):
        return None


def proc_state(pid: int) -> str | None:
    """The scheduler state of `pid` (/proc/PID/stat field 3: R running, S sleeping, T stopped
    by a signal, t stopped by a tracer, ...), or None when there is no such process."""
    rest = _proc_stat_fields(pid)
    return rest[0].decode("ascii", "replace") if rest else None


class LockHeld(UserError):
    """Another engine holds the run's lock: this one was refused and touches nothing there."""


class EngineLock:
    """The `engine.lock` flock, held for the engine's lifetime (the kernel drops it on any exit).

    `created` says whether this process made the lock file: only then may it remove it
    (`discard`), while holding it. A file removed under a waiting engine is not a lock any
    more: `acquire` locks the file that is at the path once it holds it, or tries again."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._path: Path | None = None
        self.created = False
        self.made_dir = False  # the run directory was removed under acquire and made again

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, run_dir: Path, retry_s: float = 1.0) -> EngineLock:
        """Take the lock or raise LockHeld naming the holder's pid.

        A controller probes the lock with a brief shared flock, so a failed attempt is retried
        for `retry_s` before concluding another engine holds it.
        """
        path = Path(run_dir) / LOCK
        deadline = time.monotonic() + retry_s
        while True:
            fd, created = self._open(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() >= deadline:
                    info = read_engine_info(Path(run_dir))
                    holder = info.pid if isinstance(info, EngineInfo) else "unknown"
                    raise LockHeld(
                        f"{path}: held by engine pid {holder}: another engine is running on "
                        f"this run directory"
                    ) from None
                time.sleep(0.02)
                continue
            if _same_file(fd, path):
                break
            os.close(fd)  # its creator removed it (a refused start): lock the one there now
        self._fd, self._path, self.created = fd, path, created
        return self

    def _open(self, path: Path) -> tuple[int, bool]:
        """The lock file's descriptor, and whether this call created it. A run directory that
        its creator removed meanwhile (a refused start) is made again: this engine was given
        it, and then counts as its creator."""
        # O_NOFOLLOW: a link in the lock's place (dangling, it would make the create and the
        # open below fail in turn for ever) is refused, as anything not the run's own file.
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            while True:
                try:
                    return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
                except FileExistsError:
                    pass
                except FileNotFoundError:
                    if self.made_dir or path.parent.exists():
                        raise
                    try:
                        path.parent.mkdir()
                        self.made_dir = True
                    except FileExistsError:
                        pass
                    continue
                try:
                    return os.open(path, flags), False
                except FileNotFoundError:
                    continue  # removed in between: create it
        except OSError as e:
            why = "a symbolic link, not the run's lock file" if e.errno == errno.ELOOP else \
                e.strerror or e
            raise UserError(f"{path}: cannot open the run's lock: {why}") from None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None

    def discard(self, remove_dir: bool = False) -> None:
        """A refused start: remove the lock file if this process created it, then, with
        `remove_dir` (this process created the run directory), the directory if it is empty,
        all while the lock is held; then release it. Another process's files stay."""
        if self._fd is not None and self._path is not None:
            try:
                if self.created and _same_file(self._fd, self._path):
                    self._path.unlink()
                if remove_dir or self.made_dir:
                    os.rmdir(self._path.parent)  # fails unless empty: nobody else's is there
            except OSError:
                pass
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open on `fd`."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


@contextlib.contextmanager
def unmade_on_refusal(run_dir: Path, created: bool) -> Iterator[None]:
    """Bad input found before the run's lock is taken: the run directory this process made
    goes again while it is empty (an engine that took the lock meanwhile has its lock file
    there, so the directory stays)."""
    try:
        yield
    except UserError:
        if created:
            try:
                run_dir.rmdir()
            except OSError:
                pass
        raise


def make_run_dir(run_dir: Path) -> bool:
    """Make the run directory (and its parents); True when this call created it, False when it
    was there already (another engine's, perhaps made at the same instant)."""
    try:
        run_dir.mkdir(parents=True)
        return True
    except FileExistsError:
        if run_dir.is_dir():
            return False
        raise UserError(f"{run_dir}: exists and is not a directory") from None
    except OSError as e:
        raise UserError(f"--run-dir {run_dir}: cannot create it: {e.strerror or e}") from None


def engine_info(argv: list[str], run_id: str, world: World | None = None,
                ranks: Sequence[RankInfo] = ()) -> EngineInfo:
    """This job's identity, as `engine.json` records it: the process a controller signals (this
    one; or, under `andrea-train --gpus`, the launcher that holds the lock and passes signals on
    to every rank) and, for a data-parallel job, its ranks."""
    pid = world.launcher_pid if world is not None and world.launcher_pid else os.getpid()
    return EngineInfo(pid=pid, start_time=proc_start_time(pid), boot_id=boot_id(),
                      host=socket.gethostname(), run_id=run_id, argv=list(argv),
                      started_at=time.time(),
                      launcher=world.launcher if world is not None else "single",
                      world_size=world.size if world is not None else 1, ranks=list(ranks))


def write_engine_json(run_dir: Path, argv: list[str], run_id: str) -> EngineInfo:
    """Write `engine.json` atomically (after the lock is taken and signal handlers installed)."""
    info = engine_info(argv, run_id)
    write_json_atomic(RunPaths(Path(run_dir)).engine, info.to_json())
    return info


def read_engine_info(run_dir: Path) -> EngineInfo | Unreadable:
    """`engine.json` of a run directory, or why it cannot be used."""
    path = RunPaths(Path(run_dir)).engine
    obj = read_json(path)
    if obj is None:
        return Unreadable("engine.json", f"{path}: missing or unreadable")
    return EngineInfo.from_json(obj)
