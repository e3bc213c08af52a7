"""The engine's run directory under faults, with real engine processes: a torn last line left
by a crash or a full disk, two engines started on one new run directory at once, a checkpoint
that cannot be written (a full disk, a file-size limit), and a resume whose config asks for
another max_steps."""

from __future__ import annotations

import asyncio
import json
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from engine import records as rec
from engine.run.checkpoint import verify_checkpoint
from engine.runfiles import read_events
from tests.conftest import (
    ROOT,
    engine_cmd,
    loss_records,
    micro_config_dict,
    run_engine,
    start_engine,
    wait_for_step,
)

T = TypeVar("T")
TORN = {"events.jsonl": b'{"t":1,"event":"pha', "loss.jsonl": b'{"step":19,"lo',
        "engine.log": b"12:00:00 step 19/20 lo"}


def files_of(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def one_line_error(r: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr


def state_of(run: Path) -> dict:
    return json.loads((run / "state.json").read_text())


def errors_of(run: Path) -> list[str]:
    return [e.message for e in read_events(run / "events.jsonl")[0]
            if isinstance(e, rec.ErrorEvent)]


# ---------------------------------------------------------------- a torn last line


def test_a_torn_last_line_does_not_swallow_the_resume(finished_run, tmp_path: Path) -> None:
    """A crash or a full disk left events.jsonl, loss.jsonl and engine.log ending mid-line. The
    resumed engine's first lines must not be glued onto the fragments: the resume event parses
    (so the dead timeline's steps 16-20 are dropped) and step 11's record is kept."""
    cfg, run = finished_run
    shutil.rmtree(run / "checkpoints" / "step_00000020")  # the newest valid is now step 10
    for name, fragment in TORN.items():
        with open(run / name, "ab") as f:
            f.write(fragment)
    r = run_engine(cfg, run, "--resume", "--max-steps", "15")
    assert r.returncode == 0, r.stdout + r.stderr
    events, bad = read_events(run / "events.jsonl")
    assert [e.step for e in events if isinstance(e, rec.ResumeEvent)] == [10]
    assert [s.step for s in loss_records(run)] == list(range(1, 16))
    assert bad == 1
    for name, fragment in TORN.items():  # each fragment kept, a line of its own
        assert fragment in (run / name).read_bytes().split(b"\n"), name
    assert any(ln.endswith("resume: from " + str(run / "checkpoints" / "step_00000010")
                           + " (step 10)") for ln in (run / "engine.log").read_text().splitlines())
    # What a user exports: one row per step of the timeline that happened.
    csv = tmp_path / "x.csv"
    r = subprocess.run([sys.executable, "-m", "andrea_tui.cli", "export", str(run), "--csv",
                        str(csv)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rows = csv.read_text().splitlines()[1:]
    assert [int(row.split(",")[0]) for row in rows] == list(range(1, 16))


def test_a_refused_resume_puts_a_torn_file_back_byte_for_byte(finished_run) -> None:
    cfg, run = finished_run
    for name, fragment in TORN.items():
        with open(run / name, "ab") as f:
            f.write(fragment)
    before = files_of(run)
    r = run_engine(cfg, run, "--resume", "--max-steps", "5")  # below the run's step 20
    assert r.returncode == 2, r.stdout + r.stderr
    one_line_error(r)
    assert files_of(run) == before


# ---------------------------------------------------------------- two engines, one new run


# The engine in a script that stops just before it takes the run's lock, once it has made the
# run directory (`ready`), until the test says `go`: the instant two engines race for a new
# run directory, held open.
HELD_AT_THE_LOCK = """
import sys, time
from pathlib import Path
from engine.run import identity

ready, go = Path(sys.argv[1]), Path(sys.argv[2])
real = identity.EngineLock.acquire

def acquire(self, run_dir, *a, **k):
    ready.write_text("at the lock")
    deadline = time.monotonic() + 300
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return real(self, run_dir, *a, **k)

identity.EngineLock.acquire = acquire
from engine.run.cli import main
main(sys.argv[3:])
"""


def start_held(tmp_path: Path, cfg: Path, run: Path, *extra: str) -> tuple[subprocess.Popen,
                                                                            Path, Path]:
    ready, go = tmp_path / "ready", tmp_path / "go"
    proc = subprocess.Popen([sys.executable, "-c", HELD_AT_THE_LOCK, str(ready), str(go),
                             *engine_cmd(cfg, run, *extra)[3:]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the engine never reached the lock"
        time.sleep(0.01)
    return proc, ready, go


def test_an_engine_refused_by_the_lock_removes_nothing(tmp_path: Path, write_config) -> None:
    """Two engines on one new run directory: the one that made the directory loses the lock.
    It is refused in one line and removes nothing; the winner trains on and stops cleanly."""
    cfg = write_config(micro_config_dict(max_steps=100000))
    run = tmp_path / "new"
    loser, _, go = start_held(tmp_path, cfg, run)
    assert run.is_dir() and not any(run.iterdir())  # the loser made it
    winner = start_engine(cfg, run)
    wait_for_step(run, 2, winner)
    go.write_text("go")
    out, err = loser.communicate(timeout=120)
    assert loser.returncode == 2, out + err
    r = subprocess.CompletedProcess(loser.args, 2, out, err)
    one_line_error(r)
    assert f"held by engine pid {winner.pid}" in err
    assert {"engine.json", "config.json", "loss.jsonl", "engine.lock"} <= set(files_of(run)), \
        "the winner's files are gone"
    step = loss_records(run)[-1].step
    wait_for_step(run, step + 3, winner)  # still training, in its directory
    winner.send_signal(signal.SIGTERM)
    assert winner.wait(timeout=120) == 0, winner.stdout.read() if winner.stdout else ""
    state = state_of(run)
    assert state["status"] == "stopped", state
    verify_checkpoint(Path(state["last_checkpoint"]["path"]))
    steps = [s.step for s in loss_records(run)]
    assert steps == list(range(1, state["step"] + 1))
    assert json.loads((run / "engine.json").read_text())["pid"] == winner.pid


def test_a_refused_creator_removes_only_its_own_files(tmp_path: Path, write_config) -> None:
    """The engine that made a new run directory takes the lock and is refused for bad input
    (no CUDA device here): it removes its own files, never another process's; the directory
    stays while that file is in it."""
    from engine.backends import cuda_status

    if cuda_status()[0]:
        pytest.skip("a CUDA device is usable here: --backend cuda is not refused")
    cfg = write_config(micro_config_dict(max_steps=5))
    run = tmp_path / "new"
    proc, _, go = start_held(tmp_path, cfg, run, "--backend", "cuda")
    (run / "notes.txt").write_text("another process's file\n")
    go.write_text("go")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, out + err
    one_line_error(subprocess.CompletedProcess(proc.args, 2, out, err))
    assert files_of(run) == {"notes.txt": b"another process's file\n"}


# ---------------------------------------------------------------- a checkpoint not written


def assert_stopped_at_the_failed_checkpoint(r: subprocess.CompletedProcess, run: Path,
                                            why: str, steps_past: int = 0) -> None:
    """The periodic checkpoint of step 20 could not be written; step 10's is valid. Known
    before writing (no room, a file-size limit), no step is trained past it; found by the
    background writer, at most `steps_past` steps."""
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    last = loss_records(run)[-1].step
    assert 20 <= last <= 20 + steps_past, last
    newest = str(run / "checkpoints" / "step_00000010")
    state = state_of(run)
    assert state["status"] == "failed" and state["step"] == last, state
    for said in (r.stderr, state["error"], errors_of(run)[-1],
                 (run / "engine.log").read_text()):
        assert why in said and newest in said and "--resume" in said, said
    assert "checkpoint step 20 (periodic)" in r.stderr
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step_00000010"], names  # no half-written directory left
    verify_checkpoint(run / "checkpoints" / "step_00000010")


def resume_continues_from_step_10(cfg: Path, run: Path) -> None:
    r = run_engine(cfg, run, "--resume", "--max-steps", "30")
    assert r.returncode == 0, r.stdout + r.stderr
    resumes = [e for e in read_events(run / "events.jsonl")[0] if isinstance(e, rec.ResumeEvent)]
    assert resumes[-1].step == 10
    assert [s.step for s in loss_records(run)] == list(range(1, 31))
    assert state_of(run)["status"] == "finished"


def _limit_file_size(limit: int):
    def pre() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


def test_a_checkpoint_over_the_file_size_limit_stops_the_run(tmp_path: Path,
                                                              write_config) -> None:
    """No root needed: a file-size limit below model.ckpt (7 MB) makes every checkpoint write
    fail (EFBIG) while the small files still take their lines."""
    cfg = write_config(micro_config_dict(max_steps=30))
    run = tmp_path / "run"
    assert run_engine(cfg, run, "--max-steps", "10").returncode == 0
    r = subprocess.run(engine_cmd(cfg, run, "--resume", "--max-steps", "30"),
                       capture_output=True, text=True, timeout=300,
                       preexec_fn=_limit_file_size(1 << 20))
    assert_stopped_at_the_failed_checkpoint(r, run, "File too large")
    resume_continues_from_step_10(cfg, run)


def test_a_state_json_that_cannot_be_replaced_is_said(finished_run) -> None:
    """A file-size limit below every run file's size: nothing can be written, state.json not
    replaced either; stderr says the run failed, and that state.json does not say so."""
    cfg, run = finished_run
    r = subprocess.run(engine_cmd(cfg, run, "--resume", "--max-steps", "30"),
                       capture_output=True, text=True, timeout=300,
                       preexec_fn=_limit_file_size(256))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert f"{run / 'state.json'} could not be replaced (File too large)" in r.stderr, r.stderr
    assert "but the run failed" in r.stderr
    assert "step_00000020" in r.stderr  # where a resume continues
    assert state_of(run)["status"] != "failed"


# The engine with a disk that fills while a checkpoint is written: the write of step 20's
# model.ckpt fails in the background writer, after the loop went on.
FILLS_WHILE_WRITING = """
import errno, os, sys
from engine.run import checkpoint_write

real = checkpoint_write._write_model_file

def write_model_file(path, step, arrays):
    if step == 20:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(path, step, arrays)

checkpoint_write._write_model_file = write_model_file
from engine.run.cli import main
main(sys.argv[1:])
"""


def test_a_checkpoint_write_failing_in_the_background_stops_the_run(tmp_path: Path,
                                                                     write_config) -> None:
    cfg = write_config(micro_config_dict(max_steps=30))
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", FILLS_WHILE_WRITING,
                        *engine_cmd(cfg, run)[3:]], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    # found by the background writer while steps go on: how many depends on the machine's load
    # (2 alone, 3 seen beside a full suite); the run must stop before its next checkpoint
    assert_stopped_at_the_failed_checkpoint(r, run, "No space left on device", steps_past=9)
    resume_continues_from_step_10(cfg, run)


def test_a_full_disk_stops_the_run_at_the_failed_checkpoint(tmp_path: Path,
                                                             write_config) -> None:
    """A real full file system: a 12 MiB tmpfs holds one 7 MB checkpoint, not two."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$1"', "sh",
             str(tmp_path)], capture_output=True).returncode != 0:
        pytest.skip("no user and mount namespaces here to mount a small tmpfs")
    cfg = write_config(micro_config_dict(max_steps=30))
    disk, run = tmp_path / "disk", tmp_path / "run"
    disk.mkdir()
    # The run lives on the tmpfs, inside a mount namespace: copied out afterwards to look at it.
    script = ('mount -t tmpfs -o size=12m tmpfs "$1" || exit 99; d="$1" o="$2"; shift 2; '
              '"$@"; rc=$?; cp -a "$d/run" "$o"; exit $rc')
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(disk), str(run),
                        *engine_cmd(cfg, disk / "run")], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode != 99, r.stderr
    # The paths as they are outside the namespace.
    for name in ("events.jsonl", "loss.jsonl", "state.json", "engine.log"):
        (run / name).write_text((run / name).read_text().replace(str(disk / "run"), str(run)))
    r.stderr = r.stderr.replace(str(disk / "run"), str(run))
    # said at start: keep's checkpoints and the one being written do not fit in 12 MiB
    log = (run / "engine.log").read_text()
    assert "warning: checkpoints need" in log and "the run stops at the first checkpoint" \
        in log, log[:2000]
    assert_stopped_at_the_failed_checkpoint(r, run, "No space left on device")
    resume_continues_from_step_10(cfg, run)


# ---------------------------------------------------------------- --resume and max_steps


def test_resume_says_the_kept_max_steps_and_how_to_go_on(finished_run, tmp_path: Path) -> None:
    cfg, run = finished_run
    c = json.loads(cfg.read_text())
    c["train"]["max_steps"] = 30
    longer = tmp_path / "longer.json"
    longer.write_text(json.dumps(c))
    # The dashboard is attached while the resume runs, as `andrea-tui CONFIG --resume` is.
    r, told = _with_the_dashboard(run, lambda: run_engine(longer, run, "--resume"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "train.max_steps: 20 (kept) -- given 30" in r.stderr, r.stderr
    assert "--max-steps 30" in r.stderr and "extends" in r.stderr, r.stderr
    assert "drop --resume" not in r.stderr  # nothing else of the config is left unused
    nothing = [ln for ln in r.stdout.splitlines() if "nothing to train" in ln]
    assert nothing and "--max-steps N" in nothing[0], r.stdout
    [resume] = [e for e in read_events(run / "events.jsonl")[0]
                if isinstance(e, rec.ResumeEvent)]
    assert [(i.key, i.kept, i.given) for i in resume.ignored] == [("train.max_steps", 20, 30)]
    [notice] = [t for t in told if "NOT used" in t]
    assert "train.max_steps: 20 kept (given 30)" in notice and "--max-steps 30" in notice
    assert "start a new run" not in notice, notice  # max_steps alone: a resume extends it
    # Given on the command line, it is used, not warned about.
    r = run_engine(longer, run, "--resume", "--max-steps", "30")
    assert r.returncode == 0 and "NOT used" not in r.stderr, r.stderr
    assert loss_records(run)[-1].step == 30


def _with_the_dashboard(run: Path, action: Callable[[], T]) -> tuple[T, list[str]]:
    """What `action` returns, run while the dashboard is attached to `run`, and the notices
    the dashboard showed meanwhile."""
    from andrea_tui.app import AndreaApp

    app = AndreaApp(run)
    texts: list[str] = []
    result: list[T] = []

    async def go() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            while not app.history_loaded:
                await pilot.pause(0.05)
            result.append(await asyncio.to_thread(action))
            for _ in range(200):
                app.pacer.poll_all()
                texts[:] = [n.message for n in app._notifications]
                if any("NOT used" in t for t in texts):
                    return
                await pilot.pause(0.05)

    asyncio.run(go())
    return result[0], texts
