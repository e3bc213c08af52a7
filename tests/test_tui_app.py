"""The app, headless (run_test + Pilot): values on screen, following, signals to a real child,
the engine dying, and the checkpoint browser on real checkpoints."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from andrea_tui.app import AndreaApp
from andrea_tui.launcher import launch
from andrea_tui.screentext import screen_text
from engine.run.control import engine_alive
from engine.runfiles import read_jsonl
from tests.fakerun import loss_record, write_run

SIZE = (140, 45)


async def wait_until(pilot, cond: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting; screen:\n{screen_text(pilot.app)}")
        await pilot.pause(0.05)


@contextlib.asynccontextmanager
async def finished_run_app(root: Path, size: tuple[int, int] = (140, 45)):
    """A headless AndreaApp on a run directory, not following it, once its history is loaded:
    yields (app, pilot)."""
    app = AndreaApp(root, follow=False, control_interval=3600)
    async with app.run_test(size=size) as pilot:
        await wait_until(pilot, lambda: app.history_loaded)
        yield app, pilot


def record_notes(app: AndreaApp) -> list[str]:
    notes: list[str] = []
    orig = app.notify

    def notify(message, *a, **kw):
        notes.append(str(message))
        return orig(message, *a, **kw)

    app.notify = notify  # type: ignore[method-assign]
    return notes


def run(coro) -> None:
    asyncio.run(coro)


def start_fake_engine(run_dir: Path, rate: float = 20.0):
    proc = launch([sys.executable, "-m", "tests.fakerun", str(run_dir),
                   "--rate", str(rate)], run_dir)
    deadline = time.monotonic() + 20
    while not engine_alive(run_dir)[0]:
        assert proc.poll() is None, (run_dir / "engine.log").read_text()
        assert time.monotonic() < deadline, "fake engine did not come up"
        time.sleep(0.05)
    return proc


@pytest.fixture
def engine_proc(tmp_path: Path):
    run_dir = tmp_path / "run"
    proc = start_fake_engine(run_dir)
    yield run_dir, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_dashboard_shows_run_values(tmp_path: Path) -> None:
    paths = write_run(tmp_path / "run", 1200, status="finished")

    async def go() -> None:
        app = AndreaApp(paths.root, clock=lambda: 1_700_000_500.0, follow=False)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.history_loaded)
            await pilot.pause()
            text = screen_text(app)
            last = loss_record(1200, 0)
            assert "ANDREA-fake" in text and "numpy/cpu" in text and "finished" in text
            assert "step 1,200/2,000" in text
            assert "tokens 307k" in text  # 1200 steps x 256 tokens
            # tok/s over the last 10 s of records: 256 tokens each 0.1 s (a step's own tok_s,
            # 5120 in these records, counts only its compute)
            assert "2.56k tok/s" in text and "elapsed 2m00s" in text
            skipped = sum(loss_record(s, 0)["skipped"] for s in range(1, 1201))
            assert f"skipped   {skipped} non-finite" in text
            for name, w in last["weights"].items():
                assert name in text and f"{w:.2g}" in text
            assert f"phase {1200 // 14}" in text
            assert "read-only: this run is finished" in text
            assert "def f1200(x)" in text and "plan 29.0 MiB" in text
            assert "clip at 1" in text
            notes = record_notes(app)
            await pilot.press("s")
            assert any("snapshot is off" in n for n in notes)
            await pilot.press("y")
            await pilot.pause()
            assert "log y" in screen_text(app)
            await pilot.press("w")
            await pilot.pause()
            assert "last 500" in screen_text(app)
            await pilot.press("q")  # read-only: q just closes
        assert app.return_value and "read-only" in app.return_value

    run(go())


def test_attach_follows_torn_corrupt_and_duplicate_lines(tmp_path: Path) -> None:
    paths = write_run(tmp_path / "run", 100, status="running")

    async def go() -> None:
        app = AndreaApp(paths.root, clock=lambda: 1_700_000_500.0)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.history_loaded)
            assert app.state.series.n == 100
            line = json.dumps(loss_record(101, 1_700_000_010.0)).encode()
            with open(paths.loss, "ab") as f:
                f.write(line[:30])
            await pilot.pause(0.3)
            assert app.state.series.n == 100  # the torn line waits for its end
            with open(paths.loss, "ab") as f:
                f.write(line[30:] + b"\n{garbage\n")
                f.write(json.dumps({**loss_record(50, 0.0), "loss": 77.0}).encode() + b"\n")
            await wait_until(pilot, lambda: app.state.series.n == 101, timeout=5)
            await wait_until(pilot, lambda: "step 101/2,000" in screen_text(app), timeout=5)
            # step 50 again, with no resume to explain it: out of sequence, skipped and counted
            assert app.state.series.col("loss")[49] != 77.0
            assert app.state.bad_lines == 1 and app.state.skipped_lines == 2
            # the panels refresh after the header: under load the training panel can lag it
            await wait_until(pilot, lambda: "2 corrupt line(s) skipped" in screen_text(app),
                             timeout=5)
            # samples.jsonl replaced atomically, events appended: both seen
            tmp = paths.root / "s.tmp"
            tmp.write_text(json.dumps({"step": 101, "t": 0, "prompt": "The ",
                                       "text": "The replaced sample"}) + "\n")
            os.replace(tmp, paths.samples)
            await wait_until(pilot, lambda: "The replaced sample" in screen_text(app), 5)

    run(go())


def test_keys_send_signals_to_a_real_engine(engine_proc) -> None:
    run_dir, proc = engine_proc

    async def go() -> None:
        app = AndreaApp(run_dir, stop_timeout=30)
        notes = record_notes(app)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.history_loaded and app.supervisor.controllable)
            await wait_until(pilot, lambda: (app.state.series.n or 0) > 3)
            await pilot.press("s")
            await wait_until(pilot, lambda: any("checkpoint step" in n and "snapshot" in n
                                                for n in notes))
            events, _ = read_jsonl(run_dir / "events.jsonl")
            assert any(e.get("signal") == "SIGUSR1" for e in events)
            snap = [e for e in events if e.get("event") == "checkpoint"]
            assert snap and snap[0]["reason"] == "snapshot"
            assert any(snap[0]["path"] in n for n in notes)
            await pilot.press("q")
            assert "stopping" in screen_text(app)
            await wait_until(pilot, lambda: app.return_value is not None, timeout=20)
        assert proc.wait(timeout=10) == 0
        events, _ = read_jsonl(run_dir / "events.jsonl")
        assert any(e.get("signal") == "SIGTERM" for e in events)
        stops = [e for e in events if e.get("event") == "checkpoint" and e["reason"] == "stop"]
        assert stops and Path(stops[0]["path"]).is_dir()
        assert "stopped" in app.return_value and stops[0]["path"] in app.return_value

    run(go())


def test_detach_leaves_engine_running(engine_proc) -> None:
    run_dir, proc = engine_proc

    async def go() -> None:
        app = AndreaApp(run_dir)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.history_loaded and app.supervisor.controllable)
            await pilot.press("d")
        assert f"andrea-tui attach {run_dir}" in app.return_value

    run(go())
    time.sleep(0.3)
    assert proc.poll() is None and engine_alive(run_dir)[0]


def test_launched_engine_killed_shows_status_and_stays_up(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_fake_engine(run_dir)

    async def go() -> None:
        app = AndreaApp(run_dir, proc=proc, control_interval=0.2)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.history_loaded and app.supervisor.controllable)
            os.kill(proc.pid, signal.SIGKILL)
            await wait_until(pilot, lambda: "killed by signal 9" in screen_text(app))
            assert app.supervisor.engine_exit == -9 and not app.supervisor.controllable
            await pilot.pause(0.5)
            assert app.is_running and app.return_value is None  # stays up for inspection
            await pilot.press("q")
        assert "read-only" in app.return_value

    run(go())


def test_stop_timeout_offers_force(tmp_path: Path) -> None:
    """An engine that ignores SIGTERM: after the timeout the app asks, `f` sends SIGKILL."""
    run_dir = tmp_path / "run"
    proc = start_fake_engine(run_dir)
    # Make the fake ignore SIGTERM by stopping it (SIGSTOP): it cannot act on the signal.
    os.kill(proc.pid, signal.SIGSTOP)

    async def go() -> None:
        app = AndreaApp(run_dir, proc=proc, stop_timeout=0.5, control_interval=0.1)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.history_loaded and app.supervisor.controllable)
            await pilot.press("q")
            await wait_until(pilot, lambda: "did not stop within" in screen_text(app))
            await pilot.press("f")
            await wait_until(pilot, lambda: app.return_value is not None, timeout=10)
        assert proc.wait(timeout=10) == -signal.SIGKILL

    try:
        run(go())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- checkpoint browser


def write_checkpoints(run_dir: Path) -> list[Path]:
    from engine.run.checkpoint_write import write_checkpoint

    table = [{"name": "wte", "shape": [8, 4], "offset": 0},
             {"name": "h0.w", "shape": [4, 4], "offset": 32}]
    rng = np.random.default_rng(3)
    p1 = rng.normal(size=48).astype(np.float32)
    p2 = p1.copy()
    p2[:32] *= 1.5  # wte changes by 50%, h0.w not at all
    out = []
    for step, params, reason in ((10, p1, "periodic"), (20, p2, "snapshot"),
                                 (30, p2, "periodic")):
        info = write_checkpoint(run_dir / "checkpoints", step, params, params * 0.1,
                                params * params, {"bandit": {"phase": 3, "eta": 0.5},
                                                  "schedule": {"lr": 1e-3}}, reason, table)
        out.append(info.path)
    model = out[2] / "model.ckpt"
    data = bytearray(model.read_bytes())
    data[20] ^= 0xFF  # corrupt the newest one
    model.write_bytes(bytes(data))
    return out


def test_checkpoint_browser_lists_verifies_details_and_compares(tmp_path: Path) -> None:
    from andrea_tui.ckpt_screens import (
        CheckpointDetailScreen,
        CheckpointListScreen,
        CompareScreen,
    )

    paths = write_run(tmp_path / "run", 30)
    ck = write_checkpoints(paths.root)

    async def go() -> None:
        app = AndreaApp(paths.root, follow=False)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.history_loaded)
            await pilot.press("c")
            scr = app.screen
            assert isinstance(scr, CheckpointListScreen)
            await wait_until(pilot, lambda: len(scr.entries) == 3)
            text = screen_text(app)
            assert "3 found, 1 invalid" in text and "INVALID" in text and "sha256" in text
            assert [e.step for e in scr.entries] == [30, 20, 10]
            await pilot.press("down")  # step 20 (valid)
            await pilot.press("enter")
            det = app.screen
            assert isinstance(det, CheckpointDetailScreen)
            await wait_until(pilot, lambda: len(det.stats) == 2)
            text = screen_text(app)
            assert "step 20" in text and "snapshot" in text and "verified" in text
            assert "bandit" in text and "phase=3" in text and "schedule" in text
            w = np.frombuffer((ck[1] / "model.ckpt").read_bytes()[8:8 + 4 * 48], "<f4")
            assert det.stats[0]["weights"]["rms"] == pytest.approx(
                float(np.sqrt(np.mean(w[:32].astype(np.float64) ** 2))))
            await pilot.press("escape")
            await pilot.press("m")  # step 20
            await pilot.press("down")
            await pilot.press("m")  # step 10
            cmp_ = app.screen
            assert isinstance(cmp_, CompareScreen)
            await wait_until(pilot, lambda: len(cmp_.rows) == 2)
            rel = {r["name"]: r["rel"] for r in cmp_.rows}
            assert rel["wte"] == pytest.approx(0.5, rel=1e-6) and rel["h0.w"] == 0.0
            await pilot.press("escape")
            await pilot.press("escape")
            assert app.screen is app.screen_stack[0]

    run(go())


def test_q_in_pushed_screens_closes_them_not_the_engine(engine_proc) -> None:
    from andrea_tui.ckpt_screens import CheckpointListScreen
    from andrea_tui.logscreen import LogScreen
    from andrea_tui.screens import HelpScreen

    run_dir, proc = engine_proc

    async def go() -> None:
        app = AndreaApp(run_dir, control_interval=0.2)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.history_loaded and app.supervisor.controllable)
            dashboard = app.screen
            for key, screen_type in (("c", CheckpointListScreen), ("l", LogScreen),
                                     ("question_mark", HelpScreen)):
                for close in ("q", "escape"):
                    await pilot.press(key)
                    assert isinstance(app.screen, screen_type)
                    await pilot.press(close)
                    await pilot.pause()
                    assert app.screen is dashboard, f"{close} did not close {screen_type}"
                    assert app.supervisor.stopping_since is None and app.is_running
            await pilot.pause(0.5)
            assert proc.poll() is None  # the engine got no SIGTERM
            await pilot.press("q")  # on the dashboard, q still stops the engine
            assert app.supervisor.stopping_since is not None
            await wait_until(pilot, lambda: proc.poll() is not None, timeout=20)
        assert proc.returncode == 0

    run(go())


# ---------------------------------------------------------------- launch guards

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "experiments" / "ANDREA-tiny-TRAIN.json"


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "andrea_tui.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)


def signals_seen(run_dir: Path) -> list[str]:
    events, _ = read_jsonl(run_dir / "events.jsonl")
    return [e["signal"] for e in events if e.get("event") == "signal"]


def test_launch_on_a_run_dir_with_a_live_engine_is_refused(engine_proc, tmp_path: Path) -> None:
    run_dir, proc = engine_proc
    log_before = (run_dir / "engine.log").stat().st_size
    r = cli([str(TINY), "--run-dir", str(run_dir)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr == (f"error: an engine (pid {proc.pid}) is already running on {run_dir}; "
                        f"use `andrea-tui attach {run_dir}`\n")
    assert (run_dir / "engine.log").stat().st_size == log_before  # nothing was started
    assert proc.poll() is None and signals_seen(run_dir) == []


def test_launch_on_old_checkpoints_without_resume_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_00000100").mkdir(parents=True)
    r = cli([str(TINY), "--run-dir", str(run_dir)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr == (f"error: {run_dir}: already holds checkpoints; pass --resume to continue "
                        "this run, or choose another --run-dir (nothing was changed)\n")
    assert not (run_dir / "engine.log").exists()


@pytest.mark.parametrize("where", ["file", "proc"])
def test_uncreatable_run_dir_is_one_line(tmp_path: Path, where: str) -> None:
    f = tmp_path / "plain.txt"
    f.write_text("x")
    bad = f / "sub" if where == "file" else Path("/proc/andrea-no-such/sub")
    r = cli([str(TINY), "--run-dir", str(bad)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: --run-dir {bad}: cannot create it: ")
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    if where == "file":
        assert r.stderr.endswith(f"cannot create it: {os.strerror(errno.ENOTDIR)}\n")


def test_refused_launch_never_steers_the_other_engine(engine_proc) -> None:
    """A launched child that is not the engine of the run dir (the real one refused and exits
    2, as andrea-train does on a held lock): s/q must not reach the other engine, and the
    app ends with the child's error line and status 2."""
    run_dir, other = engine_proc
    child = launch([sys.executable, "-c", "import time; time.sleep(1.0); "
                    "print('error: engine.lock: held by another engine'); raise SystemExit(2)"],
                   run_dir)

    async def go() -> AndreaApp:
        app = AndreaApp(run_dir, proc=child, control_interval=0.1)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.history_loaded)
            await pilot.pause(0.3)
            assert not app.supervisor.controllable  # the live engine here is not ours
            await pilot.press("s")
            await wait_until(pilot, lambda: app.return_value is not None or not app.is_running)
        return app

    app = asyncio.run(go())
    child.wait(timeout=10)
    assert app.supervisor.engine_error == "error: engine.lock: held by another engine"
    assert app.supervisor.exit_status == 2
    assert other.poll() is None and signals_seen(run_dir) == []


def test_dead_engine_in_attach_is_shown_dead_with_frozen_clock(tmp_path: Path) -> None:
    """kill -9 leaves state.json at "running" and the lock free."""
    t0, dt, n = 1_700_000_000.0, 0.1, 300
    paths = write_run(tmp_path / "run", n, t0=t0, dt=dt, status="running")

    async def go() -> None:
        app = AndreaApp(paths.root, clock=lambda: t0 + 10_000.0, follow=False)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.history_loaded)
            await pilot.pause()
            head = screen_text(app).splitlines()[0]
            assert "dead (state.json says running)" in head, head
            # elapsed stops at the last record's t (t0 + n*dt = 30 s), not the clock's 10000 s
            assert "elapsed 30s" in head and "ETA –" in head, head

    run(go())


def test_ctrl_q_in_launch_mode_detaches_and_says_so(engine_proc) -> None:
    run_dir, proc = engine_proc

    async def go() -> AndreaApp:
        app = AndreaApp(run_dir, proc=proc)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.history_loaded and app.supervisor.controllable)
            await pilot.press("ctrl+c")
            await pilot.press("ctrl+q")
            await wait_until(pilot, lambda: app.return_value is not None)
        return app

    app = asyncio.run(go())
    assert "engine keeps running" in app.return_value
    assert f"andrea-tui attach {run_dir}" in app.return_value
    assert proc.poll() is None


def test_q_before_the_engine_started_stops_it_cleanly(tmp_path: Path) -> None:
    """`q` before engine.json exists: the stop waits until the engine can take it, so the
    engine writes its stop checkpoint and exits 0 (not killed by SIGTERM at startup)."""
    run_dir = tmp_path / "run"
    proc = launch([sys.executable, "-c", "import time, sys; time.sleep(1.5); "
                   "from tests.fakerun import main; sys.exit(main(sys.argv[1:]))",
                   str(run_dir)], run_dir)

    async def go() -> AndreaApp:
        app = AndreaApp(run_dir, proc=proc, control_interval=0.1)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("q")
            assert "stopping" in screen_text(app)
            await wait_until(pilot, lambda: app.return_value is not None, timeout=20)
        return app

    try:
        app = asyncio.run(go())
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert signals_seen(run_dir) == ["SIGTERM"]
    assert "stopped" in app.return_value and "engine exit status 0" in app.return_value


@pytest.mark.parametrize("size", [(80, 24), (140, 45)])
def test_small_terminal_keeps_charts_and_side_panels(tmp_path: Path, size) -> None:
    paths = write_run(tmp_path / "run", 300, status="finished")

    async def go() -> None:
        app = AndreaApp(paths.root, follow=False)
        async with app.run_test(size=size) as pilot:
            await wait_until(pilot, lambda: app.history_loaded)
            await pilot.pause()
            dash = app.view.screen
            small = size == (80, 24)
            for wid in ("loss", "gradnorm"):
                assert dash.query_one(f"#{wid}").size.height >= (8 if small else 10)
            training = dash.query_one("#training")
            assert training.size.height >= 6 and training.size.width >= 30
            for wid in ("bottom", "sample"):  # events + engine.log rows, latest sample
                assert dash.query_one(f"#{wid}").display is not small
            assert "loss" in screen_text(app)

    run(go())


def test_timers_firing_after_the_screens_are_gone_do_nothing(tmp_path: Path) -> None:
    """Textual stops an app's timers after it has removed its screens (a test's teardown), so
    under load a control tick or a chart redraw can run with no screen left: the chart timer
    raised ScreenStackError, the tick NoScreen from a LinePanel it redrew."""
    paths = write_run(tmp_path / "run", 30, status="running")
    app = AndreaApp(paths.root)

    async def go() -> None:
        async with app.run_test(size=SIZE) as pilot:
            while not app.history_loaded:
                await pilot.pause(0.05)
        assert not app.screen_stack
        app.view.redraw_charts_if_due()
        app._tick()

    asyncio.run(go())
