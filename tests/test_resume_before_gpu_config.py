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


def test_a_gpu_run_s_old_checkpoint_resumed_with_its_own_config_warns_of_nothing(
        tmp_path: Path) -> None:
    """The GPU fixture's record translates to a gpu section other than the defaults; its own
    config, which sets no gpu section, gave none of it: no "NOT used" warning (here on the
    numpy backend, in fp32: the translation and the warning are the loop's, not the GPU's)."""
    config, run = install(FIXTURES / "resume-before-gpu-config-cuda", tmp_path / "fixture")
    r = run_engine(config, run, "--resume", "--precision", "fp32")
    assert r.returncode == 0, r.stderr
    log = (run / "engine.log").read_text()
    assert "its run's settings go on as gpu: fusions true" in log, log[-2000:]
    assert "NOT used" not in r.stderr, r.stderr
    assert [x["step"] for x in step_records(run / "loss.jsonl")] == [5, 6, 7, 8]
