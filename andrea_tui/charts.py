"""Loss and grad-norm charts: textual-plotext (plotext 5.3.2) fed from a StepSeries.

The charts only draw what `update_from()` handed them: downsampled (min and max per column) and
windowed in numpy, so a 200k-step history costs the same to draw as a short one. A noisy series
is drawn as two lines, one through each column's min and one through each column's max: every
spike is still drawn, at a fraction of the cost of a zig-zag through both (plotext draws each
segment dot by dot, and a zig-zag's segments span the column's whole range: 60+ ms a build). plotext 5's
log scale re-logs data on every build (plotext #209), so log-y is drawn as log10 values with
tick labels in the original units.

A plotext build costs tens of milliseconds, so each chart builds only when what it would draw
changed: `update_from()` ignores data equal to what is drawn, and `render()` reuses the last
canvas while (data, size, theme) are the same (Textual re-renders widgets for reasons of its
own, e.g. when a pushed screen is popped). `build_seconds` lets the app budget redraws.
"""

from __future__ import annotations

import math
import time

import numpy as np
from rich.text import Text
from textual_plotext import PlotextPlot

from andrea_tui.series import StepSeries, column_ranges, downsample_minmax, window
from andrea_tui.textfmt import fmt_num

AXIS_COLUMNS = 10  # plotext's y-axis labels and frame take about this many columns


def _log_ticks(lo: float, hi: float) -> tuple[list[float], list[str]]:
    """Tick positions (log10 units) and labels (original units) for a log-y axis."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [], []
    if hi - lo < 1e-9:
        hi = lo + 0.1
    ticks = list(np.linspace(lo, hi, 5))
    return ticks, [fmt_num(10**t) for t in ticks]


def _same(a: tuple | None, b: tuple) -> bool:
    """Whether two chart inputs (tuples of arrays and scalars) would draw the same picture."""
    if a is None or len(a) != len(b):
        return False
    for u, v in zip(a, b, strict=True):
        if isinstance(u, np.ndarray) or isinstance(v, np.ndarray):
            if not np.array_equal(u, v, equal_nan=True):
                return False
        elif u != v:
            return False
    return True


def _plot_range(plt, x: np.ndarray, lo: np.ndarray, hi: np.ndarray, color: str) -> None:
    """Per-column max as a line, and per-column min as a second one where it differs."""
    plt.plot(x.tolist(), hi.tolist(), color=color, marker="braille")
    if not np.array_equal(lo, hi):
        plt.plot(x.tolist(), lo.tolist(), color=color, marker="braille")


class CachedPlot(PlotextPlot):
    """A PlotextPlot that builds only when its inputs, size or theme changed."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._data: tuple | None = None
        self._inputs: tuple | None = None  # everything the picture depends on besides size
        self._data_version = 0
        self._canvas_key: tuple | None = None
        self._canvas: Text | None = None
        self.build_seconds = 0.0  # cost of the last build (plotext + ANSI decoding)

    def _set_inputs(self, inputs: tuple, data: tuple) -> bool:
        """Store new inputs and refresh; False (and nothing done) when they draw the same."""
        if _same(self._inputs, inputs):
            return False
        self._inputs, self._data = inputs, data
        self._data_version += 1
        self.refresh()
        return True

    def _draw(self) -> None:
        """Issue the plotext calls for the current data (subclasses)."""
        raise NotImplementedError

    def render(self):
        key = (self._data_version, self.size, self.app.theme, self.theme)
        if key == self._canvas_key and self._canvas is not None:
            return self._canvas
        t0 = time.perf_counter()
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        self._draw()
        self._canvas = super().render()
        self._canvas_key = key
        self.build_seconds = time.perf_counter() - t0
        return self._canvas


class LossChart(CachedPlot):
    """Raw loss (dim) and its debiased EMA, whole run or the last N steps, linear or log y."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.log_y = False
        self.last_n: int | None = None

    def update_from(self, series: StepSeries) -> None:
        cols = max(10, self.size.width - AXIS_COLUMNS)
        x, y = window(series.steps, series.col("loss"), self.last_n)
        _, e = window(series.steps, series.ema(), self.last_n)
        if self.log_y:
            with np.errstate(divide="ignore", invalid="ignore"):
                y = np.where(y > 0, np.log10(np.where(y > 0, y, 1.0)), np.nan)
                e = np.where(e > 0, np.log10(np.where(e > 0, e, 1.0)), np.nan)
        rx, rlo, rhi = column_ranges(x, y, cols)
        ex, ey = downsample_minmax(x, e, cols)  # smooth: its zig-zag is short and cheap
        data = (rx, rlo, rhi, ex, ey)
        self._set_inputs((*data, self.log_y, self.last_n), data)

    def _draw(self) -> None:
        plt = self.plt
        scope = "all" if self.last_n is None else f"last {self.last_n}"
        plt.title(f"loss ({scope}{', log y' if self.log_y else ''}) · raw + EMA")
        if self._data is not None and len(self._data[0]):
            rx, rlo, rhi, ex, ey = self._data
            _plot_range(plt, rx, rlo, rhi, "gray")
            if len(ex):
                plt.plot(ex.tolist(), ey.tolist(), color="cyan", marker="braille")
            if self.log_y:
                lo = float(np.nanmin(rlo)) if len(rlo) else 0.0
                hi = float(np.nanmax(rhi)) if len(rhi) else 1.0
                plt.yticks(*_log_ticks(lo, hi))


class GradNormChart(CachedPlot):
    """Global grad norm (before clipping), the max_norm line, and clipped steps marked."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.last_n: int | None = None
        self.max_norm: float | None = None

    def update_from(self, series: StepSeries, max_norm: float | None) -> None:
        cols = max(10, self.size.width - AXIS_COLUMNS)
        x, g = window(series.steps, series.col("grad_norm"), self.last_n)
        _, cs = window(series.steps, series.col("clip_scale"), self.last_n)
        gx, glo, ghi = column_ranges(x, g, cols)
        clipped = cs < 1.0
        # Clipped steps: one mark per column is enough to see where clipping happened.
        cx, cy = downsample_minmax(x[clipped], g[clipped], cols // 2 or 1)
        self.max_norm = max_norm
        data = (gx, glo, ghi, cx, cy, int(np.count_nonzero(clipped)))
        self._set_inputs((*data, max_norm, self.last_n), data)

    def _draw(self) -> None:
        plt = self.plt
        title = "grad norm"
        if self._data is not None:
            gx, glo, ghi, cx, cy, n_clipped = self._data
            title += f" · max_norm {fmt_num(self.max_norm)} · clipped steps ✕ {n_clipped}"
            if len(gx):
                _plot_range(plt, gx, glo, ghi, "green")
                if self.max_norm is not None:
                    plt.hline(self.max_norm, color="red")
                if len(cx):
                    plt.scatter(cx.tolist(), cy.tolist(), color="red", marker="x")
        plt.title(title)
