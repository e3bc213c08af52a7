"""The dashboard under hostile files and faults: megabytes of junk in a run file, a frozen or
stalled engine, forged step records, an engine that refuses its start, a config read from a
pipe, the checkpoints of an earlier session. Real processes and real signals where the fault
is about them."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from andrea_tui.app import AndreaApp
from andrea_tui.launcher import launch
from andrea_tui.runstate import RunState
from andrea_tui.screens import HelpScreen
from andrea_tui.screentext import screen_text
from engine import records as rec
from engine.run.control import engine_alive, signal_engine
from engine.runfiles import read_jsonl, write_json_atomic
from tests.conftest import ROOT, micro_config_dict
from tests.fakerun import CONFIG, loss_record, write_run

SIZE = (140, 45)
JUNK_BYTES = 60 << 20


def run(coro) -> None:
    asyncio.run(coro)


async def wait_until(pilot, cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting; screen:\n{screen_text(pilot.app)}")
        await pilot.pause(0.05)


def header(app: AndreaApp) -> str:
    """The header line as drawn last (its plain text)."""
    return app.view._panel_text.get("header", ("",))[0]


def record_notes(app: AndreaApp) -> list[tuple[str, str]]:
    """Every toast the app raises from now on: (title, message)."""
    notes: list[tuple[str, str]] = []
    orig = app.notify

    def notify(message, *a, **kw):
        notes.append((str(kw.get("title", "")), str(message)))
        return orig(message, *a, **kw)

    app.notify = notify  # type: ignore[method-assign]
    return notes


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def start_fake_engine(run_dir: Path, *extra: str) -> subprocess.Popen:
    proc = launch([sys.executable, "-m", "tests.fakerun", str(run_dir), *extra], run_dir)
    deadline = time.monotonic() + 30
    while not engine_alive(run_dir)[0]:
        assert proc.poll() is None, (run_dir / "engine.log").read_text()
        assert time.monotonic() < deadline, "fake engine did not come up"
        time.sleep(0.05)
    return proc


def end(proc: subprocess.Popen) -> None:
    """End a process this test started (continued first: a stopped one ignores SIGTERM)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
    proc.wait(timeout=30)


# ---------------------------------------------------------------- junk in the run files


def test_sixty_megabytes_of_junk_are_read_through_with_keys_answered(tmp_path: Path) -> None:
    """NUL bytes (what a crash can leave) in events.jsonl and records of a kind the app does not
    know in samples.jsonl: each poll reads a bounded part, and the next part is read at a frame
    scheduled on the loop (never a nested call, one level a poll, that Python's recursion
    limit would end), with keys answered in between."""
    paths = write_run(tmp_path / "run", 50, status="running")
    with open(paths.events, "ab") as f:
        for _ in range(JUNK_BYTES >> 20):
            f.write(b"\0" * (1 << 20))
    unknown = (json.dumps({"kind": "future-record", "pad": "x" * 200}) + "\n").encode()
    with open(paths.samples, "ab") as f:
        f.write(unknown * (JUNK_BYTES // len(unknown)))
    # What comes after the junk (the NULs end at this newline: one corrupt line).
    with open(paths.events, "ab") as f:
        f.write(b"\n" + json.dumps(rec.CheckpointEvent(
            t=time.time(), step=50, reason="snapshot", path="checkpoints/step_00000050",
            bytes=1, seconds=0.5).to_json()).encode() + b"\n")
    with open(paths.samples, "a") as f:
        f.write(json.dumps(rec.Sample(step=50, t=time.time(), prompt="def ",
                                      text="after the junk").to_json()) + "\n")

    async def go() -> None:
        errors: list[object] = []  # what the loop's callbacks raise (a frame is one)
        asyncio.get_running_loop().set_exception_handler(
            lambda _, ctx: errors.append(ctx.get("exception") or ctx.get("message")))
        app = AndreaApp(paths.root, control_interval=0.5)
        async with app.run_test(size=SIZE) as pilot:
            rss0 = rss_mib()
            during: list[bool] = []  # whether junk was left to read when a key was answered
            deadline = time.monotonic() + 180
            while not during or not (
                    app.state.last_sample and app.state.last_sample.text == "after the junk"
                    and app.state.checkpoints and app.state.checkpoints[-1].step == 50):
                assert time.monotonic() < deadline, screen_text(app)
                await pilot.press("question_mark")
                await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen))
                during.append(bool(app.reader.backlog))
                await pilot.press("escape")
                await wait_until(pilot, lambda: not isinstance(app.screen, HelpScreen))
            assert any(during), "no key was answered while the junk was read"
            await wait_until(pilot, lambda: "after the junk" in screen_text(app))
            assert not app.reader.backlog
            assert app.reader.samples.bad_lines == 0 and app.state.unreadable >= 200_000
            grew = rss_mib() - rss0
            assert grew < 200, f"RSS grew {grew:.0f} MiB reading 120 MB of junk"
            # and it goes on following the run
            with open(paths.loss, "a") as f:
                f.write(json.dumps(loss_record(51, time.time())) + "\n")
            await wait_until(pilot, lambda: app.state.series.last_step == 51)
        assert not errors, errors
        assert app.return_code in (None, 0)

    run(go())


# ---------------------------------------------------------------- a frozen or stalled engine


def test_a_frozen_engine_is_said_frozen_and_recovers(tmp_path: Path) -> None:
    """kill -STOP of the engine: its own watchdog is frozen with it, so the viewer judges by its
    own clock and the process state; the header says frozen, not `running · tok/s · ETA`."""
    run_dir = tmp_path / "run"
    proc = start_fake_engine(run_dir, "--rate", "20")
    try:
        async def go() -> None:
            app = AndreaApp(run_dir, control_interval=0.2)
            notes = record_notes(app)
            async with app.run_test(size=SIZE) as pilot:
                await wait_until(pilot, lambda: app.history_loaded and app.supervisor.controllable
                                 and (app.state.series.last_step or 0) > 5)
                assert "tok/s" in header(app) and "frozen" not in header(app)
                os.kill(proc.pid, signal.SIGSTOP)
                await wait_until(pilot, lambda: "frozen (SIGSTOP)" in header(app), timeout=20)
                assert "tok/s" not in header(app) and "ETA" not in header(app)
                assert [t for t, _ in notes].count("frozen (SIGSTOP)") == 1
                await pilot.pause(0.6)  # a few more control ticks: told once
                assert [t for t, _ in notes].count("frozen (SIGSTOP)") == 1
                step = app.state.series.last_step or 0
                os.kill(proc.pid, signal.SIGCONT)
                await wait_until(pilot, lambda: "frozen" not in header(app)
                                 and (app.state.series.last_step or 0) > step + 3, timeout=20)
                assert "tok/s" in header(app) and "ETA" in header(app)
        run(go())
    finally:
        end(proc)


def test_a_stalled_engine_is_said_stalled_once_and_recovers(tmp_path: Path) -> None:
    """An engine that is alive and not stopped but writes no step for much longer than its own
    pace: the header says so instead of tok/s and ETA, one toast tells it, and it goes back to
    normal when steps come again."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_json_atomic(run_dir / "config.json",
                      {**CONFIG, "alerts": {"stall_factor": 5, "stall_min_s": 2}}, durable=False)
    proc = start_fake_engine(run_dir, "--rate", "20", "--stall-at", "40", "--stall-s", "5",
                             "--stall-min-s", "1000")  # the engine's own watchdog stays quiet
    try:
        async def go() -> None:
            app = AndreaApp(run_dir, control_interval=0.2)
            notes = record_notes(app)
            async with app.run_test(size=SIZE) as pilot:
                await wait_until(pilot, lambda: "stalled: no step for" in header(app), timeout=60)
                assert app.state.series.last_step == 40
                assert "tok/s" not in header(app) and "ETA" not in header(app)
                told = [t for t, _ in notes].count("stalled")
                assert told >= 1
                await wait_until(pilot, lambda: (app.state.series.last_step or 0) > 45,
                                 timeout=60)
                await wait_until(pilot, lambda: "stalled" not in header(app))
                assert "tok/s" in header(app) and "ETA" in header(app)
                assert [t for t, _ in notes].count("stalled") == told  # once for the spell
        run(go())
    finally:
        end(proc)


def test_the_stall_line_follows_the_runs_pace_and_its_work_between_steps() -> None:
    """The viewer's stall rule with its own clock: max(stall_min_s, stall_factor x the median
    step interval); a checkpoint after the last step is progress too."""
    from andrea_tui import liveness

    t0 = 1_700_000_000.0
    st = RunState()
    st.set_files(config={**CONFIG, "alerts": {"stall_factor": 20, "stall_min_s": 60}},
                 state=rec.RunStatus(rec.Status.RUNNING, step=100).to_json())
    st.add_events([rec.StartEvent(t=t0, pid=1, name="ANDREA-fake").to_json()])
    st.add_loss([loss_record(s, t0 + s * 5.0) for s in range(1, 101)])  # 5 s a step
    last = t0 + 500.0
    assert liveness.step_pace(st) == 5.0
    assert liveness.stalled(st, last + 99) is None  # 20 x 5 s = 100 s
    stall = liveness.stalled(st, last + 101)
    assert stall is not None and stall.line == 100.0 and round(stall.waited) == 101
    st.add_events([rec.CheckpointEvent(t=last + 90, step=100, reason="periodic",
                                       path="c").to_json()])
    assert liveness.stalled(st, last + 101) is None  # the checkpoint was work
    st.set_files(state=rec.RunStatus(rec.Status.STOPPED, step=100).to_json())
    assert liveness.stalled(st, last + 10_000) is None  # only a running run stalls


def test_the_final_checkpoint_after_the_last_step_is_not_a_stall() -> None:
    """At max_steps a running engine writes its final checkpoint, for as long as the disk
    takes, with no step to show."""
    from andrea_tui import liveness

    t0 = 1_700_000_000.0
    train = {**CONFIG["train"], "max_steps": 100}
    st = RunState()
    st.set_files(config={**CONFIG, "train": train,
                         "alerts": {"stall_factor": 20, "stall_min_s": 60}},
                 state=rec.RunStatus(rec.Status.RUNNING, step=100).to_json())
    st.add_events([rec.StartEvent(t=t0, pid=1, name="ANDREA-fake").to_json()])
    st.add_loss([loss_record(s, t0 + s * 0.5) for s in range(1, 100)])
    assert liveness.stalled(st, t0 + 50 + 90) is not None  # one step short: a stall
    st.add_loss([loss_record(100, t0 + 50)])
    assert st.max_steps == 100 and liveness.stalled(st, t0 + 50 + 90) is None


# ---------------------------------------------------------------- forged step records


def test_a_forged_step_record_neither_pins_the_header_nor_reaches_the_csv(
        tmp_path: Path) -> None:
    paths = write_run(tmp_path / "run", 100, status="running")
    forged = [{"step": 999999, "loss": -1},  # beyond max_steps, impossible loss
              {**loss_record(40, time.time()), "loss": 0.5},  # behind, no resume explains it
              {**loss_record(101, time.time()), "loss": -0.1},  # negative cross-entropy
              {**loss_record(101, time.time()), "loss": math.nan}]  # NaN, not skipped

    async def go() -> None:
        app = AndreaApp(paths.root, clock=lambda: 1_700_000_050.0, control_interval=0.2)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.history_loaded and "step 100/2,000"
                             in header(app))
            assert "corrupt line" not in screen_text(app)
            with open(paths.loss, "a") as f:
                f.write(json.dumps(forged[0]) + "\n")
            await wait_until(pilot, lambda: "step 100/2,000" not in header(app)
                             or "1 corrupt line(s) skipped" in screen_text(app))
            await pilot.pause(0.3)
            assert "step 100/2,000" in header(app), header(app)
            assert app.state.series.last_step == 100
            with open(paths.loss, "a") as f:
                for r in forged[1:]:
                    f.write(json.dumps(r) + "\n")
                f.write(json.dumps(loss_record(101, 1_700_000_010.1)) + "\n")
            await wait_until(pilot, lambda: "step 101/2,000" in header(app))
            await wait_until(pilot, lambda: "4 corrupt line(s) skipped" in screen_text(app))
            assert app.state.series.col("loss")[39] == loss_record(40, 0)["loss"]
            assert app.state.series.last("loss") == loss_record(101, 0)["loss"]
        run_dir_csv_keeps_out(paths.root)

    run(go())


def run_dir_csv_keeps_out(run_dir: Path) -> None:
    from andrea_tui import export

    out = run_dir / "steps.csv"
    assert export.write_csv(run_dir, out, force=True) == 101
    rows = out.read_text().splitlines()
    head = rows[0].split(",")
    steps = [int(r.split(",")[0]) for r in rows[1:]]
    loss = {int(r.split(",")[0]): float(r.split(",")[head.index("loss")]) for r in rows[1:]}
    assert steps == list(range(1, 102))
    assert loss[40] == loss_record(40, 0)["loss"] and loss[101] == loss_record(101, 0)["loss"]


def test_the_sequence_rule_keeps_what_real_runs_write() -> None:
    """What engines legitimately write: a kill -9 and a resume re-writing steps (the later
    record wins, the abandoned timeline is dropped), a resume event read after the records
    that follow it, a run resumed with a larger --max-steps, a fresh start over a run that
    crashed before its first checkpoint, a skipped step's NaN, lines lost to corruption."""
    from engine.records import STEP_GAP_MAX, StepOrder

    def steps(objs: list[dict]) -> list[rec.StepRecord]:
        return [rec.StepRecord.from_json(o) for o in objs]  # type: ignore[misc]

    t0 = 1_700_000_000.0
    # kill -9 at 150, resumed from the checkpoint at 100: 101.. written again
    old = steps([loss_record(s, t0 + s) for s in range(1, 151)])
    new = steps([loss_record(s, t0 + 1000 + s) for s in range(101, 131)])
    resume = rec.ResumeEvent(t=t0 + 1000, step=100, path="c")
    order = StepOrder(max_steps=2000)
    order.note([resume])
    kept = order.admit(rec.drop_abandoned(old + new, [resume]))
    assert [r.step for r in rec.latest_by_step(kept)] == list(range(1, 131))
    assert order.skipped == 0
    # the same, the abandoned records kept (no time on them) and the resume read late
    order = StepOrder(max_steps=2000)
    assert len(order.admit(old)) == 150
    # ... the first new records are held; five that follow one another go on from there
    assert [r.step for r in order.admit(new)] == list(range(105, 131)) and order.skipped == 4
    order.note([resume])  # ... and the resume, read at last, lets the held ones in
    assert [r.step for r in order.readmit()] == list(range(101, 105)) and order.skipped == 0
    # resumed with --max-steps 3000 past the config's 2000: the ready event says so
    order = StepOrder(max_steps=2000)
    order.note([rec.ReadyEvent(t=t0, step=2000, max_steps=3000)])
    assert len(order.admit(steps([loss_record(s, t0 + s) for s in range(2001, 2011)]))) == 10
    # a fresh start in a directory whose first run crashed before any checkpoint
    order = StepOrder(max_steps=2000)
    order.admit(steps([loss_record(s, t0 + s) for s in range(1, 38)]))
    order.note([rec.StartEvent(t=t0 + 500, pid=1)])
    assert len(order.admit(steps([loss_record(s, t0 + 600 + s) for s in range(1, 11)]))) == 10
    # NaN and Infinity on a skipped step; a few lines lost; then a jump no run makes
    order = StepOrder(max_steps=2000)
    skipped_step = {**loss_record(5, t0), "loss": math.nan, "grad_norm": math.inf,
                    "skipped": True}
    assert len(order.admit(steps([loss_record(4, t0), skipped_step, loss_record(9, t0)]))) == 3
    assert order.admit(steps([loss_record(10 + STEP_GAP_MAX, t0)])) == []
    # ... unless the records go on from there: a stray line does not, a sequence does
    assert len(order.admit(steps([loss_record(s, t0) for s in range(300, 310)]))) == 6


def test_a_run_resumed_with_more_steps_reads_whole(tmp_path: Path, write_config) -> None:
    """A real engine: 20 steps, stopped, then resumed with --max-steps 30 past the config's
    20: the dashboard's history and the CSV hold all 30 steps, nothing skipped."""
    from andrea_tui import export
    from engine.runfiles import read_steps
    from tests.conftest import run_engine

    cfg = write_config(micro_config_dict(max_steps=20))
    run_dir = tmp_path / "run"
    assert run_engine(cfg, run_dir).returncode == 0
    r = run_engine(cfg, run_dir, "--resume", "--max-steps", "30")
    assert r.returncode == 0, r.stderr
    records, skipped = read_steps(run_dir / "loss.jsonl")
    assert [x.step for x in records] == list(range(1, 31)) and skipped == 0
    assert export.write_csv(run_dir, tmp_path / "s.csv", force=False) == 30

    async def go() -> None:
        app = AndreaApp(run_dir, follow=False, control_interval=3600)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.history_loaded)
            assert app.state.series.n == 30 and app.state.skipped_lines == 0
            assert "step 30/30" in header(app)

    run(go())


# ---------------------------------------------------------------- a refused start


# a host the model does not fit: the engine refuses it after it said who it was (engine.json),
# with its figures on one line (engine.run.memcheck), exit 2
TOO_SMALL = {"ANDREA_TEST_MEM_AVAILABLE": "1000000"}


def tui(*args: str, cwd: Path | None = None, timeout: float = 120,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "andrea_tui.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=cwd,
                          stdin=subprocess.DEVNULL)


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_a_refused_start_leaves_no_run_directory(tmp_path: Path, write_config) -> None:
    """`andrea-tui CFG --run-dir NEW` on a host the model does not fit: refused by the engine
    after it said who it was (the dashboard had opened), and before that (`--backend cuda`
    with no GPU here, refused while the dashboard waits): NEW, and the parent the TUI made for
    it, are gone, as andrea-train leaves them."""
    cfg = write_config(micro_config_dict())
    new = tmp_path / "parent" / "new"
    r = tui(str(cfg), "--run-dir", str(new), "--backend", "numpy", env=TOO_SMALL)
    assert r.returncode == 2 and "host memory" in r.stderr and "Traceback" not in r.stderr, \
        r.stderr
    assert not new.exists() and not new.parent.exists(), sorted(os.listdir(new))
    r = tui(str(cfg), "--run-dir", str(new), "--backend", "cuda")
    if r.returncode == 2:  # no GPU (or no pycuda) here: the engine refuses the backend
        assert "Traceback" not in r.stderr and not new.parent.exists(), r.stderr


def test_a_refused_start_keeps_every_byte_of_a_run_directory_that_was_there(
        tmp_path: Path, write_config) -> None:
    cfg = write_config(micro_config_dict())
    old = tmp_path / "old"
    old.mkdir()
    (old / "engine.log").write_bytes(b"12:00:00 an earlier engine's last words\n")
    (old / "notes.txt").write_text("mine")
    before = tree(old)
    r = tui(str(cfg), "--run-dir", str(old), "--backend", "numpy", env=TOO_SMALL)
    assert r.returncode == 2 and "host memory" in r.stderr, r.stderr
    after = tree(old)
    after.pop("engine.lock", None)  # the engine's lock file, left as andrea-train leaves it
    assert after == before


# ---------------------------------------------------------------- a config from a pipe


def test_start_engine_hands_a_piped_config_to_the_engine(tmp_path: Path, write_config) -> None:
    """`andrea-tui <(cat cfg.json)`: the TUI reads the pipe, so the engine could not; it gets
    the same bytes now (the run's config.json is that config)."""
    from andrea_tui.cli import start_engine

    cfg = write_config(micro_config_dict(max_steps=10_000))
    run_dir = tmp_path / "run"
    r, w = os.pipe()
    os.write(w, cfg.read_bytes())
    os.close(w)
    args = argparse.Namespace(config=f"/dev/fd/{r}", run_dir=str(run_dir), resume=False,
                              max_steps=None, backend="numpy", precision=None, gpus=1)
    try:
        proc, got = start_engine(args)
    finally:
        os.close(r)
    try:
        assert got == run_dir and engine_alive(run_dir)[0]
        deadline = time.monotonic() + 120
        while not read_jsonl(run_dir / "loss.jsonl")[0]:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        written = json.loads((run_dir / "config.json").read_text())
        assert written["name"] == "ANDREA-micro" and written["train"]["max_steps"] == 10_000
    finally:
        signal_engine(run_dir, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0


def test_the_real_command_reads_a_config_from_process_substitution(
        tmp_path: Path, write_config) -> None:
    """bash's `<(cat cfg.json)`, the real command: the engine reads the config (here to refuse
    a model the host cannot hold, its own answer naming the model, not `no such file`), and
    leaves no run directory."""
    cfg = write_config(micro_config_dict())
    new = tmp_path / "new"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1", **TOO_SMALL}
    r = subprocess.run(["bash", "-c", f'"{sys.executable}" -m andrea_tui.cli <(cat "{cfg}") '
                        f'--run-dir "{new}" --backend numpy'],
                       capture_output=True, text=True, timeout=120, env=env,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "no such file" not in r.stderr, r.stderr
    assert "ANDREA-micro" in r.stderr and "host memory" in r.stderr and not new.exists(), \
        r.stderr


# ---------------------------------------------------------------- news of this session only


def test_an_earlier_sessions_stop_checkpoint_is_no_news(tmp_path: Path) -> None:
    """Resumed moments after `q`: the stop checkpoint the last session wrote is not toasted as if
    just written. A checkpoint of this session is still news."""
    paths = write_run(tmp_path / "run", 30, status="stopped")
    with open(paths.events, "a") as f:
        f.write(json.dumps(rec.CheckpointEvent(
            t=time.time() - 2.0, step=30, reason="stop", path="checkpoints/step_00000030",
            bytes=4, seconds=0.1).to_json()) + "\n")

    async def go() -> None:
        app = AndreaApp(paths.root, control_interval=0.2)
        notes = record_notes(app)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.history_loaded)
            await pilot.pause(0.5)
            assert not [m for _, m in notes if "checkpoint step" in m], notes
            with open(paths.events, "a") as f:
                f.write(json.dumps(rec.CheckpointEvent(
                    t=time.time(), step=31, reason="snapshot",
                    path="checkpoints/step_00000031", bytes=4, seconds=0.1).to_json()) + "\n")
            await wait_until(pilot, lambda: any("checkpoint step 31" in m for _, m in notes))
            assert not [m for _, m in notes if "checkpoint step 30" in m]

    run(go())


def test_launch_mode_counts_the_session_from_before_the_engine_started(tmp_path: Path) -> None:
    """The app a launch opens counts news from before it started the engine (it waited for
    the engine to accept its input first): a stop checkpoint of the run it resumes is old."""
    paths = write_run(tmp_path / "run", 30, status="stopped")
    with open(paths.events, "a") as f:
        f.write(json.dumps(rec.CheckpointEvent(
            t=time.time() - 1.0, step=30, reason="stop", path="checkpoints/step_00000030",
            bytes=4, seconds=0.1).to_json()) + "\n")
    began = time.time()
    proc = start_fake_engine(paths.root, "--rate", "20", "--start", "30")
    try:
        async def go() -> None:
            app = AndreaApp(paths.root, proc=proc, session_start=began, control_interval=0.2)
            notes = record_notes(app)
            async with app.run_test(size=SIZE) as pilot:
                await wait_until(pilot, lambda: app.history_loaded
                                 and (app.state.series.last_step or 0) > 35)
                await pilot.press("s")
                await wait_until(pilot, lambda: any("(snapshot)" in m for _, m in notes))
                assert not [m for _, m in notes if "(stop)" in m], notes
        run(go())
    finally:
        end(proc)


def test_the_runs_table_and_compare_leave_a_forged_record_out(tmp_path: Path) -> None:
    from andrea_tui.compare import load_curves
    from andrea_tui.runscan import RunScanner

    paths = write_run(tmp_path / "runs" / "a", 100, status="stopped")
    with open(paths.loss, "a") as f:
        f.write(json.dumps({"step": 999999, "loss": -1}) + "\n")
    [row] = RunScanner(tmp_path / "runs").scan()
    assert row.step == 100 and row.best_loss > 0 and row.last_loss == loss_record(100, 0)["loss"]
    curves = load_curves(paths.root)
    assert curves.n == 100 and curves.steps[-1] == 100 and np.nanmin(curves.cols["loss"]) > 0


def test_a_config_named_through_dev_stdin_reaches_the_engine(tmp_path: Path,
                                                             write_config) -> None:
    """`andrea-tui /dev/stdin < cfg.json`: the engine's own stdin is /dev/null, so it is given
    the file that /dev/stdin names here."""
    cfg = write_config(micro_config_dict())
    run_dir = tmp_path / "run"
    code = ("import argparse, signal, sys\n"
            "from andrea_tui.cli import start_engine\n"
            "from engine.run.control import signal_engine\n"
            f"a = argparse.Namespace(config='/dev/stdin', run_dir={str(run_dir)!r}, resume=False,"
            " max_steps=None, backend='numpy', precision=None, gpus=1)\n"
            "proc, run_dir = start_engine(a)\n"
            "signal_engine(run_dir, signal.SIGTERM)\n"
            "sys.exit(proc.wait(120))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"}
    with open(cfg, "rb") as stdin:
        r = subprocess.run([sys.executable, "-c", code], stdin=stdin, capture_output=True,
                           text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads((run_dir / "config.json").read_text())["name"] == "ANDREA-micro"
