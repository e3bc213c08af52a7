"""The overlay of several runs: one metric against step, tokens or wall time, smoothed or raw, a
legend, and the settings in which their configs differ. `andrea-tui compare RUN RUN ...`, or `v`
in the runs browser on the marked runs. The histories load in a thread worker
(compare.load_curves); `e` writes the overlay's CSV and PNG (compare_export) in a thread too."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
from rich.text import Text
from textual import events, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from andrea_tui import compare_export
from andrea_tui import settings as user_settings
from andrea_tui.chartparts import AXIS_COLUMNS, LIGHT, x_ticks, y_ticks
from andrea_tui.compare import (
    METRICS,
    XAXES,
    RunCurves,
    column_means,
    config_rows,
    load_curves,
    run_labels,
)
from andrea_tui.plotcache import CachedPlot
from andrea_tui.textfmt import fmt_metric
from andrea_tui.ticks import full_range
from engine.errors import UserError

# Each run's colour: plotext's on a dark background with the Rich style that looks the same in
# the legend, and RGB ones for a light background.
COLORS = (("cyan", "cyan"), ("orange", "dark_orange"), ("green", "green"),
          ("magenta", "magenta"), ("yellow", "yellow"), ("blue", "blue"), ("red", "red"),
          ("white", "white"))
LIGHT_COLORS = ((0, 110, 170), (200, 100, 0), (20, 130, 50), (150, 0, 150), (140, 110, 0),
                (40, 70, 200), (200, 30, 30), (60, 60, 60))


def _value(v: object) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return repr(v)  # a setting as written: 0.0003, 1e-08
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return str(v)


class OverlayChart(CachedPlot):
    """Each run's metric as one coloured line (the mean of each column's points; its EMA when
    smoothed), on round ticks."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.runs: list[RunCurves] = []
        self.metric = "loss"
        self.xaxis = "step"
        self.log_y = False
        self.smoothing = 0.0
        self._curves: dict[tuple, tuple] = {}  # (run, metric, x axis, smoothing) -> curve

    def show(self, runs: list[RunCurves], metric: str, xaxis: str, log_y: bool,
             smoothing: float = 0.0) -> None:
        if runs is not self.runs:
            self._curves.clear()
        self.runs, self.metric, self.xaxis, self.log_y = runs, metric, xaxis, log_y
        self.smoothing = smoothing
        lines = self.series()
        ys = [np.asarray(y) for _, _, y in lines]
        data = (tuple((c, tuple(x), tuple(y)) for c, x, y in lines),
                full_range(*ys) if ys else None)
        self._set_inputs((data, metric, xaxis, log_y, self.smoothed, self.size.width), data)

    def on_resize(self, event: events.Resize) -> None:
        if self.runs:
            self.show(self.runs, self.metric, self.xaxis, self.log_y, self.smoothing)

    @property
    def smoothed(self) -> bool:
        return self.smoothing > 0 and self.metric in compare_export.SMOOTHED

    def curve(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Run i's points as drawn (its EMA when smoothed), before downsampling."""
        key = (i, self.metric, self.xaxis, self.smoothing)
        if key not in self._curves:
            x, y, smooth = compare_export.curve(self.runs[i], self.metric, self.xaxis,
                                                self.smoothing)
            self._curves[key] = (x, smooth if smooth is not None else y)
        return self._curves[key]

    def series(self) -> list[tuple[str | tuple[int, int, int], list[float], list[float]]]:
        """(colour, x, y) per run with points, downsampled to the chart's width."""
        cols = max(10, self.size.width - AXIS_COLUMNS)
        light = self.colors is LIGHT
        out = []
        for i in range(len(self.runs)):
            x, y = self.curve(i)
            x, y = column_means(x, y, cols)
            if self.log_y:  # drawn as log10 values (plotext's own log scale re-logs, #209)
                keep = y > 0
                x, y = x[keep], np.log10(y[keep])
            if len(x):
                color = LIGHT_COLORS[i % len(COLORS)] if light else COLORS[i % len(COLORS)][0]
                out.append((color, x.tolist(), y.tolist()))
        return out

    def _draw(self) -> None:
        plt = self.plt
        title = f"{METRICS[self.metric]} by {XAXES[self.xaxis]}"
        title += f" · EMA {self.smoothing:g}" if self.smoothed else " · raw"
        title += " · log y" if self.log_y else ""
        plt.title(title)
        plt.xlabel(XAXES[self.xaxis])
        if self._data is None:
            return
        lines, yr = self._data
        xs: list[float] = []
        for color, x, y in lines:
            marker = "dot" if self.metric == "val_loss" and len(x) < 50 else "braille"
            plt.plot(list(x), list(y), color=color, marker=marker)
            xs += [x[0], x[-1]]
        width, height = self.size
        if xs:
            lo, hi = min(xs), max(xs)
            if hi > lo:
                plt.xlim(lo, hi)
            plt.xticks(*x_ticks(lo, hi, self.xaxis == "time", max(10, width - AXIS_COLUMNS)))
        if yr is not None:
            plt.ylim(yr.lo, yr.hi)
            plt.yticks(*y_ticks(yr, self.log_y, max(3, height - 5)))


class RunCompareScreen(Screen[None]):
    """Overlay of the runs at `paths`; keys pick the metric, the x axis, log y and the
    smoothing (the dashboard's EMA weight to start with), and export the overlay."""

    DEFAULT_CSS = """
    RunCompareScreen #compare-chart { height: 1fr; min-height: 10; }
    RunCompareScreen #compare-header, RunCompareScreen #compare-legend { height: auto;
                                                                         padding: 0 1; }
    RunCompareScreen #compare-config { height: auto; max-height: 14; }
    """

    BINDINGS: ClassVar[list[Binding]] = [
        Binding("escape,q", "close", "back"),
        Binding("1", "metric('loss')", "loss"),
        Binding("2", "metric('val_loss')", "val loss"),
        Binding("3", "metric('grad_norm')", "grad norm"),
        Binding("4", "metric('tok_s')", "tok/s"),
        Binding("x", "next_x", "x axis"),
        Binding("y", "log_y", "log y"),
        Binding("s", "smooth", "smoothing"),
        Binding("left_square_bracket", "smoother(-1)", "less smoothing", show=False),
        Binding("right_square_bracket", "smoother(1)", "more smoothing", show=False),
        Binding("e", "export", "export"),
    ]

    def __init__(self, paths: list[Path], metric: str = "loss", xaxis: str = "step",
                 log_y: bool = False, smoothing: float | None = None,
                 export_dir: Path | None = None) -> None:
        super().__init__()
        self.paths = [Path(p) for p in paths]
        self.labels = run_labels(self.paths)
        self.runs: list[RunCurves] = []
        self.metric = metric
        self.xaxis = xaxis
        self.log_y = log_y
        # the dashboard's smoothing (the user's settings) unless given; `s` turns it off and on
        self.alpha = user_settings.load().smoothing if smoothing is None else smoothing
        self.smoothing = self.alpha
        self.export_dir = export_dir  # where `e` writes (None: the current directory)
        self.rows: list[tuple[str, list[object]]] = []

    def compose(self) -> ComposeResult:
        yield Static(f"comparing {len(self.paths)} runs · loading…", id="compare-header")
        yield OverlayChart(id="compare-chart")
        yield Static("", id="compare-legend")
        yield DataTable(id="compare-config", zebra_stripes=True, cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        self._load()

    @work(thread=True, exclusive=True, group="compare", exit_on_error=False)
    def _load(self) -> None:
        runs = [load_curves(p, label) for p, label in zip(self.paths, self.labels, strict=True)]
        self.app.call_from_thread(self._show, runs)

    def _show(self, runs: list[RunCurves]) -> None:
        self.runs = runs
        self.query_one("#compare-header", Static).update(
            f"comparing {len(runs)} runs · 1 loss · 2 val loss · 3 grad norm · 4 tok/s · "
            "x: step / tokens / wall time · y: log y · s [ ]: smoothing · e: export")
        self._redraw()
        self._show_config()

    def legend(self) -> Text:
        """One entry per run: its colour, its label, its newest value of the metric (of its
        EMA when smoothed)."""
        chart = self.query_one(OverlayChart)
        light = chart.colors is LIGHT
        text = Text()
        for i, run in enumerate(self.runs):
            style = (f"rgb{LIGHT_COLORS[i % len(COLORS)]}".replace(" ", "") if light
                     else COLORS[i % len(COLORS)][1])
            _, y = chart.curve(i)
            finite = y[np.isfinite(y)]
            last = fmt_metric(self.metric, float(finite[-1])) if len(finite) else "–"
            if i:
                text.append("   ")
            text.append("━━ ", style=f"bold {style}")
            text.append(f"{run.label}", style=style)
            note = "" if len(finite) else f" (no {METRICS[self.metric]})"
            text.append(f" {last}{note}")
        return text

    def _redraw(self) -> None:
        self.query_one(OverlayChart).show(self.runs, self.metric, self.xaxis, self.log_y,
                                          self.smoothing)
        self.query_one("#compare-legend", Static).update(self.legend())

    def _show_config(self) -> None:
        table = self.query_one("#compare-config", DataTable)
        table.clear(columns=True)
        self.rows = config_rows([r.config for r in self.runs])
        missing = [r.label for r in self.runs if r.config is None]
        table.add_column("config: setting")
        for r in self.runs:
            table.add_column(r.label)
        if not self.rows:
            word = ("the same config" if not missing
                    else f"no readable config.json in {', '.join(missing)}")
            table.add_row(Text(word, style="dim"), *["" for _ in self.runs])
        for key, values in self.rows:
            table.add_row(key, *[_value(v) for v in values])

    def action_metric(self, metric: str) -> None:
        self.metric = metric
        self._redraw()

    def action_next_x(self) -> None:
        keys = list(XAXES)
        self.xaxis = keys[(keys.index(self.xaxis) + 1) % len(keys)]
        self._redraw()

    def action_log_y(self) -> None:
        self.log_y = not self.log_y
        self._redraw()

    def action_smooth(self) -> None:
        """Smoothing off, or back on at its weight (the dashboard's to start with)."""
        if self.smoothing:
            self.smoothing = 0.0
        else:
            self.smoothing = self.alpha or user_settings.Settings().smoothing
            self.alpha = self.smoothing
        self._redraw()

    def action_smoother(self, direction: int) -> None:
        """One notch more (+1) or less (-1) smoothing, as the dashboard's `[` and `]`."""
        now = user_settings.Settings(smoothing=self.smoothing).smoother(direction).smoothing
        self.smoothing = now
        if now:
            self.alpha = now
        self._redraw()

    def action_export(self) -> None:
        """The overlay as CSV and PNG, under fresh names in the export directory."""
        if not self.runs:
            return
        where = self.export_dir or Path.cwd()
        args = (list(self.runs), self.metric, self.xaxis, self.smoothing, self.log_y)
        self.notify(f"exporting the overlay into {where}…", markup=False)

        def work() -> None:
            try:
                paths, left_out = compare_export.export_into(where, *args)
            except UserError as e:
                self.app.call_from_thread(self.notify, str(e), title="export failed",
                                          severity="error")
                return
            names = ", ".join(p.name for p in paths)
            self.app.call_from_thread(self.notify, f"{names} in {where}", title="exported")
            if left_out:
                self.app.call_from_thread(self.notify, left_out, severity="warning",
                                          timeout=10)

        self.run_worker(work, thread=True, group="export", exit_on_error=False)

    def action_close(self) -> None:
        if isinstance(self.app, CompareApp):
            self.app.exit()
        else:
            self.app.pop_screen()


class CompareApp(App[None]):
    """`andrea-tui compare RUN RUN ...`."""

    CSS_PATH = "andrea.tcss"
    TITLE = "ANDREA compare"

    def __init__(self, paths: list[Path], **options) -> None:
        super().__init__()
        self.paths = paths
        self.options = options  # RunCompareScreen's: metric, xaxis, log_y, smoothing

    def on_mount(self) -> None:
        user_settings.keep_theme(self)
        self.push_screen(RunCompareScreen(self.paths, **self.options))
