"""The step-sequence rule, once for every reader of `loss.jsonl`: which step records cannot be
the run's (`impossible_step`, `follows`, `out_of_sequence`), and `StepOrder`, the rule applied to
a stream of records read chunk by chunk.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.records.events import Event, ReadyEvent, ResumeEvent, StartEvent
from engine.records.steps import StepRecord

STEP_GAP_MAX = 100  # steps a record may run ahead of the one before it (a few lines lost)
SEQUENCE_CONFIRM = 5  # records that follow each other after an unexplained jump: a new anchor
HELD_MAX = 256  # records out of sequence kept in case a restart read later explains them


def restart_point(event: Event) -> tuple[int, float] | None:
    """Where an engine (re)started its step sequence: (the step it goes on from, when). A resume
    and a ready event name their step; a fresh start begins at 0. None for other events."""
    if isinstance(event, ResumeEvent):
        point = (event.step, event.t)
    elif isinstance(event, ReadyEvent) and event.step is not None:
        point = (event.step, event.t)
    elif isinstance(event, StartEvent) and not event.resumed:
        point = (0, event.t)
    else:
        return None
    return point if math.isfinite(point[1]) else None


def impossible_step(r: StepRecord, max_steps: int | None) -> str | None:
    """What makes step record `r` impossible whatever came before it, or None: a negative loss
    or gradient norm (cross-entropy and norms are >= 0), a NaN or infinite loss on a step that
    was not skipped, a step beyond the run's `max_steps`."""
    if r.loss < 0 or r.grad_norm < 0:
        return f"step {r.step}: a negative loss or gradient norm"
    if not r.skipped and not math.isfinite(r.loss):
        return f"step {r.step}: a non-finite loss on a step that was not skipped"
    if max_steps is not None and r.step > max_steps:
        return f"step {r.step}: beyond the run's max_steps {max_steps}"
    return None


def follows(r: StepRecord, last: StepRecord | None,
            restarts: Iterable[tuple[int, float]]) -> bool:
    """Whether step record `r` may come next after `last` (the newest record kept before it,
    in file order): a step after it, at most STEP_GAP_MAX past it; or a step that a (re)start
    explains: one of `restarts` (restart_point) from step k, written after `last` and before
    `r`, with k < r.step <= k + STEP_GAP_MAX. Unknown times (NaN) never refuse a record."""
    if last is None or last.step < r.step <= last.step + STEP_GAP_MAX:
        return True
    return any(k < r.step <= k + STEP_GAP_MAX and not r.t < t and not last.t > t
               for k, t in restarts)


def out_of_sequence(r: StepRecord, last: StepRecord | None,
                    restarts: Iterable[tuple[int, float]], max_steps: int | None) -> str | None:
    """The step-sequence rule, for every reader of `loss.jsonl`: why `r` cannot come after
    `last`, or None when it can (`impossible_step`, `follows`). Records of an abandoned
    timeline are dropped before this rule (`drop_abandoned`)."""
    why = impossible_step(r, max_steps)
    if why is None and not follows(r, last, restarts):
        why = f"step {r.step} after step {last.step if last else '-'} with no restart between"
    return why


@dataclass
class StepOrder:
    """`out_of_sequence` over a stream of step records read in file order, chunk by chunk:
    what a reader keeps (`admit`) and how many records it skipped (`skipped`). Feed it the
    run's events (`note`) and its max_steps (`limit`), before the records that follow them
    where the reader can; a restart read late (its events file behind) still lets in the
    records it explains (`readmit`). After an unexplained jump, SEQUENCE_CONFIRM records that
    follow one another are taken as the sequence going on there (a stray record cannot)."""

    max_steps: int | None = None
    restarts: list[tuple[int, float]] = field(default_factory=list)
    last: StepRecord | None = None
    skipped: int = 0
    chain: list[StepRecord] = field(default_factory=list)  # refused records in a row
    admitted: int = 0  # records let in so far
    # Records refused for their place in the sequence: (record, `last` then, `admitted` then).
    held: deque[tuple[StepRecord, StepRecord | None, int]] = field(
        default_factory=lambda: deque(maxlen=HELD_MAX))

    def note(self, events: Iterable[Event]) -> bool:
        """Learn the (re)starts and max_steps the events name; True when a restart is new
        (then `readmit` may let in records it explains)."""
        new = False
        for e in events:
            point = restart_point(e)
            if point is not None and point not in self.restarts:
                self.restarts.append(point)
                new = True
            if isinstance(e, ReadyEvent):
                self.limit(e.max_steps)
        return new

    def readmit(self) -> list[StepRecord]:
        """The held records that the restarts known now explain, in file order (no longer
        counted as skipped): a resume event read after the records that follow it."""
        out: list[StepRecord] = []
        keep = []
        prev: StepRecord | None = None  # the held record before, when it was let in
        for r, before, n in self.held:
            if follows(r, prev or before, self.restarts):
                out.append(r)
                prev = r
                if n == self.admitted:  # nothing was let in after it: the sequence goes on there
                    self.last = r
            else:
                keep.append((r, before, n))
                prev = None
        if out:
            self.held, self.chain = deque(keep, maxlen=HELD_MAX), []
            self.skipped -= len(out)
        return out

    def limit(self, *max_steps: int | None) -> None:
        """The run's max_steps as a source says it: the largest one known counts (a run
        resumed with a larger --max-steps goes on past the config's)."""
        known = [m for m in (self.max_steps, *max_steps) if m is not None and m > 0]
        self.max_steps = max(known) if known else None

    def admit(self, records: Iterable[StepRecord]) -> list[StepRecord]:
        """The records that may come next, in order; the others are counted in `skipped`."""
        out = []
        for r in records:
            if impossible_step(r, self.max_steps) is not None:
                self.skipped += 1
                continue
            if not follows(r, self.last, self.restarts):
                c = self.chain
                self.chain = [*c, r] if c and follows(r, c[-1], ()) else [r]
                if len(self.chain) < SEQUENCE_CONFIRM:
                    self.skipped += 1
                    self.held.append((r, self.last, self.admitted))
                    continue
            self.chain = []
            self.last = r
            self.admitted += 1
            out.append(r)
        return out

    def fresh(self) -> StepOrder:
        """The same run's rule for a reading that starts over (nothing kept yet)."""
        return StepOrder(self.max_steps, list(self.restarts))

