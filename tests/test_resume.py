"""Checkpoints, signals and resume with real engine processes and real signals (DESIGN §6, §8)."""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import (
    engine_cmd,
    loss_records,
    micro_config_dict,
    run_engine,
    start_engine,
    wait_for_step,
)

KEYS = ("step", "loss", "grad_norm", "clip_scale", "lr", "tokens", "phase", "phase_step",
        "weights", "src_loss")
N = 40


def trajectory(run: Path) -> list[tuple]:
    return [tuple(json.dumps(getattr(r, k), sort_keys=True) for k in KEYS) for r in loss_records(run)]


def final_bytes(run: Path, step: int = N) -> bytes:
    return (run / "checkpoints" / f"step_{step:08d}" / "model.ckpt").read_bytes()


def events(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines() if ln]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, prepared_data) -> dict:
    """Reference runs of N steps without interruption, one per micro-batching setting."""
    out = {}
    base = tmp_path_factory.mktemp("straight")
    for accum in (1, 2):
        cfg = base / f"cfg{accum}.json"
        cfg.write_text(json.dumps(micro_config_dict(max_steps=N, grad_accum=accum)))
        run = base / f"run{accum}"
        r = run_engine(cfg, run)
        assert r.returncode == 0, r.stdout + r.stderr
        out[accum] = {"cfg": cfg, "run": run, "traj": trajectory(run), "bytes": final_bytes(run),
                      "recs": loss_records(run)}
    return out


def stop_at(cfg: Path, run: Path, k: int) -> int:
    """Start the engine, SIGTERM it once step k-1 is logged, return the step it stopped at."""
    proc = start_engine(cfg, run)
    wait_for_step(run, k - 1, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    state = json.loads((run / "state.json").read_text())
    assert state["status"] == "stopped", state
    stops = [e for e in events(run) if e["event"] == "checkpoint" and e["reason"] == "stop"]
    assert stops, "no stop checkpoint"
    return stops[-1]["step"]


def phase_boundary(recs: list) -> int:
    """A step that ends a bandit phase (the next step starts a new one), not too close to N."""
    return next(r.step for r in recs if r.phase_step == r.phase_len and 3 < r.step < N - 3)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["inside-phase", "phase-boundary", "grad-accum-2"])
def test_sigterm_and_resume_is_bit_exact(case: str, straight: dict, tmp_path: Path) -> None:
    accum = 2 if case == "grad-accum-2" else 1
    ref = straight[accum]
    if case == "phase-boundary":
        target = phase_boundary(ref["recs"])
    else:
        target = next(r.step for r in ref["recs"] if r.step > 12 and r.phase_step < r.phase_len - 1)
    for _attempt in range(3):  # the stop lands at the step in flight when SIGTERM arrives
        run = tmp_path / f"run{_attempt}"
        k = stop_at(ref["cfg"], run, target)
        if k == target:
            break
    rec_k = next(r for r in ref["recs"] if r.step == k)
    if case == "phase-boundary":
        assert rec_k.phase_step == rec_k.phase_len, "did not stop on a phase boundary"
    elif case == "inside-phase":
        assert rec_k.phase_step < rec_k.phase_len
    assert 0 < k < N
    r = run_engine(ref["cfg"], run, "--resume")
    assert r.returncode == 0, r.stdout + r.stderr
    assert trajectory(run) == ref["traj"]
    assert final_bytes(run) == ref["bytes"]
    kinds = [e["event"] for e in events(run)]
    assert kinds.count("start") == 2 and "resume" in kinds
    assert any(e["event"] == "start" and e["resumed"] for e in events(run))


@pytest.mark.slow
def test_sigusr1_snapshot_keeps_training_and_trajectory(straight: dict, tmp_path: Path) -> None:
    ref = straight[1]
    run = tmp_path / "run"
    proc = start_engine(ref["cfg"], run)
    wait_for_step(run, 5, proc)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    snaps = [e for e in events(run) if e["event"] == "checkpoint" and e["reason"] == "snapshot"]
    assert len(snaps) == 1 and 5 <= snaps[0]["step"] < N
    assert Path(snaps[0]["path"]).is_dir()
    assert trajectory(run) == ref["traj"]
    assert final_bytes(run) == ref["bytes"]


@pytest.mark.slow
def test_a_storm_of_100_sigusr1(straight: dict, tmp_path: Path) -> None:
    ref = straight[1]
    run = tmp_path / "run"
    proc = start_engine(ref["cfg"], run)
    wait_for_step(run, 3, proc)
    for _ in range(100):
        os.kill(proc.pid, signal.SIGUSR1)  # raises if the engine died
        time.sleep(0.002)
    assert proc.poll() is None, "the engine did not survive the storm"
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    evs = events(run)
    # The kernel merges a signal that is already pending, so the engine may see fewer than 100.
    noticed = sum(e["count"] for e in evs if e["event"] == "signal" and e["signal"] == "SIGUSR1")
    assert 1 <= noticed <= 100
    snaps = [e for e in evs if e["event"] == "checkpoint" and e["reason"] == "snapshot"]
    assert 1 <= len(snaps) < 100  # coalesced
    assert trajectory(run) == ref["traj"]
    assert final_bytes(run) == ref["bytes"]


def wait_for_committed_checkpoint(run: Path, proc: subprocess.Popen[str], timeout: float = 120
                                  ) -> None:
    """Block until `run` has a checkpoint that verifies (the engine still running)."""
    from engine.run.checkpoint_store import find_resume_checkpoint

    deadline = time.monotonic() + timeout
    while find_resume_checkpoint(run / "checkpoints")[0] is None:
        if proc.poll() is not None:
            raise AssertionError(f"engine exited {proc.returncode} before its first checkpoint")
        if time.monotonic() > deadline:
            raise AssertionError(f"no committed checkpoint in {run} after {timeout} s")
        time.sleep(0.005)


@pytest.mark.slow
def test_kill_9_during_checkpoint_writes_then_resume(straight: dict, tmp_path: Path) -> None:
    """Checkpoint every step, SIGKILL at random moments; the newest valid checkpoint loads and
    the resumed trajectory is the straight one. (The kill -9 test of the writer itself, over
    20 and more kills, is in test_checkpoint.py.)"""
    from engine.run.checkpoint import CheckpointInvalid, verify_checkpoint
    from engine.run.checkpoint_store import find_resume_checkpoint, list_checkpoints

    cfg_d = micro_config_dict(max_steps=N)
    cfg_d["checkpoint"].update(every=1, keep=3)
    cfg = tmp_path / "every1.json"
    cfg.write_text(json.dumps(cfg_d))
    rng = random.Random(1234)
    trials, torn = 5, 0
    for trial in range(trials):
        run = tmp_path / f"run{trial}"
        proc = start_engine(cfg, run)
        wait_for_step(run, 2 + trial * 3, proc)
        # the writer runs beside the loop at niceness +10, so on a loaded machine the records
        # can be steps ahead of the first committed checkpoint: kill once one exists
        wait_for_committed_checkpoint(run, proc)
        time.sleep(rng.uniform(0.0, 0.05))
        proc.kill()
        proc.wait()
        path, _skipped = find_resume_checkpoint(run / "checkpoints")
        assert path is not None and path.name.startswith("step_")
        assert all(e.valid for e in list_checkpoints(run))
        leftovers = [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp")]
        listed = {e.path.name for e in list_checkpoints(run)}
        for p in leftovers:  # an uncommitted directory is never a candidate, complete or not
            assert p.name not in listed
            try:
                verify_checkpoint(p)
            except CheckpointInvalid:
                torn += 1
        r = run_engine(cfg, run, "--resume")
        assert r.returncode == 0, r.stdout + r.stderr
        assert trajectory(run) == straight[1]["traj"], f"trial {trial}"
        # the resumed engine removed the dead writer's temporary directory
        assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    print(f"kill -9 trials: {trials}, {torn} left a half-written directory")


def _limit_file_size(limit: int):
    def pre() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


@pytest.mark.slow
def test_full_disk_periodic_failure_stops_the_run(tmp_path: Path, write_config) -> None:
    cfg = write_config(micro_config_dict(max_steps=25))
    run = tmp_path / "run"
    # First a healthy stretch with checkpoints, then the same run resumed under a file-size limit
    # smaller than model.ckpt: every later checkpoint write fails (EFBIG).
    r = run_engine(cfg, run, "--max-steps", "10")
    assert r.returncode == 0
    ok_before = sorted(p.name for p in (run / "checkpoints").iterdir())
    r = subprocess.run(engine_cmd(cfg, run, "--resume", "--max-steps", "25"), capture_output=True,
                       text=True, timeout=300, preexec_fn=_limit_file_size(1 << 20))
    assert r.returncode == 1, r.stdout + r.stderr
    evs = events(run)
    errors = [e for e in evs if e["event"] == "checkpoint_error"]
    assert [e["reason"] for e in errors] == ["periodic"]
    assert [r.step for r in loss_records(run)][-1] == 20  # no step past the failed checkpoint
    assert json.loads((run / "state.json").read_text())["status"] == "failed"
    from engine.run.checkpoint import verify_checkpoint
    from engine.run.checkpoint_store import list_checkpoints

    names = sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith("."))
    assert names == ok_before
    for name in names:
        verify_checkpoint(run / "checkpoints" / name)
    assert all(e.valid for e in list_checkpoints(run))


@pytest.mark.slow
def test_full_disk_on_stop_exits_1_failed(tmp_path: Path, write_config) -> None:
    cfg = write_config(micro_config_dict(max_steps=4000))
    run = tmp_path / "run"
    proc = subprocess.Popen(engine_cmd(cfg, run), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=_limit_file_size(1 << 20))
    wait_for_step(run, 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert json.loads((run / "state.json").read_text())["status"] == "failed"
    assert any(e["event"] == "checkpoint_error" and e["reason"] == "stop" for e in events(run))
    assert not list((run / "checkpoints").glob("step_*"))  # (none: not even the directory)


@pytest.mark.slow
def test_resume_falls_back_past_a_corrupt_checkpoint(straight: dict, tmp_path: Path) -> None:
    ref = straight[1]
    run = tmp_path / "run"
    shutil.copytree(ref["run"], run)
    shutil.rmtree(run / "checkpoints" / f"step_{N:08d}")
    (run / "loss.jsonl").write_text("".join(
        json.dumps(r.to_json()) + "\n" for r in loss_records(ref["run"]) if r.step <= 30))
    newest = run / "checkpoints" / "step_00000030" / "model.ckpt"
    data = bytearray(newest.read_bytes())
    data[1000] ^= 0xFF
    newest.write_bytes(bytes(data))
    r = run_engine(ref["cfg"], run, "--resume")
    assert r.returncode == 0, r.stdout + r.stderr
    log = (run / "engine.log").read_text()
    assert "skipping" in log and "step_00000030" in log and "step_00000020" in log
    resume = [e for e in events(run) if e["event"] == "resume"][-1]
    assert resume["step"] == 20 and resume["skipped"][0]["path"].endswith("step_00000030")
    assert trajectory(run) == ref["traj"]
    assert final_bytes(run) == ref["bytes"]


@pytest.mark.slow
def test_snapshot_requested_during_a_periodic_write_is_not_lost(tmp_path: Path, write_config) -> None:
    """A checkpoint every step keeps the writer busy; each SIGUSR1 must still give a snapshot
    (written once the periodic one is done), never vanish into a periodic that is pruned."""
    cfg_d = micro_config_dict(max_steps=400)
    cfg_d["checkpoint"].update(every=1, keep=1)
    cfg = write_config(cfg_d)
    run = tmp_path / "run"
    proc = start_engine(cfg, run)
    wait_for_step(run, 5, proc)
    for i in range(5):
        proc.send_signal(signal.SIGUSR1)
        wait_for_step(run, 10 + 5 * i, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    evs = events(run)
    asked = [e for e in evs if e["event"] == "signal" and e.get("action") == "snapshot"]
    snaps = [e for e in evs if e["event"] == "checkpoint" and e["reason"] == "snapshot"]
    assert len(asked) == 5 and len(snaps) == 5
    for e in snaps:
        assert Path(e["path"]).is_dir()  # never pruned


@pytest.mark.slow
def test_resume_keeps_the_runs_max_steps(tmp_path: Path, write_config) -> None:
    cfg = write_config(micro_config_dict(max_steps=N))
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert run_engine(cfg, ref, "--max-steps", "24").returncode == 0
    proc = start_engine(cfg, run, "--max-steps", "24")
    wait_for_step(run, 8, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    r = run_engine(cfg, run, "--resume")  # no --max-steps: the run's 24, not the file's 40
    assert r.returncode == 0, r.stdout + r.stderr
    assert trajectory(run) == trajectory(ref)
    assert final_bytes(run, 24) == final_bytes(ref, 24)


@pytest.mark.slow
def test_resume_refuses_when_the_data_changed(tmp_path: Path, prepared_data: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(prepared_data, data, ignore=shutil.ignore_patterns(".*"))  # no lock, no temp files
    text = tmp_path / "mine.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n"
                            for i in range(400)))
    c = micro_config_dict(max_steps=N)
    c["data"]["dir"] = str(data)
    c["data"]["sources"].append({"name": "mine", "paths": [str(text)]})
    c["bandit"]["floor"] = 0.05
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(c))
    run = tmp_path / "run"
    assert run_engine(cfg, run, "--max-steps", "10").returncode == 0
    with text.open("a") as f:
        f.write("one more line that changes the shard\n")
    r = run_engine(cfg, run, "--resume", "--max-steps", "20")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "the data changed since the checkpoint" in r.stderr and "source mine:" in r.stderr
    assert "Traceback" not in r.stderr
    assert [r.step for r in loss_records(run)][-1] == 10


def test_bad_paths_are_one_line_errors(tmp_path: Path, write_config) -> None:
    cfg_d = micro_config_dict(max_steps=5)
    (tmp_path / "afile").write_text("x")
    r = run_engine(write_config(cfg_d), tmp_path / "afile" / "sub")
    assert r.returncode == 2 and "--run-dir" in r.stderr and "Traceback" not in r.stderr
    cfg_d["data"]["dir"] = str(tmp_path / "afile")
    r = run_engine(write_config(cfg_d, "bad.json"), tmp_path / "run")
    assert r.returncode == 2, r.stderr
    assert "data.dir" in r.stderr and "Traceback" not in r.stderr
