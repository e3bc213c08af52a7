#!/usr/bin/env python3
"""What a finished (or running) run says of its health, as a table: the alerts per 1,000 steps by
kind, the health state's timeline (engine.records.HealthEvent) and the share of the run's time
that validation took.

    python3 scripts/health_report.py RUN_DIR [RUN_DIR ...]

Validation's share is read from the step records' times: an evaluation runs between the record
of its step and the next step, so its cost is that gap less the run's median gap between
records; summed over the evaluations, over the wall time from the first record to the last.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import records as rec
from engine.runfiles import RunPaths, read_events, read_jsonl, read_steps


def validation_share(steps: list[rec.StepRecord], eval_steps: set[int]) -> tuple[float, int]:
    """(the share of the wall time spent in evaluations, how many were timed)."""
    t = np.array([r.t for r in steps], dtype=float)
    s = np.array([r.step for r in steps])
    if len(t) < 3:
        return float("nan"), 0
    gaps = np.diff(t)
    after_eval = np.isin(s[:-1], list(eval_steps))
    usual = float(np.median(gaps[~after_eval])) if (~after_eval).any() else 0.0
    cost = float(np.clip(gaps[after_eval] - usual, 0, None).sum())
    return cost / float(t[-1] - t[0]), int(after_eval.sum())


def report(run_dir: Path) -> str:
    paths = RunPaths(run_dir)
    steps, skipped = read_steps(paths.loss)
    events, _ = read_events(paths.events)
    evals = [o for o in read_jsonl(paths.eval)[0] if isinstance(o.get("step"), int)]
    alerts = [e for e in events if isinstance(e, rec.AlertEvent)]
    health = [e for e in events if isinstance(e, rec.HealthEvent)]
    n = len(steps)
    out = [f"## {run_dir}", "",
           f"{n:,} steps (last {steps[-1].step if steps else '-'}), {skipped} lines skipped, "
           f"{len(evals)} evaluations", ""]
    per_k = 1000 / n if n else float("nan")
    out += ["| alert kind | count | per 1,000 steps |", "| --- | ---: | ---: |"]
    for kind, c in sorted(Counter(a.alert for a in alerts).items()):
        out.append(f"| {kind} | {c} | {c * per_k:.2f} |")
    out.append(f"| all | {len(alerts)} | {len(alerts) * per_k:.2f} |")
    out += ["", "| step | health | reason |", "| ---: | --- | --- |"]
    for e in health:
        out.append(f"| {e.step if e.step is not None else '-'} | {e.state.value} | "
                   f"{e.reason.replace('|', '/')[:160]} |")
    if not health:
        out.append("| - | (no health events) | |")
    share, timed = validation_share(steps, {o["step"] for o in evals})
    out += ["", f"validation: {timed} evaluations timed, {share:.2%} of the wall time"
            if timed else "validation: none timed", ""]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories")
    args = ap.parse_args()
    for run in args.runs:
        if not RunPaths(run).loss.is_file():
            print(f"error: {run}: no loss.jsonl (not a run directory?)", file=sys.stderr)
            return 2
        print(report(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
