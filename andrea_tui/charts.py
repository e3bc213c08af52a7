"""Loss, grad-norm and learning-rate charts: textual-plotext (plotext 5.3.2) fed from a StepSeries.

What the user controls (ChartOptions, kept by andrea_tui.settings): log y, a robust y-range for
the loss (the 1st to 99th percentile of what is shown), x by step or wall time, the window, and
the loss smoothing. The loss chart overlays the validation loss (eval.jsonl) on its own axes;
the loss and grad-norm charts mark the steps of the engine's alerts with `!`.

Axes: ticks at round values (andrea_tui.ticks: 1-2-5 steps, SI suffixes for steps, whole
minutes or hours for wall time), one label format per axis. The grad-norm axis is robust by
default (ticks.grad_range): it reaches the top of the bulk of the data (the columns' maxima
below their median + 8 robust deviations), never a clip line far beyond the data; what lies
above is drawn on the top edge (`▲`) and counted in the title; the clip line is drawn when it
is inside that range or near it (within ticks.CLIP_NEAR times its top), else the title says
`clip 1.00e9 off scale`. Log y (`g`) shows the whole range. The learning-rate chart marks
resumes (a vertical line: a resume that moved the lr shows as a jump there) and evaluations
(`·` along the bottom).

Colours: the charts' frame, titles and tick labels take the app theme's foreground on its
surface; the ANSI themes (whose colours are the terminal's own) leave them to the terminal.
The lines take a palette for dark or light backgrounds.

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
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from plotext._dict import themes as plotext_themes
from rich.text import Text
from textual import events
from textual.color import Color
from textual.content import Content, Span
from textual.strip import Strip
from textual.style import Style as TStyle
from textual_plotext import PlotextPlot

from andrea_tui import ticks
from andrea_tui.series import StepSeries, column_ranges, downsample_minmax, window
from andrea_tui.strips import fitting_strip, plain_line, plain_widget
from andrea_tui.textfmt import fmt_grad, fmt_lr
from andrea_tui.ticks import YRange, full_range, grad_range, percentile_range
from engine.records import AlertEvent, EvalRecord, ResumeEvent

AXIS_COLUMNS = 10  # plotext's y-axis labels and frame take about this many columns
MARKS_MAX = 40  # alert marks drawn at most (the newest)
LOSS_ALERTS = ("loss_spike", "diverging", "nonfinite", "stall", "slow")
GRAD_ALERTS = ("grad_spike", "nonfinite")
X_TICK_COLUMNS = 12  # columns per x tick label (a label and the gap to the next)
Y_TICK_ROWS = 3  # rows per y tick

# Line colours for dark and light backgrounds (plotext colours: names, or RGB on light ones).
DARK = {"raw": "gray", "ema": "cyan", "val": "yellow", "grad": "green", "clip": "red",
        "alert": "red+", "edge": "magenta+", "lr": "blue+", "resume": "magenta",
        "eval": "yellow"}
LIGHT = {"raw": (150, 150, 150), "ema": (0, 110, 170), "val": (190, 105, 0),
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


def _log10(y: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(y > 0, np.log10(np.where(y > 0, y, 1.0)), np.nan)


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


def _event_x(events: Sequence[object], opts: ChartOptions, t0: float) -> list[float]:
    """The x of events with a step and a time (alerts, resumes, evaluations)."""
    out = []
    for e in events:
        x = (e.t - t0) / 60.0 if opts.by_time else e.step  # type: ignore[attr-defined]
        if x is not None and math.isfinite(x):
            out.append(float(x))
    return out


def _mark_x(alerts: list[AlertEvent], kinds: tuple[str, ...], opts: ChartOptions,
            t0: float) -> list[float]:
    return _event_x([a for a in alerts if a.alert in kinds], opts, t0)[-MARKS_MAX:]


def _in_view(xs: list[float], x: np.ndarray) -> list[float]:
    if not len(x):
        return []
    lo, hi = float(np.nanmin(x)), float(np.nanmax(x))
    return [v for v in xs if lo <= v <= hi]


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


def _axes(plt, x: np.ndarray, yr: YRange, opts: ChartOptions, size: tuple[int, int]) -> int:
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


def _clamped(y: np.ndarray, yr: YRange) -> np.ndarray:
    return np.clip(y, yr.lo, yr.hi)


def _edges(plt, x: np.ndarray, hi: np.ndarray, lo: np.ndarray, yr: YRange, color) -> None:
    """Columns with points above (below) the range: `▲` on the top (`▼` on the bottom) edge."""
    up, down = x[hi > yr.hi], x[lo < yr.lo]
    if len(up):
        plt.scatter(up.tolist(), [yr.hi] * len(up), color=color, marker="▲")
    if len(down):
        plt.scatter(down.tolist(), [yr.lo] * len(down), color=color, marker="▼")


def _marks(plt, xs: list[float], top: float, color) -> None:
    """Alert marks: a `!` at the top of the plot at each alert's x."""
    if xs:
        plt.scatter(xs, [top] * len(xs), color=color, marker="!")


def _scope(opts: ChartOptions, robust: bool | None = None) -> str:
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


def _plot_range(plt, x: np.ndarray, lo: np.ndarray, hi: np.ndarray, color) -> None:
    """Per-column max as a line, and per-column min as a second one where it differs."""
    plt.plot(x.tolist(), hi.tolist(), color=color, marker="braille")
    if not np.array_equal(lo, hi):
        plt.plot(x.tolist(), lo.tolist(), color=color, marker="braille")


def _plotext_color(value: str) -> str | tuple[int, int, int]:
    """A theme colour (a Textual CSS value) as plotext takes it: RGB, or `default` (the
    terminal's own) for ANSI colours and transparency, which have no RGB of their own."""
    color = Color.parse(value)
    if color.ansi is not None or color.a < 1.0:
        return "default"
    return color.rgb


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
        self._again: Callable[[], None] | None = None  # the last update_from, to run again

    # ------------------------------------------------------------ theme

    def _register_theme(self, app_theme_name: str) -> None:
        """A theme change (PlotextPlot subscribes to it): the next build takes the new one."""
        self.refresh()

    def _get_plotext_theme_name(self, app_theme_name: str) -> str:
        """The plotext theme for the app theme: frame, titles and ticks in the theme's
        foreground on its surface (registered with plotext the first time)."""
        if self.theme != "auto":
            return self.theme
        name = f"andrea-{app_theme_name}"
        if name not in plotext_themes:
            theme = self.app.get_theme(app_theme_name)
            colors = theme.to_color_system().generate() if theme else {}
            surface = _plotext_color(colors.get("surface", "transparent"))
            foreground = _plotext_color(colors.get("foreground", "ansi_default"))
            plotext_themes[name] = [surface, surface, foreground, "default",
                                    list(plotext_themes["default"][4])]
        return name

    @property
    def colors(self) -> dict[str, str | tuple[int, int, int]]:
        """The line colours for the app theme: names (the terminal's own colours on ANSI
        themes), RGB on a light background."""
        fg = self.app.theme_variables.get("foreground")
        ansi = fg is not None and Color.parse(fg).ansi is not None
        return DARK if self.app.current_theme.dark or ansi else LIGHT

    def on_resize(self, event: events.Resize) -> None:
        """A new size: the data again for its width (the columns it is downsampled to), at
        once rather than at the app's next redraw. And the chart column changed height: a
        learning-rate chart in it is shown only where it leaves the others room (LrChart.fit;
        its own size does not tell, as it has none while hidden)."""
        if self._again is not None:
            self._again()
        column = self.parent
        if column is not None and not isinstance(self, LrChart):
            for lr in column.query_children(LrChart):
                lr.fit(column.size.height)

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
        if self._canvas_key is not None and self._canvas_key[2:] != key[2:]:
            self._styles.clear()  # colours convert for the theme they are drawn in
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
    """Raw loss (dim), its debiased EMA, the validation loss on the same axes (`●`), and alert
    marks (`!`)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.opts = ChartOptions()
        self.smoothing = 0.9

    def update_from(self, series: StepSeries, evals: list[EvalRecord] | None = None,
                    alerts: list[AlertEvent] | None = None) -> None:
        self._again = lambda: self.update_from(series, evals, alerts)
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
            pts = [(x, v.val_loss) for v in shown for x in _event_x([v], opts, t0)]
            vx = np.array([p[0] for p in pts], dtype=float)
            vy = np.array([p[1] for p in pts], dtype=float)
        if opts.log_y:
            y, e, vy = _log10(y), _log10(e), _log10(vy)
        rx, rlo, rhi = column_ranges(x, y, cols)
        ex, ey = downsample_minmax(x, e, cols)  # smooth: its zig-zag is short and cheap
        vx, vy = downsample_minmax(vx, vy, cols) if len(vx) > 2 * cols else (vx, vy)
        yr = (percentile_range(np.concatenate([y, vy])) if opts.robust_y
              else full_range(rlo, rhi, ey, vy))
        marks = np.array(_in_view(_mark_x(list(alerts or []), LOSS_ALERTS, opts, t0), x))
        data = (rx, rlo, rhi, ex, ey, vx, vy, yr, marks)
        self._set_inputs((*data, opts, self.smoothing), data)

    def _draw(self) -> None:
        plt, c = self.plt, self.colors
        label_cols = 0
        smooth = f"EMA {self.smoothing:g}" if self.smoothing else "no smoothing"
        parts = [(f"loss ({_scope(self.opts)})", "loss"),
                 (f"raw + {smooth}", smooth if self.smoothing else "raw")]
        if self._data is not None and len(self._data[0]) and self._data[7] is not None:
            rx, rlo, rhi, ex, ey, vx, vy, yr, marks = self._data
            _plot_range(plt, rx, _clamped(rlo, yr), _clamped(rhi, yr), c["raw"])
            if len(ex) and self.smoothing:
                plt.plot(ex.tolist(), _clamped(ey, yr).tolist(), color=c["ema"],
                         marker="braille")
            if len(vx):
                plt.scatter(vx.tolist(), _clamped(vy, yr).tolist(), color=c["val"],
                            marker="●")
                parts.append(("val ●", "val ●"))
            _edges(plt, rx, rhi, rlo, yr, c["edge"])
            label_cols = _axes(plt, rx, yr, self.opts, self.size)
            if yr.above:
                parts.append((f"{yr.above} above ▲", f"▲{yr.above}"))
            if yr.below:
                parts.append((f"{yr.below} below ▼", f"▼{yr.below}"))
            if len(marks):
                _marks(plt, marks.tolist(), yr.hi, c["alert"])
                parts.append((f"alerts ! {len(marks)}", f"!{len(marks)}"))
        plt.title(fit_title(parts, self.size.width - label_cols))


class GradNormChart(CachedPlot):
    """Global grad norm (before clipping) on a robust axis (grad_range; log y shows it all),
    the clip threshold when it is on scale, clipped steps (✕), points above the axis (▲ on the
    top edge) and grad-norm alerts (`!`)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.opts = ChartOptions()
        self.max_norm: float | None = None

    def update_from(self, series: StepSeries, max_norm: float | None,
                    alerts: list[AlertEvent] | None = None) -> None:
        self._again = lambda: self.update_from(series, max_norm, alerts)
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
        yr = grad_range(g, glo, ghi, line, log=opts.log_y)
        # Clipped steps: one mark per column is enough to see where clipping happened.
        cx, cy = downsample_minmax(x[clipped], g[clipped], cols // 2 or 1)
        marks = np.array(_in_view(_mark_x(list(alerts or []), GRAD_ALERTS, opts, t0), x))
        self.max_norm = max_norm
        data = (gx, glo, ghi, cx, cy, n_clipped, yr, marks)
        self._set_inputs((*data, max_norm, opts), data)

    def _draw(self) -> None:
        plt, c = self.plt, self.colors
        label_cols = 0
        parts = [(f"grad norm ({_scope(self.opts, robust=not self.opts.log_y)})", "grad norm")]
        if self._data is not None:
            gx, glo, ghi, cx, cy, n_clipped, yr, marks = self._data
            clip = fmt_grad(self.max_norm).strip()
            if yr is not None and yr.line_off_scale:
                parts.append((f"clip {clip} off scale", f"clip {clip} off"))
            else:
                parts.append((f"clip {clip}", f"clip {clip}"))
            parts.append((f"clipped ✕ {n_clipped}", f"✕{n_clipped}"))
            if len(gx) and yr is not None:
                _plot_range(plt, gx, _clamped(glo, yr), _clamped(ghi, yr), c["grad"])
                if yr.line is not None:
                    plt.hline(yr.line, color=c["clip"])
                if len(cx):
                    plt.scatter(cx.tolist(), _clamped(cy, yr).tolist(), color=c["clip"],
                                marker="x")
                _edges(plt, gx, ghi, glo, yr, c["edge"])
                label_cols = _axes(plt, gx, yr, self.opts, self.size)
                if yr.above:
                    parts.append((f"{yr.above} above ▲", f"▲{yr.above}"))
                if len(marks):
                    _marks(plt, marks.tolist(), yr.hi, c["alert"])
                    parts.append((f"alerts ! {len(marks)}", f"!{len(marks)}"))
        plt.title(fit_title(parts, self.size.width - label_cols))


class LrChart(CachedPlot):
    """The learning rate by step (or wall time), with resume marks (a vertical line each: a
    resume that moved the lr is a jump at its line) and evaluation marks (`·` on the bottom)."""

    HEIGHT = 7
    DEFAULT_CSS = f"LrChart {{ height: {HEIGHT}; }}"
    SHOW_FROM = 2 * 9 + HEIGHT  # rows its column needs to leave the charts above 9 rows each

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.opts = ChartOptions()

    def fit(self, column_rows: int) -> bool:
        """Shown only where its column (of `column_rows`) leaves the charts above it room
        enough; True when that changed (the charts above then have another size)."""
        show = column_rows >= self.SHOW_FROM
        if show == self.display:
            return False
        self.display = show
        return True

    def update_from(self, series: StepSeries, resumes: Sequence[ResumeEvent] = (),
                    evals: Sequence[EvalRecord] = ()) -> None:
        self._again = lambda: self.update_from(series, resumes, evals)
        opts = ChartOptions(False, False, self.opts.x_axis, self.opts.last_n)
        # hidden, it has no width: its column's (it fills it) is what it will have
        width = self.size.width or (self.parent.size.width if self.parent else 0)
        cols = max(10, width - AXIS_COLUMNS)
        xall, t0 = _x_of(series, opts)
        x, lr = window(xall, series.col("lr"), opts.last_n)
        lx, llo, lhi = column_ranges(x, lr, cols)
        yr = full_range(llo, lhi)
        rx = np.array(_in_view(_event_x(list(resumes), opts, t0), x))
        ex = np.array(_in_view(_event_x(list(evals), opts, t0), x))
        n_evals = len(ex)
        if len(ex) > cols:  # about one mark per column is all the columns can show
            ex = ex[np.linspace(0, len(ex) - 1, cols).astype(np.int64)]
        finite = lr[np.isfinite(lr)]
        now = float(finite[-1]) if len(finite) else math.nan
        data = (lx, llo, lhi, rx, ex, n_evals, now, yr)
        self._set_inputs((*data, opts), data)

    def _draw(self) -> None:
        plt, c = self.plt, self.colors
        label_cols = 0
        scope = "all" if self.opts.last_n is None else f"last {self.opts.last_n}"
        parts = [(f"learning rate ({scope})", "lr")]
        if self._data is not None and self._data[-1] is not None and len(self._data[0]):
            lx, llo, lhi, rx, ex, n_evals, now, yr = self._data
            parts.append((f"now {fmt_lr(now).strip()}", fmt_lr(now).strip()))
            _plot_range(plt, lx, llo, lhi, c["lr"])
            for x in rx.tolist():
                plt.vline(x, color=c["resume"])
            if len(rx):
                parts.append((f"resumes │ {len(rx)}", f"│{len(rx)}"))
            if len(ex):
                plt.scatter(ex.tolist(), [yr.lo] * len(ex), color=c["eval"], marker="·")
                parts.append((f"evals · {n_evals}", f"·{n_evals}"))
            label_cols = _axes(plt, lx, yr, ChartOptions(x_axis=self.opts.x_axis), self.size)
        plt.title(fit_title(parts, self.size.width - label_cols))
