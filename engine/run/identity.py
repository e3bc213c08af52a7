"""Who the engine is (DESIGN §7/§8): boot id, process start time, the run lock, engine.json.

A controller signals a pid only if the process behind it is provably the engine that wrote
`engine.json`: same boot, same start time (clock ticks since boot, /proc/PID/stat field 22), and
`engine.lock` held. Standard library only: engine.run.control, which the TUI signals
through, imports this.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Sequence
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


def proc_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None when there is no such process."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and ')': the fields after it start after the LAST ')'.
    rest = data[data.rfind(b")") + 2 :].split()
    try:
        return int(rest[22 - 3])  # rest[0] is field 3 (state)
    except (IndexError, ValueError):
        return None


class EngineLock:
    """The `engine.lock` flock, held for the engine's lifetime (the kernel drops it on any exit)."""

    def __init__(self) -> None:
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, run_dir: Path, retry_s: float = 1.0) -> EngineLock:
        """Take the lock or raise UserError naming the holder's pid.

        A controller probes the lock with a brief shared flock, so a failed attempt is retried
        for `retry_s` before concluding another engine holds it.
        """
        path = Path(run_dir) / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise UserError(f"{path}: cannot open the run's lock: {e.strerror or e}") from None
        deadline = time.monotonic() + retry_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    info = read_engine_info(Path(run_dir))
                    holder = info.pid if info else "unknown"
                    raise UserError(
                        f"{path}: held by engine pid {holder}: another engine is running on "
                        f"this run directory"
                    ) from None
                time.sleep(0.02)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


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
