"""Validation loss of a run (`eval.jsonl`, one engine.records.EvalRecord per evaluation), where
the run has one (a run without `eval` in its config, or from an engine before validation loss,
has none, and a reader then finds nothing). Records are read tolerantly (a bad line or field is
skipped), one per step (the later wins), and the abandoned-timeline rule applies as to the loss
records. Headless.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from engine import records as rec
from engine.runfiles import RunPaths, read_jsonl


def parse_eval(obj: Any) -> tuple[int, float, float] | None:
    """(step, t, val_loss) of one eval.jsonl object, or None when it is no usable record."""
    r = rec.EvalRecord.from_json(obj)
    return None if isinstance(r, rec.Unreadable) else (r.step, r.t, r.val_loss)


def surviving(points: Iterable[tuple[int, float, float]],
              resumes: Iterable[rec.ResumeEvent]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, t, val_loss) sorted by step, one per step (the later wins), without the records
    of abandoned timelines."""
    cuts = [(r.step, r.t) for r in resumes if math.isfinite(r.t)]
    by_step: dict[int, tuple[float, float]] = {}
    for step, t, v in points:
        if not any(rec.abandoned(step, t, k, tr) for k, tr in cuts):
            by_step[step] = (t, v)
    steps = sorted(by_step)
    return (np.asarray(steps, dtype=np.int64),
            np.asarray([by_step[s][0] for s in steps], dtype=float),
            np.asarray([by_step[s][1] for s in steps], dtype=float))


def read_val_loss(run_dir: Path, resumes: Iterable[rec.ResumeEvent] = ()
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The run's validation losses: (steps, t, val_loss); empty arrays when it has none."""
    objects, _ = read_jsonl(RunPaths(Path(run_dir)).eval)
    return surviving((p for p in map(parse_eval, objects) if p is not None), resumes)


def val_by_step(run_dir: Path, resumes: Iterable[rec.ResumeEvent] = ()) -> dict[int, float]:
    """{step: validation loss} (what a per-step export joins to the step records)."""
    steps, _, vals = read_val_loss(run_dir, resumes)
    return {int(s): float(v) for s, v in zip(steps, vals, strict=True)}
