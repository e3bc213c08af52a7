"""What a run writes beside its step records and events: text samples (`samples.jsonl`),
validation losses (`eval.jsonl`) and the system telemetry (`system.jsonl`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from engine.records.parse import (
    Unreadable,
    as_finite,
    as_float,
    as_int,
    as_number_map,
    as_step,
    as_str,
)

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
        return cls(as_step(obj.get("step")), as_float(obj.get("t")),
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
        step = as_step(obj.get("step"))
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
        return cls(t, as_step(obj.get("step")), as_float(obj.get("cpu_pct")),
                   as_int(obj.get("rss_bytes"), 0),
                   [g for g in map(GpuSample.from_json, gpus[:256]) if g is not None]
                   if isinstance(gpus, list) else [])
