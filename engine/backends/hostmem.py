"""Host memory: how much there is to take, and a refusal before taking more than that.

The numpy backend and the run loop allocate everything up front (DESIGN §5); a model the machine
cannot hold must be refused before the first allocation, with the plan and what is available,
not end in a MemoryError traceback (or the kernel's OOM killer) half-way through.
"""

from __future__ import annotations

import resource

from engine.errors import UserError

MEMINFO = "/proc/meminfo"


def available_bytes() -> int | None:
    """Memory a new allocation can have: MemAvailable, capped by this process's address-space
    limit (RLIMIT_AS) where one is set; None when neither is known."""
    avail = None
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        avail = soft if avail is None else min(avail, soft)
    return avail


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def require(plan: dict[str, int], what: str) -> None:
    """Refuse (UserError, exit status 2) when `plan`'s total does not fit in available memory."""
    total = sum(plan.values())
    avail = available_bytes()
    if avail is not None and total > avail:
        parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in plan.items())
        raise UserError(f"{what}: needs {fmt_bytes(total)} of host memory ({parts}), "
                        f"{fmt_bytes(avail)} available: use a smaller model, batch_size or "
                        "seq_len")
