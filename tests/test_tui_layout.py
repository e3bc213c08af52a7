"""The dashboard at a glance: the engine's health in the header, numbers that hold still, and a
layout that works at 80x24 as well as at 200x50 (headless: run_test + Pilot, and the panels
as text)."""

from __future__ import annotations

import asyncio
import math
import re
from pathlib import Path

import pytest
from textual.widgets import Footer
from textual.widgets._toast import Toast

from andrea_tui import panels, textfmt
from andrea_tui.app import AndreaApp
from andrea_tui.charts import GradNormChart, LossChart
from andrea_tui.runstate import RunState
from andrea_tui.screens import HelpScreen, TextScreen
from andrea_tui.screentext import screen_text
from andrea_tui.supervisor import EngineSupervisor, health_words
from engine import records as rec
from engine.runfiles import JsonlWriter, RunPaths, read_json, write_json_atomic
from tests.fakerun import write_run
from tests.test_tui_app import finished_run_app, record_notes, wait_until

REASON = ("loss 7.5 at step 500 is 3.0x the median 2.5 of the last 100 steps: a spike; "
          "if it repeats, lower optim.lr")


def run(coro) -> None:
    asyncio.run(coro)


def with_health(paths: RunPaths, state: rec.Health, reason: str, step: int) -> None:
    """The engine's judgement, as it writes it: a health event and state.json's fields."""
    status = rec.RunStatus.from_json(read_json(paths.state))
    assert isinstance(status, rec.RunStatus)
    ev = JsonlWriter(paths.events)
    ev.write(rec.HealthEvent(t=(status.updated or 0.0) - 1.0, state=state, step=step,
                             reason=reason).to_json())
    ev.close()
    obj = status.to_json()
    obj.update(health=state.value, health_reason=reason)
    write_json_atomic(paths.state, obj, durable=False)


def state_with_health(health: rec.Health | None, reason: str = "", updated: float = 10.0,
                      events: list[rec.Event] = ()) -> RunState:
    st = RunState()
    st.add_events([e.to_json() for e in events])
    st.set_files(state=rec.RunStatus(rec.Status.RUNNING, step=5, max_steps=10, updated=updated,
                                     health=health, health_reason=reason).to_json())
    return st


def span_style(text, word: str) -> str:
    """The style of the span that covers `word` in a Rich Text."""
    i = text.plain.index(word)
    return " ".join(str(s.style) for s in text.spans if s.start <= i < s.end)


# ---------------------------------------------------------------- health, as the engine says it


@pytest.mark.parametrize(("health", "colour"), [
    (rec.Health.HEALTHY, "green"), (rec.Health.WARNING, "yellow"),
    (rec.Health.DIVERGING, "red"), (rec.Health.STALLED, "magenta"),
    (rec.Health.FAILED, "red")])
def test_header_shows_the_engines_health_in_its_colour(health, colour) -> None:
    st = state_with_health(health, "why" if health != rec.Health.HEALTHY else "")
    text = panels.header(st, 20.0)
    assert f" · {health.value}" in text.plain
    assert colour in span_style(text, health.value)


def test_no_health_word_before_the_engine_judged_and_none_while_halted() -> None:
    older = state_with_health(None)
    assert older.health is None
    plain = panels.header(older, 20.0).plain
    assert not any(h.value in plain for h in rec.Health)
    assert panels.events(older, 7).plain == "no events yet"
    st = state_with_health(rec.Health.DIVERGING, "loss 1,084 at step 2")
    halted = panels.header(st, 20.0, note="frozen (SIGSTOP)", halted=True).plain
    assert "frozen (SIGSTOP)" in halted and "diverging" not in halted


def test_the_newest_word_wins_between_state_json_and_the_health_events() -> None:
    # a health event written after state.json (the engine writes both on a change)
    ev = rec.HealthEvent(t=12.0, state=rec.Health.DIVERGING, step=2, reason="loss x100")
    st = state_with_health(rec.Health.HEALTHY, updated=10.0, events=[ev])
    assert st.health is not None and st.health.state == rec.Health.DIVERGING
    assert st.health.step == 2 and st.health.reason == "loss x100"
    # state.json rewritten after it: its word, with the event's step when they agree
    st.set_files(state=rec.RunStatus(rec.Status.RUNNING, step=9, updated=13.0,
                                     health=rec.Health.DIVERGING,
                                     health_reason="loss x100").to_json())
    assert st.health == st.health.__class__(rec.Health.DIVERGING, "loss x100", 2)
    st.set_files(state=rec.RunStatus(rec.Status.RUNNING, step=9, updated=14.0,
                                     health=rec.Health.HEALTHY).to_json())
    assert st.health.state == rec.Health.HEALTHY and st.health.step is None
    assert "since step" not in panels.header(st, 20.0).plain


def test_a_resume_forgets_the_health_of_the_abandoned_timeline() -> None:
    st = RunState()
    st.add_events([rec.HealthEvent(t=5.0, state=rec.Health.DIVERGING, step=50).to_json(),
                   rec.ResumeEvent(t=9.0, step=40).to_json()])
    assert st.health is None


def test_the_events_panel_leads_with_the_health_reason() -> None:
    ev = rec.HealthEvent(t=11.0, state=rec.Health.WARNING, step=500, reason=REASON)
    st = state_with_health(rec.Health.WARNING, REASON, updated=12.0,
                           events=[rec.StartEvent(t=1.0), ev])
    text = panels.events(st, 7)
    first = text.plain.splitlines()[0]
    assert first == f"health warning since step 500: {REASON}"
    assert "yellow" in span_style(text, "warning")
    assert f"health warning at step 500: {REASON}" in text.plain  # the event itself, listed
    assert len(text.plain.splitlines()) <= 7
    assert panels.all_events(st).plain.startswith(first)


def test_the_exit_line_names_the_health(tmp_path: Path) -> None:
    paths = write_run(tmp_path / "run", 30, status="stopped")
    with_health(paths, rec.Health.DIVERGING, "loss 1,084 at step 2 is above ln(8449)", 2)
    st = RunState()
    st.set_files(config=read_json(paths.config), state=read_json(paths.state))
    st.add_events([rec.HealthEvent(t=1.0, state=rec.Health.DIVERGING, step=2).to_json()])
    sup = EngineSupervisor(paths.root)
    words = "health diverging since step 2: loss 1,084 at step 2 is above ln(8449)"
    assert sup.stop_summary(st).endswith("; " + words)
    assert sup.stop_summary(st).startswith("ANDREA-fake: stopped at step 30")
    assert sup.detach(st).close == f"closed {paths.root} (no engine running); {words}"
    closed = sup.stop(st).close
    assert closed is not None and closed.endswith(words) and "read-only" in closed
    assert health_words(RunState()) == ""  # an engine that never judged: nothing said
    assert "health" not in (sup.detach(RunState()).close or "")


# ---------------------------------------------------------------- numbers that hold still


@pytest.mark.parametrize(("fmt", "values", "width"), [
    (textfmt.fmt_loss, [6.19, 6.578, 10.84, 1084.2, 12345.0, 0.1234, 9.9996, 9999.7, 0.00099996,
                        0.0, math.nan, None, math.inf], textfmt.LOSS_WIDTH),
    (textfmt.fmt_lr, [9.2e-4, 0.003, 1.41e-4, 3e-5, 0.0, 1.0, None], textfmt.LR_WIDTH),
    (textfmt.fmt_rate, [4000, 4050, 40_500, 405_000, 512, 999.6, 1.23e6, 0.5, None],
     textfmt.SI_WIDTH),
    (textfmt.fmt_clip, [1, 0.985, 0.5, 0.0, None], textfmt.CLIP_WIDTH),
    (textfmt.fmt_pct, [0.0, 69.0, 100.0, 5.25, None], textfmt.PCT_WIDTH),
    (textfmt.fmt_ms, [50.0, 123.4, 1234.5, 9.87, None], textfmt.MS_WIDTH),
])
def test_each_quantity_has_one_width(fmt, values, width) -> None:
    assert {len(fmt(v)) for v in values} == {width}, [fmt(v) for v in values]


def test_each_quantity_has_one_form() -> None:
    assert [textfmt.fmt_loss(x).strip() for x in (6.19, 6.578, 10.84, 1084.2, 12345.0, 9999.7)] == [
        "6.190", "6.578", "10.84", "1084", "1.23e4", "1.00e4"]
    # the same lr values the terminal and the browser showed as 9.20e-04 and 0.003
    assert [textfmt.fmt_lr(x) for x in (9.2e-4, 0.003, 1.41e-4, 3e-5)] == [
        "9.20e-04", "3.00e-03", "1.41e-04", "3.00e-05"]
    assert [textfmt.fmt_rate(x).strip() for x in (4000, 4050, 40_500, 405_000, 999.6)] == [
        "4.00k", "4.05k", "40.5k", "405k", "1.00k"]
    assert [textfmt.fmt_clip(x) for x in (1, 0.985)] == ["1.000", "0.985"]
    assert textfmt.fmt_tokens(384_000).strip() == "384k"


def _record(step: int, loss: float, grad: float, clip: float, lr: float,
            tok_s: float) -> rec.StepRecord:
    return rec.StepRecord(step=step, loss=loss, grad_norm=grad, clip_scale=clip, lr=lr,
                          tokens=step * 1000, tok_s=tok_s, step_ms=20.0, phase=0, phase_step=1,
                          phase_len=10, weights={"a": 0.5, "b": 0.5},
                          src_loss={"a": loss, "b": loss}, skipped=False, t=float(step))


def test_training_panel_columns_hold_still_and_the_smoothed_loss_leads() -> None:
    """The smoothed loss is the headline and the step's own loss is beside it; the columns of
    every line stay where they were whatever the values (6.19 or 6.578, clip 1 or 0.985)."""
    rows = [(6.19, 1.0, 1.0, 9.2e-4, 4000.0), (6.578, 134.7, 0.985, 0.003, 4050.0),
            (10.84, 6594.0, 0.5, 1.41e-4, 405_000.0)]
    shapes = []
    for i, row in enumerate(rows, 1):
        st = RunState()
        st.add_loss([_record(s, 6.0, 1.0, 1.0, 1e-3, 4000.0).to_json() for s in range(1, i)]
                    + [_record(i, *row).to_json()])
        text = panels.training(st).plain.splitlines()
        ema = float(st.series.ema()[-1])
        assert text[0] == (f"loss EMA  {textfmt.fmt_loss(ema)}  raw {textfmt.fmt_loss(row[0])}")
        # where each value ends on its line
        shapes.append([m.end() for line in text[:5] for m in re.finditer(r"\S+", line)][:12])
    assert shapes[0] == shapes[1] == shapes[2]


# ---------------------------------------------------------------- 80x24 and bigger


def with_warning(tmp_path: Path, n: int = 1500):
    paths = write_run(tmp_path / "run", n, status="finished", monitor=True)
    with_health(paths, rec.Health.WARNING, REASON, n // 3)
    return paths


def test_80x24_keeps_help_health_alerts_chart_titles_and_says_where_panels_went(
        tmp_path: Path) -> None:
    paths = with_warning(tmp_path)

    async def go() -> None:
        async with finished_run_app(paths.root, (80, 24)) as (app, pilot):
            await pilot.pause(0.3)
            text = screen_text(app)
            lines = text.splitlines()
            assert len(lines) == 24 and max(map(len, lines)) <= 80
            assert lines[-1].lstrip().startswith("? help")  # the footer, help first
            for key in ("s snapshot", "q stop", "d detach", "l log", "v events", "p samples",
                        "i system"):
                assert key in lines[-1], key
            assert "warning since step 500" in text and "alerts 2" in text
            head = " ".join(lines[:2])
            assert "warning" in head and "alerts 2" in head
            # the four panels that do not fit: one line each, led by the key that opens them
            for wid in ("bottom", "sample", "system"):
                assert not app.view.screen.query_one(f"#{wid}").display, wid
            for line in ("v events: 2 alerts · warning: loss", "l engine.log:",
                         "p sample: step 1,500",
                         "i system: params"):
                assert line in text, line
            # both charts keep their titles and their rows
            loss = app.view.screen.query_one(LossChart)
            grad = app.view.screen.query_one(GradNormChart)
            assert loss.size.height >= 6 and grad.size.height >= 6
            assert "loss" in text and "grad norm" in text and "clip" in text
            assert "!1" in text or "! 1" in text  # the alert count on the chart titles
            # the panels' own lines fit the narrow side column
            assert "loss EMA" in text and "raw" in text

    run(go())


@pytest.mark.parametrize("size", [(120, 40), (200, 50)])
def test_larger_terminals_show_every_panel_and_the_reason(tmp_path: Path, size) -> None:
    paths = with_warning(tmp_path)

    async def go() -> None:
        async with finished_run_app(paths.root, size) as (app, pilot):
            await pilot.pause(0.3)
            text = screen_text(app)
            assert not app.view.screen.query_one("#summary").display
            for title in ("events", "engine.log", "latest sample", "system", "training",
                          "data mixture"):
                assert title in text, title
            assert "health warning since step 500: loss 7.5 at step 500" in text
            assert app.view.screen.query_one(Footer).show_command_palette

    run(go())


def test_help_scrolls_at_80x24_and_is_never_cut(tmp_path: Path) -> None:
    paths = with_warning(tmp_path, 200)

    async def go() -> None:
        async with finished_run_app(paths.root, (80, 24)) as (app, pilot):
            await pilot.press("question_mark")
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)
            box = app.screen.query_one("#help-box")
            assert box.region.height <= 24 and box.max_scroll_y > 0  # taller than the screen
            assert "escape or ? closes" not in screen_text(app)
            await pilot.press("end")
            await pilot.pause()
            text = screen_text(app)
            assert "escape or ? closes this help" in text and "terminal bell" in text
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)

    run(go())


def test_collapsed_panels_open_with_their_keys(tmp_path: Path) -> None:
    paths = with_warning(tmp_path, 200)

    async def go() -> None:
        async with finished_run_app(paths.root, (80, 24)) as (app, pilot):
            await pilot.press("v")
            await pilot.pause()
            assert isinstance(app.screen, TextScreen)
            text = screen_text(app)
            assert "events" in text and "health warning at step 66" in text  # the newest
            await pilot.press("home")
            await pilot.pause()
            assert "health warning since step 66: loss 7.5 at step 500" in screen_text(app)
            await pilot.press("escape")
            await pilot.press("i")
            await pilot.pause()
            assert isinstance(app.screen, TextScreen)
            assert "rss 412.0 MiB" in screen_text(app)
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, TextScreen)
            await pilot.press("q")  # read-only: q closes, and the line it ends with says
        assert app.return_value is not None and "read-only" in app.return_value
        assert app.return_value.endswith(f"; health warning since step 66: {REASON}")

    run(go())


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (200, 50)])
def test_toasts_do_not_cover_a_charts_data(tmp_path: Path, size) -> None:
    """An alert toast sits bottom right, over the side column and the text panels; on a small
    terminal it is one toast with the alert's first words."""
    paths = write_run(tmp_path / "run", 300, status="finished", monitor=True)

    async def go() -> None:
        app = AndreaApp(paths.root, follow=False, control_interval=3600)
        async with app.run_test(size=size, notifications=True) as pilot:
            await wait_until(pilot, lambda: app.history_loaded)
            notes = record_notes(app)
            st = app.state
            long = "loss 1,084 at step 2 is above ln(8449) = 9.04, the loss of a uniform " \
                   "guess: the run is diverging; lower optim.lr (now 5) or raise warmup_steps"
            app._started, app._alerts_seen = 0.0, st.alerts_seen  # these alerts are news
            st.add_events([rec.AlertEvent(t=1.0 + i, alert="loss_spike", step=300, value=1084,
                                          message=long).to_json() for i in range(3)])
            app._tell_alerts()
            await pilot.pause(0.3)
            toasts = list(app.screen.query(Toast))
            compact = size[1] < 30
            assert len(toasts) == (2 if compact else 3)  # the alerts' and the "more" one
            if compact:
                assert "(v: events)" in notes[0] and len(notes[0]) < len(long)
            else:
                assert notes[0] == long
            charts = [w.region for w in app.view.screen.query("LossChart, GradNormChart, LrChart")
                      if w.display]
            for toast in toasts:
                for region in charts:
                    assert not toast.region.overlaps(region), (toast.region, region)

    run(go())


def test_an_alert_whose_message_looks_like_markup_is_toasted_as_text(tmp_path: Path) -> None:
    """events.jsonl is another process's file: `[/]` in a message is shown, never parsed."""
    paths = write_run(tmp_path / "run", 300, status="finished", monitor=True)

    async def go() -> None:
        app = AndreaApp(paths.root, follow=False, control_interval=3600)
        async with app.run_test(size=(120, 40), notifications=True) as pilot:
            await wait_until(pilot, lambda: app.history_loaded)
            notes = record_notes(app)
            app._started, app._alerts_seen = 0.0, app.state.alerts_seen
            app.state.add_events([rec.AlertEvent(t=1.0, alert="loss_spike", step=300,
                                                 value=9.0, message="[/] and [b").to_json()])
            app._tell_alerts()
            await pilot.pause(0.3)
            assert notes == ["[/] and [b"]
            assert "[/] and [b" in screen_text(app)

    run(go())


def test_losses_beyond_a_floats_span_give_axes_not_a_crash() -> None:
    from andrea_tui import chartparts, ticks

    assert ticks.linear_ticks(-1e308, 1e308) == []
    vals, labels = chartparts.y_ticks(ticks.YRange(300.0, 320.0), log=True, height=20)
    assert len(vals) == len(labels)


def test_a_resize_lays_the_header_and_panels_out_for_the_new_width_at_once(
        tmp_path: Path) -> None:
    """The header and the data-mixture panel follow a resize in the same frame as the layout,
    not at the next control tick (here an hour away)."""
    paths = with_warning(tmp_path)

    async def go() -> None:
        async with finished_run_app(paths.root, (80, 24)) as (app, pilot):
            await pilot.pause(0.3)
            assert "numpy/cpu" not in screen_text(app).splitlines()[0]  # the narrow header
            await pilot.resize_terminal(120, 40)
            await pilot.pause(0.3)
            text = screen_text(app)
            head = " ".join(text.splitlines()[:2])
            assert "numpy/cpu" in head and "tokens 384k" in head and "elapsed" in head, head
            assert "python-reference" in text  # the bandit panel's wide names
            await pilot.resize_terminal(80, 24)
            await pilot.pause(0.3)
            assert "numpy/cpu" not in screen_text(app).splitlines()[0]

    run(go())
