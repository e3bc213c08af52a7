"""The overlay of several runs out of the terminal: a CSV (step, then each run's metric and its
smoothed form) and a PNG (matplotlib: the runs' curves on one axes with round ticks). Headless.

What is written where follows export.py: a new file, or with `force` a regular file replaced
atomically; never a symbolic link, a directory, a device, a FIFO or a socket; `-` is standard
output (the command line's business). The overlay's `e` writes fresh names into a directory.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from andrea_tui.compare import METRICS, XAXES, RunCurves, column_means, ema, xy
from andrea_tui.export import (
    NO_MATPLOTLIB,
    PNG_DPI,
    PNG_SIZE,
    figure_png,
    have_matplotlib,
    mpl_round_ticks,
    write_fresh,
)
from andrea_tui.textfmt import fmt_metric
from engine.errors import UserError

SMOOTHED = ("loss", "grad_norm", "tok_s")  # metrics with one value a step: smoothed when asked


def curve(run: RunCurves, metric: str, xaxis: str, alpha: float
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(x, y, smoothed y or None): `metric` of `run` against `xaxis`, with its EMA (weight
    `alpha` on the past) when alpha > 0 and the metric has a value every step."""
    x, y = xy(run, metric, xaxis)
    smooth = ema(y, alpha) if alpha > 0 and metric in SMOOTHED else None
    return x, y, smooth


def csv_text(runs: Sequence[RunCurves], metric: str = "loss", alpha: float = 0.0) -> str:
    """One row per step any run has (sorted), `step` then per run its `metric` and, with
    smoothing, its EMA: columns `LABEL:METRIC` and `LABEL:METRIC_ema`. A run without that step
    leaves its cells empty; numbers are written as Python reads them back (repr)."""
    if metric not in METRICS:
        raise UserError(f"--metric: expected one of {', '.join(METRICS)}, got {metric!r}")
    head = ["step"]
    by_run: list[list[dict[int, float]]] = []
    all_steps: set[int] = set()
    for run in runs:
        steps, y, smooth = curve(run, metric, "step", alpha)
        cols = [dict(zip(steps.astype(np.int64).tolist(), y.tolist(), strict=True))]
        head.append(f"{run.label}:{metric}")
        if smooth is not None:
            cols.append(dict(zip(steps.astype(np.int64).tolist(), smooth.tolist(),
                                 strict=True)))
            head.append(f"{run.label}:{metric}_ema")
        by_run.append(cols)
        all_steps.update(cols[0])
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(head)
    for step in sorted(all_steps):
        row = [str(step)]
        for cols in by_run:
            for col in cols:
                v = col.get(step)
                row.append("" if v is None else repr(float(v)))
        w.writerow(row)
    return buf.getvalue()


def figure(runs: Sequence[RunCurves], metric: str = "loss", xaxis: str = "step",
           alpha: float = 0.0, log_y: bool = False, size: tuple[int, int] = PNG_SIZE) -> Any:
    """The overlay as a matplotlib Figure of `size` pixels: per run its curve (thin and light
    under its EMA when smoothed), a legend with each run's newest value, round ticks."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(NO_MATPLOTLIB) from None
    width, height = size
    fig = Figure(figsize=(width / PNG_DPI, height / PNG_DPI), dpi=PNG_DPI)
    FigureCanvasAgg(fig)
    ax = fig.subplots(1, 1)
    cols = max(100, width)
    smoothed = alpha > 0 and metric in SMOOTHED
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        x, y, smooth = curve(run, metric, xaxis, alpha)
        if log_y:
            y = np.where(y > 0, y, np.nan)
            smooth = None if smooth is None else np.where(smooth > 0, smooth, np.nan)
        mx, my = column_means(x, y, cols)
        finite = y[np.isfinite(y)]
        last = smooth[np.isfinite(smooth)] if smooth is not None else finite
        label = f"{run.label} ({fmt_metric(metric, last[-1])})" if len(last) else f"{run.label} (none)"
        marker = "o" if metric == "val_loss" and len(mx) < 50 else None
        if smooth is not None:
            ax.plot(mx, my, color=color, linewidth=0.6, alpha=0.35)
            sx, sy = column_means(x, smooth, cols)
            ax.plot(sx, sy, color=color, linewidth=1.4, label=label)
        else:
            ax.plot(mx, my, color=color, linewidth=1.0, marker=marker, markersize=3,
                    label=label)
    if log_y:
        ax.set_yscale("log")
    title = f"{METRICS[metric]} by {XAXES[xaxis]}"
    if smoothed:
        title += f" · EMA {alpha:g}"
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(XAXES[xaxis])
    ax.set_ylabel(METRICS[metric])
    mpl_round_ticks(ax.xaxis, "value" if xaxis == "time" else "count")
    mpl_round_ticks(ax.yaxis, "value", log=log_y)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.94, bottom=0.08)
    return fig


def png_bytes(runs: Sequence[RunCurves], metric: str = "loss", xaxis: str = "step",
              alpha: float = 0.0, log_y: bool = False,
              size: tuple[int, int] = PNG_SIZE) -> bytes:
    return figure_png(figure(runs, metric, xaxis, alpha, log_y, size))


def export_into(where: Path, runs: Sequence[RunCurves], metric: str, xaxis: str, alpha: float,
                log_y: bool) -> tuple[list[Path], str | None]:
    """The overlay's `e`: its CSV and, with matplotlib, its PNG under fresh names
    `compare-METRIC.csv/.png` in `where`. (paths written, what was left out)."""
    stem = f"compare-{metric}"
    written = [write_fresh(where, stem, ".csv", csv_text(runs, metric, alpha).encode())]
    if not have_matplotlib():
        return written, NO_MATPLOTLIB
    written.append(write_fresh(where, stem, ".png",
                               png_bytes(runs, metric, xaxis, alpha, log_y)))
    return written, None
