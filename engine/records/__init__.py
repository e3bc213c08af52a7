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

Everyone imports the contract from here (`from engine import records as rec`); its modules:
`parse` (the reading helpers, `Unreadable`), `steps` (the step record, the abandoned-timeline
rule), `sequence` (the step-sequence rule), `events` (the event kinds), `health` (alerts and the
run's health), `outputs` (samples, validation, telemetry), `status` (state.json) and
`engine_info` (engine.json).

Standard library only: the engine, the app, the checkpoint tools and the tests all import it.
"""

from engine.records.engine_info import EngineInfo, RankInfo
from engine.records.events import (
    MIXTURE_SHIFT,
    CheckpointErrorEvent,
    CheckpointEvent,
    ErrorEvent,
    Event,
    FinishedEvent,
    IgnoredSetting,
    MixtureEvent,
    OtherEvent,
    PhaseEvent,
    PrepEvent,
    ReadyEvent,
    ResumeEvent,
    SignalEvent,
    SkippedCheckpoint,
    SkippedEvent,
    StartEvent,
    StopEvent,
    ignored_advice,
)
from engine.records.health import ALERT_KINDS, AlertEvent, Health, HealthEvent, as_health
from engine.records.outputs import EvalRecord, GpuSample, Sample, SystemRecord
from engine.records.parse import (
    STEP_MAX,
    Unreadable,
    as_finite,
    as_float,
    as_int,
    as_number_map,
    as_opt_str,
    as_optional_number_map,
    as_step,
    as_str,
    parse_all,
)
from engine.records.sequence import (
    HELD_MAX,
    SEQUENCE_CONFIRM,
    STEP_GAP_MAX,
    StepOrder,
    follows,
    impossible_step,
    out_of_sequence,
    restart_point,
)
from engine.records.status import (
    LIVE_STATUSES,
    STATE_FP8_GEMMS,
    STATE_FP8_HISTORY,
    STATE_GPU_RAN,
    STATE_MIXTURE,
    CheckpointRef,
    RunStatus,
    Status,
    fp8_gemms_of,
    gpu_ran_of,
)
from engine.records.steps import StepRecord, abandoned, drop_abandoned, latest_by_step

__all__ = [
    "ALERT_KINDS",
    "HELD_MAX",
    "LIVE_STATUSES",
    "MIXTURE_SHIFT",
    "SEQUENCE_CONFIRM",
    "STATE_FP8_GEMMS",
    "STATE_FP8_HISTORY",
    "STATE_GPU_RAN",
    "STATE_MIXTURE",
    "STEP_GAP_MAX",
    "STEP_MAX",
    "AlertEvent",
    "CheckpointErrorEvent",
    "CheckpointEvent",
    "CheckpointRef",
    "EngineInfo",
    "ErrorEvent",
    "EvalRecord",
    "Event",
    "FinishedEvent",
    "GpuSample",
    "Health",
    "HealthEvent",
    "IgnoredSetting",
    "MixtureEvent",
    "OtherEvent",
    "PhaseEvent",
    "PrepEvent",
    "RankInfo",
    "ReadyEvent",
    "ResumeEvent",
    "RunStatus",
    "Sample",
    "SignalEvent",
    "SkippedCheckpoint",
    "SkippedEvent",
    "StartEvent",
    "Status",
    "StepOrder",
    "StepRecord",
    "StopEvent",
    "SystemRecord",
    "Unreadable",
    "abandoned",
    "as_finite",
    "as_float",
    "as_health",
    "as_int",
    "as_number_map",
    "as_opt_str",
    "as_optional_number_map",
    "as_step",
    "as_str",
    "drop_abandoned",
    "follows",
    "fp8_gemms_of",
    "gpu_ran_of",
    "ignored_advice",
    "impossible_step",
    "latest_by_step",
    "out_of_sequence",
    "parse_all",
    "restart_point",
]
