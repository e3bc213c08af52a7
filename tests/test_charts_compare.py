"""The compare overlay: smoothing (the dashboard's debiased EMA), round ticks, and its export
(`e` in the overlay; `andrea-tui compare ... --csv/--png` with export's rules), checked value by
value."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from andrea_tui import compare_export
from andrea_tui.compare import ema, load_curves, run_labels
from andrea_tui.series import StepSeries
from andrea_tui.settings import Settings
from engine.records import StepRecord
from tests.fakerun import loss_record, write_run
from tests.test_charts_axes import is_125_multiple, number, rows, x_labels, y_labels
from tests.test_tui_app import wait_until

T0 = 1_700_000_000.0


def two_runs(tmp_path: Path) -> list[Path]:
    a = write_run(tmp_path / "lr-1e-3", 300, t0=T0, monitor=True).root
    b = write_run(tmp_path / "lr-3e-4", 200, t0=T0).root
    lines = [json.loads(line) for line in (b / "loss.jsonl").read_text().splitlines()]
    for o in lines:
        if math.isfinite(o["loss"]):
            o["loss"] = round(o["loss"] + 0.5, 6)
    (b / "loss.jsonl").write_text("".join(json.dumps(o) + "\n" for o in lines))
    return [a, b]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "andrea_tui.cli", *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_ema_is_the_dashboards() -> None:
    records = [StepRecord.from_json(loss_record(s, T0 + s)) for s in range(1, 400)]
    series = StepSeries.from_records(records, ema_alpha=0.9)  # with skipped (NaN) steps
    assert np.allclose(ema(series.col("loss"), 0.9), series.ema(), equal_nan=True)
    assert np.array_equal(ema(np.array([1.0, 2.0]), 0.0), [1.0, 2.0])
    with pytest.raises(ValueError, match="smoothing"):
        ema(np.array([1.0]), 1.0)


def test_compare_csv_has_each_runs_loss_and_ema_by_step(tmp_path: Path) -> None:
    a, b = two_runs(tmp_path)
    out = tmp_path / "overlay.csv"
    r = cli("compare", str(a), str(b), "--csv", str(out), "--smoothing", "0.9")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{out}: 2 runs, 300 steps"
    rows = list(csv.reader(out.open()))
    assert rows[0] == ["step", "lr-1e-3:loss", "lr-1e-3:loss_ema", "lr-3e-4:loss",
                       "lr-3e-4:loss_ema"]
    body = rows[1:]
    assert [int(row[0]) for row in body] == list(range(1, 301))
    ca = load_curves(a)
    want_ema = ema(ca.cols["loss"], 0.9)
    for row in body:
        s = int(row[0])
        raw = loss_record(s, 0)["loss"]
        assert (row[1] == "nan") if math.isnan(raw) else float(row[1]) == raw
        assert float(row[2]) == want_ema[s - 1]
        if s <= 200:
            assert row[3] == "nan" if math.isnan(raw) else float(row[3]) == round(raw + 0.5, 6)
        else:
            assert row[3] == row[4] == ""  # the shorter run has no such step
    # export's rules: no overwrite without --force, one line, exit status 2
    r = cli("compare", str(a), str(b), "--csv", str(out))
    assert r.returncode == 2 and r.stderr.strip() == (
        f"error: {out}: already exists; pass --force to replace it")
    r = cli("compare", str(a), str(b), "--csv", str(out), "--force", "--smoothing", "0")
    assert r.returncode == 0 and next(csv.reader(out.open())) == ["step", "lr-1e-3:loss",
                                                                   "lr-3e-4:loss"]
    r = cli("compare", str(a), str(b), "--csv", "-", "--metric", "val_loss")
    assert r.returncode == 0 and r.stdout.splitlines()[:2] == [
        "step,lr-1e-3:val_loss,lr-3e-4:val_loss", "100,9.259207,"]
    assert "standard output: 2 runs, 3 steps" in r.stderr
    r = cli("compare", str(a), str(b), "--csv", "x.csv", "--smoothing", "1.5")
    assert r.returncode == 2 and "--smoothing: expected 0 <= ALPHA < 1" in r.stderr


def test_compare_png_overlays_the_runs_with_round_ticks(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    a, b = two_runs(tmp_path)
    runs = [load_curves(p, label) for p, label in zip([a, b], run_labels([a, b]), strict=True)]
    fig = compare_export.figure(runs, "loss", "tokens", 0.9, size=(900, 600))
    (ax,) = fig.axes
    assert ax.get_title() == "loss by tokens · EMA 0.9" and ax.get_xlabel() == "tokens"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert [lab.split(" (")[0] for lab in labels] == ["lr-1e-3", "lr-3e-4"]
    fig.canvas.draw()
    lo, hi = sorted(ax.xaxis.get_view_interval())
    xt = [t.label1.get_text() for t in ax.xaxis.get_major_ticks() if lo <= t.get_loc() <= hi]
    assert xt and all(t == "0" or t.endswith("k") for t in xt), xt  # 20k 40k ...: SI
    out = tmp_path / "overlay.png"
    r = cli("compare", str(a), str(b), "--png", str(out), "--size", "640x480")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_overlay_smooths_and_exports_from_its_keys(tmp_path: Path) -> None:
    from andrea_tui.compare_screen import CompareApp, OverlayChart, RunCompareScreen

    a, b = two_runs(tmp_path)
    where = tmp_path / "out"
    where.mkdir()

    async def go() -> None:
        app = CompareApp([a, b], smoothing=0.9, export_dir=where)
        async with app.run_test(size=(140, 40)) as pilot:
            await wait_until(pilot, lambda: isinstance(app.screen, RunCompareScreen)
                             and bool(app.screen.runs))
            await pilot.pause(0.2)
            chart = app.screen.query_one(OverlayChart)
            assert "EMA 0.9" in chart.render_line(0).text
            assert x_labels(chart) == ["step"]  # the axis's name under its ticks
            xs = [number(s) for s in rows(chart)[-2].split()]
            assert len(xs) >= 3
            ys = [number(s) for s in y_labels(chart)]
            assert is_125_multiple(xs) and is_125_multiple(ys), (xs, ys)
            _, smooth = chart.curve(0)
            assert smooth[-1] == pytest.approx(ema(load_curves(a).cols["loss"], 0.9)[-1])
            await pilot.press("s")  # raw
            await pilot.pause()
            assert "raw" in chart.render_line(0).text and chart.smoothing == 0
            await pilot.press("right_square_bracket")  # one notch up from none
            assert chart.smoothing == Settings(smoothing=0.0).smoother(1).smoothing
            await pilot.press("e")
            await wait_until(pilot, lambda: (where / "compare-loss.csv").exists()
                             and (where / "compare-loss.png").exists())
            await pilot.press("e")  # never over the first
            await wait_until(pilot, lambda: (where / "compare-loss-2.csv").exists())

    asyncio.run(go())
    head = (where / "compare-loss.csv").read_text().splitlines()[0]
    assert head == "step,lr-1e-3:loss,lr-1e-3:loss_ema,lr-3e-4:loss,lr-3e-4:loss_ema"
