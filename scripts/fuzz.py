#!/usr/bin/env python3
"""The fuzzing harness, run long: every reader of outside data (tests/fuzz_targets.py) fed
hostile inputs for a time budget each; prints inputs tried, seconds and failures per target.

    python3 scripts/fuzz.py [--seconds 60] [--only NAME]

A failure prints Hypothesis's smallest failing input and the exception; exit status 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, given, seed, settings

from tests.fuzz_targets import TARGETS

CHUNK = 200  # examples per Hypothesis run; runs repeat with new seeds until the budget is spent


def fuzz(name: str, seconds: float) -> tuple[int, float, str | None]:
    fn, strategy = TARGETS[name]
    tried = 0

    def body(data: object) -> None:
        nonlocal tried
        tried += 1
        fn(data)

    t0 = time.perf_counter()
    k = 0
    while time.perf_counter() - t0 < seconds:
        run = settings(max_examples=CHUNK, deadline=5000, database=None,
                       suppress_health_check=list(HealthCheck))(given(strategy)(body))
        try:
            seed(k)(run)()
        except Exception as e:
            return tried, time.perf_counter() - t0, f"{type(e).__name__}: {e}"
        k += 1
    return tried, time.perf_counter() - t0, None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="budget per target")
    ap.add_argument("--only", choices=sorted(TARGETS), help="one target")
    args = ap.parse_args()
    names = [args.only] if args.only else sorted(TARGETS)
    print("| target | inputs tried | seconds | result |")
    print("| --- | ---: | ---: | --- |")
    failed = 0
    for name in names:
        tried, secs, err = fuzz(name, args.seconds)
        failed += err is not None
        print(f"| {name} | {tried:,} | {secs:.0f} | {'FAIL: ' + err if err else 'ok'} |",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
