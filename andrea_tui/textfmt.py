"""Short human formats for the dashboard (numbers, durations, sizes, bars). Headless."""

from __future__ import annotations

import math
from typing import Any


def as_number(x: Any) -> float | None:
    """`x` as a float when it is a real number (bool excluded; ints too large for a float are
    infinities), else None. Run files are written by another process and may hold anything."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def fmt_num(x: Any, digits: int = 3) -> str:
    """Compact number: 1234567 -> '1.23M', 0.000123 -> '1.23e-04'; None/NaN/non-number -> '–'."""
    x = as_number(x)
    if x is None or math.isnan(x):
        return "–"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    a = abs(x)
    if a >= 1e3:
        for div, suf in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if a >= div:
                return f"{x / div:.{digits}g}{suf}"
    if a == 0:
        return "0"
    if a < 1e-3:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def fmt_int(x: Any) -> str:
    """'1,234'; None, non-finite and non-numbers -> '–'."""
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}"
    f = as_number(x)
    if f is None or not math.isfinite(f):
        return "–"
    return f"{int(f):,}"


def fmt_duration(seconds: Any) -> str:
    """'1h02m03s', '4m05s', '9s'; None or non-number -> '–'."""
    seconds = as_number(seconds)
    if seconds is None or not math.isfinite(seconds):
        return "–"
    s = round(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


def fmt_bytes(n: Any) -> str:
    n = as_number(n)
    if n is None or not math.isfinite(n):
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def bar(frac: Any, width: int) -> str:
    """A horizontal bar of `width` cells filled to `frac` (eighth-cell resolution)."""
    frac = as_number(frac)
    if frac is None or not math.isfinite(frac):
        frac = 0.0
    frac = min(1.0, max(0.0, frac))
    eighths = round(frac * width * 8)
    full, part = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[part] if part else ""
    return ("█" * full + partial).ljust(width)
