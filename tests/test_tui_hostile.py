"""The app against what users and machines do to its run directories: a gigabyte-sized loss
file swapped in, a 10 MB line, nested JSON, a read-only mount, a directory that is no run, a
refused resume, a resume that does not use the given config. Each reproduces a defect found."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from andrea_tui.app import AndreaApp
from andrea_tui.screens import HelpScreen
from engine import records as rec
from engine.run.identity import EngineLock
from tests.conftest import ROOT, micro_config_dict, run_engine
from tests.fakerun import loss_record, write_run

SIZE = (120, 40)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def big_loss_file(path: Path, n: int) -> None:
    """`n` step records, written fast (one record's JSON, its step and time patched)."""
    proto = json.dumps(loss_record(1, 1_800_000_000.0))
    head, tail = proto.split('"step": 1,', 1)
    with open(path, "w") as f:
        for s in range(1, n + 1):
            f.write(f'{head}"step": {s},{tail}\n')


async def press_help(pilot, app: AndreaApp) -> bool:
    """Press `?` and wait for the help screen; True if the history was still loading (in its
    worker) when the screen came up: the key was answered during the load, not after it."""
    await pilot.press("question_mark")
    while not isinstance(app.screen, HelpScreen):
        await asyncio.sleep(0.005)
    during = app._loading
    await pilot.press("escape")
    while isinstance(app.screen, HelpScreen):
        await asyncio.sleep(0.005)
    return during


def test_a_huge_loss_file_swapped_in_keeps_keys_answered_and_memory_bounded(
        tmp_path: Path) -> None:
    """The UI loop's lag during such a load is a figure for dev/bench_tui.py; here the
    behaviour: keys answered while the worker loads, memory bounded, nothing left behind."""
    paths = write_run(tmp_path / "run", 200, status="finished", max_steps=150_000)
    big = tmp_path / "big.jsonl"
    big_loss_file(big, 150_000)  # about 60 MB
    app = AndreaApp(paths.root)

    async def go() -> None:
        async with app.run_test(size=SIZE) as pilot:
            while not app.history_loaded:
                await pilot.pause(0.05)
            rss0 = rss_mib()
            os.replace(big, paths.loss)
            app.pacer.poll_all()  # as the watcher or the control tick would
            assert app.reader.loss_backlog  # left to the worker
            answered_during_load = [await press_help(pilot, app) for _ in range(3)]
            deadline = time.monotonic() + 300
            while app.state.series.n != 150_000 and time.monotonic() < deadline:
                await pilot.pause(0.1)
            assert app.state.series.n == 150_000 and app.state.series.last_step == 150_000
            assert any(answered_during_load), "no key was answered while the history loaded"
            assert not app.reader.loss_backlog and not app.reader.backlog and not app._loading
            grew = rss_mib() - rss0
            assert grew < 300, f"RSS grew {grew:.0f} MiB for a 60 MB file"

    asyncio.run(go())


def test_ten_megabyte_lines_and_nested_json_are_skipped(tmp_path: Path) -> None:
    paths = write_run(tmp_path / "run", 50, status="running")
    app = AndreaApp(paths.root)

    async def go() -> None:
        async with app.run_test(size=SIZE) as pilot:
            while not app.history_loaded:
                await pilot.pause(0.05)
            huge = json.dumps({"t": 1.0, "event": "error", "message": "x" * (10 << 20)})
            nested = "[" * 1000 + "]" * 1000
            for f in (paths.events, paths.samples, paths.loss):
                with open(f, "a") as fh:
                    fh.write(huge + "\n" + nested + "\n")
            with open(paths.loss, "a") as fh:
                fh.write(json.dumps(loss_record(51, 2e9)) + "\n")
            t0 = time.monotonic()
            while app.state.series.last_step != 51 and time.monotonic() - t0 < 30:
                app.pacer.poll_all()
                await pilot.pause(0.05)
            assert app.state.series.last_step == 51
            await press_help(pilot, app)
            assert app.reader.events.bad_lines >= 2 and app.reader.samples.bad_lines >= 2

    asyncio.run(go())


def test_attach_refuses_what_is_no_run_directory(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def attach(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "andrea_tui.cli", "attach", str(path)],
                              capture_output=True, text=True, timeout=60, env=env,
                              stdin=subprocess.DEVNULL)

    for path in (Path("/"), tmp_path):
        r = attach(path)
        assert r.returncode == 2 and "not a run directory (no engine.json" in r.stderr, r.stderr
    lock = EngineLock().acquire(tmp_path)  # an engine starting there, nothing written yet
    try:
        r = attach(tmp_path)
        assert r.returncode == 2 and "starting there" in r.stderr, r.stderr
    finally:
        lock.release()


def test_a_refused_resume_is_one_line_and_no_screen(tmp_path: Path, write_config) -> None:
    cfg = write_config(micro_config_dict(max_steps=20))
    run = tmp_path / "run"
    assert run_engine(cfg, run).returncode == 0
    r = subprocess.run([sys.executable, "-m", "andrea_tui.cli", str(cfg), "--run-dir", str(run),
                        "--resume", "--max-steps", "5", "--backend", "numpy"],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().count("\n") == 0 and "already at step 20" in r.stderr, r.stderr
    assert "\x1b[" not in r.stdout  # no screen was drawn
    assert json.loads((run / "state.json").read_text())["status"] == "finished"


READ_ONLY_APP = r"""
import asyncio, sys
from andrea_tui.app import AndreaApp
from andrea_tui.ckpt_screens import CheckpointApp
async def go():
    app = AndreaApp(sys.argv[1])
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(100):
            if app.state.series.n: break
            await pilot.pause(0.05)
        await pilot.press("c")
        await pilot.pause(0.3)
        print("steps", app.state.series.n, "screen", type(app.screen).__name__)
asyncio.run(go())
"""


def test_attach_and_browse_a_read_only_run_directory(tmp_path: Path) -> None:
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode:
        pytest.skip("no user namespaces here to make a read-only mount")
    paths = write_run(tmp_path / "run", 120, status="finished")
    script = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script, str(paths.root), sys.executable,
                        "-c", READ_ONLY_APP, str(paths.root)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert "steps 120 screen CheckpointListScreen" in r.stdout, r.stdout + r.stderr


def test_a_resume_that_ignores_the_given_config_is_told(tmp_path: Path) -> None:
    paths = write_run(tmp_path / "run", 30, status="running")
    app = AndreaApp(paths.root)

    async def go() -> None:
        async with app.run_test(size=SIZE) as pilot:
            while not app.history_loaded:
                await pilot.pause(0.05)
            ev = rec.ResumeEvent(t=time.time(), step=20, path="checkpoints/step_00000020",
                                 ignored=[rec.IgnoredSetting("optim.lr", 0.001, 0.002)])
            with open(paths.events, "a") as f:
                f.write(json.dumps(ev.to_json()) + "\n")
            for _ in range(100):
                app.pacer.poll_all()
                texts = [n.message for n in app._notifications]
                if any("optim.lr: 0.001 kept (given 0.002)" in t for t in texts):
                    break
                await pilot.pause(0.05)
            else:
                raise AssertionError(f"no notice: {texts}")

    asyncio.run(go())
