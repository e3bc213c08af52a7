"""Process identity, the engine lock and safe signalling, against real child processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.errors import UserError
from engine.run.control import ControlRefused, engine_alive, signal_engine
from engine.run.identity import EngineLock, boot_id, proc_start_time, write_engine_json

REPO = Path(__file__).resolve().parents[1]

# A child that records every SIGUSR1/SIGTERM it gets in a file. With "engine" it also takes
# engine.lock and writes engine.json like the real engine; "exit" makes it leave right after.
CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    run_dir, mode = Path(sys.argv[1]), sys.argv[2]
    log = run_dir / "signals.txt"
    def record(sig, frame):
        with open(log, "a") as f:
            f.write(signal.Signals(sig).name + "\\n")
    signal.signal(signal.SIGUSR1, record)
    signal.signal(signal.SIGTERM, record)
    if mode in ("engine", "exit"):
        from engine.run.identity import EngineLock, write_engine_json
        lock = EngineLock().acquire(run_dir)
        write_engine_json(run_dir, sys.argv, "run-1")
    print("ready", flush=True)
    if mode == "exit":
        sys.exit(0)
    time.sleep(60)
""")


def spawn(run_dir: Path, mode: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir), mode],
                             stdout=subprocess.PIPE, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.stdout and child.stdout.readline() == b"ready\n"
    return child


@pytest.fixture
def children():
    started: list[subprocess.Popen] = []
    yield started
    for c in started:
        if c.poll() is None:
            c.kill()
        c.wait()


def received(run_dir: Path, want: int = 0, settle: float = 0.3, timeout: float = 15) -> list[str]:
    """The signals the child recorded: wait for `want` of them (a loaded machine can be slow),
    or, when none are expected, give a stray one `settle` seconds to show up."""
    deadline = time.monotonic() + (timeout if want else settle)
    while True:
        try:
            got = (run_dir / "signals.txt").read_text().split()
        except FileNotFoundError:
            got = []
        if (want and len(got) >= want) or time.monotonic() >= deadline:
            return got
        time.sleep(0.02)


def fake_engine_json(run_dir: Path, real_pid: int, **over: object) -> None:
    info = {"pid": real_pid, "start_time": proc_start_time(real_pid), "boot_id": boot_id(),
            "host": "h", "run_id": "r", "argv": [], "started_at": 0.0, **over}
    (run_dir / "engine.json").write_text(json.dumps(info))


def test_proc_start_time_parses_after_the_last_paren(tmp_path: Path, children) -> None:
    odd = tmp_path / "a) b (c"  # comm with spaces and parentheses
    odd.symlink_to("/bin/sleep")
    child = subprocess.Popen([str(odd), "30"])
    children.append(child)
    time.sleep(0.1)
    stat = Path(f"/proc/{child.pid}/stat").read_text()
    prefix = f"{child.pid} (a) b (c) "
    assert stat.startswith(prefix)
    reference = int(stat[len(prefix):].split()[19])  # fields 3.. after the known comm
    assert proc_start_time(child.pid) == reference
    assert reference >= proc_start_time(os.getpid())  # started after us
    child.kill()
    child.wait()
    assert proc_start_time(child.pid) is None
    assert len(boot_id()) == 36


def test_signals_the_real_engine(tmp_path: Path, children) -> None:
    child = spawn(tmp_path, "engine")
    children.append(child)
    info = json.loads((tmp_path / "engine.json").read_text())
    assert info["pid"] == child.pid and info["start_time"] == proc_start_time(child.pid)
    assert info["boot_id"] == boot_id() and info["run_id"] == "run-1"
    assert engine_alive(tmp_path) == (True, f"running (pid {child.pid})")
    signal_engine(tmp_path, signal.SIGUSR1)
    assert received(tmp_path, want=1) == ["SIGUSR1"]
    signal_engine(tmp_path, signal.SIGTERM)
    assert received(tmp_path, want=2) == ["SIGUSR1", "SIGTERM"]
    assert child.poll() is None  # the recorder handled both, still alive


def test_refuses_a_dead_job(tmp_path: Path, children) -> None:
    child = spawn(tmp_path, "exit")
    children.append(child)
    assert child.wait(10) == 0
    with pytest.raises(ControlRefused, match=r"engine not running \(lock free\)"):
        signal_engine(tmp_path, signal.SIGUSR1)
    alive, why = engine_alive(tmp_path)
    assert not alive and "lock free" in why


def test_refuses_a_pid_now_used_by_another_process(tmp_path: Path, children) -> None:
    victim = spawn(tmp_path, "recorder")  # a live process that is NOT the engine
    children.append(victim)
    real = proc_start_time(victim.pid)
    assert real is not None
    fake_engine_json(tmp_path, victim.pid, start_time=real - 7)
    lock = EngineLock().acquire(tmp_path)  # somebody holds the lock, so only identity can save us
    try:
        with pytest.raises(ControlRefused, match=f"pid {victim.pid} now belongs to another"):
            signal_engine(tmp_path, signal.SIGUSR1)
        assert not engine_alive(tmp_path)[0]
    finally:
        lock.release()
    assert received(tmp_path) == []
    assert victim.poll() is None


def test_refuses_when_the_lock_is_free_even_if_identity_matches(tmp_path: Path, children) -> None:
    victim = spawn(tmp_path, "recorder")
    children.append(victim)
    fake_engine_json(tmp_path, victim.pid)
    (tmp_path / "engine.lock").touch()
    with pytest.raises(ControlRefused, match="lock free"):
        signal_engine(tmp_path, signal.SIGUSR1)
    assert received(tmp_path) == []
    # the probe released the lock at once: an engine can still take it
    EngineLock().acquire(tmp_path, retry_s=0).release()


def test_refuses_bad_engine_json(tmp_path: Path, children) -> None:
    with pytest.raises(ControlRefused, match=r"engine\.json: missing"):
        signal_engine(tmp_path, signal.SIGUSR1)
    victim = spawn(tmp_path, "recorder")
    children.append(victim)
    lock = EngineLock().acquire(tmp_path)
    try:
        for pid in (0, 1, -5, "12", True):
            fake_engine_json(tmp_path, victim.pid, pid=pid)
            with pytest.raises(ControlRefused, match="pid: expected an integer"):
                signal_engine(tmp_path, signal.SIGUSR1)
        fake_engine_json(tmp_path, victim.pid, boot_id="0" * 36)
        with pytest.raises(ControlRefused, match="reboot or on another host"):
            signal_engine(tmp_path, signal.SIGUSR1)
        (tmp_path / "engine.json").write_text("{not json")
        with pytest.raises(ControlRefused, match="missing or unreadable"):
            signal_engine(tmp_path, signal.SIGUSR1)
    finally:
        lock.release()
    assert received(tmp_path) == []
    assert issubclass(ControlRefused, UserError)


def test_engine_lock_is_exclusive_and_names_the_holder(tmp_path: Path, children) -> None:
    child = spawn(tmp_path, "engine")
    children.append(child)
    with pytest.raises(UserError, match=f"held by engine pid {child.pid}"):
        EngineLock().acquire(tmp_path, retry_s=0.1)
    child.kill()
    child.wait()  # the kernel drops the flock of a killed process
    lock = EngineLock().acquire(tmp_path, retry_s=0)
    assert lock.held
    info = write_engine_json(tmp_path, ["andrea-train", "x.json"], "run-2")
    assert json.loads((tmp_path / "engine.json").read_text()) == info.to_json()
    assert info.pid == os.getpid() and info.start_time == proc_start_time(os.getpid())
    lock.release()
    assert not lock.held
