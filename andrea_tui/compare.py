"""Several runs side by side, headless: their curves on one x axis, and how their configs differ.

`load_curves` reads one run's loss history in bounded chunks into column arrays (the same
reader as the dashboard's history: engine.records via runreader.load_history, resumes, the
abandoned-timeline and the step-sequence rules applied) and its validation losses; `xy` gives
one metric against steps, tokens or wall time, `ema` its smoothed form (the dashboard's
debiased EMA); `config_rows` the hyper-parameters in which the runs differ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from andrea_tui.runreader import load_history
from andrea_tui.runstate import read_config
from andrea_tui.series import EmaFold
from andrea_tui.valloss import read_val_loss
from engine.config import Config, config_diff
from engine.records import ResumeEvent
from engine.runfiles import MAX_LINE_BYTES, RunPaths, read_events, read_json, step_order

METRICS: dict[str, str] = {
    "loss": "loss",
    "val_loss": "validation loss",
    "grad_norm": "grad norm",
    "tok_s": "tok/s",
}
XAXES: dict[str, str] = {"step": "step", "tokens": "tokens", "time": "wall time (min)"}


@dataclass
class RunCurves:
    """One run's per-step columns (sorted by step, one row per step) and validation losses."""

    path: Path
    label: str
    config: Config | None
    steps: np.ndarray
    cols: dict[str, np.ndarray]  # loss, grad_norm, tok_s, tokens, t
    val_steps: np.ndarray
    val_t: np.ndarray
    val_loss: np.ndarray

    @property
    def n(self) -> int:
        return len(self.steps)

    def t0(self) -> float:
        """When the run's first step was logged (unix time), NaN when unknown."""
        t = self.cols["t"]
        finite = t[np.isfinite(t)]
        return float(finite[0]) if len(finite) else math.nan


def run_labels(paths: Sequence[Path]) -> list[str]:
    """Short names that tell the runs apart: the directory name, with parents where needed."""
    parts = [Path(p).resolve().parts for p in paths]
    for depth in range(1, max((len(p) for p in parts), default=1) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


def load_curves(run_dir: Path, label: str | None = None) -> RunCurves:
    """Read a run's history (bounded memory: columns, not records)."""
    paths = RunPaths(Path(run_dir))
    events, _ = read_events(paths.events)
    resumes = [e for e in events if isinstance(e, ResumeEvent)]
    history, _ = load_history(paths.loss, MAX_LINE_BYTES, 0.9, resumes,
                              step_order(paths.root, events))
    series = history.series
    cols = {c: series.col(c).copy() for c in ("loss", "grad_norm", "tok_s", "tokens", "t")}
    obj = read_json(paths.config)
    vs, vt, vl = read_val_loss(paths.root, resumes)
    return RunCurves(paths.root, label or paths.root.name,
                     read_config(obj) if obj is not None else None, series.steps.copy(), cols,
                     vs, vt, vl)


def xy(run: RunCurves, metric: str, xaxis: str) -> tuple[np.ndarray, np.ndarray]:
    """`metric` of `run` against `xaxis` (step, tokens, or minutes since its first step), only
    the points with a finite x."""
    if metric not in METRICS:
        raise ValueError(f"metric: expected one of {', '.join(METRICS)}, got {metric!r}")
    if xaxis not in XAXES:
        raise ValueError(f"x axis: expected one of {', '.join(XAXES)}, got {xaxis!r}")
    if metric == "val_loss":
        steps, y = run.val_steps, run.val_loss
        if xaxis == "step":
            x = steps.astype(float)
        elif xaxis == "tokens":  # the tokens at an evaluation's step, from the step records
            x = (np.interp(steps, run.steps, run.cols["tokens"], left=np.nan, right=np.nan)
                 if run.n else np.full(len(steps), np.nan))
        else:
            x = (run.val_t - run.t0()) / 60.0
    else:
        y = run.cols[metric]
        if xaxis == "step":
            x = run.steps.astype(float)
        elif xaxis == "tokens":
            x = run.cols["tokens"]
        else:
            x = (run.cols["t"] - run.t0()) / 60.0
    keep = np.isfinite(x)
    return x[keep], y[keep]


def ema(y: np.ndarray, alpha: float) -> np.ndarray:
    """The debiased exponential moving average of `y` with weight `alpha` on the past, as the
    dashboard's loss EMA (StepSeries.ema): a non-finite value is skipped (the average holds);
    NaN before the first finite value. alpha 0 gives `y` itself."""
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"smoothing: expected 0 <= alpha < 1, got {alpha!r}")
    fold = EmaFold(alpha)
    return np.fromiter((fold.add(v) for v in y.tolist()), dtype=float, count=len(y))


def column_means(x: np.ndarray, y: np.ndarray, columns: int) -> tuple[np.ndarray, np.ndarray]:
    """At most `columns` points: per bucket of equal row counts its first x and the mean of its
    finite y (buckets with none left out). Short series come back point by point."""
    finite = np.isfinite(y)
    if len(x) <= columns:
        return x[finite], y[finite]
    edges = np.linspace(0, len(x), columns + 1).astype(np.int64)[:-1]
    sums = np.add.reduceat(np.where(finite, y, 0.0), edges)
    counts = np.add.reduceat(finite.astype(np.int64), edges)
    keep = counts > 0
    return x[edges][keep], sums[keep] / counts[keep]


def _dig(obj: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def config_rows(configs: Sequence[Config | None]) -> list[tuple[str, list[Any]]]:
    """(dotted key, each run's value) for every setting in which some run differs from the
    first (engine.config.config_diff against the first run's config); a run whose config.json
    could not be read has None everywhere."""
    known = [c for c in configs if c is not None]
    if len(known) < 2:
        return []
    first = known[0]
    keys: list[str] = []
    for other in known[1:]:
        for key, _, _ in config_diff(first, other):
            if key not in keys:
                keys.append(key)
    docs = [c.to_json() if c is not None else None for c in configs]
    return [(k, [_dig(d, k) if d is not None else None for d in docs]) for k in sorted(keys)]
