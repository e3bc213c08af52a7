"""The charts draw plotext's matrix straight into strips (charts.CachedPlot): the very strips
PlotextPlot's own path (plotext's ANSI string, Rich's Text.from_ansi, Textual's Content) draws,
for every chart option, colours and text-selection offsets included; a redraw draws again only
the rows that changed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from textual.visual import Visual, visualize
from textual_plotext import PlotextPlot

from andrea_tui.plotcache import CachedPlot
from andrea_tui.settings import Settings
from engine.records import StepRecord
from tests.fakerun import loss_record, write_run
from tests.test_tui_app import finished_run_app


def textual_path(chart: CachedPlot) -> list:
    """What PlotextPlot draws for the chart's current plot: its render() (plotext's build and
    Text.from_ansi), then Textual's Visual path, as Widget._render_content does."""
    width, height = chart.size
    text = PlotextPlot.render(chart)
    return Visual.to_strips(chart, visualize(chart, text), width, height, chart.visual_style)


SETTINGS = [
    Settings(),
    Settings(log_y_loss=True, log_y_grad=True, robust_y=True, x_axis="time"),
    Settings(window=True, smoothing=0.0),
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_chart_strips_are_what_plotext_plot_draws(tmp_path: Path, settings: Settings) -> None:
    # monitor: validation points (yellow) and alert marks (red `!`) on the charts too
    paths = write_run(tmp_path / "run", 1500, status="finished", monitor=True)

    async def go() -> None:
        async with finished_run_app(paths.root) as (app, pilot):
            app.settings = settings
            app.view.apply(settings)
            await pilot.pause()
            for chart in app.view._charts():
                drawn = [chart.render_line(y) for y in range(chart.size.height)]
                assert chart._strips is not None  # drawn from the matrix, not by the fallback
                expected = textual_path(chart)
                assert len(expected) == chart.size.height
                for y, (got, want) in enumerate(zip(drawn, expected, strict=True)):
                    assert got == want, f"{chart.id} row {y}: {got.text!r} != {want.text!r}"
                # several colours on screen: the styles were compared, not only the text
                assert len({seg.style.color for s in drawn for seg in s if seg.style}) >= 3

    asyncio.run(go())


def test_chart_rebuilds_only_for_new_data_and_textual_path_agrees(tmp_path: Path) -> None:
    paths = write_run(tmp_path / "run", 600, status="finished")

    async def go() -> None:
        async with finished_run_app(paths.root, (120, 40)) as (app, pilot):
            await pilot.pause()
            loss = app.view._charts()[0]
            first = [loss.render_line(y) for y in range(loss.size.height)]
            key = loss._canvas_key
            app.view.redraw_charts()  # the same data: nothing to build
            assert [loss.render_line(y) for y in range(loss.size.height)] == first
            assert loss._canvas_key == key
            loss.smoothing = 0.0  # another picture: a new build
            loss.update_from(app.state.series)
            assert [loss.render_line(y) for y in range(loss.size.height)] != first
            assert loss._canvas_key != key
            # Textual's own path (as for a text selection) draws the same rows
            assert [loss.render_line(y) for y in range(loss.size.height)] == textual_path(loss)
            assert "EMA" not in loss.render().plain and "no smoothing" in loss.render().plain

    asyncio.run(go())


def test_a_redraw_keeps_the_strips_of_the_rows_that_did_not_change(tmp_path: Path) -> None:
    """Following a long run, new steps change a few rows of a chart (an axis label, the newest
    column): only those are drawn again, and the chart on screen is the new picture."""
    paths = write_run(tmp_path / "run", 20_000, status="running", max_steps=200_000)

    async def go() -> None:
        async with finished_run_app(paths.root) as (app, pilot):
            await pilot.pause()
            charts = app.view._charts()
            before = {c.id: list(c._strips or ()) for c in charts}
            step = app.state.series.last_step
            app.state.add_loss([StepRecord.from_json(loss_record(s, 1.7e9 + s)).to_json()
                                for s in range(step + 1, step + 21)])
            app.view.redraw_charts()
            await pilot.pause()
            for c in charts:
                now = [c.render_line(y) for y in range(c.size.height)]
                assert now == textual_path(c), c.id  # the new picture, as Textual draws it
                changed = [y for y, (a, b) in enumerate(zip(before[c.id], now, strict=True))
                           if a != b]
                assert 0 < len(changed) < c.size.height // 2, c.id  # something moved, not all
                kept = [y for y in range(len(now)) if y not in changed]
                assert all(now[y] is before[c.id][y] for y in kept), c.id  # not drawn again

    asyncio.run(go())


def test_the_charts_read_the_plotext_they_were_written_for() -> None:
    """CachedPlot reads plotext's matrix and colour helpers, which are not public API: the pin
    in pyproject.toml and the version installed agree (a new plotext needs the tests above run
    against it before the pin moves)."""
    import importlib.metadata
    import re

    pin = re.search(r'"plotext==([\d.]+)"', (Path(__file__).parents[1] / "pyproject.toml")
                    .read_text())
    assert pin and importlib.metadata.version("plotext") == pin.group(1) == "5.3.2"


def test_a_plotext_without_those_internals_falls_back_to_plotext_plot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When plotext's matrix is not as CachedPlot reads it, the chart is drawn by PlotextPlot's
    own path (the same rows) and the app goes on."""
    paths = write_run(tmp_path / "run", 300, status="finished")

    def missing(self) -> list:
        raise AttributeError("'Figure' object has no attribute 'monitor'")

    monkeypatch.setattr(CachedPlot, "_matrix_rows", missing)

    async def go() -> None:
        async with finished_run_app(paths.root) as (app, pilot):
            await pilot.pause()
            for chart in app.view._charts():
                drawn = [chart.render_line(y) for y in range(chart.size.height)]
                assert not chart._matrix_ok and chart._strips is None
                assert [s.text for s in drawn] == [s.text for s in textual_path(chart)]
                assert any(s.text.strip() for s in drawn)

    asyncio.run(go())
