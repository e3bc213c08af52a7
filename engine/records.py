"""The run-directory contract as code (DESIGN §7): every record the engine writes and the app reads.

One typed class per record: the `loss.jsonl` step record, each `events.jsonl` event kind, a
`samples.jsonl` sample, an `eval.jsonl` validation record, a `system.jsonl` telemetry sample,
the run's `state.json` and `engine.json`. Each class has one writer-side
`to_json()` (the exact fields on disk) and one tolerant reader-side `from_json()`: a field that is
missing, of the wrong type or out of range becomes a neutral value (NaN, None, empty), and a
record that cannot be used at all (no valid step, not an object, an unknown status) comes back as
an `Unreadable` value that says why — never an exception. Readers ignore fields they do not know.

The abandoned-timeline rule (`abandoned`) and the step-sequence rule (`out_of_sequence`,
`StepOrder`: which step records cannot be the run's) live here too, once, for every reader.

Standard library only: the engine, the app, the checkpoint tools and the tests all import it.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar

STEP_MAX = 2**63 - 1  # steps are int64 wherever they are stored


# ---------------------------------------------------------------- reading helpers


@dataclass(frozen=True)
class Unreadable:
    """A record the reader could not use; falsy, and says why."""

    what: str
    reason: str

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return f"unreadable {self.what}: {self.reason}"


def as_int(x: Any, lo: int = -STEP_MAX, hi: int = STEP_MAX) -> int | None:
    """An int in [lo, hi] (bool is not an int here), else None."""
    if isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi:
        return x
    return None


def as_float(x: Any) -> float:
    """A number as float (NaN and infinities kept: a skipped step logs them); else NaN."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return math.nan
    try:
        return float(x)
    except OverflowError:  # an int beyond float range
        return math.inf if x > 0 else -math.inf


def as_finite(x: Any) -> float | None:
    """A finite number as float, else None."""
    f = as_float(x)
    return f if math.isfinite(f) else None


def as_str(x: Any, default: str = "") -> str:
    return x if isinstance(x, str) else default


def as_opt_str(x: Any) -> str | None:
    return x if isinstance(x, str) else None


def as_number_map(x: Any) -> dict[str, float]:
    """{name: finite float}: entries with other values are left out."""
    if not isinstance(x, Mapping):
        return {}
    out = {}
    for k, v in x.items():
        f = as_finite(v)
        if f is not None:
            out[str(k)] = f
    return out


def as_optional_number_map(x: Any) -> dict[str, float | None]:
    """{name: finite float or None} (a source with no sequence this step logs null)."""
    if not isinstance(x, Mapping):
        return {}
    return {str(k): as_finite(v) for k, v in x.items()}


def _valid_step(x: Any) -> int | None:
    return as_int(x, 0, STEP_MAX)


# ---------------------------------------------------------------- the step record (loss.jsonl)


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
        step = _valid_step(obj.get("step"))
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


# ---------------------------------------------------------------- the step sequence

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


# ---------------------------------------------------------------- events (events.jsonl)


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
                   as_str(o.get("device")), _valid_step(o.get("step")),
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
        step = _valid_step(o.get("step"))
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
        return cls(t, as_str(o.get("signal")), _valid_step(o.get("step")),
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
        step = _valid_step(o.get("step"))
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
        return cls(t, _valid_step(o.get("step")), as_str(o.get("reason")), as_str(o.get("error")))


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
        step, phase = _valid_step(o.get("step")), as_int(o.get("phase"), 0)
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
        step = _valid_step(o.get("step"))
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
        return cls(t, _valid_step(o.get("step")), as_float(o.get("grad_norm")))


@dataclass(frozen=True)
class StopEvent(Event):
    """The run ended before max_steps (stopped, or failed while stopping)."""

    KIND: ClassVar[str] = "stop"
    step: int | None = None
    status: str = ""

    @classmethod
    def _read(cls, o: Mapping[str, Any], t: float) -> StopEvent:
        return cls(t, _valid_step(o.get("step")), as_str(o.get("status")))


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


ALERT_KINDS = ("loss_spike", "grad_spike", "nonfinite", "stall", "slow", "diverging")


@dataclass(frozen=True)
class AlertEvent(Event):
    """Something a practitioner wants to hear about at once, raised by the engine: `alert` (the
    `kind` field on disk) is one of ALERT_KINDS; `value` is what was seen (a loss, a grad norm,
    seconds without a step, tok/s), `baseline` what was expected (the window's median, what the
    step's mixture predicts, ln(vocab_size), the best smoothed loss) and `threshold` the line
    `value` crossed; `message` says it in words: what happened, by how much, against what, and
    what a user might do."""

    KIND: ClassVar[str] = "alert"
    alert: str = ""
    step: int | None = None
    value: float = math.nan
    baseline: float = math.nan
    threshold: float = math.nan
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"t": self.t, "event": self.KIND, "kind": self.alert, "step": self.step,
                "value": self.value, "baseline": self.baseline, "threshold": self.threshold,
                "message": self.message}

    def details(self) -> dict[str, Any]:
        return {"kind": self.alert, "step": self.step, "value": self.value,
                "baseline": self.baseline, "threshold": self.threshold, "message": self.message}

    @classmethod
    def _read(cls, o: Mapping[str, Any], t: float) -> AlertEvent:
        return cls(t, as_str(o.get("kind"))[:32], _valid_step(o.get("step")),
                   as_float(o.get("value")), as_float(o.get("baseline")),
                   as_float(o.get("threshold")), as_str(o.get("message"))[:1000])


class Health(str, Enum):
    """A run's health as the engine judges it (engine.run.health), so that every viewer says
    the same: `healthy`; `warning` (a recent spike, slow throughput); `diverging` (the loss is
    running away); `stalled` (no step for far longer than the run's pace); `failed`."""

    HEALTHY = "healthy"
    WARNING = "warning"
    DIVERGING = "diverging"
    STALLED = "stalled"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


def as_health(x: Any) -> Health | None:
    """A Health from a run file's value; None for anything else (older runs have none)."""
    try:
        return Health(x)
    except ValueError:
        return None


@dataclass(frozen=True)
class HealthEvent(Event):
    """The engine's judgement of the run changed (engine.run.health): `state` now, from `step`,
    and why in words (`reason`: what happened, by how much, against what)."""

    KIND: ClassVar[str] = "health"
    state: Health = Health.HEALTHY
    step: int | None = None
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"t": self.t, "event": self.KIND, "state": self.state.value, "step": self.step,
                "reason": self.reason}

    def details(self) -> dict[str, Any]:
        return {"state": self.state.value, "step": self.step, "reason": self.reason}

    @classmethod
    def _read(cls, o: Mapping[str, Any], t: float) -> HealthEvent | Unreadable:
        state = as_health(o.get("state"))
        if state is None:
            return Unreadable("health event", f"unknown state {o.get('state')!r:.40}")
        return cls(t, state, _valid_step(o.get("step")), as_str(o.get("reason"))[:1000])


# ---------------------------------------------------------------- samples (samples.jsonl)


@dataclass(frozen=True)
class Sample:
    """A text generated at `step` from `prompt`."""

    step: int | None
    t: float
    prompt: str
    text: str

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "t": self.t, "prompt": self.prompt, "text": self.text}

    @classmethod
    def from_json(cls, obj: Any) -> Sample | Unreadable:
        if not isinstance(obj, Mapping) or not isinstance(obj.get("text"), str):
            return Unreadable("sample", "not an object with a text")
        return cls(_valid_step(obj.get("step")), as_float(obj.get("t")),
                   as_str(obj.get("prompt")), obj["text"])


# ---------------------------------------------------------------- validation (eval.jsonl)


@dataclass(frozen=True)
class EvalRecord:
    """The validation loss at `step`: the mean over the held-out windows of every source
    (`val_loss`) and each source's own (`src_val_loss`)."""

    step: int
    t: float
    val_loss: float
    src_val_loss: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "t": self.t, "val_loss": self.val_loss,
                "src_val_loss": dict(self.src_val_loss)}

    @classmethod
    def from_json(cls, obj: Any) -> EvalRecord | Unreadable:
        if not isinstance(obj, Mapping):
            return Unreadable("eval record", f"not an object ({type(obj).__name__})")
        step = _valid_step(obj.get("step"))
        if step is None:
            return Unreadable("eval record", "no valid step")
        return cls(step, as_float(obj.get("t")), as_float(obj.get("val_loss")),
                   as_number_map(obj.get("src_val_loss")))


# ---------------------------------------------------------------- telemetry (system.jsonl)


@dataclass(frozen=True)
class GpuSample:
    """One GPU as NVML saw it: `util` percent busy, memory in bytes, `power_w` watts, `temp_c`
    degrees Celsius, `sm_clock_mhz` the SM clock. A value NVML would not give is NaN/None."""

    index: int
    name: str = ""
    util: float = math.nan
    mem_used: int | None = None
    mem_total: int | None = None
    power_w: float = math.nan
    temp_c: float = math.nan
    sm_clock_mhz: float = math.nan

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, obj: Any) -> GpuSample | None:
        if not isinstance(obj, Mapping):
            return None
        index = as_int(obj.get("index"), 0, 1 << 16)
        if index is None:
            return None
        return cls(index, as_str(obj.get("name"))[:128], as_float(obj.get("util")),
                   as_int(obj.get("mem_used"), 0), as_int(obj.get("mem_total"), 0),
                   as_float(obj.get("power_w")), as_float(obj.get("temp_c")),
                   as_float(obj.get("sm_clock_mhz")))


@dataclass(frozen=True)
class SystemRecord:
    """A line of `system.jsonl`, sampled every few seconds by the engine: the step it had
    reached, its own CPU use (percent of one core since the last sample) and resident memory,
    and each GPU it trains on."""

    t: float
    step: int | None = None
    cpu_pct: float = math.nan
    rss_bytes: int | None = None
    gpus: list[GpuSample] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"t": self.t, "step": self.step, "cpu_pct": self.cpu_pct,
                "rss_bytes": self.rss_bytes, "gpus": [g.to_json() for g in self.gpus]}

    @classmethod
    def from_json(cls, obj: Any) -> SystemRecord | Unreadable:
        if not isinstance(obj, Mapping):
            return Unreadable("system record", f"not an object ({type(obj).__name__})")
        t = as_finite(obj.get("t"))
        if t is None:
            return Unreadable("system record", "no valid time")
        gpus = obj.get("gpus")
        return cls(t, _valid_step(obj.get("step")), as_float(obj.get("cpu_pct")),
                   as_int(obj.get("rss_bytes"), 0),
                   [g for g in map(GpuSample.from_json, gpus[:256]) if g is not None]
                   if isinstance(gpus, list) else [])


# ---------------------------------------------------------------- the run's status (state.json)


class Status(str, Enum):
    """A run's status in `state.json`; `live` ones have (or should have) an engine behind them."""

    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def live(self) -> bool:
        return self in LIVE_STATUSES

    def __str__(self) -> str:
        return self.value


LIVE_STATUSES = frozenset({Status.STARTING, Status.RUNNING, Status.STOPPING})


@dataclass(frozen=True)
class CheckpointRef:
    """Where the newest checkpoint of a run is."""

    path: str
    step: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "step": self.step, "reason": self.reason}

    @classmethod
    def from_json(cls, obj: Any) -> CheckpointRef | None:
        if not isinstance(obj, Mapping):
            return None
        step = _valid_step(obj.get("step"))
        if step is None:
            return None
        return cls(as_str(obj.get("path")), step, as_str(obj.get("reason")))


@dataclass(frozen=True)
class RunStatus:
    """`state.json`: replaced atomically by the engine as the run moves on."""

    status: Status
    step: int = 0
    max_steps: int | None = None
    backend: str = ""
    device: str = ""
    pid: int | None = None
    run_id: str = ""
    last_checkpoint: CheckpointRef | None = None
    updated: float | None = None
    error: str = ""  # status `failed`: why, and where a resume continues ("" otherwise)
    health: Health | None = None  # the engine's judgement now (None: runs that never said)
    health_reason: str = ""  # why, in words ("" when healthy)

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status.value, "step": self.step, "max_steps": self.max_steps,
                "backend": self.backend, "device": self.device, "pid": self.pid,
                "run_id": self.run_id,
                "last_checkpoint": self.last_checkpoint.to_json() if self.last_checkpoint
                else None, "updated": self.updated, "error": self.error,
                "health": self.health.value if self.health else None,
                "health_reason": self.health_reason}

    @classmethod
    def from_json(cls, obj: Any) -> RunStatus | Unreadable:
        if not isinstance(obj, Mapping):
            return Unreadable("state.json", f"not an object ({type(obj).__name__})")
        try:
            status = Status(obj.get("status"))
        except ValueError:
            return Unreadable("state.json", f"unknown status {obj.get('status')!r:.40}")
        step = _valid_step(obj.get("step"))
        return cls(status, step if step is not None else 0, as_int(obj.get("max_steps"), 1),
                   as_str(obj.get("backend")), as_str(obj.get("device")),
                   as_int(obj.get("pid"), 1), as_str(obj.get("run_id")),
                   CheckpointRef.from_json(obj.get("last_checkpoint")),
                   as_finite(obj.get("updated")), as_str(obj.get("error")),
                   as_health(obj.get("health")), as_str(obj.get("health_reason"))[:1000])



# ---------------------------------------------------------------- the engine's identity


@dataclass(frozen=True)
class RankInfo:
    """One rank of a data-parallel job: its process, host and device."""

    rank: int
    pid: int
    host: str
    device: str

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": self.pid, "host": self.host, "device": self.device}

    @classmethod
    def from_json(cls, obj: Any) -> RankInfo | None:
        if not isinstance(obj, Mapping):
            return None
        rank, pid = as_int(obj.get("rank"), 0), as_int(obj.get("pid"), 1)
        if rank is None or pid is None:
            return None
        return cls(rank, pid, as_str(obj.get("host")), as_str(obj.get("device")))


@dataclass(frozen=True)
class EngineInfo:
    """`engine.json`: who the engine of a run directory is, for verified control (DESIGN §8):
    `start_time` is field 22 of /proc/PID/stat (clock ticks since boot), `boot_id` the kernel's."""

    pid: int
    start_time: int | None  # None where /proc gave none (then no controller can verify it)
    boot_id: str
    host: str = ""
    run_id: str = ""
    argv: list[str] = field(default_factory=list)
    started_at: float | None = None
    launcher: str = "single"  # single | andrea (andrea-train --gpus) | torchrun | slurm
    world_size: int = 1
    ranks: list[RankInfo] = field(default_factory=list)  # a data-parallel job's ranks

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["ranks"] = [r.to_json() for r in self.ranks]
        return out

    @classmethod
    def from_json(cls, obj: Any) -> EngineInfo | Unreadable:
        if not isinstance(obj, Mapping):
            return Unreadable("engine.json", f"not an object ({type(obj).__name__})")
        pid, boot = as_int(obj.get("pid"), -(2**31), 2**31 - 1), as_opt_str(obj.get("boot_id"))
        if pid is None or boot is None:
            return Unreadable("engine.json", f"pid: expected an integer, got "
                              f"{obj.get('pid')!r:.40}" if pid is None else "no boot_id")
        argv = obj.get("argv")
        ranks = obj.get("ranks")
        return cls(pid, as_int(obj.get("start_time"), 0), boot, as_str(obj.get("host")),
                   as_str(obj.get("run_id")),
                   [str(a) for a in argv] if isinstance(argv, list) else [],
                   as_finite(obj.get("started_at")), as_str(obj.get("launcher"), "single"),
                   as_int(obj.get("world_size"), 1, 1 << 16) or 1,
                   [r for r in map(RankInfo.from_json, ranks[:4096]) if r is not None]
                   if isinstance(ranks, list) else [])


# A checkpoint's state.json: the GEMMs that ran in FP8, written by fp8 runs only
STATE_FP8_GEMMS = "fp8_gemms"


def fp8_gemms_of(state: Any) -> list[str]:
    """The FP8 GEMMs a checkpoint's state.json names ([] when none, or not a list of names)."""
    got = state.get(STATE_FP8_GEMMS) if isinstance(state, Mapping) else None
    return [g[:32] for g in got[:16] if isinstance(g, str)] if isinstance(got, list) else []


def parse_all(reader: Any, objects: Iterable[Any]) -> tuple[list[Any], int]:
    """`reader.from_json` over `objects`: (the readable records, how many were not)."""
    out, bad = [], 0
    for o in objects:
        r = reader.from_json(o)
        if isinstance(r, Unreadable):
            bad += 1
        else:
            out.append(r)
    return out, bad
