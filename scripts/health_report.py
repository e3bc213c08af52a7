#!/usr/bin/env python3
"""What a finished (or running) run says of its health, as a table: the alerts per 1,000 steps by
kind, the health state's timeline (engine.records.HealthEvent) and the share of the run's time
that validation took.

    python3 scripts/health_report.py RUN_DIR [RUN_DIR ...]

Validation's share: the seconds the engine logged for each evaluation (engine.log's `eval step N:
val loss X (S s)` lines), over the wall time from the first step record to the last.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import records as rec
from engine.runfiles import RunPaths, read_events, read_jsonl, read_steps

EVAL_LINE = re.compile(rb"eval step (\d+): val loss \S+ \(([\d.]+) s\)")


def validation_share(steps: list[rec.StepRecord], log: Path) -> tuple[float, int]:
    """(the share of the wall time from the first step record to the last spent in
    evaluations, as the engine timed each in engine.log; how many it timed)."""
    try:
        found = EVAL_LINE.findall(log.read_bytes())
    except OSError:
        found = []
    if len(steps) < 2 or not found:
        return float("nan"), 0
    return sum(float(sec) for _, sec in found) / (steps[-1].t - steps[0].t), len(found)


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
    share, timed = validation_share(steps, paths.log)
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
