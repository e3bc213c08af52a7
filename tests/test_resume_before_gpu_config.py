"""A checkpoint written before the config had a gpu section resumes bit for bit: the fixture's
run (tests/fixtures/resume-before-gpu-config/, numpy) stopped at its checkpoint of step 4 and
resumed to step 8 writes the very step records of its straight run to 8. Its GPU twin:
tests/gpu/test_train_resume.py."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_engine
from tests.resume_fixture import FIXTURES, install, step_records

FIXTURE = FIXTURES / "resume-before-gpu-config"


def test_the_fixture_is_a_checkpoint_from_before_the_gpu_section() -> None:
    state = json.loads((FIXTURE / "run/checkpoints/step_00000004/state.json").read_text())
    assert state["step"] == 4 and "gpu" not in state["config"]
    assert len(step_records(FIXTURE / "loss.jsonl")) == 8


def test_it_resumes_at_4_and_trains_to_8_as_the_straight_run_did(tmp_path: Path) -> None:
    config, run = install(FIXTURE, tmp_path / "fixture")
    r = run_engine(config, run, "--resume")
    assert r.returncode == 0, r.stderr
    resumed = step_records(run / "loss.jsonl")
    assert [x["step"] for x in resumed] == [5, 6, 7, 8]
    assert resumed == step_records(FIXTURE / "loss.jsonl")[4:]
    log = (run / "engine.log").read_text()
    assert ("resume: the checkpoint's config has no gpu section (written before it existed): "
            "its run's settings go on as gpu: the defaults") in log, log[-2000:]
    assert "NOT used" not in r.stderr  # the given config is the run's: nothing to warn about
    final = json.loads((run / "checkpoints/step_00000008/state.json").read_text())
    assert final["config"]["gpu"]["attention"] == "auto"  # the run's config now holds it
