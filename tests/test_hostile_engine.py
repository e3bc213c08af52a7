"""What users and machines actually do to the engine, one test each: a resume it refuses (which
must leave the run as it was), nested JSON, an unwritable or vanishing run directory, a stop
during tokenizer training, a closed terminal, a model too large for memory."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.run.checkpoint import verify_checkpoint
from tests.conftest import (
    ROOT,
    engine_cmd,
    loss_records,
    micro_config_dict,
    run_engine,
    start_engine,
    tiny_config_dict,
    wait_for_step,
)

NESTED = "[" * 1000 + "]" * 1000


def files_of(run: Path) -> dict[str, bytes]:
    """Every file under the run directory and its bytes."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def no_traceback(r: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in r.stderr + r.stdout, r.stderr


# ---------------------------------------------------------------- refusals change nothing


@pytest.mark.parametrize("extra, says", [
    (("--max-steps", "5"), "already at step 20"),
    (("--backend", "cuda"), "cuda"),
])
def test_a_refused_resume_leaves_every_file_as_it_was(finished_run, extra, says) -> None:
    cfg, run = finished_run
    if "cuda" in extra:
        from engine.backends import cuda_status

        if cuda_status()[0]:
            pytest.skip("a CUDA device is usable here")
    before = files_of(run)
    state = json.loads((run / "state.json").read_text())
    assert (state["status"], state["step"]) == ("finished", 20)
    r = run_engine(cfg, run, "--resume", *extra)
    assert r.returncode == 2, r.stdout + r.stderr
    no_traceback(r)
    assert says in r.stderr.lower()
    assert files_of(run) == before  # state.json still says finished, step 20


def test_a_refused_fresh_run_leaves_no_run_directory(tmp_path: Path, write_config) -> None:
    from engine.backends import cuda_status

    if cuda_status()[0]:
        pytest.skip("a CUDA device is usable here")
    cfg = write_config(micro_config_dict(max_steps=5))
    r = run_engine(cfg, tmp_path / "new", "--backend", "cuda")
    assert r.returncode == 2 and not (tmp_path / "new").exists(), r.stderr


# ---------------------------------------------------------------- nested JSON everywhere


def test_nested_json_config_is_one_line_in_every_cli(tmp_path: Path) -> None:
    bad = tmp_path / "nested.json"
    bad.write_text(NESTED)
    for argv in ([sys.executable, "-m", "engine.run.cli", str(bad)],
                 [sys.executable, "-m", "engine.data.prep", str(bad)],
                 [sys.executable, "-m", "andrea_tui.cli", str(bad)]):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                           stdin=subprocess.DEVNULL)
        assert r.returncode == 2, (argv, r.stderr)
        no_traceback(r)
        assert r.stderr.startswith("error: ") and "nested deeper" in r.stderr, r.stderr


def test_nested_checkpoint_state_is_invalid_and_resume_falls_back(finished_run,
                                                                   tmp_path: Path) -> None:
    cfg, run = finished_run
    newest = run / "checkpoints" / "step_00000020"
    (newest / "state.json").write_text(NESTED)
    r = subprocess.run([sys.executable, "-m", "engine.run.ckpt_cli", "verify", str(newest)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "nested deeper" in r.stderr, r.stderr
    no_traceback(r)
    r = run_engine(cfg, run, "--resume", "--max-steps", "22")
    assert r.returncode == 0, r.stderr
    log = (run / "engine.log").read_text()
    assert "skipping" in log and "step_00000020" in log and "from " in log
    assert "resume: from" in log and "step_00000010" in log
    assert loss_records(run)[-1].step == 22


# ---------------------------------------------------------------- the directory goes away


def test_run_directory_removed_under_the_engine(tmp_path: Path, write_config) -> None:
    cfg = write_config(micro_config_dict(max_steps=100000))
    run = tmp_path / "run"
    proc = subprocess.Popen(engine_cmd(cfg, run), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    wait_for_step(run, 5, None)
    shutil.rmtree(run)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "Traceback" not in err and err.count("error: ") == 1, err
    assert "not writable" in err


def _limit_file_size(limit: int):
    def pre() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


def test_full_disk_for_small_files_then_resume(tmp_path: Path, write_config) -> None:
    cfg = write_config(micro_config_dict(max_steps=40))
    run = tmp_path / "run"
    assert run_engine(cfg, run, "--max-steps", "20").returncode == 0
    # Room for a few more loss lines only: the run directory stops taking writes mid-run.
    limit = (run / "loss.jsonl").stat().st_size + 1500
    r = subprocess.run(engine_cmd(cfg, run, "--resume", "--max-steps", "40"),
                       capture_output=True, text=True, timeout=300,
                       preexec_fn=_limit_file_size(limit))
    assert r.returncode == 1, r.stdout + r.stderr
    no_traceback(r)
    assert r.stderr.count("error: cannot write") == 1, r.stderr
    assert not [p for p in run.rglob(".*tmp*")], list(run.rglob(".*tmp*"))
    assert json.loads((run / "state.json").read_text())["status"] != "running"
    verify_checkpoint(run / "checkpoints" / "step_00000020")
    # Space is back: the run continues from its newest valid checkpoint.
    r = run_engine(cfg, run, "--resume", "--max-steps", "40")
    assert r.returncode == 0, r.stderr
    assert loss_records(run)[-1].step == 40


# ---------------------------------------------------------------- read-only run directory


def _read_only(path: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """Run `argv` with `path` bind-mounted read-only (a user and mount namespace: no root)."""
    script = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    return subprocess.run(["unshare", "-rm", "sh", "-c", script, str(path), *argv],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_read_only_run_directory_is_refused_in_one_line(finished_run) -> None:
    cfg, run = finished_run
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0 or shutil.which("unshare") is None:
        pytest.skip("no user namespaces here to make a read-only mount")
    before = files_of(run)
    r = _read_only(run, engine_cmd(cfg, run, "--resume", "--max-steps", "12"))
    assert r.returncode == 2, r.stdout + r.stderr
    no_traceback(r)
    assert "cannot write here (read-only file system)" in r.stderr
    r = _read_only(run, [sys.executable, "-m", "andrea_tui.cli", str(cfg), "--run-dir", str(run),
                         "--resume", "--max-steps", "12"])
    assert r.returncode == 2, r.stdout + r.stderr
    no_traceback(r)
    assert files_of(run) == before


# ---------------------------------------------------------------- stop during data preparation


@pytest.mark.slow
def test_sigterm_during_tokenizer_training_stops_it(tmp_path: Path) -> None:
    c = tiny_config_dict()
    c["data"]["dir"] = str(tmp_path / "fresh-data")  # nothing prepared: the tokenizer trains
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(c))
    run = tmp_path / "run"
    proc = start_engine(cfg, run)
    deadline = time.monotonic() + 120
    log = run / "engine.log"
    while time.monotonic() < deadline:
        if log.exists() and "tokenizer: training" in log.read_text():
            break
        time.sleep(0.05)
    else:
        proc.kill()
        raise AssertionError("the tokenizer never started training")
    time.sleep(0.5)  # inside HF's trainer
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 0, out
    # about a second on an idle machine; the bound leaves room for a loaded one (the whole
    # preparation would take longer: the tokenizer never appears, asserted below)
    assert took < 10.0, f"stopped {took:.1f} s after SIGTERM"
    assert json.loads((run / "state.json").read_text())["status"] == "stopped"
    data = tmp_path / "fresh-data"
    assert not (data / "tokenizer.json").exists()
    assert not [p for p in data.rglob("*") if ".tmp" in p.name], list(data.rglob("*"))


# ---------------------------------------------------------------- a closed terminal


def test_sighup_is_a_stop_with_a_checkpoint(tmp_path: Path, write_config) -> None:
    cfg = write_config(micro_config_dict(max_steps=100000))
    run = tmp_path / "run"
    proc = start_engine(cfg, run)
    wait_for_step(run, 5, proc)
    proc.send_signal(signal.SIGHUP)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    state = json.loads((run / "state.json").read_text())
    assert state["status"] == "stopped" and state["last_checkpoint"]["reason"] == "stop"
    verify_checkpoint(Path(state["last_checkpoint"]["path"]))


# ---------------------------------------------------------------- a model too large


def test_a_model_too_large_for_host_memory_is_refused(tmp_path: Path, write_config) -> None:
    c = micro_config_dict(max_steps=5)
    c["model"].update(n_layer=256, d_model=65536, n_head=1, d_ff=4)
    cfg = write_config(c)
    r = run_engine(cfg, tmp_path / "run", "--backend", "numpy")
    assert r.returncode == 2, r.stdout + r.stderr
    no_traceback(r)
    assert "of host memory" in r.stderr and "available" in r.stderr and "weights" in r.stderr
    assert not (tmp_path / "run").exists()


def test_a_huge_description_is_refused(tmp_path: Path) -> None:
    c = micro_config_dict()
    c["description"] = "x" * 50_000
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(c))
    r = subprocess.run([sys.executable, "-m", "engine.run.cli", str(cfg)], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2 and "description: must be at most 4096 characters" in r.stderr


# ---------------------------------------------------------------- resume, retention, crash


def test_resume_names_every_setting_it_does_not_use(finished_run, tmp_path: Path) -> None:
    cfg, run = finished_run
    c = json.loads(cfg.read_text())
    c["optim"]["lr"] = 0.002
    c["samples"]["top_k"] = 7
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(c))
    r = run_engine(edited, run, "--resume", "--max-steps", "21")
    assert r.returncode == 0, r.stderr
    assert "optim.lr: 0.001 (kept) -- given 0.002" in r.stderr
    assert "samples.top_k: 40 (kept) -- given 7" in r.stderr and "drop --resume" in r.stderr
    from engine.records import ResumeEvent
    from engine.runfiles import read_events

    [resume] = [e for e in read_events(run / "events.jsonl")[0] if isinstance(e, ResumeEvent)]
    assert {(i.key, i.kept, i.given) for i in resume.ignored} == {
        ("optim.lr", 0.001, 0.002), ("samples.top_k", 40, 7)}


def test_keep_manual_bounds_snapshot_and_stop_checkpoints(tmp_path: Path, write_config) -> None:
    c = micro_config_dict(max_steps=100000)
    c["checkpoint"].update(every=1000, keep_manual=2)
    cfg = write_config(c)
    run = tmp_path / "run"
    for i in range(3):  # three q's: three stop checkpoints, the oldest pruned
        proc = start_engine(cfg, run, *(("--resume",) if i else ()))
        wait_for_step(run, 3 * (i + 1), proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    names = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert len(names) == 2, names


def test_a_crash_keeps_the_record_of_the_step_before(tmp_path: Path, write_config) -> None:
    """The loop writes a step's record while the next step runs: a failure before that (here:
    drawing the batch after the bandit's first phase, which ends at step 7 and so is not drawn
    ahead) must not lose it. loss.jsonl ends at the last step that completed; exit status 1."""
    cfg = write_config(micro_config_dict(max_steps=20))
    run = tmp_path / "run"
    script = (
        "import sys\n"
        "from engine.data.sampler import Sampler\n"
        "calls = [0]\n"
        "real = Sampler.sample\n"
        "def sample(self, *a, **k):\n"
        "    calls[0] += 1\n"
        "    if calls[0] == 8:\n"
        "        raise RuntimeError('injected failure drawing step 8')\n"
        "    return real(self, *a, **k)\n"
        "Sampler.sample = sample\n"
        "from engine.run.cli import main\n"
        f"sys.exit(main([{str(cfg)!r}, '--run-dir', {str(run)!r}, '--backend', 'numpy']))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "injected failure drawing step 8" in r.stderr
    assert [x.step for x in loss_records(run)] == list(range(1, 8))
    assert json.loads((run / "state.json").read_text())["status"] == "failed"
