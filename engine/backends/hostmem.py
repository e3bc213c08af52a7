"""Host memory: how much there is to take, and a refusal before taking more than that.

The numpy backend and the run loop allocate everything up front (DESIGN §5); a model the machine
cannot hold must be refused before the first allocation, with the plan and what is available,
not end in a MemoryError traceback or, worse, in the kernel's OOM killer half-way through (which
may pick another process on a shared host). Available is the least of MemAvailable
(/proc/meminfo), the headroom under the cgroup's memory limit (v2 `memory.max`, v1
`memory.limit_in_bytes`, at this process's cgroup and every one above it) and the address-space
limit (RLIMIT_AS). The plan must fit with a safety margin (MARGIN_FRACTION of it plus
MARGIN_BYTES) for what is not in it: the interpreter, libraries, data pages, transient copies.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

from engine import env
from engine.errors import UserError

MEMINFO = "/proc/meminfo"
CGROUP_FS = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"
SELF_STATUS = "/proc/self/status"
# Tests: pretend this many bytes are available (read by the check alone, nowhere else).
TEST_AVAILABLE_ENV = env.TEST_MEM_AVAILABLE.name
MARGIN_FRACTION = 0.05
MARGIN_BYTES = 256 << 20
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


@dataclass(frozen=True)
class Available:
    """Bytes a new allocation can have, and which bound said so."""

    bytes: int
    source: str


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def meminfo_available(path: str | Path = MEMINFO) -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None when it cannot be read)."""
    text = _read(Path(path)) or ""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def _number(text: str | None) -> int | None:
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None  # "max": no limit


def _stat_field(text: str | None, key: str) -> int:
    for line in (text or "").splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            return _number(v) or 0
    return 0


def _levels(fs: Path, rel: str) -> list[Path]:
    """The cgroup directory of `rel` under `fs` and each one above it, up to `fs` itself. In a
    container the path /proc names may not exist in its view: then `fs` alone."""
    here = fs / rel.strip("/")
    if not here.is_dir():
        return [fs]
    out = [here]
    while here != fs and fs in here.parents:
        here = here.parent
        out.append(here)
    return out


def cgroup_headroom(fs: str | Path = CGROUP_FS,
                    self_cgroup: str | Path = SELF_CGROUP) -> int | None:
    """Bytes left under the tightest cgroup memory limit over this process (its cgroup and every
    one above it): the limit less the usage, plus the file cache (active and inactive; not
    tmpfs or shared memory) the kernel reclaims before it fails an allocation. None where no limit is set (or none can be read)."""
    fs = Path(fs)
    best: int | None = None
    for line in (_read(Path(self_cgroup)) or "").splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hier == "0" and controllers == "":  # cgroup v2
            files = ("memory.max", "memory.current", "memory.stat", "active_file",
                     "inactive_file")
            root = fs
        elif "memory" in controllers.split(","):  # cgroup v1
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat",
                     "total_active_file", "total_inactive_file")
            root = fs / "memory"
        else:
            continue
        for level in _levels(root, rel):
            limit = _number(_read(level / files[0]))
            if limit is None or limit >= _UNLIMITED:
                continue
            used = _number(_read(level / files[1])) or 0
            text = _read(level / files[2])
            cache = _stat_field(text, files[3]) + _stat_field(text, files[4])
            left = max(0, limit - used + min(cache, used))
            best = left if best is None else min(best, left)
    return best


def _address_space_left() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    vm = 0  # what this process has mapped already counts against the limit
    for line in (_read(Path(SELF_STATUS)) or "").splitlines():
        if line.startswith("VmSize:"):
            vm = _number(line.split()[1]) or 0
    return max(0, soft - vm * 1024)


def available() -> Available | None:
    """What a new allocation can have now (None when nothing can be read)."""
    test = env.TEST_MEM_AVAILABLE.read()
    if test is not None:
        return Available(test, TEST_AVAILABLE_ENV)
    found = [(v, src) for v, src in (
        (meminfo_available(), "MemAvailable in /proc/meminfo"),
        (cgroup_headroom(), "under the cgroup's memory limit"),
        (_address_space_left(), "under the address-space limit (ulimit -v)"),
    ) if v is not None]
    if not found:
        return None
    v, src = min(found)
    return Available(v, src)


def margin(total: int) -> int:
    """The safety margin kept free beside a plan of `total` bytes."""
    return int(total * MARGIN_FRACTION) + MARGIN_BYTES


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def require(plan: dict[str, int], what: str) -> None:
    """Refuse (UserError, exit status 2) when `plan` (bytes by group; a "total" key is ignored)
    and its safety margin do not fit in available host memory."""
    groups = {k: v for k, v in plan.items() if k != "total"}
    total = sum(groups.values())
    avail = available()
    if avail is None or total + margin(total) <= avail.bytes:
        return
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in groups.items())
    raise UserError(
        f"{what}: needs {fmt_bytes(total)} of host memory ({parts}) and a safety margin of "
        f"{fmt_bytes(margin(total))} ({MARGIN_FRACTION:.0%} + {fmt_bytes(MARGIN_BYTES)}); "
        f"{fmt_bytes(avail.bytes)} available ({avail.source}): use a smaller model, batch_size "
        "or seq_len")
