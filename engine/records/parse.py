"""Reading helpers of the run-directory contract: how every record's reader turns a JSON value into
a field (a value missing, of the wrong type or out of range becomes a neutral value: NaN, None,
empty) and how a record that cannot be used at all comes back (`Unreadable`, never an exception).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

STEP_MAX = 2**63 - 1  # steps are int64 wherever they are stored


@dataclass(frozen=True)
class Unreadable:
    """A record the reader could not use; falsy, and says why."""

    what: str
    reason: str

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return f"unreadable {self.what}: {self.reason}"


def as_int(x: Any, lo: int = -STEP_MAX, hi: int = STEP_MAX) -> int | None:
    """An int in [lo, hi] (bool is not an int here), else None."""
    if isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi:
        return x
    return None


def as_float(x: Any) -> float:
    """A number as float (NaN and infinities kept: a skipped step logs them); else NaN."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return math.nan
    try:
        return float(x)
    except OverflowError:  # an int beyond float range
        return math.inf if x > 0 else -math.inf


def as_finite(x: Any) -> float | None:
    """A finite number as float, else None."""
    f = as_float(x)
    return f if math.isfinite(f) else None


def as_str(x: Any, default: str = "") -> str:
    return x if isinstance(x, str) else default


def as_opt_str(x: Any) -> str | None:
    return x if isinstance(x, str) else None


def as_number_map(x: Any) -> dict[str, float]:
    """{name: finite float}: entries with other values are left out."""
    if not isinstance(x, Mapping):
        return {}
    out = {}
    for k, v in x.items():
        f = as_finite(v)
        if f is not None:
            out[str(k)] = f
    return out


def as_optional_number_map(x: Any) -> dict[str, float | None]:
    """{name: finite float or None} (a source with no sequence this step logs null)."""
    if not isinstance(x, Mapping):
        return {}
    return {str(k): as_finite(v) for k, v in x.items()}


def as_step(x: Any) -> int | None:
    """A step number (an int in [0, STEP_MAX]), else None."""
    return as_int(x, 0, STEP_MAX)


def parse_all(reader: Any, objects: Iterable[Any]) -> tuple[list[Any], int]:
    """`reader.from_json` over `objects`: (the readable records, how many were not)."""
    out, bad = [], 0
    for o in objects:
        r = reader.from_json(o)
        if isinstance(r, Unreadable):
            bad += 1
        else:
            out.append(r)
    return out, bad
