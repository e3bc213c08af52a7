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
import tempfile
import time
from collections.abc import Callable, Iterator
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


# Each test runs its own tmux server (the `session` fixture points TMUX at it): a session's
# shell gets the environment of the process that started the server, so a shared one (the
# developer's, another test worker's) would hand over its own XDG_CONFIG_HOME and settings.
TMUX = ["tmux"]


def tmux(*args: str) -> str:
    return subprocess.run([*TMUX, *args], capture_output=True, text=True, check=False,
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
def session(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The tmux session of a test, on a server of its own, ended with the test."""
    home = Path(tempfile.mkdtemp(prefix="andrea-tmux-", dir="/tmp"))  # a socket path: 107 bytes
    monkeypatch.setattr(sys.modules[__name__], "TMUX", ["tmux", "-S", str(home / "socket")])
    yield "andrea-test"
    tmux("kill-server")
    shutil.rmtree(home, ignore_errors=True)


def start_tmux(session: str, command: str) -> None:
    env = f"cd {ROOT} && unset COLUMNS LINES; PYTHONPATH={ROOT} TERM=xterm-256color "
    subprocess.run([*TMUX, "new-session", "-d", "-s", session, "-x", "140", "-y", "45",
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


def start_fake(run_dir: Path, *extra: str) -> subprocess.Popen:
    from andrea_tui.launcher import launch

    proc = launch([PY, "-m", "tests.fakerun", str(run_dir), "--rate", "10", *extra], run_dir)
    deadline = time.monotonic() + 20
    while not engine_alive(run_dir)[0]:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    return proc


def keep_capture(suffix: str, text: str) -> None:
    capture = os.environ.get("ANDREA_TMUX_CAPTURE")
    if capture:
        Path(f"{capture}.{suffix}").write_text(text)


def chart_rows(text: str) -> int:
    """Rows of a chart's plot area on the screen: a y axis (`┤` at a tick, `│` between ticks,
    `├` where a line crosses it) after its label column."""
    return sum(1 for line in text.splitlines() if re.match(r"^[ \d.eE+\-kMGT]{1,10}[┤├│]", line))


def test_resize_and_alert_in_tmux(tmp_path: Path, session: str) -> None:
    """200x50 -> 80x24 -> 120x40: the layout follows each size (charts keep their rows); an
    injected loss spike shows as a toast and a mark on the loss chart."""
    run_dir = tmp_path / "run"
    engine = start_fake(run_dir, "--spike-at", "60")
    try:
        # Started at another size: a first resize that changes nothing sends no SIGWINCH, and
        # tmux may size a new pane only after its program has read the size.
        subprocess.run([*TMUX, "new-session", "-d", "-s", session, "-x", "100", "-y", "30",
                        f"cd {ROOT} && unset COLUMNS LINES; PYTHONPATH={ROOT} TERM=xterm-256color "
                        f"XDG_CONFIG_HOME={tmp_path} {PY} -m andrea_tui.cli attach {run_dir}; "
                        "sleep 60"], check=True, timeout=10)
        wait_for(lambda: steps_on_screen(session) >= 30, "steps on screen", session, 60)
        for size in ((200, 50), (80, 24), (120, 40)):
            tmux("resize-window", "-t", session, "-x", str(size[0]), "-y", str(size[1]))
            got = tmux("display", "-p", "-t", session, "#{window_width}x#{window_height}").strip()
            assert got == f"{size[0]}x{size[1]}", got

            def laid_out(size: tuple[int, int] = size) -> bool:
                text = screen(session)
                # charts keep their rows; the compact layout (80x24) folds the bottom panels
                # into one line each (`l engine.log: ...`); the panels were laid out for the
                # new width (a line reaches its right edge) and the charts redrawn at it (their
                # right border shows)
                return (chart_rows(text) >= 8 and "step " in text and "┐" in text
                        and max(map(len, text.splitlines())) >= size[0] - 1
                        and ("─ engine.log ─" in text) is (size != (80, 24))
                        and ("l engine.log:" in text) is (size == (80, 24)))

            wait_for(laid_out, f"the layout at {size}", session, 20)
            text = screen(session)
            lines = text.splitlines()
            assert len(lines) <= size[1] and max(len(x) for x in lines) <= size[0]
            keep_capture(f"{size[0]}x{size[1]}", text)
        wait_for(lambda: "loss spike" in (t := screen(session)) and "alerts !" in t,
                 "the alert's toast and its mark on the loss chart", session, 30)
        keep_capture("alert", screen(session))
    finally:
        engine.terminate()
        engine.wait(timeout=20)
