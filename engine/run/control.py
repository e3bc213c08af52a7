"""Signal a run directory's engine safely (DESIGN §8). Standard library only: the TUI uses it.

Before every signal: `engine.json` is readable and names a pid > 1 from this boot; somebody holds
`engine.lock`; the pid is pinned with a pidfd and its /proc start time equals the recorded one.
The signal goes through the pidfd, so it can only reach the process that was checked: if that
process exits after the check, the send fails instead of hitting a recycled pid.
"""

from __future__ import annotations

import fcntl
import os
import signal
from pathlib import Path

from engine.errors import UserError
from engine.records import EngineInfo, Unreadable
from engine.run.identity import boot_id, proc_start_time, read_engine_info
from engine.runfiles import RunPaths, read_json


class ControlRefused(UserError):
    """The engine must not (or cannot) be signalled; the message says why."""


def _lock_free(lock_path: Path) -> bool:
    """True when nobody holds `engine.lock` (we could take it; released at once)."""
    try:
        # O_NONBLOCK: a FIFO in the lock's place must not keep us waiting in open()
        fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return True
    try:
        # Shared, so two controllers probing at once do not mistake each other for the engine.
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # also drops our probe lock when we got it
    return True


def lock_held(run_dir: Path) -> bool:
    """True when some process holds the run directory's engine.lock (an engine is there, perhaps
    still starting). Sends nothing, takes nothing."""
    return not _lock_free(RunPaths(Path(run_dir)).lock)


def _checked_engine(run_dir: Path) -> EngineInfo:
    """The engine's identity after the checks that need no pidfd; raises ControlRefused."""
    paths = RunPaths(Path(run_dir))
    info = read_engine_info(paths.root)
    if isinstance(info, Unreadable):
        if read_json(paths.engine) is None:
            raise ControlRefused(f"{paths.engine}: missing or unreadable: no engine to signal")
        raise ControlRefused(f"{paths.engine}: {info.reason}")
    if info.pid <= 1:
        raise ControlRefused(f"{paths.engine}: pid: expected an integer > 1, got {info.pid!r}")
    if info.boot_id != boot_id():
        raise ControlRefused(f"{paths.engine}: written before the last reboot or on another host")
    if _lock_free(paths.lock):
        raise ControlRefused(f"{paths.lock}: engine not running (lock free)")
    return info


def _check_identity(info: EngineInfo) -> None:
    pid = info.pid
    started = proc_start_time(pid)
    if started is None:
        raise ControlRefused(f"engine pid {pid} is not running")
    if started != info.start_time:
        raise ControlRefused(
            f"pid {pid} now belongs to another process (start time {started}, "
            f"engine.json says {info.start_time!r})"
        )


def signal_engine(run_dir: Path, sig: int) -> None:
    """Send `sig` to the engine of `run_dir`, or raise ControlRefused having sent nothing."""
    info = _checked_engine(run_dir)
    pid = info.pid
    if not hasattr(os, "pidfd_open"):
        # No pidfd (old kernel / not Linux): same checks, then kill at once; a tiny race remains.
        _check_identity(info)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            raise ControlRefused(f"engine pid {pid} exited before the signal") from None
        return
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise ControlRefused(f"engine pid {pid} is not running") from None
    try:
        # Read /proc only after pinning: if the pid was recycled in between, the start time
        # differs; if the pinned process dies after this read, the pidfd send fails (ESRCH).
        _check_identity(info)
        try:
            signal.pidfd_send_signal(pidfd, sig)
        except ProcessLookupError:
            raise ControlRefused(f"engine pid {pid} exited before the signal") from None
    finally:
        os.close(pidfd)


def engine_alive(run_dir: Path) -> tuple[bool, str]:
    """(True, 'running (pid N)') when the engine could be signalled, else (False, why). Sends nothing."""
    try:
        info = _checked_engine(run_dir)
        _check_identity(info)
    except ControlRefused as e:
        return False, str(e)
    return True, f"running (pid {info.pid})"
