"""The monitor practitioners expect, headless: alerts from a fake engine with an
injected spike, NaN step and stall (toasts, bell, chart marks), the chart controls and their
persistence, telemetry and validation on the panels, the samples and log screens, and what a
newcomer meets first (resize, old checkpoints, running time, resumed-engine banner, pushed
screens, screenshot, log echoes, help)."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.text import Text

from andrea_tui import panels
from andrea_tui import settings as user_settings
from andrea_tui.app import AndreaApp
from andrea_tui.launcher import launch
from andrea_tui.logscreen import LogScreen
from andrea_tui.runstate import RunState, peak_flops
from andrea_tui.samplescreen import SamplesScreen
from andrea_tui.screens import HELP, HELP_WIDTH
from andrea_tui.screentext import screen_text
from andrea_tui.settings import Settings
from andrea_tui.supervisor import EngineSupervisor
from engine import records as rec
from engine.run.control import engine_alive
from engine.runfiles import read_jsonl
from tests.fakerun import CONFIG, write_run
from tests.test_tui_app import finished_run_app, record_notes, wait_until


def run(coro) -> None:
    asyncio.run(coro)


# ---------------------------------------------------------------- alerts end to end


def test_injected_spike_nan_and_stall_raise_alerts_toasts_bell_and_marks(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch([sys.executable, "-m", "tests.fakerun", str(run_dir), "--rate", "20",
                   "--spike-at", "40", "--nan-at", "60", "--stall-at", "70", "--stall-s", "2.5",
                   "--stall-min-s", "1"], run_dir)
    try:
        deadline = time.monotonic() + 20
        while not engine_alive(run_dir)[0]:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)

        async def go() -> None:
            app = AndreaApp(run_dir, control_interval=0.3, redraw_interval=0.5)
            bells: list[int] = []
            app.bell = lambda: bells.append(1)  # type: ignore[method-assign]
            async with app.run_test(size=(140, 45)) as pilot:
                want = {"loss_spike", "grad_spike", "nonfinite", "stall"}
                await wait_until(pilot, lambda: want <= set(app.alerts_told), timeout=40)
                assert bells  # the bell rang (settings.bell is on by default)
                await wait_until(pilot, lambda: (app.state.series.last_step or 0) > 75)
                app.view.redraw_charts()
                loss, grad = app.view._charts()
                assert {40.0, 60.0, 70.0} <= set(loss._data[-1].tolist())  # ! marks
                assert {40.0, 60.0} <= set(grad._data[-1].tolist())
                await pilot.pause()
                text = screen_text(app)
                assert "alerts !" in text and "alert loss_spike" in text
        run(go())
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    alerts = [e for e in read_jsonl(run_dir / "events.jsonl")[0] if e.get("event") == "alert"]
    by_kind = {a["kind"]: a for a in alerts}
    assert by_kind["loss_spike"]["step"] == 40 and by_kind["grad_spike"]["step"] == 40
    assert by_kind["loss_spike"]["value"] > by_kind["loss_spike"]["threshold"]
    assert by_kind["nonfinite"]["step"] == 60
    assert by_kind["stall"]["step"] == 70 and by_kind["stall"]["value"] >= 1.0


def test_alerts_are_told_after_the_kept_ones_are_full(tmp_path: Path) -> None:
    """The state keeps the newest 1,000 alerts; once it is full, a new alert is still news."""
    paths = write_run(tmp_path / "run", 30, status="running")

    def alert(step: int, kind: str, t: float) -> str:
        return json.dumps(rec.AlertEvent(t=t, alert=kind, step=step, value=9.0, baseline=1.0,
                                         threshold=2.0, message=f"{kind} at {step}").to_json())

    async def go() -> None:
        async with finished_run_app(paths.root) as (app, pilot):
            now = time.time()
            with open(paths.events, "a") as f:
                f.write("".join(alert(s, "loss_spike", now) + "\n" for s in range(1000)))
            app.pacer.poll_all()
            await wait_until(pilot, lambda: app.state.alerts_seen == 1000)
            told = len(app.alerts_told)
            with open(paths.events, "a") as f:
                f.write(alert(2000, "nonfinite", now) + "\n")
            app.pacer.poll_all()
            await wait_until(pilot, lambda: "nonfinite" in app.alerts_told[told:])
            assert len(app.state.alerts) == 1000 and app.state.alerts_seen == 1001
    run(go())


# ---------------------------------------------------------------- chart controls


def test_chart_controls_persist_per_user(tmp_path: Path, user_config_home: Path) -> None:
    paths = write_run(tmp_path / "run", 600, status="finished", monitor=True)

    async def go() -> None:
        async with finished_run_app(paths.root) as (app, pilot):
            for key in ("right_square_bracket", "right_square_bracket", "r", "t", "g", "y",
                        "b"):
                await pilot.press(key)
            await pilot.pause()
            text = screen_text(app)
            assert "EMA 0.98" in text and "robust y" in text and "x: time" in text
            assert "log y" in text.split("grad norm (")[1]  # the grad chart has log y too
            assert app.state.series.ema_alpha == 0.98
            await pilot.press("left_square_bracket")
            await pilot.press("left_square_bracket")
            await pilot.pause()
            assert "EMA 0.9 ·" in screen_text(app)
            await pilot.press("t")
        saved = json.loads((user_config_home / "andrea" / "tui.json").read_text())
        assert saved == {"smoothing": 0.9, "log_y_loss": True, "log_y_grad": True,
                         "robust_y": True, "x_axis": "step", "window": False, "bell": False,
                         "theme": ""}

        again = AndreaApp(paths.root, follow=False, control_interval=3600)
        async with again.run_test(size=(140, 45)) as pilot:
            await wait_until(pilot, lambda: again.history_loaded)
            await pilot.pause()
            assert "log y, robust y" in screen_text(again)
            assert again.settings.bell is False

    run(go())


def test_settings_file_tolerates_damage(tmp_path: Path) -> None:
    p = tmp_path / "tui.json"
    p.write_text('{"smoothing": 7, "log_y_loss": "yes", "x_axis": "time", "robust_y": true}')
    s = user_settings.load(p)
    assert s == Settings(x_axis="time", robust_y=True)
    p.write_text("not json")
    assert user_settings.load(p) == Settings()
    assert Settings(smoothing=0.9).smoother(1).smoothing == 0.95
    assert Settings(smoothing=0.0).smoother(-1).smoothing == 0.0
    assert Settings().toggled("bell").bell is False and Settings().toggled("window").window
    assert Settings().toggled("x_axis").x_axis == "time" == Settings(x_axis="step").toggled(
        "x_axis").x_axis
    with pytest.raises(ValueError, match="not a yes/no choice"):
        Settings().toggled("smoothing")
    assert user_settings.save(s, tmp_path / "d" / "tui.json")
    assert user_settings.load(tmp_path / "d" / "tui.json") == s
    assert not user_settings.save(s, Path("/proc/nope/tui.json"))


def test_robust_y_range_ignores_an_outlier(tmp_path: Path) -> None:
    import numpy as np

    from andrea_tui.ticks import percentile_range

    y = np.concatenate([np.linspace(2.0, 3.0, 500), [400.0]])
    yr = percentile_range(y)
    assert yr is not None and 1.9 < yr.lo < 2.1 and 2.9 < yr.hi < 3.2 and yr.above == 1


# ---------------------------------------------------------------- panels and derived values


def _state_with(events: list[rec.Event], steps: list[tuple[int, float]]) -> RunState:
    st = RunState()
    st.add_events([e.to_json() for e in events])
    st.add_loss([rec.StepRecord(step=s, loss=3.0, grad_norm=1.0, clip_scale=1.0, lr=1e-3,
                                tokens=s * 1000, tok_s=50_000.0, step_ms=20.0, phase=0,
                                phase_step=1, phase_len=10, weights={}, src_loss={},
                                skipped=False, t=t).to_json() for s, t in steps])
    return st


def test_elapsed_and_eta_count_running_time_only() -> None:
    st = _state_with([rec.StartEvent(t=1000.0), rec.StopEvent(t=1100.0, step=100),
                      rec.StartEvent(t=5000.0)],
                     [(s, 1000.0 + s) for s in range(1, 101)]
                     + [(s, 5000.0 + (s - 100) * 0.5) for s in range(101, 121)])
    st.set_files(state=rec.RunStatus(rec.Status.RUNNING, step=120, max_steps=220).to_json())
    assert st.elapsed(5010.0) == pytest.approx(100 + 10)  # not the 3.9 ks it sat stopped
    assert st.eta() == pytest.approx(100 / 2.0)  # 2 steps/s since the restart
    # A crashed engine (no stop event): its interval ends at its last record.
    crashed = _state_with([rec.StartEvent(t=0.0), rec.StartEvent(t=500.0)],
                          [(s, float(s)) for s in range(1, 51)] + [(51, 501.0)])
    crashed.set_files(state=rec.RunStatus(rec.Status.RUNNING, step=51).to_json())
    assert crashed.elapsed(510.0) == pytest.approx(50 + 10)


def test_smoothed_tok_s_and_mfu() -> None:
    # 1000 tokens a step, two steps a second, one slow step: the header's tok/s stays ~2000.
    steps = [(s, 100.0 + s * 0.5) for s in range(1, 60)]
    steps[40] = (41, steps[40][1] + 0.4)
    st = _state_with([rec.StartEvent(t=100.0)], steps)
    assert st.smooth_tok_s() == pytest.approx(2000, rel=0.05)
    assert st.mfu() is None  # no model size, no device: unknown
    st.set_files(config=CONFIG)
    st.add_events([rec.ReadyEvent(t=100.0, n_params=10_000_000, device="NVIDIA H100 80GB HBM3",
                                  backend="cuda").to_json()])
    st.set_files(state=rec.RunStatus(rec.Status.RUNNING, device="NVIDIA H100 80GB HBM3"
                                     ).to_json())
    fpt = 6 * 10_000_000 + 6 * 2 * 64 * 64
    assert st.mfu() == pytest.approx(st.smooth_tok_s() * fpt / 989e12)
    assert peak_flops("NVIDIA H200") == 989e12 and peak_flops("cpu") is None
    text = panels.header(st, 130.0).plain
    assert "MFU" in text and "k tok/s" in text


def test_system_panel_shows_gpus_against_the_plan() -> None:
    st = _state_with([rec.ReadyEvent(t=1.0, memory_plan={"total": 60 << 30},
                                     n_params=92_248_320)], [(1, 1.0), (2, 2.0)])
    st.add_system([rec.SystemRecord(t=2.0, step=2, cpu_pct=99.0, rss_bytes=3 << 30, gpus=[
        rec.GpuSample(0, "NVIDIA H200", 97.0, 80 << 30, 141 << 30, 655.0, 61.0, 1980.0)])
        .to_json()])
    text = panels.system(st, 3.0).plain
    assert "gpu0 H200 97.0% · 61°C · 655 W · 1980 MHz" in text
    assert "mem 80.0 GiB / 141.0 GiB (plan 60.0 GiB)" in text
    assert "cpu 99.0% of a core · rss 3.0 GiB" in text


def test_log_tail_leaves_out_event_echoes_and_repeats() -> None:
    lines = ["10:00:00 step 5/10 loss 3", "10:00:01 checkpoint periodic step 5: /x (1 MiB)",
             "10:00:02 SIGUSR1 x1: snapshot at step 6", "10:00:03 warning: slow disk",
             "10:00:04 warning: slow disk", "10:00:05 alert stall: no step for 61 s"]
    assert panels.log_tail(lines, 5) == ["10:00:00 step 5/10 loss 3",
                                         "10:00:04 warning: slow disk (×2)"]


def test_old_checkpoints_are_no_news_on_attach(tmp_path: Path) -> None:
    st = RunState()
    st.add_events([rec.CheckpointEvent(t=1000.0, step=5, reason="stop", path="/c/5").to_json(),
                   rec.CheckpointEvent(t=9000.0, step=9, reason="snapshot",
                                       path="/c/9").to_json()])
    sup = EngineSupervisor(tmp_path)
    news = sup.checkpoint_news(st, since=5000.0)
    assert len(news) == 1 and "step 9" in news[0]


def test_no_unreachable_banner_while_a_resumed_engine_starts(tmp_path: Path) -> None:
    paths = write_run(tmp_path / "run", 10, status="stopped")
    (paths.root / "engine.json").write_text(json.dumps(
        {"pid": 1, "start_time": 1, "boot_id": "old", "run_id": "old"}))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)"])
    try:
        sup = EngineSupervisor(paths.root, child)
        st = RunState()
        st.set_files(state=json.loads(paths.state.read_text()))
        check = sup.check(st)
        assert check.banner is not None and check.banner.text == "engine starting…"
    finally:
        child.kill()
        child.wait()


def test_help_lines_fit_the_box() -> None:
    inner = HELP_WIDTH - 2 - 2 - 4  # border, scroll bar and padding
    for line in Text.from_markup(HELP.format(last_n=500)).plain.splitlines():
        assert len(line) <= inner, line


# ---------------------------------------------------------------- screens and keys


def test_samples_log_screens_and_dashboard_keys_off_on_them(tmp_path: Path) -> None:
    paths = write_run(tmp_path / "run", 300, status="finished")
    with open(paths.log, "a") as f:
        f.write("12:01:00 warning: disk slow\n12:01:01 error: something broke\n")

    async def go() -> None:
        async with finished_run_app(paths.root) as (app, pilot):
            await pilot.press("p")
            assert isinstance(app.screen, SamplesScreen)
            await pilot.pause()
            assert len(app.screen.order) == 6  # a sample every 50 steps
            text = screen_text(app)
            assert "def f300(x)" in text and "6 sample(s)" in text
            before = app.settings
            await pilot.press("y")  # a dashboard key: nothing here
            assert app.settings == before
            await pilot.press("escape")
            await pilot.press("l")
            assert isinstance(app.screen, LogScreen)
            await pilot.press("slash")
            for ch in "ERROR":
                await pilot.press(ch)
            await pilot.press("enter")
            await pilot.pause()
            assert "match 1/1" in screen_text(app) and "something broke" in screen_text(app)
            await pilot.press("f")
            await pilot.pause()
            assert app.screen.shown == ["12:01:01 error: something broke"]
            await pilot.press("f")
            await pilot.press("e")
            await pilot.pause()
            assert len(app.screen.shown) == 2  # the warning and the error
            await pilot.press("w")  # not a log key, not a dashboard key here
            assert app.settings == before
            await pilot.press("escape")
            await pilot.pause()
            assert app.screen is app.screen_stack[0]
            await pilot.press("w")
            assert app.settings.window is True

    run(go())


def test_screenshot_goes_to_the_run_directory(tmp_path: Path) -> None:
    paths = write_run(tmp_path / "run", 20, status="finished")

    async def go() -> None:
        app = AndreaApp(paths.root, follow=False, control_interval=3600)
        notes = record_notes(app)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_until(pilot, lambda: app.history_loaded)
            app.deliver_screenshot("shot.svg")
            await pilot.pause(0.3)
        assert (paths.root / "shot.svg").is_file()
        assert any(str(paths.root) in n for n in notes)

    run(go())


def test_resize_follows_the_new_size(tmp_path: Path) -> None:
    paths = write_run(tmp_path / "run", 200, status="finished", monitor=True)

    async def go() -> None:
        async with finished_run_app(paths.root, (200, 50)) as (app, pilot):
            screen = app.view.screen
            assert not screen.has_class("compact")
            for size, compact in (((80, 24), True), ((120, 40), False), ((80, 24), True)):
                await pilot.resize_terminal(*size)
                await pilot.pause()
                await pilot.pause()
                assert screen.has_class("compact") is compact, size
                loss, grad = app.view._charts()
                assert loss.size.height >= 6 and grad.size.height >= 6, size

    run(go())


def test_eval_and_telemetry_reach_the_panels(tmp_path: Path) -> None:
    paths = write_run(tmp_path / "run", 400, status="finished", monitor=True)

    async def go() -> None:
        async with finished_run_app(paths.root) as (app, pilot):
            await pilot.pause()
            text = screen_text(app)
            ev = app.state.val_loss
            assert ev is not None and ev.step == 400
            assert f"val loss   {ev.val_loss:.4g}" in text and "val ●" in text
            assert "cpu 97.5% of a core" in text and "rss 412.0 MiB" in text
            assert not math.isnan(app.state.system.cpu_pct)

    run(go())
