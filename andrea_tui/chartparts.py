"""What the charts draw with: the user's options, x values, axes, lines, marks and titles.

The user's choices for a chart (ChartOptions, kept by andrea_tui.settings): log y, a robust
y-range, x by step or wall time (minutes since the first record shown), the window. The x of a
run's rows and of its events (alerts, resumes, evaluations); round ticks on both axes
(andrea_tui.ticks: 1-2-5 steps, SI suffixes for steps, whole minutes or hours for wall time, one
label format per axis) with the y-range set by hand, as plotext's own would not be round; log y
drawn as log10 values with tick labels in the original units, since plotext 5's log scale
re-logs the data on every build (plotext #209); values clamped to the y-range, with `▲`/`▼` on
the edge where a column lies beyond it; alert marks (`!`); a noisy series as two lines, one
through each column's min and one through its max (every spike drawn, at a fraction of the cost
of a zig-zag through both); a title that fits the width; the line colours for dark and light
backgrounds. Plain functions over a plotext figure (`plt`): the widgets are andrea_tui.charts
(the dashboard's) and andrea_tui.compare_screen (the compare overlay, which takes the ticks).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from andrea_tui import ticks
from andrea_tui.series import StepSeries, window
from andrea_tui.ticks import YRange
from engine.records import AlertEvent

if TYPE_CHECKING:
    from textual_plotext.plot import Plot

AXIS_COLUMNS = 10  # plotext's y-axis labels and frame take about this many columns
MARKS_MAX = 40  # alert marks drawn at most (the newest)
X_TICK_COLUMNS = 12  # columns per x tick label (a label and the gap to the next)
Y_TICK_ROWS = 3  # rows per y tick

LineColor = str | tuple[int, int, int]  # a plotext colour: a name, or RGB
# Line colours for dark and light backgrounds (plotext colours: names, or RGB on light ones).
DARK: dict[str, LineColor] = {"raw": "gray", "ema": "cyan", "val": "yellow", "grad": "green", "clip": "red",
        "alert": "red+", "edge": "magenta+", "lr": "blue+", "resume": "magenta",
        "eval": "yellow"}
LIGHT: dict[str, LineColor] = {"raw": (150, 150, 150), "ema": (0, 110, 170), "val": (190, 105, 0),
         "grad": (20, 130, 50), "clip": (200, 30, 30), "alert": (200, 30, 30),
         "edge": (150, 0, 150), "lr": (40, 70, 200), "resume": (150, 0, 150),
         "eval": (190, 105, 0)}


@dataclass(frozen=True)
class ChartOptions:
    """What the user chose for a chart: log y, robust y-range, x by step or wall time (minutes
    since the first record shown), the last `last_n` steps or all."""

    log_y: bool = False
    robust_y: bool = False
    x_axis: str = "step"
    last_n: int | None = None

    @property
    def by_time(self) -> bool:
        return self.x_axis == "time"


# ---------------------------------------------------------------- x values


def log10_positive(y: np.ndarray) -> np.ndarray:
    """log10 of the positive values, NaN (not drawn) for the others."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(y > 0, np.log10(np.where(y > 0, y, 1.0)), np.nan)


def x_values(series: StepSeries, opts: ChartOptions) -> tuple[np.ndarray, float]:
    """The x values of the rows (steps, or minutes since the first row shown) and the time
    origin (unix seconds) for converting event times."""
    steps = series.steps
    if not opts.by_time:
        return steps, math.nan
    t = series.col("t")
    _, tw = window(steps, t, opts.last_n)
    finite = tw[np.isfinite(tw)]
    t0 = float(finite.min()) if finite.size else 0.0
    return (t - t0) / 60.0, t0


def event_x(events: Sequence[object], opts: ChartOptions, t0: float) -> list[float]:
    """The x of events with a step and a time (alerts, resumes, evaluations)."""
    out = []
    for e in events:
        x = (e.t - t0) / 60.0 if opts.by_time else e.step  # type: ignore[attr-defined]
        if x is not None and math.isfinite(x):
            out.append(float(x))
    return out


def alert_x(alerts: list[AlertEvent], kinds: tuple[str, ...], opts: ChartOptions,
            t0: float) -> list[float]:
    """The x of the newest MARKS_MAX alerts of `kinds`."""
    return event_x([a for a in alerts if a.alert in kinds], opts, t0)[-MARKS_MAX:]


def in_view(xs: list[float], x: np.ndarray) -> list[float]:
    """The values of `xs` within the range of `x` (what the chart's x axis shows)."""
    if not len(x):
        return []
    lo, hi = float(np.nanmin(x)), float(np.nanmax(x))
    return [v for v in xs if lo <= v <= hi]


# ---------------------------------------------------------------- axes


def x_ticks(lo: float, hi: float, by_time: bool, width: int) -> tuple[list[float], list[str]]:
    """Round ticks for an x axis of `width` columns: steps (1-2-5, `5k`) or minutes."""
    target = max(2, min(7, width // X_TICK_COLUMNS))
    if by_time:
        return ticks.time_ticks(lo, hi, target)
    return ticks.axis(lo, hi, "count", target)


def y_ticks(yr: YRange, log: bool, height: int) -> tuple[list[float], list[str]]:
    """Round ticks for a y axis of `height` rows (positions in the units drawn)."""
    target = max(2, min(5, height // Y_TICK_ROWS))
    if not log:
        return ticks.axis(yr.lo, yr.hi, "value", target)
    top = math.floor(math.log10(sys.float_info.max))  # past a float's range: clamped
    vals, labels = ticks.axis(10 ** min(yr.lo, top), 10 ** min(yr.hi, top), "value", target,
                              log=True)
    return [math.log10(v) for v in vals], labels


def set_axes(plt: Plot, x: np.ndarray, yr: YRange, opts: ChartOptions,
             size: tuple[int, int]) -> int:
    """Round x and y ticks, and the y-range set by hand (plotext's own would not be round);
    the columns the y tick labels take (plotext draws a title only over the plot area)."""
    width, height = size
    if len(x):
        lo, hi = float(np.nanmin(x)), float(np.nanmax(x))
        if hi > lo:
            plt.xlim(lo, hi)
        plt.xticks(*x_ticks(lo, hi, opts.by_time, max(10, width - AXIS_COLUMNS)))
    plt.ylim(yr.lo, yr.hi)
    positions, labels = y_ticks(yr, opts.log_y, max(3, height - 4))
    plt.yticks(positions, labels)
    return max((len(label) for label in labels), default=0)


# ---------------------------------------------------------------- lines and marks


def clamped(y: np.ndarray, yr: YRange) -> np.ndarray:
    """`y` within the y-range (what lies beyond is drawn on its edge)."""
    return np.clip(y, yr.lo, yr.hi)


def plot_range(plt: Plot, x: np.ndarray, lo: np.ndarray, hi: np.ndarray,
               color: LineColor) -> None:
    """Per-column max as a line, and per-column min as a second one where it differs: every
    spike is drawn, at a fraction of the cost of a zig-zag through both (plotext draws each
    segment dot by dot, and a zig-zag's segments span the column's whole range: 60+ ms a
    build)."""
    plt.plot(x.tolist(), hi.tolist(), color=color, marker="braille")
    if not np.array_equal(lo, hi):
        plt.plot(x.tolist(), lo.tolist(), color=color, marker="braille")


def draw_edges(plt: Plot, x: np.ndarray, hi: np.ndarray, lo: np.ndarray, yr: YRange,
               color: LineColor) -> None:
    """Columns with points above (below) the range: `▲` on the top (`▼` on the bottom) edge."""
    up, down = x[hi > yr.hi], x[lo < yr.lo]
    if len(up):
        plt.scatter(up.tolist(), [yr.hi] * len(up), color=color, marker="▲")
    if len(down):
        plt.scatter(down.tolist(), [yr.lo] * len(down), color=color, marker="▼")


def draw_marks(plt: Plot, xs: list[float], top: float, color: LineColor) -> None:
    """Alert marks: a `!` at the top of the plot at each alert's x."""
    if xs:
        plt.scatter(xs, [top] * len(xs), color=color, marker="!")


# ---------------------------------------------------------------- titles


def scope_label(opts: ChartOptions, robust: bool | None = None) -> str:
    """What the chart shows, for its title: `all` or `last N`, and the options that are on."""
    parts = ["all" if opts.last_n is None else f"last {opts.last_n}"]
    if opts.log_y:
        parts.append("log y")
    if opts.robust_y if robust is None else robust:
        parts.append("robust y")
    if opts.by_time:
        parts.append("x: time")
    return ", ".join(parts)


def fit_title(parts: Sequence[tuple[str, str]], width: int) -> str:
    """The title's parts (long, short) joined with ` · `: the long forms when they fit in
    `width`, else the short ones from the last part back, then short forms joined by spaces."""
    longs = [p[0] for p in parts if p[0]]
    title = " · ".join(longs)
    if len(title) <= width:
        return title
    forms = list(parts)
    for i in range(len(forms) - 1, -1, -1):
        forms[i] = (forms[i][1], forms[i][1])
        title = " · ".join(p[0] for p in forms if p[0])
        if len(title) <= width:
            return title
    return " ".join(p[1] for p in parts if p[1])
