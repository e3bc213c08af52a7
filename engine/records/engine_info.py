"""Who the engine of a run directory is (`engine.json`): its process, for verified control, and
the ranks of a data-parallel job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from engine.records.parse import Unreadable, as_finite, as_int, as_opt_str, as_str


@dataclass(frozen=True)
class RankInfo:
    """One rank of a data-parallel job: its process, host and device."""

    rank: int
    pid: int
    host: str
    device: str

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": self.pid, "host": self.host, "device": self.device}

    @classmethod
    def from_json(cls, obj: Any) -> RankInfo | None:
        if not isinstance(obj, Mapping):
            return None
        rank, pid = as_int(obj.get("rank"), 0), as_int(obj.get("pid"), 1)
        if rank is None or pid is None:
            return None
        return cls(rank, pid, as_str(obj.get("host")), as_str(obj.get("device")))


@dataclass(frozen=True)
class EngineInfo:
    """`engine.json`: who the engine of a run directory is, for verified control (DESIGN §8):
    `start_time` is field 22 of /proc/PID/stat (clock ticks since boot), `boot_id` the kernel's."""

    pid: int
    start_time: int | None  # None where /proc gave none (then no controller can verify it)
    boot_id: str
    host: str = ""
    run_id: str = ""
    argv: list[str] = field(default_factory=list)
    started_at: float | None = None
    launcher: str = "single"  # single | andrea (andrea-train --gpus) | torchrun | slurm
    world_size: int = 1
    ranks: list[RankInfo] = field(default_factory=list)  # a data-parallel job's ranks

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["ranks"] = [r.to_json() for r in self.ranks]
        return out

    @classmethod
    def from_json(cls, obj: Any) -> EngineInfo | Unreadable:
        if not isinstance(obj, Mapping):
            return Unreadable("engine.json", f"not an object ({type(obj).__name__})")
        pid, boot = as_int(obj.get("pid"), -(2**31), 2**31 - 1), as_opt_str(obj.get("boot_id"))
        if pid is None or boot is None:
            return Unreadable("engine.json", f"pid: expected an integer, got "
                              f"{obj.get('pid')!r:.40}" if pid is None else "no boot_id")
        argv = obj.get("argv")
        ranks = obj.get("ranks")
        return cls(pid, as_int(obj.get("start_time"), 0), boot, as_str(obj.get("host")),
                   as_str(obj.get("run_id")),
                   [str(a) for a in argv] if isinstance(argv, list) else [],
                   as_finite(obj.get("started_at")), as_str(obj.get("launcher"), "single"),
                   as_int(obj.get("world_size"), 1, 1 << 16) or 1,
                   [r for r in map(RankInfo.from_json, ranks[:4096]) if r is not None]
                   if isinstance(ranks, list) else [])

