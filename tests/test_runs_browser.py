"""`andrea-tui runs` and `andrea-tui compare`, headless, on prepared run directories: one live (a
real tests/fakerun.py process), one finished, one dead (state.json says running, nobody holds the
lock), one with corrupt files. The scanner reads only bounded tails for the first table and
follows whole files incrementally after."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from andrea_tui.compare import config_rows, load_curves, run_labels, xy
from andrea_tui.runscan import RunScanner, find_runs
from andrea_tui.screentext import screen_text
from engine import records as rec
from engine.run.control import engine_alive
from engine.run.identity import write_engine_json
from engine.runfiles import JsonlWriter, RunPaths
from tests.fakerun import CONFIG, loss_record, write_run

SIZE = (170, 40)
T0 = 1_700_000_000.0


@pytest.fixture
def runs_root(tmp_path: Path) -> Iterator[Path]:
    from andrea_tui.launcher import launch

    root = tmp_path / "runs"
    write_run(root / "finished", 1200, t0=T0, status="finished")
    dead = write_run(root / "dead", 300, t0=T0 + 5000, status="running")
    write_engine_json(dead.root, ["andrea-train"], "gone")  # nobody holds engine.lock
    bad = root / "group" / "corrupt"
    bad.mkdir(parents=True)
    (bad / "state.json").write_text("{torn")
    (bad / "config.json").write_text('{"name": 12}')
    with open(bad / "loss.jsonl", "w") as f:
        f.write("garbage\n" + json.dumps(loss_record(1, T0)) + "\n[1, 2]\n")
        f.write(json.dumps(loss_record(2, T0 + 1)) + "\n" + '{"step": "x"}\n{"ste')
    live = root / "live"
    proc = launch([sys.executable, "-m", "tests.fakerun", str(live), "--rate", "20"], live)
    deadline = time.monotonic() + 20
    def stepped() -> bool:  # the fake engine holds its lock and has logged a step
        loss = live / "loss.jsonl"
        return engine_alive(live)[0] and loss.exists() and loss.stat().st_size > 0

    while not stepped():
        assert proc.poll() is None, (live / "engine.log").read_text()
        assert time.monotonic() < deadline, "fake engine did not come up"
        time.sleep(0.05)
    (root / "not-a-run").mkdir()
    yield root
    proc.kill()  # the fake engine this fixture started
    proc.wait(timeout=10)


def by_name(summaries: list) -> dict[str, object]:
    return {s.path.name: s for s in summaries}


def test_scanner_summaries(runs_root: Path) -> None:
    assert [p.name for p in find_runs(runs_root)] == ["dead", "finished", "corrupt", "live"]
    rows = by_name(RunScanner(runs_root).scan())
    fin, dead, bad, live = rows["finished"], rows["dead"], rows["corrupt"], rows["live"]
    assert (fin.status, fin.step, fin.max_steps, fin.backend) == ("finished", 1200, 2000, "numpy")
    assert fin.last_loss == loss_record(1200, 0)["loss"]
    losses = [loss_record(s, 0)["loss"] for s in range(1, 1201)]
    assert fin.best_loss == min(x for x in losses if math.isfinite(x))
    assert fin.tok_s == 5120.0 and fin.started == T0 and math.isnan(fin.val_loss)
    assert dead.status == "dead" and "lock free" in dead.note and dead.step == 300
    assert live.status == "live" and live.step >= 1 and live.name == CONFIG["name"]
    assert bad.status == "?" and "state.json" in bad.note and "config.json" in bad.note
    assert bad.name == "corrupt" and bad.step == 2
    assert bad.best_loss == min(loss_record(s, 0)["loss"] for s in (1, 2))


def test_the_first_table_reads_no_whole_file(runs_root: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.runfiles import JsonlTail

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("a whole-file read in the quick scan")

    monkeypatch.setattr(JsonlTail, "read_new", refuse)
    rows = by_name(RunScanner(runs_root).scan(whole_files=False))
    assert rows["finished"].step == 1200 and math.isnan(rows["finished"].best_loss)


def test_unchanged_runs_are_not_read_again(runs_root: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import andrea_tui.runscan as runscan

    scanner = RunScanner(runs_root)
    first = by_name(scanner.scan())
    read: list[Path] = []
    real = runscan.tail_objects
    monkeypatch.setattr(runscan, "tail_objects", lambda p, *a: read.append(p) or real(p, *a))
    again = by_name(scanner.scan())
    assert {p.parent.name for p in read} == {"live"}  # only the live run's files were read
    assert again["finished"] is first["finished"] and again["dead"] is first["dead"]
    assert again["live"].step >= first["live"].step


def test_best_loss_follows_appends_and_resumes(tmp_path: Path) -> None:
    paths = write_run(tmp_path / "r", 100, t0=T0)
    scanner = RunScanner(tmp_path)
    first = scanner.scan()[0].best_loss
    with open(paths.loss, "a") as f:  # a low loss on a timeline a resume will abandon
        f.write(json.dumps({**loss_record(101, T0 + 20), "loss": 0.5}) + "\n")
    assert scanner.scan()[0].best_loss == 0.5
    ev = JsonlWriter(paths.events)
    ev.write(rec.ResumeEvent(t=T0 + 50, step=100, path="x").to_json())
    ev.close()
    with open(paths.loss, "a") as f:
        f.write(json.dumps({**loss_record(101, T0 + 60), "loss": 0.75}) + "\n")
    assert scanner.scan()[0].best_loss == min(first, 0.75)
    with open(tmp_path / "r" / "eval.jsonl", "w") as f:
        f.write(json.dumps({"step": 50, "t": T0, "val_loss": 3.0}) + "\n{bad\n")
    assert scanner.scan()[0].val_loss == 3.0


async def wait_until(pilot, cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; screen:\n{screen_text(pilot.app)}")
        await pilot.pause(0.05)


def _capture(name: str, text: str) -> None:
    """ANDREA_SCREEN_CAPTURE=DIR keeps the screens these tests see (for people to read)."""
    where = os.environ.get("ANDREA_SCREEN_CAPTURE")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / name).write_text(text)


def test_runs_browser_table_filter_keys(runs_root: Path) -> None:
    from andrea_tui.ckpt_screens import CheckpointListScreen
    from andrea_tui.compare_screen import RunCompareScreen
    from andrea_tui.runs_screen import RunsApp, RunsScreen

    async def go() -> None:
        app = RunsApp(runs_root)
        async with app.run_test(size=SIZE) as pilot:
            def whole_files_read() -> bool:
                rows = by_name(getattr(app.screen, "summaries", []))
                return "finished" in rows and math.isfinite(rows["finished"].best_loss)

            await wait_until(pilot, whole_files_read)
            screen = app.screen
            text = screen_text(app)
            _capture("runs.txt", text)
            assert "4 runs under" in text and "(1 live, 1 dead)" in text
            for word in ("finished", "dead", "live", "group/corrupt", "1,200/2,000", "numpy",
                         "ANDREA-fake", "5.12k",
                         time.strftime("%Y-%m-%d", time.localtime(T0))):  # the local day
                assert word in text, word
            # newest first by default: the live run started last
            assert screen.shown[0].path.name == "live"
            await pilot.press("slash", *"dead")
            await wait_until(pilot, lambda: len(screen.shown) == 1)
            assert screen.shown[0].path.name == "dead" and "1 shown" in screen_text(app)
            await pilot.press("enter")  # back to the table
            assert "lock free" in screen_text(app)  # the detail line says why it is dead
            await pilot.press("slash", *["backspace"] * 4, "enter")
            await wait_until(pilot, lambda: len(screen.shown) == 4)
            await pilot.press("o")  # sort by the next column (backend)
            assert "sorted by backend" in screen_text(app)
            # mark the finished and the dead run, compare them
            for name in ("finished", "dead"):
                row = [s.path.name for s in screen.shown].index(name)
                screen.query_one("DataTable").move_cursor(row=row)
                await pilot.press("m")
            assert "marked 2" in screen_text(app)
            await pilot.press("v")
            await wait_until(pilot, lambda: isinstance(app.screen, RunCompareScreen)
                             and bool(app.screen.runs))
            await pilot.pause(0.3)
            text = screen_text(app)
            _capture("compare.txt", text)
            assert "finished" in text and "dead" in text and "loss by step" in text
            assert "the same config" in text
            await pilot.press("x")
            assert "loss by tokens" in screen_text(app)
            await pilot.press("escape")
            await wait_until(pilot, lambda: isinstance(app.screen, RunsScreen))
            row = [s.path.name for s in screen.shown].index("finished")
            screen.query_one("DataTable").move_cursor(row=row)
            await pilot.press("c")
            await wait_until(pilot, lambda: isinstance(app.screen, CheckpointListScreen))
            await pilot.press("escape")
            await wait_until(pilot, lambda: isinstance(app.screen, RunsScreen))
            await pilot.press("enter")  # the dashboard of the run under the cursor
        assert app.return_value == runs_root / "finished"

    asyncio.run(go())


def test_compare_curves_and_config_diff(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", 200, t0=T0, dt=0.5).root
    b = write_run(tmp_path / "x" / "a", 100, t0=T0 + 99, dt=1.0).root
    cfg = json.loads((b / "config.json").read_text())
    cfg["optim"]["lr"] = 3e-4
    cfg["model"]["n_layer"] = 4
    (b / "config.json").write_text(json.dumps(cfg))
    (b / "eval.jsonl").write_text(json.dumps({"step": 50, "t": T0 + 149, "val_loss": 4.0}) + "\n")
    labels = run_labels([a, b])
    assert labels == [f"{tmp_path.name}/a", "x/a"]
    ca, cb = load_curves(a, labels[0]), load_curves(b, labels[1])
    x, y = xy(ca, "loss", "step")
    assert list(x[:3]) == [1.0, 2.0, 3.0] and y[0] == loss_record(1, 0)["loss"]
    x, _ = xy(cb, "grad_norm", "tokens")
    assert x[9] == 10 * 256
    x, _ = xy(cb, "tok_s", "time")
    assert x[0] == 0.0 and x[60] == pytest.approx(1.0)  # minutes since its first step
    x, y = xy(cb, "val_loss", "tokens")
    assert list(x) == [50 * 256] and list(y) == [4.0]
    x, y = xy(cb, "val_loss", "time")
    assert list(x) == [pytest.approx(49 / 60)]
    assert len(xy(ca, "val_loss", "step")[0]) == 0
    rows = dict(config_rows([ca.config, cb.config]))
    assert rows == {"model.n_layer": [2, 4], "optim.lr": [1e-3, 3e-4]}


def test_compare_command_shows_overlay_legend_and_diff(tmp_path: Path) -> None:
    from andrea_tui.compare_screen import CompareApp, RunCompareScreen

    a = write_run(tmp_path / "lr-1e-3", 300, t0=T0).root
    b = write_run(tmp_path / "lr-3e-4", 200, t0=T0).root
    cfg = json.loads((b / "config.json").read_text())
    cfg["optim"]["lr"] = 3e-4
    (b / "config.json").write_text(json.dumps(cfg))

    async def go() -> None:
        app = CompareApp([a, b])
        async with app.run_test(size=(140, 40)) as pilot:
            await wait_until(pilot, lambda: isinstance(app.screen, RunCompareScreen)
                             and bool(app.screen.runs))
            await pilot.pause(0.3)
            text = screen_text(app)
            _capture("compare-cmd.txt", text)
            assert "lr-1e-3" in text and "lr-3e-4" in text and "optim.lr" in text
            assert "0.0003" in text and "0.001" in text
            await pilot.press("2")
            assert "(no validation loss)" in screen_text(app)
            await pilot.press("escape")

    asyncio.run(go())


# ---------------------------------------------------------------- best loss, settings, health


def ema_of(losses: list[float], alpha: float) -> list[float]:
    """The dashboard's smoothed loss (andrea_tui.series), row by row."""
    import numpy as np

    from andrea_tui.series import StepSeries

    series = StepSeries.from_records(
        [rec.StepRecord.from_json(loss_record(s, T0)) for s in range(1, len(losses) + 1)],
        alpha)
    return list(np.asarray(series.ema()))


def set_state(paths, **fields) -> None:
    """Rewrite a fake run's state.json with `fields` changed (health, health_reason, ...)."""
    from engine.runfiles import write_json_atomic

    obj = json.loads(paths.state.read_text())
    write_json_atomic(paths.state, {**obj, **fields}, durable=False)


def test_best_is_validation_where_the_run_evaluates_else_smoothed(tmp_path: Path) -> None:
    from andrea_tui.runs_screen import best_header
    from tests.fakerun import eval_record

    evaluated = write_run(tmp_path / "evaluated", 600, t0=T0, monitor=True)
    write_run(tmp_path / "plain", 600, t0=T0)
    rows = by_name(RunScanner(tmp_path, ema_alpha=0.9).scan())
    vals = [eval_record(s, 0)["val_loss"] for s in range(100, 601, 100)]
    assert rows["evaluated"].best == (min(vals), "val")
    losses = [loss_record(s, 0)["loss"] for s in range(1, 601)]
    smoothed = min(x for x in ema_of(losses, 0.9) if math.isfinite(x))
    assert rows["plain"].best == (pytest.approx(smoothed, rel=1e-12), "ema")
    # the smoothed best is not the lowest single step (a noisy dip)
    assert rows["plain"].best[0] > rows["plain"].best_loss
    assert best_header([rows["evaluated"]]) == "best val"
    assert best_header([rows["plain"]]) == "best ema"
    assert best_header(list(rows.values())) == "best val (ema*)"
    # a validation loss of a timeline a resume abandoned is not the run's best
    with open(evaluated.eval, "a") as f:
        f.write(json.dumps({"step": 700, "t": T0 + 70, "val_loss": 0.25}) + "\n")
    scanner = RunScanner(tmp_path, ema_alpha=0.9)
    assert by_name(scanner.scan())["evaluated"].best == (0.25, "val")
    ev = JsonlWriter(evaluated.events)
    ev.write(rec.ResumeEvent(t=T0 + 80, step=600, path="x").to_json())
    ev.close()
    assert by_name(scanner.scan())["evaluated"].best == (min(vals), "val")


def test_settings_and_health_of_each_run(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", 50, t0=T0)
    set_state(a, health="diverging", health_reason="loss 1084 at step 2, 119x the start (9.1)")
    b = write_run(tmp_path / "b", 50, t0=T0)
    cfg = json.loads(b.config.read_text())
    cfg["optim"]["lr"] = 3e-4
    cfg["train"].update(batch_size=8, grad_accum=2)
    b.config.write_text(json.dumps(cfg))
    ev = JsonlWriter(b.events)  # a resume with --precision and two ranks: the engine's word
    ev.write(rec.ReadyEvent(t=T0 + 9, n_params=12_400_000, backend="numpy", step=50,
                            tokens_per_step=2 * 8 * 2 * 64, world_size=2,
                            precision="bf16").to_json())
    ev.close()
    rows = by_name(RunScanner(tmp_path).scan())
    ra, rb = rows["a"], rows["b"]
    assert (ra.health, ra.health_reason) == ("diverging", "loss 1084 at step 2, 119x the start "
                                             "(9.1)")
    assert (ra.lr, ra.tokens_per_step, ra.n_params, ra.precision) == (1e-3, 256, 1048576, "fp32")
    assert rb.health == ""  # a run whose engine never judged it
    assert (rb.lr, rb.batch_size, rb.grad_accum, rb.seq_len) == (3e-4, 8, 2, 64)
    assert (rb.tokens_per_step, rb.world_size, rb.n_params, rb.precision) == \
        (2048, 2, 12_400_000, "bf16")
    from andrea_tui.runs_screen import settings_line

    assert settings_line(rb) == ("lr 3.00e-04 · batch 8 × accum 2 × seq 64 × 2 ranks = 2,048 "
                                 "tokens/step · 12,400,000 parameters · bf16")


def test_the_browser_shows_health_settings_and_keeps_notes_and_tags(tmp_path: Path) -> None:
    from andrea_tui.notes import read_notes
    from andrea_tui.runs_screen import EditScreen, RunsApp, RunsScreen

    root = tmp_path / "runs"
    sick = write_run(root / "sick", 40, t0=T0)
    set_state(sick, health="diverging", health_reason="loss ×119 in one step")
    write_run(root / "fine", 400, t0=T0 + 100, monitor=True)
    set_state(RunPaths(root / "fine"), health="healthy")
    write_run(root / "old", 300, t0=T0 + 200)

    async def go() -> None:
        app = RunsApp(root)
        async with app.run_test(size=(200, 30)) as pilot:
            screen = app.screen
            await wait_until(pilot, lambda: isinstance(screen, RunsScreen) and any(
                math.isfinite(s.best_ema) for s in screen.summaries))
            await pilot.pause(0.2)
            table = screen.query_one("DataTable")
            text = screen_text(app)
            _capture("runs-health.txt", text)
            for word in ("health", "diverging", "healthy", "best val (ema*)", "lr", "tok/step",
                         "params", "prec", "1.00e-03", "1.05M", "fp32"):
                assert word in text, word
            cell = table.get_cell(str(root / "sick"), "health")
            assert cell.plain == "diverging" and cell.style == "bold red"
            assert table.get_cell(str(root / "fine"), "health").style == "green"
            assert table.get_cell(str(root / "old"), "health").plain == "–"  # never said
            # the cursor's run: its settings and the engine's reason under the table
            row = [s.path.name for s in screen.shown].index("sick")
            table.move_cursor(row=row)
            await pilot.pause()
            assert "diverging: loss ×119 in one step" in screen_text(app)
            # tags, then a note, kept in the run directory
            await pilot.press("t")
            await wait_until(pilot, lambda: isinstance(app.screen, EditScreen))
            await pilot.press(*"lr-sweep, #bad-lr", "enter")
            await wait_until(pilot, lambda: isinstance(app.screen, RunsScreen))
            assert read_notes(root / "sick").tags == ("lr-sweep", "bad-lr")
            await pilot.press("n")
            await wait_until(pilot, lambda: isinstance(app.screen, EditScreen))
            await pilot.press(*"lr 5 blew up", "enter")
            await wait_until(pilot, lambda: isinstance(app.screen, RunsScreen))
            assert read_notes(root / "sick").note == "lr 5 blew up"
            text = screen_text(app)
            assert "#lr-sweep #bad-lr" in text and "note: lr 5 blew up" in text
            # escape in the editor leaves the tags as they were
            await pilot.press("t")
            await wait_until(pilot, lambda: isinstance(app.screen, EditScreen))
            await pilot.press("ctrl+u", *"other", "escape")
            await wait_until(pilot, lambda: isinstance(app.screen, RunsScreen))
            assert read_notes(root / "sick").tags == ("lr-sweep", "bad-lr")
            # a tag that is no word: one line, nothing written
            await pilot.press("t")
            await wait_until(pilot, lambda: isinstance(app.screen, EditScreen))
            await pilot.press("ctrl+u", *"a=b", "enter")
            await wait_until(pilot, lambda: isinstance(app.screen, RunsScreen))
            assert read_notes(root / "sick").tags == ("lr-sweep", "bad-lr")
            # the filter by tag
            await pilot.press("slash", *"#bad-lr", "enter")
            await wait_until(pilot, lambda: [s.path.name for s in screen.shown] == ["sick"])
            await pilot.press("slash", *["backspace"] * 7, *"#lr", "enter")  # a whole tag only
            await wait_until(pilot, lambda: screen.shown == [])
            _capture("runs-tags.txt", screen_text(app))

    asyncio.run(go())
    assert json.loads((root / "sick" / "notes.json").read_text()) == {
        "note": "lr 5 blew up", "tags": ["lr-sweep", "bad-lr"]}


def test_a_refresh_keeps_the_table_where_it_is_scrolled(runs_root: Path) -> None:
    """The live run changes the table every refresh: its cells change in place, so a table
    scrolled to its right-hand columns (a narrow terminal) stays there."""
    from andrea_tui.runs_screen import RunsApp

    async def go() -> None:
        app = RunsApp(runs_root)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            await wait_until(pilot, lambda: len(getattr(screen, "shown", [])) == 4)
            table = screen.query_one("DataTable")
            table.scroll_x = table.max_scroll_x  # the right-hand columns
            await pilot.pause()
            before = table.scroll_x
            assert before > 0
            live = next(s for s in screen.summaries if s.path.name == "live")
            await wait_until(pilot, lambda: next(
                s for s in screen.summaries if s.path.name == "live").step != live.step)
            await pilot.pause(0.1)
            assert table.scroll_x == before

    asyncio.run(go())


# ---------------------------------------------------------------- escape back to the browser


def test_escape_leaves_a_dashboard_opened_from_the_browser_and_the_engine_trains_on(
        tmp_path: Path) -> None:
    from andrea_tui.app import AndreaApp
    from tests.test_tui_app import start_fake_engine

    live = tmp_path / "live"
    proc = start_fake_engine(live)
    try:

        async def go(from_browser: bool) -> AndreaApp:
            app = AndreaApp(live, control_interval=3600, from_browser=from_browser)
            async with app.run_test(size=(80, 24)) as pilot:
                await wait_until(pilot, lambda: app.history_loaded)
                await pilot.pause(0.2)
                footer = screen_text(app).splitlines()[-1]
                # at 80 columns the way back and the help are both in the footer
                assert footer.startswith("esc runs ? help" if from_browser else "? help"), footer
                await pilot.press("question_mark")  # escape closes a screen over it first
                await pilot.press("escape")
                await pilot.pause(0.2)
                assert app.is_running
                await pilot.press("escape")
                await pilot.pause(0.2)
                if not from_browser:
                    assert app.is_running  # `andrea-tui attach`: escape does nothing
                    await pilot.press("d")
            return app

        app = asyncio.run(go(True))
        assert "engine keeps running" in (app.return_value or "")
        assert engine_alive(live)[0] and proc.poll() is None
        app = asyncio.run(go(False))
        assert engine_alive(live)[0] and proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_the_runs_command_opens_dashboards_that_escape_leaves(tmp_path: Path,
                                                              monkeypatch) -> None:
    """`andrea-tui runs`: enter runs the dashboard as one opened from the browser (escape
    goes back), and what it ended with is told when the browser comes back."""
    from andrea_tui import app as app_mod
    from andrea_tui import cli, runs_screen

    run_dir = write_run(tmp_path / "runs" / "r", 20, t0=T0).root
    chosen = [run_dir, None]
    messages: list[str | None] = []
    opened: list[bool] = []

    def browser_run(self):  # type: ignore[no-untyped-def]
        messages.append(self.browser_state.message)
        return chosen.pop(0)

    def dashboard_run(self):  # type: ignore[no-untyped-def]
        opened.append(self.from_browser)
        return "closed by escape"

    monkeypatch.setattr(runs_screen.RunsApp, "run", browser_run)
    monkeypatch.setattr(app_mod.AndreaApp, "run", dashboard_run)
    assert cli.runs(str(tmp_path / "runs")) == 0
    assert opened == [True] and messages == [None, "closed by escape"]


# ---------------------------------------------------------------- notes.json


def test_notes_are_parsed_kept_atomically_and_read_tolerantly(tmp_path: Path) -> None:
    from andrea_tui.notes import (
        NOTE_CHARS,
        NotesError,
        RunNotes,
        parse_note,
        parse_tags,
        read_notes,
        write_notes,
    )

    assert parse_tags(" #a, b  c,,a ") == ("a", "b", "c")
    assert parse_tags("") == ()
    with pytest.raises(NotesError, match=r"tag 'x y=z'|tag 'y=z'"):
        parse_tags("ok y=z")
    with pytest.raises(NotesError, match="at most 32 characters"):
        parse_tags("a" * 33)
    assert parse_note(" two\nlines\t here ") == "two lines here"
    with pytest.raises(NotesError, match=f"at most {NOTE_CHARS}"):
        parse_note("x" * (NOTE_CHARS + 1))
    run = tmp_path / "run"
    run.mkdir()
    assert read_notes(run) == RunNotes()
    write_notes(run, RunNotes("n", ("t1", "t2")))
    assert read_notes(run) == RunNotes("n", ("t1", "t2"))
    assert [p.name for p in run.iterdir()] == ["notes.json"]  # no temporary file left
    # hand-broken files: what reads well is kept
    (run / "notes.json").write_text('{"note": 5, "tags": ["ok", "not ok", 3, "ok"]}')
    assert read_notes(run) == RunNotes("", ("ok",))
    (run / "notes.json").write_text("{torn")
    assert read_notes(run) == RunNotes()
    # something other than a regular file in its place is left as it is
    (run / "notes.json").unlink()
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    (run / "notes.json").symlink_to(target)
    with pytest.raises(NotesError, match="symbolic link"):
        write_notes(run, RunNotes("x"))
    assert target.read_text() == "{}" and (run / "notes.json").is_symlink()
    (run / "notes.json").unlink()
    (run / "notes.json").mkdir()
    with pytest.raises(NotesError, match="a directory"):
        write_notes(run, RunNotes("x"))


def test_the_browser_and_the_dashboard_take_the_same_newest_health(tmp_path: Path) -> None:
    """state.json says healthy; a health event written after it says warning: both viewers
    show warning (the newer word), not the older state.json's."""
    from andrea_tui.runstate import RunState

    paths = write_run(tmp_path / "run", 60, t0=T0)
    set_state(paths, health="healthy", health_reason="", updated=T0 + 50)
    ev = JsonlWriter(paths.events)
    ev.write(rec.HealthEvent(t=T0 + 55, state=rec.Health.WARNING, step=58,
                             reason="grad spike at 58").to_json())
    ev.close()

    def dashboard() -> tuple[str, str]:
        st = RunState()
        st.add_events([json.loads(line) for line in paths.events.read_text().splitlines()])
        st.set_files(state=json.loads(paths.state.read_text()))
        h = st.health
        assert h is not None
        return h.state.value, h.reason

    scanner = RunScanner(tmp_path)
    row = by_name(scanner.scan())["run"]
    assert (row.health, row.health_reason) == dashboard() == ("warning", "grad spike at 58")
    # then the engine writes state.json again, newer than the event: its word again
    set_state(paths, health="healthy", health_reason="quiet for 100 steps", updated=T0 + 60)
    row = by_name(scanner.scan())["run"]
    assert (row.health, row.health_reason) == dashboard() == ("healthy", "quiet for 100 steps")
