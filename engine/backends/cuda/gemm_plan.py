"""`gemm_plan.json`: the GEMM algorithms a CUDA run chose, kept in its run directory so that a
run started or resumed there computes with the very same ones (its bits must not depend on a
new timing). Written by the training loop from `LtGemm.export_plan()`, read back into
`LtGemm.import_plan()`; nothing else reads it (the app does not).

Like engine.records' classes: a writer-side `to_json()` and a tolerant `from_json()` that turns
a hostile field into a neutral value and an unusable file into an `Unreadable` (never an
exception). Importing this needs no GPU (nor pycuda).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.records import Unreadable, as_finite, as_int, as_str
from engine.runfiles import RunPaths, read_json


@dataclass(frozen=True)
class GemmAlgo:
    """One GEMM problem's algorithm: the opaque cublasLtMatmulAlgo_t (hex of its 64 bytes), the
    time it took when chosen, its rank in cuBLASLt's heuristic (0 = the heuristic's first
    choice), that first choice's time, and how many candidates were timed."""

    algo: str
    ms: float | None = None
    rank: int | None = None
    top1_ms: float | None = None
    candidates: int | None = None

    @classmethod
    def from_json(cls, obj: Any) -> GemmAlgo | Unreadable:
        if not isinstance(obj, Mapping):
            return Unreadable("gemm algorithm", f"not an object ({type(obj).__name__})")
        algo = obj.get("algo")
        if not isinstance(algo, str) or len(algo) != 128 or \
                any(c not in "0123456789abcdef" for c in algo):
            return Unreadable("gemm algorithm", "algo: expected 128 hex digits")
        return cls(algo, as_finite(obj.get("ms")), as_int(obj.get("rank"), 0),
                   as_finite(obj.get("top1_ms")), as_int(obj.get("candidates"), 0))


# a choice's variants, each pair timed against each other: GELU in an MLP GEMM's epilogue or the
# plain GEMM and the GELU kernel; a linear map's GEMM (train/precision fp8) in FP8 or in bf16
CHOICE_PAIRS = (("epilogue", "kernel"), ("fp8", "bf16"))
CHOICE_USES = tuple(u for pair in CHOICE_PAIRS for u in pair)


def choice_pair(use: str) -> tuple[str, str]:
    """The two variants a choice of `use` was made between."""
    return next(pair for pair in CHOICE_PAIRS if use in pair)


@dataclass(frozen=True)
class GemmChoice:
    """For one MLP GEMM: the variant it runs (`use`, one of CHOICE_USES) and the timings behind
    the choice (ms of each variant of its pair; None: not timed, or it would not run)."""

    use: str
    epilogue_ms: float | None = None
    kernel_ms: float | None = None
    fp8_ms: float | None = None
    bf16_ms: float | None = None


@dataclass(frozen=True)
class GemmPlan:
    """`gemm_plan.json`: the GEMM algorithms a run chose by timing (CUDA backend), kept so that a
    resumed run uses the very same ones (bit-exact resume must not depend on re-timing).
    `library` and `device` say where it was made; a plan from elsewhere is not used."""

    version: int
    library: str
    device: str
    gemms: dict[str, GemmAlgo] = field(default_factory=dict)
    choices: dict[str, GemmChoice] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "library": self.library, "device": self.device,
                "gemms": {k: {f.name: getattr(a, f.name) for f in fields(a)}
                          for k, a in self.gemms.items()},
                "choices": {k: {f.name: getattr(c, f.name) for f in fields(c)
                                if f.name == "use" or f.name[:-3] in choice_pair(c.use)}
                            for k, c in self.choices.items()}}

    @classmethod
    def from_json(cls, obj: Any) -> GemmPlan | Unreadable:
        if not isinstance(obj, Mapping):
            return Unreadable("gemm_plan.json", f"not an object ({type(obj).__name__})")
        version = as_int(obj.get("version"), 1)
        if version is None:
            return Unreadable("gemm_plan.json", f"version: expected an integer >= 1, got "
                              f"{obj.get('version')!r:.40}")
        gemms: dict[str, GemmAlgo] = {}
        raw = obj.get("gemms")
        for k, v in (raw.items() if isinstance(raw, Mapping) else ()):
            a = GemmAlgo.from_json(v)
            if not isinstance(a, Unreadable):
                gemms[str(k)] = a
        choices: dict[str, GemmChoice] = {}
        raw = obj.get("choices")
        for k, v in (raw.items() if isinstance(raw, Mapping) else ()):
            if isinstance(v, Mapping) and v.get("use") in CHOICE_USES:
                choices[str(k)] = GemmChoice(v["use"], **{
                    f"{u}_ms": as_finite(v.get(f"{u}_ms")) for u in choice_pair(v["use"])})
        return cls(version, as_str(obj.get("library")), as_str(obj.get("device")), gemms,
                   choices)


def read_gemm_plan(run_dir: Path) -> GemmPlan | Unreadable:
    """The run directory's gemm_plan.json, typed."""
    obj = read_json(RunPaths(Path(run_dir)).gemm_plan)
    if obj is None:
        return Unreadable("gemm_plan.json", "missing, unreadable or not a JSON object")
    return GemmPlan.from_json(obj)
