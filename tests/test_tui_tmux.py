"""The real app in a real terminal (tmux) on ANDREA-tiny with the real engine.

Launch mode: steps appear on screen, `s` writes a snapshot checkpoint, `q` writes the stop
checkpoint, the engine exits 0 and the app exits. Attach mode: an engine started headless, the
app attached to it, `s` writes a snapshot. The config is ANDREA-tiny with batch_size 1 so a CPU
step takes about a second. Set ANDREA_TMUX_CAPTURE=FILE to keep the dashboard's text capture.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.run.control import engine_alive, signal_engine
from engine.runfiles import read_json, read_jsonl

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]


def tiny_config(tmp: Path) -> Path:
    cfg = json.loads((ROOT / "experiments" / "ANDREA-tiny-TRAIN.json").read_text())
    cfg["data"]["dir"] = str(ROOT / "data" / "builtin")  # the copy lives elsewhere
    cfg["train"]["batch_size"] = 1
    cfg["samples"]["every_steps"] = 5
    path = tmp / "ANDREA-tiny-TRAIN.json"
    path.write_text(json.dumps(cfg))
    return path


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=False,
                          timeout=10).stdout


def screen(session: str) -> str:
    return tmux("capture-pane", "-p", "-t", session)


def wait_for(cond: Callable[[], object], what: str, session: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; screen:\n{screen(session)}")
        time.sleep(0.25)


def steps_on_screen(session: str) -> int:
    m = re.search(r"step ([\d,]+)/", screen(session))
    return int(m.group(1).replace(",", "")) if m else 0


def checkpoints(run_dir: Path, reason: str) -> list[dict]:
    events, _ = read_jsonl(run_dir / "events.jsonl")
    return [e for e in events if e.get("event") == "checkpoint" and e.get("reason") == reason]


@pytest.fixture
def session():
    name = f"andrea-test-{os.getpid()}"
    yield name
    tmux("kill-session", "-t", name)


def start_tmux(session: str, command: str) -> None:
    env = f"cd {ROOT} && PYTHONPATH={ROOT} TERM=xterm-256color "
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "140", "-y", "45",
                    env + command], check=True, timeout=10)


def test_launch_snapshot_and_stop_in_tmux(tmp_path: Path, session: str) -> None:
    cfg = tiny_config(tmp_path)
    run_dir = tmp_path / "run"
    done = tmp_path / "app_exit"
    start_tmux(session, f"{PY} -m andrea_tui.cli {cfg} --run-dir {run_dir} --max-steps 100000 "
               f"--backend numpy; echo $? > {done}; sleep 60")
    wait_for(lambda: steps_on_screen(session) >= 2, "steps on screen", session, 50)
    capture = os.environ.get("ANDREA_TMUX_CAPTURE")
    if capture:
        Path(capture).write_text(screen(session))
    tmux("send-keys", "-t", session, "s")
    wait_for(lambda: checkpoints(run_dir, "snapshot"), "a snapshot checkpoint", session, 30)
    snap = checkpoints(run_dir, "snapshot")[0]
    assert Path(snap["path"]).is_dir()
    engine_pid = read_json(run_dir / "engine.json")["pid"]
    tmux("send-keys", "-t", session, "q")
    wait_for(done.exists, "the app to exit", session, 40)
    assert done.read_text().strip() == "0"
    stop = checkpoints(run_dir, "stop")
    assert stop and Path(stop[0]["path"]).is_dir()
    assert read_json(run_dir / "state.json")["status"] == "stopped"
    assert not Path(f"/proc/{engine_pid}").exists()  # the engine exited (the app reaped it)
    assert "engine exit status 0" in screen(session)


def test_attach_to_headless_engine_in_tmux(tmp_path: Path, session: str) -> None:
    cfg = tiny_config(tmp_path)
    run_dir = tmp_path / "run"
    with open(tmp_path / "train.log", "wb") as log:
        engine = subprocess.Popen([PY, "-m", "engine.run.cli", str(cfg), "--run-dir", str(run_dir),
                                   "--max-steps", "100000", "--backend", "numpy"], cwd=ROOT,
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + 40
        while not engine_alive(run_dir)[0]:
            assert engine.poll() is None, (tmp_path / "train.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        start_tmux(session, f"{PY} -m andrea_tui.cli attach {run_dir}; sleep 60")
        wait_for(lambda: steps_on_screen(session) >= 1, "steps on screen", session, 50)
        tmux("send-keys", "-t", session, "s")
        wait_for(lambda: checkpoints(run_dir, "snapshot"), "a snapshot checkpoint", session, 30)
        assert Path(checkpoints(run_dir, "snapshot")[0]["path"]).is_dir()
    finally:
        try:
            signal_engine(run_dir, signal.SIGTERM)
            engine.wait(timeout=30)
        finally:
            if engine.poll() is None:
                engine.kill()
                engine.wait()
