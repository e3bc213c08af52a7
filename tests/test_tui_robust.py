"""The TUI against what a crash or a corrupt file leaves behind: abandoned timelines after a
resume, hostile records in every run file (the app must never crash on them)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from andrea_tui import panels
from andrea_tui.app import AndreaApp
from andrea_tui.runreader import RunReader
from andrea_tui.runstate import RunState
from andrea_tui.screentext import screen_text
from andrea_tui.supervisor import Banner
from andrea_tui.textfmt import bar, fmt_bytes, fmt_duration, fmt_int, fmt_num
from engine.runfiles import JsonlWriter, write_json_atomic
from tests.fakerun import loss_record, write_run

T0, DT = 1_700_000_000.0, 0.1


def append_jsonl(path: Path, *records: dict) -> None:
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def crashed_and_resumed(root: Path) -> tuple:
    """kill -9 at step 27 (last checkpoint 20), then a resume from step 20 at a later time."""
    paths = write_run(root, 27, status="running")
    t_resume = T0 + 27 * DT + 5.0
    return paths, t_resume


def stopped_at_resume(paths, t_resume: float) -> None:
    """The resumed engine is stopped at once: it ends at step 20 without logging a step."""
    ev = JsonlWriter(paths.events)
    ev.write({"t": t_resume, "event": "resume", "step": 20, "path": "checkpoints/step_20",
              "skipped": []})
    ev.write({"t": t_resume + 1, "event": "stop", "step": 20, "status": "stopped"})
    ev.close()
    write_json_atomic(paths.state, {"status": "stopped", "step": 20, "max_steps": 2000,
                                    "backend": "numpy", "device": "cpu", "last_checkpoint": {
                                        "path": "checkpoints/step_20", "step": 20,
                                        "reason": "periodic"}}, durable=False)


def load_like_the_app(paths) -> RunState:
    """The app's order: preview, events and small files, then the whole history."""
    st = RunState()
    reader = RunReader(paths.root, st)
    from andrea_tui.runstate import LossHistory

    st.set_history(LossHistory.build(reader.read_preview()))
    reader.poll(include_loss=False)
    st.set_history(reader.read_history())
    reader.poll()
    return st


def test_abandoned_timeline_dropped_when_read_at_once(tmp_path: Path) -> None:
    paths, t_resume = crashed_and_resumed(tmp_path / "run")
    stopped_at_resume(paths, t_resume)
    st = load_like_the_app(paths)
    assert st.series.steps.tolist() == list(range(1, 21))
    assert st.step == 20 and st.last_record.step == 20
    assert "step 20/2,000" in panels.header(st, T0 + 100).plain


def test_abandoned_timeline_dropped_when_resume_arrives_while_following(tmp_path: Path) -> None:
    paths, t_resume = crashed_and_resumed(tmp_path / "run")
    st = RunState()
    reader = RunReader(paths.root, st)
    reader.poll()
    assert st.series.last_step == 27  # the crashed timeline, before anyone knows better
    # The resumed engine logs steps 21 and 22 again (new values), then is stopped.
    ev = JsonlWriter(paths.events)
    ev.write({"t": t_resume, "event": "resume", "step": 20, "path": "p", "skipped": []})
    ev.close()
    new = [{**loss_record(s, t_resume + s - 20), "loss": 100.0 + s} for s in (21, 22)]
    append_jsonl(paths.loss, *new)
    reader.poll()
    assert st.series.steps.tolist() == list(range(1, 23))
    assert st.series.col("loss")[-2:].tolist() == [121.0, 122.0]
    assert st.last_record.step == 22 and st.step == 22
    # EMA recomputed over the rebuilt rows: equal to a fresh build of the same records.
    fresh = RunState()
    fresh.add_loss([loss_record(s, T0 + s * DT) for s in range(1, 21)] + new)
    assert st.series.ema().tolist() == pytest.approx(fresh.series.ema().tolist())


def test_resume_event_read_after_the_new_records_still_drops_the_old_ones(tmp_path: Path) -> None:
    t_resume = T0 + 27 * DT + 5.0
    st = RunState()
    st.add_loss([loss_record(s, T0 + s * DT) for s in range(1, 28)])
    st.add_loss([loss_record(21, t_resume + 1)])
    st.add_events([{"t": t_resume, "event": "resume", "step": 20}])
    assert st.series.steps.tolist() == list(range(1, 22))
    assert st.last_record.step == 21 and st.last_record.t == t_resume + 1


def test_formats_are_total() -> None:
    for bad in ("s", {"a": 1}, [1], None, math.nan):
        assert fmt_num(bad) == "–" and fmt_int(bad) == "–"
        assert fmt_duration(bad) == "–" and fmt_bytes(bad) == "–"
    assert fmt_num(10**400) == "inf" and fmt_int(True) == "–" and fmt_int(3.0) == "3"
    assert bar("x", 4) == "    "


BIG = 100000000000000000000
HOSTILE = [
    ("loss", {"phase": "x"}),
    ("loss", {"step": 31, "phase": "x", "phase_step": "y", "phase_len": [1],
              "weights": {"python-reference": "z"}, "src_loss": "q", "t": "t"}),
    ("loss", {"step": BIG}),
    ("loss", {"step": 32, "loss": 10**400, "grad_norm": "g", "t": 10**400, "tokens": [1]}),
    ("loss", {"step": -5}),
    ("loss", {"step": True, "loss": 1.0}),
    ("loss", {"step": 33, "weights": [1, 2], "clip_scale": {"x": 1}}),
    ("events", {"t": T0, "event": "checkpoint", "step": 40, "reason": "snapshot", "path": "p",
                "bytes": "b", "seconds": "s"}),
    ("events", {"t": T0, "event": "checkpoint", "step": "s", "reason": 5, "path": 7}),
    ("events", {"t": T0, "event": "ready", "n_params": "x", "memory_plan": {"total": "x"},
                "max_steps": "m"}),
    ("events", {"t": T0, "event": "ready", "memory_plan": "x"}),
    ("events", {"t": "x", "event": "start", "name": {"a": 1}, "backend": [1]}),
    ("events", {"t": 10**400, "event": "phase", "step": "a", "phase": [1]}),
    ("events", {"t": T0 + 99, "event": "resume", "step": BIG}),
    ("events", {"event": 5}),
    ("samples", {"step": "x", "prompt": 5, "text": "ok"}),
    ("state", {"status": "stopped", "step": 30, "last_checkpoint": {"step": "q"}}),
    ("state", {"status": 5, "step": "x", "max_steps": "y", "updated": "u",
               "last_checkpoint": "z"}),
]


@pytest.mark.parametrize(("where", "record"), HOSTILE, ids=[f"{w}-{i}" for i, (w, _) in
                                                            enumerate(HOSTILE)])
def test_hostile_record_never_crashes_the_dashboard(tmp_path: Path, where: str,
                                                    record: dict) -> None:
    paths = write_run(tmp_path / "run", 30, status="finished")
    if where == "state":
        paths.state.write_text(json.dumps(record))
    else:
        append_jsonl(getattr(paths, where), record)

    async def go() -> None:
        app = AndreaApp(paths.root, clock=lambda: T0 + 50, follow=False)
        async with app.run_test(size=(140, 45)) as pilot:
            deadline = asyncio.get_running_loop().time() + 10
            while not app.history_loaded:
                assert asyncio.get_running_loop().time() < deadline, screen_text(app)
                await pilot.pause(0.05)
            app.view.redraw_charts()
            await pilot.pause()
            text = screen_text(app)
            assert "ANDREA-fake" in text and "loss" in text
            assert app.is_running

    asyncio.run(go())


# ---------------------------------------------------------------- the command line

ROOT = Path(__file__).resolve().parent.parent


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "andrea_tui.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)


def tiny_config(tmp_path: Path, **changes) -> Path:
    cfg = json.loads((ROOT / "experiments" / "ANDREA-tiny-TRAIN.json").read_text())
    cfg.update(changes)
    for key in ("dir",):  # data paths resolve against the config file's own directory
        cfg["data"][key] = str((ROOT / "experiments" / cfg["data"][key]).resolve())
    cfg["data"]["tokenizer"]["path"] = str(
        (ROOT / "experiments" / cfg["data"]["tokenizer"]["path"]).resolve())
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("changes", [{"name": "../../escaped"}, {"model": {"n_layer": "x"}}])
def test_bad_config_is_refused_before_anything_starts(tmp_path: Path, changes: dict) -> None:
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    config = tiny_config(tmp_path, **changes)
    r = cli([str(config)], work)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr
    made = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert made == ["a", "a/b", "cfg.json"]  # no run directory anywhere, no engine.log


@pytest.mark.parametrize("form", [["ckpt"], ["attach"]])
def test_a_file_where_a_directory_is_expected_exits_2(tmp_path: Path, form: list[str]) -> None:
    f = tmp_path / "plain.txt"
    f.write_text("not a checkpoint")
    r = cli([*form, str(f)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"error: {f}: not a directory, expected a " + (
        "run directory\n" if form == ["attach"] else
        "run directory, checkpoints directory or checkpoint directory\n")
    r = cli([*form, str(tmp_path / "nope")], tmp_path)
    assert r.returncode == 2 and "no such" in r.stderr and r.stderr.count("\n") == 1


def test_failed_engine_is_shown_and_makes_the_exit_status_1(tmp_path: Path) -> None:
    from andrea_tui.launcher import launch

    run_dir = tmp_path / "run"
    proc = launch([sys.executable, "-c", "print('boom: no shards in data dir'); "
                   "raise SystemExit(3)"], run_dir)

    async def go() -> AndreaApp:
        app = AndreaApp(run_dir, proc=proc, control_interval=0.1)
        async with app.run_test(size=(140, 45)) as pilot:
            deadline = asyncio.get_running_loop().time() + 15
            while "exit status 3" not in screen_text(app):
                assert asyncio.get_running_loop().time() < deadline, screen_text(app)
                await pilot.pause(0.05)
            text = screen_text(app)
            assert "boom: no shards in data dir" in text  # the log tail says what happened
            assert "engine ended: exit status 3" in text.splitlines()[0]  # the header says it
            await pilot.press("q")
            await pilot.pause()
        return app

    app = asyncio.run(go())
    assert app.return_value is not None and app.supervisor.exit_status == 1


def test_engine_that_ended_well_exits_0(tmp_path: Path) -> None:
    from andrea_tui.launcher import launch

    proc = launch([sys.executable, "-c", "pass"], tmp_path / "run")
    proc.wait(timeout=30)
    app = AndreaApp(tmp_path / "run", proc=proc)
    assert app.supervisor.exit_status == 0 and app.supervisor.engine_exit == 0
    assert AndreaApp(tmp_path / "run").supervisor.exit_status == 0  # attach mode: nothing launched


def test_banner_and_panels_update_while_another_screen_is_on_top(tmp_path: Path) -> None:
    from andrea_tui.screens import HelpScreen

    paths = write_run(tmp_path / "run", 30, status="finished")

    async def go() -> None:
        # No control tick: its read-only banner would replace the test banner (a race under load).
        app = AndreaApp(paths.root, follow=False, control_interval=3600)
        async with app.run_test(size=(140, 45)) as pilot:
            while not app.history_loaded:
                await pilot.pause(0.05)
            app.push_screen(HelpScreen(500))
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)
            app.view._widgets.clear()  # no cached widget: the lookup itself must find the dashboard
            app.view.banner(Banner("engine ended: a test banner"))
            app.pacer.draw_now()
            app.action_toggle("log_y_loss")
            assert app.view.screen.query_one("#banner").has_class("shown")
            await pilot.press("escape")
            await pilot.pause()
            assert "a test banner" in screen_text(app)

    asyncio.run(go())
