"""Whether a live engine is still training, as the viewer judges it on its own.

The engine's stall watchdog is a thread of the engine: an engine that is frozen (SIGSTOP, a
debugger) or hung says nothing. So the viewer judges from outside, as the watchdog does from
inside (engine.run.alerts.Watchdog): no step for `stall_factor` times the run's median step
interval, and at least `stall_min_s` seconds (the config's `alerts`, or their defaults), is a
stall. Work the loop does between steps (a checkpoint, validation, a text sample) counts as
progress. Whether the process is stopped is the supervisor's to find (a /proc read). Headless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from andrea_tui.runstate import RunState
from engine.config import AlertsConfig

PACE_ROWS = 100  # the step records the pace is the median interval of
PACE_MIN_INTERVALS = 3  # fewer intervals say nothing of the pace (as the engine's watchdog)


@dataclass(frozen=True)
class Stall:
    """No progress for `waited` seconds, past the run's `line` (both in seconds)."""

    waited: float
    line: float


def step_pace(st: RunState) -> float | None:
    """The median interval between the newest step records of the engine's current start
    (seconds), None when too few are known."""
    t = st.series.col("t")[-PACE_ROWS - 1:]
    if st.runs:
        t = t[t >= st.runs[-1][0]]
    dt = np.diff(t)
    dt = dt[np.isfinite(dt) & (dt > 0)]
    return float(np.median(dt)) if len(dt) >= PACE_MIN_INTERVALS else None


def stall_line(st: RunState) -> float | None:
    """Seconds without progress that make a stall of this run, None while its pace is not
    known."""
    pace = step_pace(st)
    if pace is None:
        return None
    alerts = (st.config.alerts if st.config else None) or AlertsConfig()
    return max(alerts.stall_factor * pace, alerts.stall_min_s)


def last_progress(st: RunState) -> float | None:
    """When the engine last did something the viewer can see: a step, a checkpoint, a
    validation, a text sample, a (re)start (unix time), None when nothing is known."""
    times = [st.last_record.t if st.last_record else math.nan,
             st.checkpoints[-1].t if st.checkpoints else math.nan,
             st.last_sample.t if st.last_sample else math.nan,
             st.start_event.t if st.start_event else math.nan,
             st.ready.t if st.ready else math.nan]
    if st.evals:
        times.append(st.evals[max(st.evals)].t)
    finite = [t for t in times if math.isfinite(t)]
    return max(finite) if finite else None


def stalled(st: RunState, now: float) -> Stall | None:
    """A stall of a running run at `now` (unix time), or None. At max_steps the engine writes
    its final checkpoint (as long as the disk takes) with no step to show: not a stall, as its
    own watchdog agrees."""
    if st.status != "running":
        return None
    if st.step is not None and st.max_steps is not None and st.step >= st.max_steps:
        return None
    line, last = stall_line(st), last_progress(st)
    if line is None or last is None or now - last <= line:
        return None
    return Stall(now - last, line)


def idle_for(st: RunState, now: float) -> float | None:
    """Seconds since the newest step record (None when there is none)."""
    t = st.last_record.t if st.last_record else math.nan
    return now - t if math.isfinite(t) and now >= t else None
