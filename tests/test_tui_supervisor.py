"""EngineSupervisor without a screen, against a real process: the fake engine (tests/fakerun.py,
which holds engine.lock and writes engine.json as andrea-train does) or a child that is not it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from andrea_tui.launcher import launch
from andrea_tui.runreader import RunReader
from andrea_tui.runstate import RunState
from andrea_tui.supervisor import Banner, EngineCheck, EngineSupervisor
from engine.run.control import engine_alive
from engine.runfiles import read_jsonl


def start_fake_engine(run_dir: Path, delay: float = 0.0) -> subprocess.Popen:
    """The fake engine as the app launches an engine; `delay` before it writes anything."""
    code = (f"import sys, time; time.sleep({delay}); "
            "from tests.fakerun import main; sys.exit(main(sys.argv[1:]))")
    return launch([sys.executable, "-c", code, str(run_dir), "--rate", "20"], run_dir)


def wait_for(cond: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def signals_seen(run_dir: Path) -> list[str]:
    events, _ = read_jsonl(run_dir / "events.jsonl")
    return [e["signal"] for e in events if e.get("event") == "signal"]


class Run:
    """The supervisor and the run state it is shown, fed from the run directory."""

    def __init__(self, run_dir: Path, proc: subprocess.Popen | None = None, **kw) -> None:
        self.state = RunState()
        self.reader = RunReader(run_dir, self.state)
        self.sup = EngineSupervisor(run_dir, proc, **kw)

    def check(self):
        self.reader.poll()
        return self.sup.check(self.state)


@pytest.fixture
def cleanup():
    procs: list[subprocess.Popen] = []
    yield procs.append
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def test_our_engine_is_controllable_and_a_snapshot_is_announced(tmp_path: Path,
                                                                 cleanup) -> None:
    run_dir = tmp_path / "run"
    proc = start_fake_engine(run_dir)
    cleanup(proc)
    run = Run(run_dir, proc)
    wait_for(lambda: run.check() and run.sup.controllable, "the engine to be controllable")
    assert run.sup.ours() and run.sup.reason == f"running (pid {proc.pid})"
    assert run.check() == EngineCheck(banner=Banner(""))  # nothing ended, nothing sent
    wait_for(lambda: run.check() and (run.state.series.n or 0) > 2, "steps")

    out = run.sup.snapshot(run.state)
    assert out.ok and out.message == "SIGUSR1 sent: snapshot at the next step boundary"
    news: list[str] = []

    def announced() -> bool:
        run.check()
        news.extend(run.sup.checkpoint_news(run.state))
        return bool(news)

    wait_for(announced, "the snapshot checkpoint to be announced")
    snap = [e for e in read_jsonl(run_dir / "events.jsonl")[0] if e.get("event") == "checkpoint"]
    assert [e["reason"] for e in snap] == ["snapshot"] and signals_seen(run_dir) == ["SIGUSR1"]
    assert len(news) == 1
    assert news[0].startswith(f"checkpoint step {snap[0]['step']} (snapshot): {snap[0]['path']} in ")
    assert run.sup.checkpoint_news(run.state) == []  # each checkpoint is announced once
    assert run.sup.detach().close == ("engine keeps running. Reattach with:\n"
                                      f"  andrea-tui attach {run_dir}")
    assert proc.poll() is None and run.sup.exit_status == 0


def test_stop_ends_stopped_with_exit_status_0(tmp_path: Path, cleanup) -> None:
    run_dir = tmp_path / "run"
    proc = start_fake_engine(run_dir)
    cleanup(proc)
    run = Run(run_dir, proc)
    wait_for(lambda: run.check() and run.sup.controllable, "the engine to be controllable")

    out = run.sup.stop(run.state)
    assert out.ok and out.close is None and run.sup.stopping_since is not None
    assert run.sup.note(run.state, True) == "stopping… (waiting for the stop checkpoint)"
    again = run.sup.stop(run.state)
    assert not again.ok and "already stopping" in again.message
    wait_for(lambda: run.check() and run.sup.stop_done(), "the engine to stop")

    assert proc.wait(timeout=10) == 0 and run.sup.engine_exit == 0
    assert run.sup.exit_status == 0 and run.sup.engine_error is None
    run.reader.poll()
    assert run.state.status == "stopped" and signals_seen(run_dir) == ["SIGTERM"]
    stop_ckpt = run.state.last_checkpoint
    assert stop_ckpt.reason == "stop"
    assert run.sup.stop_summary(run.state) == (
        f"ANDREA-fake: stopped at step {run.state.step}, engine exit status 0; "
        f"last checkpoint {stop_ckpt.path} (step {stop_ckpt.step})")


def test_stop_before_the_engine_started_waits_for_it(tmp_path: Path, cleanup) -> None:
    """`q` before engine.json names our child: the SIGTERM waits until its handlers exist, so
    the engine writes its stop checkpoint and exits 0 instead of dying at start-up."""
    run_dir = tmp_path / "run"
    proc = start_fake_engine(run_dir, delay=1.0)
    cleanup(proc)
    run = Run(run_dir, proc)
    run.check()
    assert not run.sup.controllable and run.sup.may_have_become_reachable()
    out = run.sup.stop(run.state)
    assert out.ok and out.message == "stop requested: sent as soon as the engine has started"
    assert run.sup.stop_deferred and signals_seen(run_dir) == []
    assert run.sup.note(run.state, True) == "stopping… (waiting for the engine to start)"
    sent: list = []
    wait_for(lambda: sent.append(run.check().stop) or run.sup.stop_done(), "the engine to stop")
    assert [s.ok for s in sent if s is not None] == [True]  # sent once, by a check
    assert proc.wait(timeout=10) == 0 and signals_seen(run_dir) == ["SIGTERM"]
    assert run.sup.exit_status == 0


def test_refused_start_gives_the_engine_error_and_exit_status_2(tmp_path: Path,
                                                                cleanup) -> None:
    run_dir = tmp_path / "run"
    proc = launch([sys.executable, "-c", "print('prep: reading x.json'); "
                   "print('error: x.json: model.n_layer: must be > 0, got 0'); "
                   "raise SystemExit(2)"], run_dir)
    cleanup(proc)
    proc.wait(timeout=20)
    run = Run(run_dir, proc)
    check = run.check()
    assert check.exited and check.refused
    assert run.sup.engine_error == "error: x.json: model.n_layer: must be > 0, got 0"
    assert run.sup.exit_status == 2 and run.sup.exit_how() == "exit status 2"
    assert not run.check().exited  # the end is reported once
    assert run.sup.stop_summary(run.state).startswith(
        "engine stopped before it started (exit status 2); see ")


def test_failed_engine_is_exit_status_1_with_its_log_in_the_banner(tmp_path: Path,
                                                                   cleanup) -> None:
    run_dir = tmp_path / "run"
    proc = launch([sys.executable, "-c", "print('boom: no shards'); raise SystemExit(3)"],
                  run_dir)
    cleanup(proc)
    proc.wait(timeout=20)
    run = Run(run_dir, proc)
    check = run.check()
    assert check.exited and not check.refused and run.sup.engine_error is None
    assert check.banner is not None and check.banner.error
    assert check.banner.text.startswith("[b]engine ended: exit status 3[/b]")
    assert "boom: no shards" in check.banner.text
    assert run.sup.exit_status == 1 and run.sup.engine_dead(True, True)
    assert run.sup.detach().close == f"closed {run_dir} (no engine running)"


def test_dead_engine_refuses_every_signal(tmp_path: Path, cleanup) -> None:
    """kill -9 leaves engine.json and state.json "running" behind, and the lock free."""
    run_dir = tmp_path / "run"
    proc = start_fake_engine(run_dir)
    cleanup(proc)
    wait_for(lambda: engine_alive(run_dir)[0], "the engine")
    proc.kill()
    proc.wait(timeout=10)
    run = Run(run_dir)  # attach mode
    check = run.check()
    assert not run.sup.controllable and run.sup.reason == "engine.lock: engine not running (lock free)"
    assert check.banner == Banner("read-only: engine.lock: engine not running (lock free); "
                                  "s and q are off")
    assert run.state.status == "running" and run.sup.engine_dead(run.state.live, True)
    assert run.sup.note(run.state, True) == "dead (state.json says running)"
    snap = run.sup.snapshot(run.state)
    assert not snap.ok and snap.severity == "warning" and snap.message.startswith("snapshot is off")
    stop = run.sup.stop(run.state)
    assert not stop.ok and stop.close is not None and "read-only" in stop.close
    force = run.sup.answer_force(True)
    assert not force.ok and force.severity == "error"
    assert force.message.startswith("force stop: not sent: ") and "lock free" in force.message
    assert signals_seen(run_dir) == []


def test_a_foreign_engine_is_never_signalled(tmp_path: Path, cleanup) -> None:
    """Launch mode, but the live engine of the run directory is not the child we started."""
    run_dir = tmp_path / "run"
    other = start_fake_engine(run_dir)
    cleanup(other)
    wait_for(lambda: engine_alive(run_dir)[0], "the other engine")
    child = launch([sys.executable, "-c", "import time; time.sleep(60)"], run_dir)
    cleanup(child)
    run = Run(run_dir, child)
    run.check()
    assert not run.sup.ours() and not run.sup.controllable
    assert run.sup.reason == (f"the engine running here is not the one this app started "
                              f"(pid {child.pid})")
    assert not run.sup.snapshot(run.state).ok
    force = run.sup.answer_force(True)
    assert not force.ok and "is not the one this app started" in force.message
    time.sleep(0.3)
    assert signals_seen(run_dir) == [] and other.poll() is None and child.poll() is None


def test_stop_timeout_asks_once_then_force_kills(tmp_path: Path, cleanup) -> None:
    run_dir = tmp_path / "run"
    proc = start_fake_engine(run_dir)
    cleanup(proc)
    now = [0.0]
    run = Run(run_dir, proc, stop_timeout=10.0, clock=lambda: now[0])
    wait_for(lambda: run.check() and run.sup.controllable, "the engine to be controllable")
    os.kill(proc.pid, signal.SIGSTOP)  # it cannot act on SIGTERM now
    assert run.sup.stop(run.state).ok
    now[0] = 10.0
    assert run.sup.stop_overdue() is None
    now[0] = 10.5
    asked = run.sup.stop_overdue()
    assert asked is not None and asked.message == "the engine did not stop within 10 s"
    assert run.sup.stop_overdue() is None  # asked once per wait
    assert run.sup.answer_force(False).ok  # keep waiting: another full timeout
    now[0] = 20.0
    assert run.sup.stop_overdue() is None
    now[0] = 21.0
    assert run.sup.stop_overdue() is not None
    assert run.sup.answer_force(True).ok  # SIGKILL, through the verified path
    assert proc.wait(timeout=10) == -signal.SIGKILL
    wait_for(lambda: run.check() and run.sup.stop_done(), "the stop to be done")
    assert run.sup.exit_status == 1
