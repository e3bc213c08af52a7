"""The records of `events.jsonl`: one class per event kind, registered by its `KIND` so that
`Event.from_json` reads each kind into its own class (a kind this version does not know reads as
`OtherEvent`). The engine's alerts and health events are in engine.records.health.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from engine.records.parse import (
    Unreadable,
    as_finite,
    as_float,
    as_int,
    as_number_map,
    as_step,
    as_str,
)


@dataclass(frozen=True)
class Event:
    """An `events.jsonl` record: `t` (unix time) and the kind in `event`, then its fields."""

    KIND: ClassVar[str] = ""
    KINDS: ClassVar[dict[str, type[Event]]] = {}

    t: float = math.nan  # the writer stamps it (engine.run.writer.RunWriter.event)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.KIND:
            Event.KINDS[cls.KIND] = cls

    @property
    def kind(self) -> str:
        return self.KIND

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": self.t, "event": self.kind}
        out.update((f.name, getattr(self, f.name)) for f in fields(self) if f.name != "t")
        return out

    def details(self) -> dict[str, Any]:
        """The kind's own fields (everything but `t`)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "t"}

    @classmethod
    def _read(cls, obj: Mapping[str, Any], t: float) -> Event:
        raise NotImplementedError  # every kind reads its own fields

    @staticmethod
    def from_json(obj: Any) -> Event | Unreadable:
        if not isinstance(obj, Mapping):
            return Unreadable("event", f"not an object ({type(obj).__name__})")
        kind = obj.get("event")
        if not isinstance(kind, str) or not kind:
            return Unreadable("event", "no `event` kind")
        t = as_float(obj.get("t"))
        sub = Event.KINDS.get(kind)
        if sub is None:
            return OtherEvent(t, kind[:64], {str(k): v for k, v in obj.items()
                                             if k not in ("t", "event")})
        return sub._read(obj, t)


@dataclass(frozen=True)
class OtherEvent(Event):
    """An event kind this version does not know (a newer engine's): kept for display."""

    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.name

    def to_json(self) -> dict[str, Any]:
        return {"t": self.t, "event": self.name, **self.extra}

    def details(self) -> dict[str, Any]:
        return dict(self.extra)


@dataclass(frozen=True)
class StartEvent(Event):
    KIND: ClassVar[str] = "start"
    pid: int | None = None
    argv: list[str] = field(default_factory=list)
    name: str = ""
    backend: str = ""
    device: str = ""
    run_id: str = ""
    resumed: bool = False

    @classmethod
    def _read(cls, o: Mapping[str, Any], t: float) -> StartEvent:
        argv = o.get("argv")
        return cls(t, as_int(o.get("pid"), 0), [str(a) for a in argv] if isinstance(argv, list)
                   else [], as_str(o.get("name")), as_str(o.get("backend")),
                   as_str(o.get("device")), as_str(o.get("run_id")), o.get("resumed") is True)


@dataclass(frozen=True)
class PrepEvent(Event):
    """A line of data preparation (`message`). A line about one source names it (`source`);
    the progress lines while it is encoded, and its last line, also carry `bytes_done` of
    `bytes_total` input bytes, the rate `mb_s` (MB/s, 1 MB = 10^6 bytes) and `eta_s` (seconds
    left at that rate; 0 on the last line). Other lines leave them empty ("" and None)."""

    KIND: ClassVar[str] = "prep"
    message: str = ""
    source: str = ""
    bytes_done: int | None = None
    bytes_total: int | None = None
    mb_s: float | None = None
    eta_s: float | None = None

    @classmethod
    def _read(cls, o: Mapping[str, Any], t: float) -> PrepEvent:
        return cls(t, as_str(o.get("message")), as_str(o.get("source")),
                   as_int(o.get("bytes_done"), 0), as_int(o.get("bytes_total"), 0),
                   as_finite(o.get("mb_s")), as_finite(o.get("eta_s")))


@dataclass(frozen=True)
class ReadyEvent(Event):
    """The engine built everything and is about to train: the memory plan (bytes per group)."""

    KIND: ClassVar[str] = "ready"
    memory_plan: dict[str, int] = field(default_factory=dict)
    n_params: int | None = None
    backend: str = ""
    device: str = ""
    step: int | None = None
    max_steps: int | None = None
    tokens_per_step: int | None = None
    attention: str = ""  # which attention runs, e.g. "cudnn (cuDNN 91900 ...)"; "" when none said
    world_size: int = 1
    topology: dict[str, Any] = field(default_factory=dict)  # GPU links and NCCL settings (DP)
    precision: str = ""  # train.precision as the run trains ("" in runs from before)
    fp8_gemms: list[str] = field(default_factory=list)  # the GEMMs that run in FP8 (fp8 only)

    @classmethod
    def _read(cls, o: Mapping[str, Any], t: float) -> ReadyEvent:
        plan = o.get("memory_plan")
        plan_ok = ({str(k): v for k, v in plan.items() if as_int(v, 0) is not None}
                   if isinstance(plan, Mapping) else {})
        fp8 = o.get("fp8_gemms")
        return cls(t, plan_ok, as_int(o.get("n_params"), 0), as_str(o.get("backend")),
                   as_str(o.get("device")), as_step(o.get("step")),
                   as_int(o.get("max_steps"), 1), as_int(o.get("tokens_per_step"), 1),
                   as_str(o.get("attention"))[:200], as_int(o.get("world_size"), 1) or 1,
                   dict(o["topology"]) if isinstance(o.get("topology"), Mapping) else {},
                   as_str(o.get("precision"))[:16],
                   [g[:32] for g in fp8[:16] if isinstance(g, str)] if isinstance(fp8, list) else [])


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A checkpoint a resume passed over, and why."""

    path: str
    reason: str


@dataclass(frozen=True)
class IgnoredSetting:
    """A setting of the config given on the command line that a resume did not use: the run
    goes on with the checkpoint's value (`kept`), not the given one."""

    key: str
    kept: Any
    given: Any


def ignored_advice(ignored: list[IgnoredSetting]) -> list[str]:
    """How to train with the settings a resume did not use: a max_steps by `--max-steps N`
    on the resume (it extends or shortens the run, and its lr schedule with it), the rest
    only in a new run."""
    steps = next((i for i in ignored if i.key == "train.max_steps"), None)
    out = []
    if steps is not None:
        out.append(f"to train to another max_steps, add --max-steps N to --resume (e.g. "
                   f"--max-steps {json.dumps(steps.given)}): it extends (or shortens) the run, "
                   "and its lr schedule with it")
    if steps is None or len(ignored) > 1:
        out.append("to train with " + ("the others" if steps is not None else "them")
                   + ", start a new run: drop --resume and pass another --run-dir")
    return out


@dataclass(frozen=True)
class ResumeEvent(Event):
    """The run continues from checkpoint `path` at `step` (records past it written before `t`
    are an abandoned timeline), with the checkpoint's config: `ignored` lists what the given
    config would have changed."""

    KIND: ClassVar[str] = "resume"
    step: int = 0
    path: str = ""
    skipped: list[SkippedCheckpoint] = field(default_factory=list)
    ignored: list[IgnoredSetting] = field(default_factory=list)
    world_size_was: int | None = None  # the checkpoint's world size, when it differs (re-shard)

    def to_json(self) -> dict[str, Any]:
        return {"t": self.t, "event": self.KIND, "step": self.step, "path": self.path,
                "skipped": [{"path": s.path, "reason": s.reason} for s in self.skipped],
                "ignored": [{"key": i.key, "kept": i.kept, "given": i.given}
                            for i in self.ignored], "world_size_was": self.world_size_was}

    @classmethod
    def _read(cls, o: Mapping[str, Any], t: float) -> ResumeEvent | Unreadable:
        step = as_step(o.get("step"))
        if step is None or not math.isfinite(t):
            return Unreadable("resume event", "no valid step or time")
        sk, ig = o.get("skipped"), o.get("ignored")
        skipped = [SkippedCheckpoint(as_str(s.get("path")), as_str(s.get("reason")))
                   for s in sk if isinstance(s, Mapping)] if isinstance(sk, list) else []
        ignored = [IgnoredSetting(as_str(i.get("key")), i.get("kept"), i.get("given"))
                   for i in ig if isinstance(i, Mapping)] if isinstance(ig, list) else []
        return cls(t, step, as_str(o.get("path")), skipped, ignored,
                   as_int(o.get("world_size_was"), 1))


@dataclass(frozen=True)
class SignalEvent(Event):
    """A signal the loop acted on: `action` is snapshot, coalesced or stop."""

    KIND: ClassVar[str] = "signal"
    ACTIONS: ClassVar[tuple[str, ...]] = ("snapshot", "coalesced", "stop")
    signal: str = ""
    step: int | None = None
    action: str = ""
    count: int | None = None

    @classmethod
    def _read(cls, o: Mapping[str, Any], t: float) -> SignalEvent:
        return cls(t, as_str(o.get("signal")), as_step(o.get("step")),
                   as_str(o.get("action")), as_int(o.get("count"), 0))


@dataclass(frozen=True)
class CheckpointEvent(Event):
    """A checkpoint committed: `reason` periodic, snapshot, stop or final."""

    KIND: ClassVar[str] = "checkpoint"
    step: int = 0
    reason: str = ""
    path: str = ""
    bytes: int | None = None
    seconds: float | None = None

    @classmethod
    def _read(cls, o: Mapping[str, Any], t: float) -> CheckpointEvent | Unreadable:
        step = as_step(o.get("step"))
        if step is None:
            return Unreadable("checkpoint event", "no valid step")
        return cls(t, step, as_str(o.get("reason")), as_str(o.get("path")),
                   as_int(o.get("bytes"), 0), as_finite(o.get("seconds")))


@dataclass(frozen=True)
class CheckpointErrorEvent(Event):
    KIND: ClassVar[str] = "checkpoint_error"
    step: int | None = None
    reason: str = ""
    error: str = ""

    @classmethod
    def _read(cls, o: Mapping[str, Any], t: float) -> CheckpointErrorEvent:
        return cls(t, as_step(o.get("step")), as_str(o.get("reason")), as_str(o.get("error")))


@dataclass(frozen=True)
class PhaseEvent(Event):
    """The bandit began phase `phase` of `phase_len` steps after `step`, with these weights
    (and the scores of the phase that ended)."""

    KIND: ClassVar[str] = "phase"
    step: int = 0
    phase: int = 0
    phase_len: int | None = None
    weights: dict[str, float] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)

    @classmethod
    def _read(cls, o: Mapping[str, Any], t: float) -> PhaseEvent | Unreadable:
        step, phase = as_step(o.get("step")), as_int(o.get("phase"), 0)
        if step is None or phase is None:
            return Unreadable("phase event", "no valid step or phase")
        return cls(t, step, phase, as_int(o.get("phase_len"), 1), as_number_map(o.get("weights")),
                   as_number_map(o.get("scores")))


@dataclass(frozen=True)
class MixtureEvent(Event):
    """The data mixture moved: from `before` (the mixture at the last such event, or the
    first phase's) to `after` by at least MIXTURE_SHIFT on one source, at `step`. A loss that
    rises with it is the mixture's doing, not the model's (engine.run.alerts)."""

    KIND: ClassVar[str] = "mixture"
    step: int = 0
    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)

    @classmethod
    def _read(cls, o: Mapping[str, Any], t: float) -> MixtureEvent | Unreadable:
        step = as_step(o.get("step"))
        if step is None:
            return Unreadable("mixture event", "no valid step")
        return cls(t, step, as_number_map(o.get("before")), as_number_map(o.get("after")))

    def moves(self) -> list[tuple[str, float, float]]:
        """(source, before, after) for every source, the largest move first."""
        names = list(dict.fromkeys([*self.before, *self.after]))
        out = [(n, self.before.get(n, 0.0), self.after.get(n, 0.0)) for n in names]
        return sorted(out, key=lambda m: -abs(m[2] - m[1]))


MIXTURE_SHIFT = 0.2  # a source's weight moved this much: a mixture event


@dataclass(frozen=True)
class SkippedEvent(Event):
    """A non-finite gradient norm: the update of `step` was skipped."""

    KIND: ClassVar[str] = "skipped"
    step: int | None = None
    grad_norm: float = math.nan

    @classmethod
    def _read(cls, o: Mapping[str, Any], t: float) -> SkippedEvent:
        return cls(t, as_step(o.get("step")), as_float(o.get("grad_norm")))


@dataclass(frozen=True)
class StopEvent(Event):
    """The run ended before max_steps (stopped, or failed while stopping)."""

    KIND: ClassVar[str] = "stop"
    step: int | None = None
    status: str = ""

    @classmethod
    def _read(cls, o: Mapping[str, Any], t: float) -> StopEvent:
        return cls(t, as_step(o.get("step")), as_str(o.get("status")))


@dataclass(frozen=True)
class FinishedEvent(StopEvent):
    """The run reached max_steps."""

    KIND: ClassVar[str] = "finished"


@dataclass(frozen=True)
class ErrorEvent(Event):
    KIND: ClassVar[str] = "error"
    message: str = ""

    @classmethod
    def _read(cls, o: Mapping[str, Any], t: float) -> ErrorEvent:
        return cls(t, as_str(o.get("message")))

