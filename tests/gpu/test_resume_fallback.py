"""A resume on a GPU that resolves the gpu section otherwise than the run before its checkpoint
did (cuDNN missing then, here now) says so in engine.log: the checkpoint keeps what ran
(state.json `gpu_ran`) and the resumed backend's choices are compared with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import micro_config_dict, run_engine

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
CUDA = ("--backend", "cuda")


def test_an_auto_attention_that_fell_back_is_said_to_differ_at_the_resume(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(micro_config_dict(max_steps=8, precision="bf16")))
    run = tmp_path / "run"
    r = run_engine(cfg, run, *CUDA, "--max-steps", "4", env={"ANDREA_CUDNN": "0"})
    assert r.returncode == 0, r.stderr
    state = json.loads(next((run / "checkpoints").glob("step_*4/state.json")).read_text())
    assert state["gpu_ran"]["attention"] == "classic"  # auto, without cuDNN
    r = run_engine(cfg, run, *CUDA, "--resume")
    assert r.returncode == 0, r.stderr
    log = (run / "engine.log").read_text()
    assert ('resume: gpu.attention ran as "classic" before the checkpoint and runs as "cudnn" '
            "now") in log, log[-3000:]
