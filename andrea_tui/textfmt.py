"""Short human formats for the dashboard (numbers, durations, sizes, bars). Headless."""

from __future__ import annotations

import math


def fmt_num(x: float | int | None, digits: int = 3) -> str:
    """Compact number: 1234567 -> '1.23M', 0.000123 -> '1.23e-04', None/NaN -> '–'."""
    if x is None:
        return "–"
    x = float(x)
    if math.isnan(x):
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


def fmt_int(x: int | float | None) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{int(x):,}"


def fmt_duration(seconds: float | None) -> str:
    """'1h02m03s', '4m05s', '9s'; None -> '–'."""
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


def fmt_bytes(n: float | int | None) -> str:
    if n is None or not isinstance(n, (int, float)) or not math.isfinite(n):
        return "–"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def bar(frac: float, width: int) -> str:
    """A horizontal bar of `width` cells filled to `frac` (eighth-cell resolution)."""
    if not math.isfinite(frac):
        frac = 0.0
    frac = min(1.0, max(0.0, frac))
    eighths = round(frac * width * 8)
    full, part = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[part] if part else ""
    return ("█" * full + partial).ljust(width)
