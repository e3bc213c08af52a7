"""A process and its descendants as Linux /proc sees them: for the tests and benchmarks that
measure a command's memory and CPU (dev/bench_data.py, dev/bench_tui.py,
tests/test_prep_resume.py)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(pid: int) -> list[int]:
    """The pids of a process's children, their children, ..."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(_stat_fields(int(entry))[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(argv: list[str], cwd: Path, every_s: float = 0.05) -> tuple[float, int, int, str]:
    """Run a command: (wall seconds, peak RSS of its process tree, exit status, its output)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(every_s)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, _ = proc.communicate()  # reading as it goes: a full pipe never stalls the command
    wall = time.perf_counter() - t0
    t.join()
    return wall, peak[0], proc.returncode, out
