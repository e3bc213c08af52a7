"""Axis ticks at round values, and one label format per axis. Headless (no Textual, no plotext).

Linear axes: 1-2-5 steps (1, 2 or 5 times a power of ten), every tick a whole multiple of the
step. Log axes: powers of ten (every k-th when they are many), with 2 and 5 between them when
they are few, or the 1-2-5 ticks of a linear axis inside one decade. Time axes (minutes): steps
of whole seconds, minutes or hours that a clock reads (15 s, 5 min, 30 min, 2 h, ...).

Labels: every tick of an axis in one format, with as few decimals as tell its ticks apart.
`count` axes (steps, tokens) take SI suffixes (`50k`, `100k`, `1.5M`), from 10,000 or when the
step is a thousand or more; `value` axes (a loss, a grad norm, a learning rate) are decimals, or
`2e9`, `5.0e-4` where decimals would be long. These are the charts' labels: the terminal charts,
the compare overlay and the PNG exports use them alike.

Ranges: the y-range a chart draws (YRange), with what lies outside it counted: the whole data
(full_range), the 1st to 99th percentile (percentile_range), or the grad-norm axis (grad_range:
up to the top of the bulk of the data, the columns' maxima below their median + ROBUST_K robust
deviations; a clip line inside it when near the data, else said to be off scale).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from andrea_tui.textfmt import SI_SUFFIXES

STEPS_125 = (1, 2, 5)
ROBUST_PCT = (1.0, 99.0)  # percentile_range: these percentiles of the values, padded
ROBUST_K = 8.0  # grad_range: up to median + ROBUST_K robust deviations of the column maxima
CLIP_NEAR = 2.0  # grad_range: a level line up to this many times the data's top is shown
PAD = 0.05  # of the range, above and below the data
MAX_DECIMALS = 6
# Time steps in seconds a clock reads; beyond the list, 1-2-5 days.
TIME_STEPS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600,
                43200, 86400)


def _power(e: int) -> float:
    """10**e, exactly rounded also for negative e (10**-3 is not 0.001 as a float product)."""
    return float(10**e) if e >= 0 else 1.0 / float(10**-e)


def _multiple(k: int, m: int, e: int) -> float:
    """k * m * 10**e, the float nearest the exact value."""
    return float(k * m * 10**e) if e >= 0 else (k * m) / float(10**-e)


def nice_step(span: float, target: int) -> tuple[int, int]:
    """The smallest 1-2-5 step (m, e: m * 10**e) at least span / target."""
    raw = span / max(1, target)
    if not (raw > 0 and math.isfinite(raw)):
        return 1, 0
    e = math.floor(math.log10(raw))
    for m in (*STEPS_125, 10):
        if _multiple(1, m, e) >= raw * (1 - 1e-9):
            return (1, e + 1) if m == 10 else (m, e)
    return 1, e + 1


def _smaller(m: int, e: int) -> tuple[int, int]:
    """The 1-2-5 step below m * 10**e."""
    return {1: (5, e - 1), 2: (1, e), 5: (2, e)}[m]


def _count(lo: float, hi: float, m: int, e: int) -> tuple[int, int]:
    step = _multiple(1, m, e)
    return math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)


def linear_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Ticks at whole multiples of a 1-2-5 step inside [lo, hi]: as near `target` of them as a
    1-2-5 step gives (at most target + 2), at least two when the range is not empty (one when
    lo == hi)."""
    if not (math.isfinite(lo) and math.isfinite(hi) and math.isfinite(hi - lo)) or hi < lo:
        return []  # (a span beyond a float, e.g. -1e308..1e308: no round ticks to give)
    if hi == lo:
        return [lo]
    m, e = nice_step(hi - lo, target)
    best: tuple[int, int] | None = None
    for _ in range(12):  # the step that fits, then smaller ones while they come closer
        n = _n(lo, hi, m, e)
        if best is not None and n > target + 2 and _n(lo, hi, *best) >= 2:
            break
        if best is None or _n(lo, hi, *best) < 2 or abs(n - target) < abs(
                _n(lo, hi, *best) - target):
            best = (m, e)
        m, e = _smaller(m, e)
    assert best is not None
    first, last = _count(lo, hi, *best)
    return [_multiple(k, *best) for k in range(first, last + 1)]


def _n(lo: float, hi: float, m: int, e: int) -> int:
    first, last = _count(lo, hi, m, e)
    return last - first + 1


def log_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Ticks for a log axis over [lo, hi] (positive values, in the axis's own units)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= 0 or hi < lo:
        return []
    lo = max(lo, hi * 1e-300)
    e_lo, e_hi = math.ceil(math.log10(lo) - 1e-9), math.floor(math.log10(hi) + 1e-9)
    powers = list(range(e_lo, e_hi + 1))
    if len(powers) > target:  # many decades: every k-th power of ten, k a 1-2-5 number
        chosen: list[int] = []
        for every in (2, 5, 10, 20, 50, 100, 200, 500):
            kept = [p for p in powers if p % every == 0]
            if len(kept) < 2:
                break
            chosen = kept
            if len(kept) <= target:
                break
        return [_power(p) for p in chosen or powers[:: max(1, len(powers) - 1)]]
    ticks = [_multiple(1, m, e) for e in range(e_lo - 1, e_hi + 1) for m in STEPS_125]
    ticks = [t for t in ticks if lo * (1 - 1e-9) <= t <= hi * (1 + 1e-9)]
    if len(powers) >= 2 and len(ticks) > target:
        return [_power(p) for p in powers]
    if len(ticks) >= 2:
        return ticks
    return linear_ticks(lo, hi, target)  # inside one decade: round values, placed on a log axis


def time_ticks(lo_min: float, hi_min: float, target: int = 5) -> tuple[list[float], list[str]]:
    """Ticks for an axis in minutes, at whole seconds, minutes or hours, and their labels
    (`30s`, `15m`, `2h`, `1.5h` when the step is half an hour within hours)."""
    if not (math.isfinite(lo_min) and math.isfinite(hi_min)) or hi_min < lo_min:
        return [], []
    lo_s, hi_s = lo_min * 60.0, hi_min * 60.0
    raw = (hi_s - lo_s) / max(1, target)
    step = next((s for s in TIME_STEPS_S if s >= raw), None)
    if step is None:
        m, e = nice_step(raw / 86400, 1)
        step = _multiple(1, m, e) * 86400
    if hi_s == lo_s:
        ticks_s = [lo_s]
    else:
        ticks_s = [k * step for k in range(math.ceil(lo_s / step - 1e-9),
                                           math.floor(hi_s / step + 1e-9) + 1)]
    if step < 60 and hi_s < 120:
        unit, div = "s", 1.0
    elif step < 3600 and hi_s < 7200:
        unit, div = "m", 60.0
    elif step < 86400 or hi_s < 2 * 86400:
        unit, div = "h", 3600.0
    else:
        unit, div = "d", 86400.0
    labels = [f"{lab}{unit}" for lab in _decimal_labels([t / div for t in ticks_s])]
    return [t / 60.0 for t in ticks_s], labels


def _decimals(values: Sequence[float], scale: float = 1.0) -> int:
    """The fewest decimals (up to MAX_DECIMALS) that write every value / scale exactly enough
    to be read back (to a millionth of its size)."""
    for d in range(MAX_DECIMALS + 1):
        if all(abs(round(v / scale, d) - v / scale) <= 1e-6 * max(abs(v / scale), 10.0**-d)
               for v in values) and len({round(v / scale, d) for v in values}) == len(
                   set(values)):
            return d
    return MAX_DECIMALS


def _decimal_labels(values: Sequence[float], scale: float = 1.0) -> list[str]:
    d = _decimals(values, scale)
    return [_zero(f"{v / scale:.{d}f}") for v in values]


def _zero(text: str) -> str:
    """'-0' and '-0.00' are written as 0."""
    return text.lstrip("-") if float(text) == 0 else text


def _exp_labels(values: Sequence[float]) -> list[str]:
    """`2e9`, `5.0e-4`, `1.0e-3`: one mantissa precision for all (0 stays `0`)."""
    nonzero = [v for v in values if v != 0]
    d = 0
    for d in range(2 * MAX_DECIMALS):
        if all(abs(float(f"{v:.{d}e}") - v) <= 1e-6 * abs(v) for v in nonzero) and len(
                {f"{v:.{d}e}" for v in nonzero}) == len(set(nonzero)):
            break
    out = []
    for v in values:
        if v == 0:
            out.append("0")
            continue
        mant, exp = f"{v:.{d}e}".split("e")
        out.append(f"{mant}e{int(exp)}")
    return out


def tick_labels(values: Sequence[float], kind: str = "value") -> list[str]:
    """Labels for the ticks of one axis, all in one format. `kind`: `count` (SI suffixes from
    10,000, or when the ticks are a thousand or more apart) or `value` (decimals; `2e9` and
    `5.0e-4` forms where decimals would be long)."""
    vals = [float(v) for v in values]
    if not vals:
        return []
    finite = [v for v in vals if math.isfinite(v)]
    if len(finite) != len(vals):
        raise ValueError(f"tick values must be finite, got {vals}")
    top = max(abs(v) for v in vals)
    gaps = [abs(b - a) for a, b in itertools.pairwise(vals) if b != a]
    step = min(gaps) if gaps else top
    if kind == "count":
        if top >= 1e4 or step >= 1e3:
            div, suffix = next(((d, s) for d, s in SI_SUFFIXES if top >= d), (1e3, "k"))
            return [("0" if v == 0 else lab + suffix)
                    for v, lab in zip(vals, _decimal_labels(vals, div), strict=True)]
        return [f"{float(lab):,.{_decimals(vals)}f}" for lab in _decimal_labels(vals)]
    if kind != "value":
        raise ValueError(f"kind: expected count or value, got {kind!r}")
    if top >= 1e5 or (0 < top < 1e-2) or _decimals(vals) > 4:
        return _exp_labels(vals)
    return _decimal_labels(vals)


def label(value: float, kind: str = "value") -> str:
    """One value written as an axis of its own would write it (e.g. a line's level in a title:
    `clip 1e9`)."""
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return tick_labels([value], kind)[0]


def log_label(value: float, kind: str = "value") -> str:
    """A tick of a log axis in its own shortest form (1k 10k 100k 1M; 0.01 0.1 1 10)."""
    if kind == "count" and value >= 1e3:
        div, suffix = next((d, s) for d, s in SI_SUFFIXES if value >= d)
        return _decimal_labels([value], div)[0] + suffix
    if kind == "value" and not 1e-2 <= value < 1e5:
        return _exp_labels([value])[0]
    return _decimal_labels([value])[0]


def axis(lo: float, hi: float, kind: str = "value", target: int = 5,
         log: bool = False) -> tuple[list[float], list[str]]:
    """Ticks of an axis from lo to hi (its own units) and their labels. On a log axis each
    tick is written in its own shortest form (their steps differ by design); exponents for all
    when one needs them."""
    if not log:
        ticks = linear_ticks(lo, hi, target)
        return ticks, tick_labels(ticks, kind)
    ticks = log_ticks(lo, hi, target)
    if kind == "value" and ticks and (min(ticks) < 1e-2 or max(ticks) >= 1e5):
        return ticks, _exp_labels(ticks)
    return ticks, [log_label(t, kind) for t in ticks]


# ---------------------------------------------------------------- ranges


@dataclass(frozen=True)
class YRange:
    """A y-range to draw (in the units drawn: log10 ones on a log axis): what lies above `hi`
    (below `lo`) is drawn on the edge and counted; `line` is a level line inside the range
    (None when there is none or it is off scale)."""

    lo: float
    hi: float
    above: int = 0
    below: int = 0
    line: float | None = None
    line_off_scale: bool = False


def _padded(lo: float, hi: float) -> tuple[float, float]:
    """[lo, hi] with PAD of its span on each side; a flat range gets a span of its own."""
    span = hi - lo
    least = 1e-3 * max(abs(lo), abs(hi))
    if not span > least:
        span = 0.2 * max(abs(lo), abs(hi)) or 1.0
        mid = (lo + hi) / 2
        return mid - span / 2, mid + span / 2
    return lo - PAD * span, hi + PAD * span


def robust_top(col_hi: np.ndarray, k: float = ROBUST_K) -> float:
    """The top of the bulk of a series from its columns' maxima: the highest of them at or
    below median + k robust deviations (1.4826 x the median absolute deviation, at least 5% of
    the median). NaN when there are none."""
    m = col_hi[np.isfinite(col_hi)]
    if not len(m):
        return math.nan
    med = float(np.median(m))
    dev = max(1.4826 * float(np.median(np.abs(m - med))), 0.05 * abs(med))
    fence = med + k * dev
    inside = m[m <= fence]
    return float(inside.max()) if len(inside) else med


def grad_range(values: np.ndarray, col_lo: np.ndarray, col_hi: np.ndarray,
               line: float | None, log: bool = False, near: float = CLIP_NEAR) -> YRange | None:
    """The grad-norm axis: from the lowest value up to robust_top of the columns' maxima (on a
    log axis, `log`: values in log10 units, up to the highest), with the level `line` (the clip
    threshold) inside when it is below that top or within `near` times it (the axis then
    reaches it), else off scale; the raw `values` above the range counted. None when there is
    nothing finite."""
    lo_f, hi_f = col_lo[np.isfinite(col_lo)], col_hi[np.isfinite(col_hi)]
    if not len(lo_f) or not len(hi_f):
        return None
    lo = float(lo_f.min())
    top = float(hi_f.max()) if log else robust_top(col_hi)
    shown: float | None = None
    off = False
    if line is not None and math.isfinite(line):
        reach = top + math.log10(near) if log else near * top if top > 0 else top
        if line <= top:
            shown, lo = line, min(lo, line)
        elif line <= reach:
            shown, top = line, line
        else:
            off = True
    lo, hi = _padded(lo, top)
    finite = values[np.isfinite(values)]
    return YRange(lo, hi, int(np.count_nonzero(finite > hi)), 0, shown, off)


def percentile_range(values: np.ndarray) -> YRange | None:
    """The loss chart's robust range (the 1st to 99th percentile, padded), with what lies
    outside counted."""
    vals = values[np.isfinite(values)]
    if vals.size < 2:
        return None
    lo, hi = _padded(*(float(v) for v in np.percentile(vals, ROBUST_PCT)))
    return YRange(lo, hi, int(np.count_nonzero(vals > hi)), int(np.count_nonzero(vals < lo)))


def full_range(*ys: np.ndarray) -> YRange | None:
    vals = [y[np.isfinite(y)] for y in ys]
    vals = [v for v in vals if len(v)]
    if not vals:
        return None
    return YRange(*_padded(min(float(v.min()) for v in vals), max(float(v.max()) for v in vals)))
