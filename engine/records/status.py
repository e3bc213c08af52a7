"""A run's status (`state.json`, replaced atomically by the engine as the run moves on), the
checkpoint it names, and what the app reads from a checkpoint's own state.json.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from engine.records.health import Health, as_health
from engine.records.parse import Unreadable, as_finite, as_int, as_step, as_str


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
        step = as_step(obj.get("step"))
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
        step = as_step(obj.get("step"))
        return cls(status, step if step is not None else 0, as_int(obj.get("max_steps"), 1),
                   as_str(obj.get("backend")), as_str(obj.get("device")),
                   as_int(obj.get("pid"), 1), as_str(obj.get("run_id")),
                   CheckpointRef.from_json(obj.get("last_checkpoint")),
                   as_finite(obj.get("updated")), as_str(obj.get("error")),
                   as_health(obj.get("health")), as_str(obj.get("health_reason"))[:1000])


# A checkpoint's state.json: the GEMMs that ran in FP8, written by fp8 runs only
STATE_FP8_GEMMS = "fp8_gemms"
# what the backend resolved the config's gpu section to (what ran where the GPU could not honour
# the config): a resume that resolves otherwise says that its bits differ
STATE_GPU_RAN = "gpu_ran"
# the data mixture the last `mixture` event moved to (engine.run.mixture.MixtureWatch): a resumed
# run measures the mixture's moves from it
STATE_MIXTURE = "mixture"
# train/precision "fp8": the amax history of the delayed FP8 scales (engine.model.fp8.AmaxHistory
# .to_json), so that a resumed run scales as the run would have gone on
STATE_FP8_HISTORY = "fp8_amax_history"


def fp8_gemms_of(state: Any) -> list[str]:
    """The FP8 GEMMs a checkpoint's state.json names ([] when none, or not a list of names)."""
    got = state.get(STATE_FP8_GEMMS) if isinstance(state, Mapping) else None
    return [g[:32] for g in got[:16] if isinstance(g, str)] if isinstance(got, list) else []


def gpu_ran_of(state: Any) -> dict[str, bool | int | str]:
    """What a checkpoint's state.json says the backend ran ({} when it says nothing)."""
    got = state.get(STATE_GPU_RAN) if isinstance(state, Mapping) else None
    if not isinstance(got, Mapping):
        return {}
    return {str(k)[:64]: v for k, v in list(got.items())[:64]
            if isinstance(v, (bool, int, str)) and not (isinstance(v, str) and len(v) > 64)}
