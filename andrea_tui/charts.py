"""Loss and grad-norm charts: textual-plotext (plotext 5.3.2) fed from a StepSeries.

What the user controls (ChartOptions, kept by andrea_tui.settings): log y, a robust y-range (the
1st to 99th percentile of what is shown: one outlier no longer flattens the rest), x by step
(whole-number ticks) or wall time, the window, and the loss smoothing. The loss chart overlays
the validation loss (eval.jsonl); both mark the steps of the engine's alerts with `!`.

The charts only draw what `update_from()` handed them: downsampled (min and max per column) and
windowed in numpy, so a 200k-step history costs the same to draw as a short one. A noisy series
is drawn as two lines, one through each column's min and one through each column's max: every
spike is still drawn, at a fraction of the cost of a zig-zag through both (plotext draws each
segment dot by dot, and a zig-zag's segments span the column's whole range: 60+ ms a build). plotext 5's
log scale re-logs data on every build (plotext #209), so log-y is drawn as log10 values with
tick labels in the original units.

A plotext build costs milliseconds, so each chart builds only when what it would draw changed:
`update_from()` ignores data equal to what is drawn, and the picture is kept while (data, size,
theme) are the same (Textual re-renders widgets for reasons of its own, e.g. when a pushed screen
is popped). The picture goes from plotext's character matrix straight to Textual strips
(CachedPlot), not through plotext's ANSI string. `build_seconds` lets the app budget redraws.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from rich.text import Text
from textual.content import Content, Span
from textual.strip import Strip
from textual.style import Style as TStyle
from textual_plotext import PlotextPlot

from andrea_tui.series import StepSeries, column_ranges, downsample_minmax, window
from andrea_tui.strips import fitting_strip, plain_line, plain_widget
from andrea_tui.textfmt import fmt_num
from engine.records import AlertEvent, EvalRecord

AXIS_COLUMNS = 10  # plotext's y-axis labels and frame take about this many columns
ROBUST_PCT = (1.0, 99.0)  # the robust y-range: these percentiles of what is shown, padded
MARKS_MAX = 40  # alert marks drawn at most (the newest)
LOSS_ALERTS = ("loss_spike", "nonfinite", "stall", "slow")
GRAD_ALERTS = ("grad_spike", "nonfinite")


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


def _log10(y: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(y > 0, np.log10(np.where(y > 0, y, 1.0)), np.nan)


def _int_ticks(lo: float, hi: float, n: int = 5) -> tuple[list[float], list[str]]:
    """Tick positions at whole numbers (steps are integers) between lo and hi."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi < lo:
        return [], []
    ticks = sorted({round(v) for v in np.linspace(lo, hi, n)})
    return [float(v) for v in ticks], [f"{v:,}" if abs(v) < 1e6 else fmt_num(v) for v in ticks]


def _time_ticks(lo: float, hi: float, n: int = 5) -> tuple[list[float], list[str]]:
    """Ticks for an x axis in minutes."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi < lo:
        return [], []
    ticks = list(np.linspace(lo, hi, n)) if hi > lo else [lo]
    if hi >= 120:
        return ticks, [f"{v / 60:.1f}h" for v in ticks]
    return ticks, [f"{v:.1f}m" if hi < 10 else f"{v:.0f}m" for v in ticks]


def _robust_range(*ys: np.ndarray) -> tuple[float, float] | None:
    """A y-range holding the bulk of the values (outliers left outside), or None."""
    vals = np.concatenate([y[np.isfinite(y)] for y in ys]) if ys else np.zeros(0)
    if vals.size < 2:
        return None
    lo, hi = np.percentile(vals, ROBUST_PCT)
    pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 0.05
    return float(lo - pad), float(hi + pad)


def _x_of(series: StepSeries, opts: ChartOptions) -> tuple[np.ndarray, float]:
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


def _mark_x(alerts: list[AlertEvent], kinds: tuple[str, ...], opts: ChartOptions,
            t0: float) -> list[float]:
    out = []
    for a in alerts:
        if a.alert not in kinds:
            continue
        x = (a.t - t0) / 60.0 if opts.by_time else a.step
        if x is not None and math.isfinite(x):
            out.append(float(x))
    return out[-MARKS_MAX:]


def _in_view(xs: list[float], x: np.ndarray) -> list[float]:
    if not len(x):
        return []
    lo, hi = float(np.nanmin(x)), float(np.nanmax(x))
    return [v for v in xs if lo <= v <= hi]


def _axes(plt, opts: ChartOptions, x: np.ndarray, ylo: np.ndarray, yhi: np.ndarray,
          extra_y: tuple[np.ndarray, ...] = ()) -> tuple[float, float] | None:
    """x ticks (whole steps, or minutes), log-y tick labels and the robust y-range; returns
    the y-range drawn when it is set by hand."""
    if len(x):
        lo, hi = float(np.nanmin(x)), float(np.nanmax(x))
        plt.xticks(*(_time_ticks(lo, hi) if opts.by_time else _int_ticks(lo, hi)))
    yr = _robust_range(ylo, yhi, *extra_y) if opts.robust_y else None
    if yr is not None:
        plt.ylim(*yr)
    if opts.log_y:
        lo = yr[0] if yr else float(np.nanmin(ylo)) if len(ylo) else 0.0
        hi = yr[1] if yr else float(np.nanmax(yhi)) if len(yhi) else 1.0
        plt.yticks(*_log_ticks(lo, hi))
    return yr


def _marks(plt, xs: list[float], top: float) -> None:
    """Alert marks: a `!` at the top of the plot at each alert's x."""
    if xs:
        plt.scatter(xs, [top] * len(xs), color="red+", marker="!")


def _scope(opts: ChartOptions) -> str:
    parts = ["all" if opts.last_n is None else f"last {opts.last_n}"]
    if opts.log_y:
        parts.append("log y")
    if opts.robust_y:
        parts.append("robust y")
    if opts.by_time:
        parts.append("x: time")
    return ", ".join(parts)


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


# what reading plotext's internals raises when they are not as plotext 5.3.2 has them
PLOTEXT_INTERNALS = (AttributeError, TypeError, IndexError, KeyError, ImportError)


class CachedPlot(PlotextPlot):
    """A PlotextPlot that builds only when its inputs, size or theme changed, and draws plotext's
    character matrix straight into strips (a row drawn as before keeps its strip).

    PlotextPlot renders plotext's ANSI string, which Rich then parses back into a Text and
    Textual splits and styles line by line: half of a build's cost, measured (5-6 of 11 ms a
    chart at 140x45, and the largest share of the dashboard's CPU while following a run). Here
    each row of the matrix becomes one Content (a span per run of one colour: each colour's
    style is converted once, through the same ANSI -> Rich -> Textual path) and is drawn as
    Textual draws a line that fits (strips.fitting_strip): the same strips, at a fraction of
    the cost. Rows that would not fit, and a text selection, take Textual's own path (`render`).
    """

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._data: tuple | None = None
        self._inputs: tuple | None = None  # everything the picture depends on besides size
        self._data_version = 0
        self._canvas_key: tuple | None = None  # what the plotext matrix was built for
        self._canvas: Text | None = None  # the matrix as Rich Text (built only when asked for)
        self._rows: list[Content] = []  # the matrix, one Content per row (top first)
        self._strips_key: tuple | None = None
        self._strips: list[Strip] | None = None  # None: a row does not fit (Textual's path)
        self._strip_rows: list[tuple] = []  # (y, text, spans) each strip was drawn from
        self._styles: dict[tuple, TStyle | None] = {}  # plotext (fg, style, bg) -> its style
        # False once plotext's internals (the matrix and its helpers, plotext 5.3.2, the
        # version pyproject pins) were not as this class reads them: PlotextPlot draws instead
        self._matrix_ok = True
        self.build_seconds = 0.0  # cost of the last build (plotext + strips)

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

    def _build(self) -> bool:
        """Build plotext's matrix for the current data, size and theme (unless it is built);
        True if it was built now."""
        key = (self._data_version, self.size, self.app.theme, self.theme)
        if key == self._canvas_key:
            return False
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        self._draw()
        # What PlotextPlot.render does before plotext's build(), which would also write the
        # ANSI string (matrix.set_canvas): that is left for `render`, when it is asked for.
        width, height = self.size
        plt.plotsize(width, height)
        plt._set_size(width, height)
        plt.theme(self._get_plotext_theme_name(self.app.theme))
        plt._set_sizes()
        plt._build_matrix()
        self._rows = self._matrix_rows()
        self._canvas_key, self._canvas = key, None  # the strips' key holds this one
        return True

    def _matrix_rows(self) -> list[Content]:
        """plotext's matrix (rows bottom first) as one Content per row, top first."""
        m = self.plt.monitor.matrix
        rows = []
        for r in reversed(m.Rows):
            marker, fg, st, bg = m.marker[r], m.fullground[r], m.style[r], m.background[r]
            spans, start, n = [], 0, len(marker)
            for c in range(1, n + 1):
                if c == n or fg[c] != fg[start] or st[c] != st[start] or bg[c] != bg[start]:
                    style = self._style_of(fg[start], st[start], bg[start])
                    if style is not None:
                        spans.append(Span(start, c, style))
                    start = c
            rows.append(Content("".join(marker), spans))
        return rows

    def _style_of(self, fg: object, st: object, bg: object) -> TStyle | None:
        """The Textual style of a cell of plotext colours (fullground, style, background): what
        PlotextPlot's path (plotext's ANSI codes, Text.from_ansi, Content.from_rich_text) gives
        it, worked out once per colour."""
        key = tuple(tuple(c) if isinstance(c, list) else c for c in (fg, st, bg))
        if key not in self._styles:
            from plotext import _utility  # plotext's own colour codes (a private module)

            ansi = _utility.colors_to_ansi(fg, st, bg)
            text = Text.from_ansi(f"{ansi}x{_utility.ansi_end}" if ansi else "x")
            spans = Content.from_rich_text(text, console=self.app.console).spans
            self._styles[key] = spans[0].style if spans else None  # type: ignore[assignment]
        return self._styles[key]

    def _give_up_matrix(self, e: Exception) -> None:
        self._matrix_ok = False
        self._canvas_key = self._strips_key = self._strips = None
        self.app.log.warning(f"chart {self.id}: plotext's matrix is not as plotext 5.3.2 has "
                             f"it ({type(e).__name__}: {e}); drawn through PlotextPlot")

    def _picture(self) -> list[Strip] | None:
        """The rows as strips, built when stale; None where Textual's own path must draw them
        (a row that does not fit, or a text selection)."""
        if not plain_widget(self) or not self._matrix_ok:
            return None
        try:
            return self._strips_of_matrix()
        except PLOTEXT_INTERNALS as e:
            self._give_up_matrix(e)
            return None

    def _strips_of_matrix(self) -> list[Strip] | None:
        t0 = time.perf_counter()
        built = self._build()
        width, style = self.size.width, self.visual_style
        key = (self._canvas_key, width, style)
        if key != self._strips_key:
            # A row drawn the same as before keeps its strip: following a long run, a redraw
            # changes 1-3 rows of 15 (an axis label, the newest column), measured at 200k steps.
            old: dict[tuple, Strip] = {}
            if self._strips is not None and self._strips_key is not None \
                    and self._strips_key[1:] == key[1:]:
                old = dict(zip(self._strip_rows, self._strips, strict=True))
            self._strips_key = key
            self._strips = None
            self._strip_rows = [(y, row.plain, tuple(row.spans))
                                for y, row in enumerate(self._rows)]
            if all(row.cell_length <= width and plain_line(row) for row in self._rows):
                self._strips = [old.get(k) or fitting_strip(self, row, k[0], style)
                                for k, row in zip(self._strip_rows, self._rows, strict=True)]
        if built:
            self.build_seconds = time.perf_counter() - t0
        return self._strips

    def render_line(self, y: int) -> Strip:
        strips = self._picture()
        if strips is None:
            return super().render_line(y)  # through `render`
        if y < len(strips):
            return strips[y]
        return Strip.blank(self.size.width, self.visual_style.rich_style)

    def render(self) -> Text:
        """The picture as Rich Text: Textual's path (text selection, rows that do not fit)."""
        if self._matrix_ok:
            t0 = time.perf_counter()
            try:
                built = self._build()
                if self._canvas is None:
                    self._canvas = Text.from_ansi(self.plt.monitor.matrix.set_canvas())
                if built:
                    self.build_seconds = time.perf_counter() - t0
                return self._canvas
            except PLOTEXT_INTERNALS as e:
                self._give_up_matrix(e)
        plt = self.plt  # PlotextPlot's own path: the plot drawn again, then plotext's build
        plt.clear_data()
        plt.clear_figure()
        self._draw()
        return super().render()  # type: ignore[return-value]


class LossChart(CachedPlot):
    """Raw loss (dim), its debiased EMA, the validation loss (yellow) and alert marks (`!`)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.opts = ChartOptions()
        self.smoothing = 0.9

    def update_from(self, series: StepSeries, evals: list[EvalRecord] | None = None,
                    alerts: list[AlertEvent] | None = None) -> None:
        opts = self.opts
        cols = max(10, self.size.width - AXIS_COLUMNS)
        xall, t0 = _x_of(series, opts)
        x, y = window(xall, series.col("loss"), opts.last_n)
        _, e = window(xall, series.ema(), opts.last_n)
        _, steps = window(xall, series.steps, opts.last_n)
        vx, vy = np.zeros(0), np.zeros(0)
        if evals and len(steps):
            first = int(steps[0])
            shown = [v for v in evals if v.step >= first and math.isfinite(v.val_loss)]
            vx = np.array([(v.t - t0) / 60.0 if opts.by_time else v.step for v in shown],
                          dtype=float)
            vy = np.array([v.val_loss for v in shown], dtype=float)
        if opts.log_y:
            y, e, vy = _log10(y), _log10(e), _log10(vy)
        rx, rlo, rhi = column_ranges(x, y, cols)
        ex, ey = downsample_minmax(x, e, cols)  # smooth: its zig-zag is short and cheap
        vx, vy = downsample_minmax(vx, vy, cols) if len(vx) > 2 * cols else (vx, vy)
        marks = np.array(_in_view(_mark_x(list(alerts or []), LOSS_ALERTS, opts, t0), x))
        data = (rx, rlo, rhi, ex, ey, vx, vy, marks)
        self._set_inputs((*data, opts, self.smoothing), data)

    def _draw(self) -> None:
        plt = self.plt
        smooth = f"EMA {self.smoothing:g}" if self.smoothing else "no smoothing"
        title = f"loss ({_scope(self.opts)}) · raw + {smooth}"
        if self._data is not None and len(self._data[0]):
            rx, rlo, rhi, ex, ey, vx, vy, marks = self._data
            _plot_range(plt, rx, rlo, rhi, "gray")
            if len(ex) and self.smoothing:
                plt.plot(ex.tolist(), ey.tolist(), color="cyan", marker="braille")
            if len(vx):
                plt.scatter(vx.tolist(), vy.tolist(), color="yellow", marker="dot")
                title += " · val ●"
            yr = _axes(plt, self.opts, rx, rlo, rhi, (vy,))
            if len(marks):
                top = yr[1] if yr else float(np.nanmax(np.concatenate([rhi, vy])))
                _marks(plt, marks.tolist(), top)
                title += f" · alerts ! {len(marks)}"
        plt.title(title)


class GradNormChart(CachedPlot):
    """Global grad norm (before clipping), the clip threshold, clipped steps (✕) and grad-norm
    alerts (`!`)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.opts = ChartOptions()
        self.max_norm: float | None = None

    def update_from(self, series: StepSeries, max_norm: float | None,
                    alerts: list[AlertEvent] | None = None) -> None:
        opts = self.opts
        cols = max(10, self.size.width - AXIS_COLUMNS)
        xall, t0 = _x_of(series, opts)
        x, g = window(xall, series.col("grad_norm"), opts.last_n)
        _, cs = window(xall, series.col("clip_scale"), opts.last_n)
        clipped = cs < 1.0
        n_clipped = int(np.count_nonzero(clipped))
        line = max_norm
        if opts.log_y:
            g = _log10(g)
            line = math.log10(max_norm) if max_norm else None
        gx, glo, ghi = column_ranges(x, g, cols)
        # Clipped steps: one mark per column is enough to see where clipping happened.
        cx, cy = downsample_minmax(x[clipped], g[clipped], cols // 2 or 1)
        marks = np.array(_in_view(_mark_x(list(alerts or []), GRAD_ALERTS, opts, t0), x))
        self.max_norm = max_norm
        data = (gx, glo, ghi, cx, cy, n_clipped, line, marks)
        self._set_inputs((*data, max_norm, opts), data)

    def _draw(self) -> None:
        plt = self.plt
        title = f"grad norm ({_scope(self.opts)})"
        if self._data is not None:
            gx, glo, ghi, cx, cy, n_clipped, line, marks = self._data
            title += f" · clip at {fmt_num(self.max_norm)} · clipped steps ✕ {n_clipped}"
            if len(gx):
                _plot_range(plt, gx, glo, ghi, "green")
                if line is not None:
                    plt.hline(line, color="red")
                if len(cx):
                    plt.scatter(cx.tolist(), cy.tolist(), color="red", marker="x")
                yr = _axes(plt, self.opts, gx, glo, ghi)
                if len(marks):
                    _marks(plt, marks.tolist(), yr[1] if yr else float(np.nanmax(ghi)))
                    title += f" · alerts ! {len(marks)}"
        plt.title(title)
