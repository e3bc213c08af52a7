"""The dashboard's charts: loss, grad norm and learning rate, fed from a StepSeries.

Each chart draws only what `update_from()` handed it: windowed and downsampled in numpy (min and
max per column), so a 200k-step history costs the same to draw as a short one. The loss chart
draws the raw loss, its EMA (the smoothing the user chose) and the validation loss (eval.jsonl)
on its own axes, on a robust y-range if asked (the 1st to 99th percentile of what is shown). The
grad-norm axis is robust by default (ticks.grad_range): it reaches the top of the bulk of the
data, never a clip line far beyond it; what lies above is drawn on the top edge (`▲`) and counted
in the title; the clip line is drawn when it is inside that range or near it (within
ticks.CLIP_NEAR times its top), else the title says `clip 1.00e9 off scale`; log y (`g`) shows
the whole range. Both mark the steps of the engine's alerts with `!`. The learning-rate chart
marks resumes (a vertical line: a resume that moved the lr shows as a jump there) and
evaluations (`·` along the bottom), and is shown only where its column has room. Axes, marks,
titles and colours are andrea_tui.chartparts; building and drawing is andrea_tui.plotcache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from andrea_tui.chartparts import (
    AXIS_COLUMNS,
    ChartOptions,
    alert_x,
    clamped,
    draw_edges,
    draw_marks,
    event_x,
    fit_title,
    in_view,
    log10_positive,
    plot_range,
    scope_label,
    set_axes,
    x_values,
)
from andrea_tui.plotcache import CachedPlot
from andrea_tui.series import StepSeries, column_ranges, downsample_minmax, window
from andrea_tui.textfmt import fmt_grad, fmt_lr
from andrea_tui.ticks import full_range, grad_range, percentile_range
from engine.records import AlertEvent, EvalRecord, ResumeEvent

LOSS_ALERTS = ("loss_spike", "diverging", "nonfinite", "stall", "slow")
GRAD_ALERTS = ("grad_spike", "nonfinite")


class ColumnChart(CachedPlot):
    """A chart of the dashboard's chart column, above the learning-rate chart."""

    def column_resized(self) -> None:
        """The column changed height: a learning-rate chart in it is shown only where it leaves
        the others room (LrChart.fit; its own size does not tell, as it has none while
        hidden)."""
        column = self.parent
        if column is not None:
            for lr in column.query_children(LrChart):
                lr.fit(column.size.height)


class LossChart(ColumnChart):
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
        xall, t0 = x_values(series, opts)
        x, y = window(xall, series.col("loss"), opts.last_n)
        _, e = window(xall, series.ema(), opts.last_n)
        _, steps = window(xall, series.steps, opts.last_n)
        vx, vy = np.zeros(0), np.zeros(0)
        if evals and len(steps):
            first = int(steps[0])
            shown = [v for v in evals if v.step >= first and math.isfinite(v.val_loss)]
            pts = [(x, v.val_loss) for v in shown for x in event_x([v], opts, t0)]
            vx = np.array([p[0] for p in pts], dtype=float)
            vy = np.array([p[1] for p in pts], dtype=float)
        if opts.log_y:
            y, e, vy = log10_positive(y), log10_positive(e), log10_positive(vy)
        rx, rlo, rhi = column_ranges(x, y, cols)
        ex, ey = downsample_minmax(x, e, cols)  # smooth: its zig-zag is short and cheap
        vx, vy = downsample_minmax(vx, vy, cols) if len(vx) > 2 * cols else (vx, vy)
        yr = (percentile_range(np.concatenate([y, vy])) if opts.robust_y
              else full_range(rlo, rhi, ey, vy))
        marks = np.array(in_view(alert_x(list(alerts or []), LOSS_ALERTS, opts, t0), x))
        data = (rx, rlo, rhi, ex, ey, vx, vy, yr, marks)
        self._set_inputs((*data, opts, self.smoothing), data)

    def _draw(self) -> None:
        plt, c = self.plt, self.colors
        label_cols = 0
        smooth = f"EMA {self.smoothing:g}" if self.smoothing else "no smoothing"
        parts = [(f"loss ({scope_label(self.opts)})", "loss"),
                 (f"raw + {smooth}", smooth if self.smoothing else "raw")]
        if self._data is not None and len(self._data[0]) and self._data[7] is not None:
            rx, rlo, rhi, ex, ey, vx, vy, yr, marks = self._data
            plot_range(plt, rx, clamped(rlo, yr), clamped(rhi, yr), c["raw"])
            if len(ex) and self.smoothing:
                plt.plot(ex.tolist(), clamped(ey, yr).tolist(), color=c["ema"],
                         marker="braille")
            if len(vx):
                plt.scatter(vx.tolist(), clamped(vy, yr).tolist(), color=c["val"],
                            marker="●")
                parts.append(("val ●", "val ●"))
            draw_edges(plt, rx, rhi, rlo, yr, c["edge"])
            label_cols = set_axes(plt, rx, yr, self.opts, self.size)
            if yr.above:
                parts.append((f"{yr.above} above ▲", f"▲{yr.above}"))
            if yr.below:
                parts.append((f"{yr.below} below ▼", f"▼{yr.below}"))
            if len(marks):
                draw_marks(plt, marks.tolist(), yr.hi, c["alert"])
                parts.append((f"alerts ! {len(marks)}", f"!{len(marks)}"))
        plt.title(fit_title(parts, self.size.width - label_cols))


class GradNormChart(ColumnChart):
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
        xall, t0 = x_values(series, opts)
        x, g = window(xall, series.col("grad_norm"), opts.last_n)
        _, cs = window(xall, series.col("clip_scale"), opts.last_n)
        clipped = cs < 1.0
        n_clipped = int(np.count_nonzero(clipped))
        line = max_norm
        if opts.log_y:
            g = log10_positive(g)
            line = math.log10(max_norm) if max_norm else None
        gx, glo, ghi = column_ranges(x, g, cols)
        yr = grad_range(g, glo, ghi, line, log=opts.log_y)
        # Clipped steps: one mark per column is enough to see where clipping happened.
        cx, cy = downsample_minmax(x[clipped], g[clipped], cols // 2 or 1)
        marks = np.array(in_view(alert_x(list(alerts or []), GRAD_ALERTS, opts, t0), x))
        self.max_norm = max_norm
        data = (gx, glo, ghi, cx, cy, n_clipped, yr, marks)
        self._set_inputs((*data, max_norm, opts), data)

    def _draw(self) -> None:
        plt, c = self.plt, self.colors
        label_cols = 0
        scope = scope_label(self.opts, robust=not self.opts.log_y)
        parts = [(f"grad norm ({scope})", "grad norm")]
        if self._data is not None:
            gx, glo, ghi, cx, cy, n_clipped, yr, marks = self._data
            clip = fmt_grad(self.max_norm).strip()
            if yr is not None and yr.line_off_scale:
                parts.append((f"clip {clip} off scale", f"clip {clip} off"))
            else:
                parts.append((f"clip {clip}", f"clip {clip}"))
            parts.append((f"clipped ✕ {n_clipped}", f"✕{n_clipped}"))
            if len(gx) and yr is not None:
                plot_range(plt, gx, clamped(glo, yr), clamped(ghi, yr), c["grad"])
                if yr.line is not None:
                    plt.hline(yr.line, color=c["clip"])
                if len(cx):
                    plt.scatter(cx.tolist(), clamped(cy, yr).tolist(), color=c["clip"],
                                marker="x")
                draw_edges(plt, gx, ghi, glo, yr, c["edge"])
                label_cols = set_axes(plt, gx, yr, self.opts, self.size)
                if yr.above:
                    parts.append((f"{yr.above} above ▲", f"▲{yr.above}"))
                if len(marks):
                    draw_marks(plt, marks.tolist(), yr.hi, c["alert"])
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
        xall, t0 = x_values(series, opts)
        x, lr = window(xall, series.col("lr"), opts.last_n)
        lx, llo, lhi = column_ranges(x, lr, cols)
        yr = full_range(llo, lhi)
        rx = np.array(in_view(event_x(list(resumes), opts, t0), x))
        ex = np.array(in_view(event_x(list(evals), opts, t0), x))
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
            plot_range(plt, lx, llo, lhi, c["lr"])
            for x in rx.tolist():
                plt.vline(x, color=c["resume"])
            if len(rx):
                parts.append((f"resumes │ {len(rx)}", f"│{len(rx)}"))
            if len(ex):
                plt.scatter(ex.tolist(), [yr.lo] * len(ex), color=c["eval"], marker="·")
                parts.append((f"evals · {n_evals}", f"·{n_evals}"))
            label_cols = set_axes(plt, lx, yr, ChartOptions(x_axis=self.opts.x_axis), self.size)
        plt.title(fit_title(parts, self.size.width - label_cols))
