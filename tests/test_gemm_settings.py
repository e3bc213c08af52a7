"""The GEMM plan and the tuner's settings, on the CPU (no GPU, no pycuda): gemm_plan.json's
record (engine/backends/cuda/gemm_plan.py) reads back what it wrote and reads hostile input as
neutral values or Unreadable; the run directory's file; the config's gpu.gemm_candidates and
how LtGemm asks cuBLASLt's heuristic for that many proposals while it tunes."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from engine import records as rec
from engine.backends.cuda.gemm import CANDIDATES, LtGemm, _Problem
from engine.backends.cuda.gemm_plan import GemmAlgo, GemmChoice, GemmPlan, read_gemm_plan
from engine.config import ConfigError, GpuConfig, parse_config
from engine.errors import RunError
from engine.runfiles import RunPaths, write_json_atomic
from tests.conftest import ROOT, micro_config_dict

PLAN = GemmPlan(
    version=1, library="cublasLt 130000", device="NVIDIA H200 (sm_90, 141 GiB, bf16)",
    gemms={"8192x2304x768 NN": GemmAlgo("0123456789abcdef" * 8, ms=0.05, rank=3,
                                        top1_ms=0.06, candidates=8),
           "8x8x8 TN": GemmAlgo("f" * 128)},
    choices={"mlp_fwd R=8192 d=768 F=3072": GemmChoice("kernel", 0.09, 0.07),
             "fp8 fc2 dgrad": GemmChoice("bf16", fp8_ms=0.31, bf16_ms=0.29),
             "fp8 fc1 fwd": GemmChoice("fp8", fp8_ms=0.18, bf16_ms=None)})


def roundtrip(obj: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(obj))


def test_gemm_plan_reads_back_what_it_wrote() -> None:
    assert GemmPlan.from_json(roundtrip(PLAN.to_json())) == PLAN
    assert GemmPlan.from_json(roundtrip(GemmPlan(1, "l", "d").to_json())) == GemmPlan(1, "l", "d")


def test_a_choice_keeps_the_times_of_its_own_pair() -> None:
    """GELU choices keep epilogue_ms and kernel_ms, FP8 choices fp8_ms and bf16_ms; a time of
    the other pair is not written, nor read."""
    obj = PLAN.to_json()["choices"]
    assert obj["mlp_fwd R=8192 d=768 F=3072"] == {"use": "kernel", "epilogue_ms": 0.09,
                                                  "kernel_ms": 0.07}
    assert obj["fp8 fc2 dgrad"] == {"use": "bf16", "fp8_ms": 0.31, "bf16_ms": 0.29}
    mixed = {"use": "fp8", "fp8_ms": 0.2, "epilogue_ms": 9.0}
    got = GemmPlan.from_json({"version": 1, "choices": {"x": mixed}})
    assert isinstance(got, GemmPlan) and got.choices["x"] == GemmChoice("fp8", fp8_ms=0.2)


def test_a_hostile_gemm_plan_reads_as_unreadable_or_drops_the_bad_entries() -> None:
    assert isinstance(GemmPlan.from_json([1, 2]), rec.Unreadable)
    assert isinstance(GemmPlan.from_json({"version": "one"}), rec.Unreadable)
    obj = PLAN.to_json()
    obj["gemms"]["bad hex"] = {"algo": "xyz"}
    obj["gemms"]["short"] = {"algo": "ab"}
    obj["gemms"]["not a map"] = 7
    obj["choices"]["odd"] = {"use": "sometimes"}
    obj["gemms"]["8x8x8 TN"]["ms"] = "fast"
    got = GemmPlan.from_json(roundtrip(obj))
    assert isinstance(got, GemmPlan)
    assert set(got.gemms) == set(PLAN.gemms) and set(got.choices) == set(PLAN.choices)
    assert got.gemms["8x8x8 TN"].ms is None


def test_gemm_plan_file_in_the_run_directory(tmp_path) -> None:
    assert isinstance(read_gemm_plan(tmp_path), rec.Unreadable)
    write_json_atomic(RunPaths(tmp_path).gemm_plan, PLAN.to_json())
    assert RunPaths(tmp_path).gemm_plan.name == "gemm_plan.json"
    assert read_gemm_plan(tmp_path) == PLAN
    RunPaths(tmp_path).gemm_plan.write_text("{not json")
    assert isinstance(read_gemm_plan(tmp_path), rec.Unreadable)


def test_candidates_default_to_the_config_s() -> None:
    assert CANDIDATES == GpuConfig().gemm_candidates == 8


@pytest.mark.parametrize("bad", [0, 65, "many", 8.5, True])
def test_a_bad_candidates_value_is_named_with_its_file(bad: Any) -> None:
    cfg = micro_config_dict()
    cfg["gpu"] = {"gemm_candidates": bad}
    with pytest.raises(ConfigError, match=r"^cfg\.json: gpu\.gemm_candidates: must be"):
        parse_config(cfg, "cfg.json", ROOT)


def _tuner(candidates: int, tuning: bool) -> tuple[LtGemm, list[int]]:
    """An LtGemm whose heuristic records how many proposals it was asked for and proposes
    none (so `_choose` stops there): no cuBLASLt needed."""
    asked: list[int] = []
    gemm = LtGemm.__new__(LtGemm)
    gemm.candidates, gemm.tuning, gemm.timer = candidates, tuning, None
    gemm._imported = {}

    def heuristics(p: Any, aligns: Any, n: int) -> list[Any]:
        asked.append(n)
        return []

    gemm._heuristics = heuristics  # type: ignore[method-assign]
    return gemm, asked


@pytest.mark.parametrize(("tuning", "expected"), [(True, 32), (False, 1)])
def test_the_tuner_asks_the_heuristic_for_its_candidates(tuning: bool, expected: int) -> None:
    gemm, asked = _tuner(32, tuning)
    problem = _Problem(desc=SimpleNamespace(), layouts=(None, None, None))  # type: ignore[arg-type]
    with pytest.raises(RunError, match="proposes no algorithm"):
        gemm._choose("8x8x8 NN", problem, (256, 256, 256), lambda algo: 0)
    assert asked == [expected]
