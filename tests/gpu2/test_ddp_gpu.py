"""Data parallelism over NCCL on two GPUs: the CPU suite's scenarios (tests/test_ddp.py) with the
CUDA backend, so the gradients go through ncclAllReduce instead of the host stand-in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import tests.test_ddp as scenarios
from tests.conftest import micro_config_dict
from tests.test_ddp import (
    cfgs,  # noqa: F401 (a fixture)
    kill_9_of_one_rank_fails_the_job_in_bounded_time,
    signals_reach_every_rank_and_resume_is_bit_exact,
    torchrun_style_ranks_with_the_file_rendezvous,
    two_ranks_equal_one_rank_with_two_micro_batches,
)

pytestmark = pytest.mark.gpu2


@pytest.fixture(autouse=True)
def first_choice_gemms(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runs compared here each start afresh: cuBLASLt's first choices (gpu.gemm_tune false:
    no timing) give every one of them the same GEMM algorithms, so bit-for-bit comparisons
    compare the parallelism."""

    def untuned(**train: Any) -> dict[str, Any]:
        return {**micro_config_dict(**train), "gpu": {"gemm_tune": False}}

    monkeypatch.setattr(scenarios, "micro_config_dict", untuned)


def test_two_gpus_equal_one_gpu_with_two_micro_batches(tmp_path: Path, cfgs) -> None:  # noqa: F811
    two_ranks_equal_one_rank_with_two_micro_batches(tmp_path, cfgs, "cuda")


def test_signals_and_resume_on_two_gpus(tmp_path: Path, write_config) -> None:
    signals_reach_every_rank_and_resume_is_bit_exact(tmp_path, write_config, "cuda")


def test_kill_9_of_one_gpu_rank(tmp_path: Path, write_config) -> None:
    kill_9_of_one_rank_fails_the_job_in_bounded_time(tmp_path, write_config, "cuda")


def test_torchrun_style_and_file_rendezvous_on_two_gpus(tmp_path: Path, cfgs) -> None:  # noqa: F811
    torchrun_style_ranks_with_the_file_rendezvous(tmp_path, cfgs, "cuda")
