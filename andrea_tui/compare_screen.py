"""The overlay of several runs: one metric against step, tokens or wall time, a legend, and the
settings in which their configs differ. `andrea-tui compare RUN RUN ...`, or `v` in the runs
browser on the marked runs. The histories load in a thread worker (compare.load_curves)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static
from textual_plotext import PlotextPlot

from andrea_tui.compare import (
    METRICS,
    XAXES,
    RunCurves,
    column_means,
    config_rows,
    load_curves,
    run_labels,
    xy,
)
from andrea_tui.textfmt import fmt_num

# plotext colour names and the Rich styles that look the same in the legend
COLORS = (("cyan", "cyan"), ("orange", "dark_orange"), ("green", "green"),
          ("magenta", "magenta"), ("yellow", "yellow"), ("blue", "blue"), ("red", "red"),
          ("white", "white"))
AXIS_COLUMNS = 10


def _value(v: object) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return repr(v)  # a setting as written: 0.0003, 1e-08
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return str(v)


class OverlayChart(PlotextPlot):
    """Each run's metric as one coloured line (the mean of each column's points)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.runs: list[RunCurves] = []
        self.metric = "loss"
        self.xaxis = "step"
        self.log_y = False

    def show(self, runs: list[RunCurves], metric: str, xaxis: str, log_y: bool) -> None:
        self.runs, self.metric, self.xaxis, self.log_y = runs, metric, xaxis, log_y
        self.refresh()

    def series(self) -> list[tuple[str, list[float], list[float]]]:
        """(colour, x, y) per run with points, downsampled to the chart's width."""
        cols = max(10, self.size.width - AXIS_COLUMNS)
        out = []
        for i, run in enumerate(self.runs):
            x, y = xy(run, self.metric, self.xaxis)
            x, y = column_means(x, y, cols)
            if self.log_y:  # drawn as log10 values (plotext's own log scale re-logs, #209)
                keep = y > 0
                x, y = x[keep], np.log10(y[keep])
            if len(x):
                out.append((COLORS[i % len(COLORS)][0], x.tolist(), y.tolist()))
        return out

    def render(self):
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        plt.title(f"{METRICS[self.metric]} by {XAXES[self.xaxis]}"
                  f"{' · log y' if self.log_y else ''} · mean per column")
        plt.xlabel(XAXES[self.xaxis])
        lo, hi = np.inf, -np.inf
        for color, x, y in self.series():
            marker = "dot" if self.metric == "val_loss" and len(x) < 50 else "braille"
            plt.plot(x, y, color=color, marker=marker)
            lo, hi = min(lo, min(y)), max(hi, max(y))
        if self.log_y and np.isfinite(lo) and np.isfinite(hi):
            ticks = list(np.linspace(lo, max(hi, lo + 0.1), 5))
            plt.yticks(ticks, [fmt_num(10**t) for t in ticks])
        return super().render()


class RunCompareScreen(Screen[None]):
    """Overlay of the runs at `paths`; keys pick the metric, the x axis and log y."""

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
    ]

    def __init__(self, paths: list[Path]) -> None:
        super().__init__()
        self.paths = [Path(p) for p in paths]
        self.labels = run_labels(self.paths)
        self.runs: list[RunCurves] = []
        self.metric = "loss"
        self.xaxis = "step"
        self.log_y = False
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
            "x: step / tokens / wall time · y: log y")
        self._redraw()
        self._show_config()

    def legend(self) -> Text:
        """One entry per run: its colour, its label, its newest value of the metric."""
        text = Text()
        for i, run in enumerate(self.runs):
            style = COLORS[i % len(COLORS)][1]
            _, y = xy(run, self.metric, self.xaxis)
            finite = y[np.isfinite(y)]
            last = fmt_num(float(finite[-1]), 4) if len(finite) else "–"
            if i:
                text.append("   ")
            text.append("━━ ", style=f"bold {style}")
            text.append(f"{run.label}", style=style)
            note = "" if len(finite) else f" (no {METRICS[self.metric]})"
            text.append(f" {last}{note}")
        return text

    def _redraw(self) -> None:
        self.query_one(OverlayChart).show(self.runs, self.metric, self.xaxis, self.log_y)
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

    def action_close(self) -> None:
        if isinstance(self.app, CompareApp):
            self.app.exit()
        else:
            self.app.pop_screen()


class CompareApp(App[None]):
    """`andrea-tui compare RUN RUN ...`."""

    CSS_PATH = "andrea.tcss"
    TITLE = "ANDREA compare"

    def __init__(self, paths: list[Path]) -> None:
        super().__init__()
        self.paths = paths

    def on_mount(self) -> None:
        self.push_screen(RunCompareScreen(self.paths))
