"""The dashboard's charts, headless: a grad-norm spike and a clip line far beyond the data leave
the grad axis on the bulk (what lies above is marked on the edge and counted), round ticks, the
learning-rate chart with a resume that moved the lr, and titles and tick labels that keep their
colours under light and ANSI themes."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from textual.color import Color

from andrea_tui.chartparts import fit_title
from andrea_tui.charts import GradNormChart, LossChart, LrChart
from andrea_tui.settings import Settings
from engine import records as rec
from engine.runfiles import JsonlWriter
from tests.fakerun import write_run
from tests.test_tui_app import finished_run_app

T0, DT = 1_700_000_000.0, 0.1


def spiky_run(root: Path, clip: float, resume_at: int | None = None) -> Path:
    """3,000 fake steps (grad norms 0.6-1.4) with grad norms of 134.7 at step 1,500 and 6,594 at
    step 1,539 (a spike inside another's cooldown), `optim.max_grad_norm` = clip; with
    `resume_at`, a resume there that moved the lr from 3e-05 to 1.41e-04."""
    paths = write_run(root, 3000, t0=T0, dt=DT, max_steps=4000, monitor=True)
    lines = [json.loads(line) for line in paths.loss.read_text().splitlines()]
    for o in lines:
        if o["step"] == 1500:
            o["grad_norm"] = 134.7
        if o["step"] == 1539:
            o["grad_norm"] = 6594.0
        if resume_at is not None:
            o["lr"] = 1.41e-4 if o["step"] > resume_at else 3e-5
    paths.loss.write_text("".join(json.dumps(o) + "\n" for o in lines))
    if resume_at is not None:
        ev = JsonlWriter(paths.events)
        ev.write(rec.ResumeEvent(t=T0 + resume_at * DT + DT / 2, step=resume_at,
                                 path=f"checkpoints/step_{resume_at:08d}").to_json())
        ev.close()
    cfg = json.loads(paths.config.read_text())
    cfg["optim"]["max_grad_norm"] = clip
    paths.config.write_text(json.dumps(cfg))
    return paths.root


def rows(chart) -> list[str]:
    return [chart.render_line(y).text for y in range(chart.size.height)]


def y_labels(chart) -> list[str]:
    """The y tick labels: what stands left of the frame's `┤` ticks."""
    return [m.group(1) for r in rows(chart) if (m := re.match(r"^\s*([^\s┤├│]+)[┤├]", r))]


def x_labels(chart) -> list[str]:
    return rows(chart)[-1].split()


def is_125_multiple(values: list[float]) -> bool:
    values = sorted(values)
    if len(values) < 2:
        return True
    step = round(values[1] - values[0], 12)
    mantissa = step / 10 ** int(f"{step:e}".split("e")[1])
    return round(mantissa, 6) in (1, 2, 5) and all(
        abs(v / step - round(v / step)) < 1e-6 for v in values)


def number(label: str) -> float:
    """An axis label read back: `1,500`, `2k`, `5.0e-4`."""
    mult = {"k": 1e3, "M": 1e6, "G": 1e9}.get(label[-1], 1.0)
    return float(label.rstrip("kMG").replace(",", "")) * mult


def test_a_grad_spike_and_a_far_clip_line_leave_the_grad_axis_on_the_data(
        tmp_path: Path) -> None:
    run = spiky_run(tmp_path / "run", clip=1e9)

    async def go() -> None:
        async with finished_run_app(run) as (app, pilot):
            await pilot.pause()
            grad = app.query_one(GradNormChart)
            text = rows(grad)
            title = text[0]
            assert "2 above ▲" in title and "clip 1.00e9 off scale" in title
            labels = [number(s) for s in y_labels(grad)]
            assert labels and max(labels) < 2.0  # the bulk (0.6-1.4), not 6,594 nor 1e9
            assert is_125_multiple(labels)
            top_row = text[2]  # under the title and the frame: the top edge of the data
            assert top_row.count("▲") == 2
            assert not any("├" in r for r in text[2:-2])  # no clip line on the axis
            # log y (`g`) shows the whole range: the spikes are on the axis, nothing above
            app.settings = Settings(log_y_grad=True)
            app.view.apply(app.settings)
            await pilot.pause()
            text = rows(grad)
            assert "above" not in text[0] and "log y" in text[0]
            assert max(number(s) for s in y_labels(grad)) >= 1000

    asyncio.run(go())


def test_a_clip_line_near_the_data_is_drawn(tmp_path: Path) -> None:
    run = spiky_run(tmp_path / "run", clip=1.0)

    async def go() -> None:
        async with finished_run_app(run) as (app, pilot):
            await pilot.pause()
            grad = app.query_one(GradNormChart)
            text = rows(grad)
            assert "clip 1.000 " in text[0] and "off scale" not in text[0]
            # the clip line: a row across the frame, `├` to `┤`, drawn with `─`
            line = [r for r in text[2:-2] if "├" in r and r.rstrip().endswith("┤")]
            assert len(line) == 1 and line[0].count("─") >= 40
            assert number(line[0].split("├")[0].strip()) == 1.0

    asyncio.run(go())


def test_the_charts_ticks_are_round(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", 1482, t0=T0, dt=DT, monitor=True).root

    async def go() -> None:
        async with finished_run_app(run, (140, 45)) as (app, pilot):
            await pilot.pause()
            for chart in (app.query_one(LossChart), app.query_one(GradNormChart)):
                xs = [number(s) for s in x_labels(chart)]
                ys = [number(s) for s in y_labels(chart)]
                assert len(xs) >= 2 and len(ys) >= 2, rows(chart)
                assert is_125_multiple(xs), xs  # 500, 1,000: not 1 / 371 / 742
                assert is_125_multiple(ys), ys
                decimals = {len(s.split(".")[1]) if "." in s else 0 for s in y_labels(chart)}
                assert len(decimals) == 1  # one format per axis: 1.0 1.5 2.0, not 1 1.5 2

    asyncio.run(go())


def test_the_lr_chart_shows_a_resume_that_moved_the_lr(tmp_path: Path) -> None:
    run = spiky_run(tmp_path / "run", clip=1.0, resume_at=2000)

    async def go() -> None:
        async with finished_run_app(run, (140, 50)) as (app, pilot):
            await pilot.pause()
            lr = app.query_one(LrChart)
            text = rows(lr)
            assert "now 1.41e-04" in text[0] and "resumes │ 1" in text[0]
            assert "evals · 30" in text[0]  # validation every 100 steps
            # the resume's line meets the frame at its step, where the lr jumps
            frame = text[1]
            xs = x_labels(lr)
            at_2k = rows(lr)[-1].index(xs[[number(s) for s in xs].index(2000)]) + 2
            assert frame[at_2k - 3: at_2k + 3].count("┬") >= 1
            assert [number(s) for s in y_labels(lr)] == [1e-4, 5e-5]  # written 1e-4, 5e-5
            yr = lr._data[-1]
            assert yr.lo < 3e-5 and yr.hi > 1.41e-4  # both levels on the axis
        # a shorter terminal leaves it out: the loss and grad-norm charts keep their rows
        for size in ((80, 24), (120, 36)):
            async with finished_run_app(run, size) as (app, pilot):
                await pilot.pause()
                await pilot.pause()
                assert app.query_one(LrChart).display is False, size
                assert app.query_one(LossChart).size.height >= 6, size

    asyncio.run(go())


def luminance(c: Color) -> float:
    r, g, b = (v / 255 for v in c.rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


@pytest.mark.parametrize("theme", ["textual-light", "solarized-light", "ansi-light",
                                   "ansi-dark", "textual-dark"])
def test_titles_and_ticks_keep_their_colour_in_every_theme(tmp_path: Path, theme: str) -> None:
    run = write_run(tmp_path / "run", 600, t0=T0, dt=DT, monitor=True).root

    async def go() -> None:
        async with finished_run_app(run, (140, 50)) as (app, pilot):
            app.theme = theme
            await pilot.pause()
            app.view.redraw_charts()
            await pilot.pause()
            for chart in (app.query_one(LossChart), app.query_one(GradNormChart),
                          app.query_one(LrChart)):
                strips = [chart.render_line(y) for y in range(chart.size.height)]
                title, ticks_row = strips[0], strips[-1]
                assert title.text.strip() and ticks_row.text.strip(), chart.id
                for strip in (title, ticks_row):
                    for seg in strip:
                        if not seg.text.strip() or seg.style is None:
                            continue
                        fg, bg = seg.style.color, seg.style.bgcolor
                        if fg is None or fg.is_default:
                            continue  # the terminal's own colour: readable by definition
                        assert bg is None or bg.is_default or fg.triplet != bg.triplet, \
                            (chart.id, seg)
                        if bg is not None and not bg.is_default and fg.triplet and bg.triplet:
                            tc = Color(*fg.triplet)
                            bc = Color(*bg.triplet)
                            assert abs(luminance(tc) - luminance(bc)) > 0.3, (chart.id, seg)

    asyncio.run(go())


def test_titles_shorten_to_fit_the_width() -> None:
    parts = [("grad norm (all, robust y)", "grad norm"), ("clip 1e9 off scale", "clip 1e9 off"),
             ("clipped ✕ 1004", "✕1004"), ("2 above ▲", "▲2"), ("alerts ! 3", "!3")]
    assert fit_title(parts, 200) == ("grad norm (all, robust y) · clip 1e9 off scale · "
                                     "clipped ✕ 1004 · 2 above ▲ · alerts ! 3")
    short = fit_title(parts, 44)
    assert len(short) <= 44 and "clip 1e9" in short and "▲2" in short and "!3" in short
    assert fit_title(parts, 10).split() == ["grad", "norm", "clip", "1e9", "off", "✕1004",
                                           "▲2", "!3"]
