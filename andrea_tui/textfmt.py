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


SI_SUFFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))  # every count's suffixes


def fmt_num(x: Any, digits: int = 3) -> str:
    """Compact number: 1234567 -> '1.23M', 0.000123 -> '1.23e-04'; None/NaN/non-number -> '–'."""
    x = as_number(x)
    if x is None or math.isnan(x):
        return "–"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    a = abs(x)
    if a >= 1e3:
        for div, suf in SI_SUFFIXES:
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


# ---------------------------------------------------------------- one format per quantity
#
# Each quantity the dashboard shows is written by one function, everywhere it appears (panels,
# header, the browser view, which is the same app): a fixed number of significant digits with
# trailing zeros kept, right-aligned in a fixed width, so a number does not change its width
# (and push its neighbours) from one refresh to the next. Unknown values are a dash in the same
# width.

LOSS_WIDTH = 6  # '6.190', '10.84', '1084', '1.08e4'
LR_WIDTH = 8  # '9.20e-04'
SI_WIDTH = 5  # '4.05k', ' 405k', '1.23M'
CLIP_WIDTH = 5  # '0.985', '1.000'
PCT_WIDTH = 6  # ' 69.0%'
MS_WIDTH = 5  # '50.0', ' 123', '1234'


def _special(x: Any, width: int) -> str | None:
    """The text of a value with no digits to show (None, NaN, a non-number, an infinity) in
    `width`, or None when `x` is a finite number."""
    f = as_number(x)
    if f is None or math.isnan(f):
        return "–".rjust(width)
    if math.isinf(f):
        return ("inf" if f > 0 else "-inf").rjust(width)
    return None


def sig(x: float, digits: int) -> str:
    """`x` with `digits` significant digits, trailing zeros kept, no exponent below 10**digits:
    6.19 -> '6.190', 1084.2 -> '1084', 0.98512 -> '0.9851' (digits=4)."""
    if x == 0:
        return f"{0:.{digits - 1}f}"
    exp = math.floor(math.log10(abs(x)))
    decimals = max(0, digits - 1 - exp)
    text = f"{x:.{decimals}f}"
    # rounding may carry into one more digit (9.9996 -> '10.000'): one decimal fewer then
    if decimals and len(text.replace("-", "").replace(".", "").lstrip("0")) > digits:
        text = f"{x:.{decimals - 1}f}"
    return text


def _sci(x: float, digits: int) -> str:
    """A short exponent form: 12345 -> '1.23e4', 1e-5 -> '1.00e-5' (digits significant)."""
    m, e = f"{x:.{digits - 1}e}".split("e")
    return f"{m}e{int(e)}"


def fmt_loss(x: Any) -> str:
    """A loss (training, smoothed, validation, per source): 4 significant digits in
    LOSS_WIDTH: ' 6.190', ' 10.84', '  1084', '1.08e4', '0.1234'."""
    special = _special(x, LOSS_WIDTH)
    if special is not None:
        return special
    f = float(x)
    if abs(float(sig(f, 4))) >= 1e4:  # (9999.7 rounds to 5 digits: the exponent form then)
        return _sci(f, 3).rjust(LOSS_WIDTH)
    if f != 0 and abs(f) < 1e-3:
        return _sci(f, 2).rjust(LOSS_WIDTH)
    return sig(f, 4).rjust(LOSS_WIDTH)


def fmt_grad(x: Any) -> str:
    """A gradient norm (and the clip line): as a loss, 4 significant digits in LOSS_WIDTH."""
    return fmt_loss(x)


def fmt_lr(x: Any) -> str:
    """A learning rate, always in one form: '9.20e-04', '3.00e-05', '0.00e+00'."""
    special = _special(x, LR_WIDTH)
    return special if special is not None else f"{float(x):.2e}".rjust(LR_WIDTH)


def fmt_si(x: Any, width: int = SI_WIDTH) -> str:
    """A count or a rate with 3 significant digits and an SI suffix, trailing zeros kept:
    4000 -> '4.00k', 4050 -> '4.05k', 405000 -> ' 405k', 512 -> '  512', 0.5 -> '0.500'."""
    special = _special(x, width)
    if special is not None:
        return special
    f = float(x)
    for div, suf in SI_SUFFIXES:
        if abs(f) >= div * 0.9995:  # what rounds up to 1.00 of a suffix takes it
            return (sig(f / div, 3) + suf).rjust(width)
    if f != 0 and abs(f) < 1e-3:
        return _sci(f, 2).rjust(width)
    return sig(f, 3).rjust(width)


def fmt_tokens(x: Any) -> str:
    """Tokens (a cumulative count): '384k', '1.23M', in SI_WIDTH."""
    return fmt_si(x)


def fmt_rate(x: Any) -> str:
    """Tokens per second: '4.05k', in SI_WIDTH (the unit is written beside it)."""
    return fmt_si(x)


def fmt_clip(x: Any) -> str:
    """A clip scale (1 = not clipped): always 3 decimals, '1.000', '0.985'."""
    special = _special(x, CLIP_WIDTH)
    return special if special is not None else f"{float(x):.3f}".rjust(CLIP_WIDTH)


def fmt_pct(x: Any) -> str:
    """A percentage (of 100): one decimal in PCT_WIDTH with its sign, ' 69.0%', '100.0%'."""
    special = _special(x, PCT_WIDTH - 1)
    return (special + "%") if special is not None else f"{float(x):5.1f}%".rjust(PCT_WIDTH)


def fmt_ms(x: Any) -> str:
    """Milliseconds (a step's time): 3 significant digits, no exponent: '50.0', ' 123',
    '1234', in MS_WIDTH."""
    special = _special(x, MS_WIDTH)
    if special is not None:
        return special
    f = float(x)
    return (f"{f:.0f}" if abs(f) >= 1000 else sig(f, 3)).rjust(MS_WIDTH)


def fmt_weight(x: Any) -> str:
    """A share of the data mixture (0..1): 2 decimals, '0.44', '1.00'."""
    special = _special(x, 4)
    return special if special is not None else f"{float(x):.2f}"


# A step record's quantity -> its one format (the dashboard, the runs browser, the compare
# overlay and its exports all write a metric through here).
BY_METRIC = {"loss": fmt_loss, "val_loss": fmt_loss, "ema": fmt_loss, "grad_norm": fmt_grad,
             "lr": fmt_lr, "tok_s": fmt_rate, "clip_scale": fmt_clip}


def fmt_metric(metric: str, x: Any) -> str:
    """`x` as `metric` is written everywhere (BY_METRIC), without padding; other metrics with
    4 significant digits."""
    fmt = BY_METRIC.get(metric)
    return (fmt(x) if fmt else fmt_num(x, 4)).strip()
