"""The step record (a line of `loss.jsonl`) and the abandoned-timeline rule every reader of it
applies after a resume.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from engine.records.parse import (
    Unreadable,
    as_float,
    as_int,
    as_number_map,
    as_optional_number_map,
    as_step,
)

if TYPE_CHECKING:
    from engine.records.events import ResumeEvent


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step (a line of `loss.jsonl`).

    `grad_norm` is the global L2 norm before clipping; `clip_scale` 1.0 or max_norm/grad_norm;
    `tokens` cumulative; `phase_step` 1-based inside a bandit phase of `phase_len` steps;
    `weights` source → mixture weight; `src_loss` source → mean loss of its rows this step (None
    when it had none); `skipped` a non-finite step whose update was skipped; `t` unix time.
    """

    step: int
    loss: float
    grad_norm: float
    clip_scale: float
    lr: float
    tokens: int | None
    tok_s: float
    step_ms: float
    phase: int | None
    phase_step: int | None
    phase_len: int | None
    weights: dict[str, float]
    src_loss: dict[str, float | None]
    skipped: bool
    t: float
    rank_ms: list[float] = field(default_factory=list)  # each rank's step time (data parallel)

    NUMERIC: ClassVar[tuple[str, ...]] = (
        "loss", "grad_norm", "clip_scale", "lr", "tokens", "tok_s", "step_ms", "t")

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, obj: Any) -> StepRecord | Unreadable:
        if not isinstance(obj, Mapping):
            return Unreadable("step record", f"not an object ({type(obj).__name__})")
        step = as_step(obj.get("step"))
        if step is None:
            return Unreadable("step record", f"no valid step ({obj.get('step')!r:.40})")
        return cls(
            step=step, loss=as_float(obj.get("loss")), grad_norm=as_float(obj.get("grad_norm")),
            clip_scale=as_float(obj.get("clip_scale")), lr=as_float(obj.get("lr")),
            tokens=as_int(obj.get("tokens"), 0), tok_s=as_float(obj.get("tok_s")),
            step_ms=as_float(obj.get("step_ms")), phase=as_int(obj.get("phase"), 0),
            phase_step=as_int(obj.get("phase_step"), 0), phase_len=as_int(obj.get("phase_len"), 0),
            weights=as_number_map(obj.get("weights")),
            src_loss=as_optional_number_map(obj.get("src_loss")),
            skipped=obj.get("skipped") is True, t=as_float(obj.get("t")),
            rank_ms=[as_float(x) for x in obj["rank_ms"][:4096]]
            if isinstance(obj.get("rank_ms"), list) else [],
        )

    def number(self, name: str) -> float:
        """A numeric field as float (an unknown token count reads as NaN)."""
        v = getattr(self, name)
        return math.nan if v is None else float(v)


# ---------------------------------------------------------------- the abandoned timeline


def abandoned(step: Any, t: Any, resume_step: Any, resume_t: Any) -> Any:
    """The abandoned-timeline rule: after a crash the engine resumes from its newest checkpoint,
    at step k, at time t_r; records it had written past k before t_r describe a future that never
    happened. True for such a record (a record with an unknown time, NaN, is kept).

    Written with `&` so it holds for plain numbers and, element-wise, for numpy arrays alike.
    """
    return (step > resume_step) & (t < resume_t)


def drop_abandoned(records: Iterable[StepRecord],
                   resumes: Iterable[ResumeEvent]) -> list[StepRecord]:
    """The step records that belong to the surviving timeline."""
    points = [(r.step, r.t) for r in resumes if math.isfinite(r.t)]
    return [r for r in records
            if not any(abandoned(r.step, r.t, k, tr) for k, tr in points)]


def latest_by_step(records: Iterable[StepRecord]) -> list[StepRecord]:
    """One record per step, the later one winning (a resumed run re-logs steps), by step."""
    by_step: dict[int, StepRecord] = {}
    for r in records:
        by_step[r.step] = r
    return [by_step[s] for s in sorted(by_step)]
