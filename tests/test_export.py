"""`andrea-tui export`: the CSV checked value by value against loss.jsonl (a resumed run with an
abandoned timeline, skipped steps, a corrupt line, validation losses), no overwrite without
--force, the PNG's header and size, the message without matplotlib, and `e` in the dashboard."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import re
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engine import records as rec
from engine.runfiles import JsonlWriter
from tests.fakerun import loss_record, write_run

T0, DT = 1_700_000_000.0, 0.1
RESUME_T = T0 + 1000.0


def resumed_run(root: Path) -> Path:
    """300 steps; 20 more (301..320) that a crash abandoned; a resume from step 300; steps
    301..310 again with other losses; a corrupt line; validation losses at 100, 200 and 305."""
    paths = write_run(root / "run", 300, t0=T0, dt=DT)
    with open(paths.loss, "a") as f:
        for s in range(301, 321):
            f.write(json.dumps(loss_record(s, T0 + s * DT)) + "\n")
        f.write("{not json\n")
        for s in range(301, 311):
            r = loss_record(s, RESUME_T + (s - 300) * DT)
            r["loss"] = 1.0 + s / 1000
            f.write(json.dumps(r) + "\n")
    ev = JsonlWriter(paths.events)
    ev.write(rec.ResumeEvent(t=RESUME_T, step=300, path="checkpoints/step_00000300").to_json())
    ev.close()
    with open(paths.root / "eval.jsonl", "w") as f:
        for s, t, v in ((100, T0 + 10, 3.5), (200, T0 + 20, 3.25), (310, T0 + 31, 9.9),
                        (305, RESUME_T + 1, 2.75)):  # 310 was on the abandoned timeline
            f.write(json.dumps({"step": s, "t": t, "val_loss": v}) + "\n")
    return paths.root


def surviving_raw(run: Path) -> dict[int, dict[str, Any]]:
    """loss.jsonl read here without the app's code: the JSON objects of the timeline that
    survived, the later one for each step."""
    out: dict[int, dict[str, Any]] = {}
    for line in (run / "loss.jsonl").read_text().splitlines():
        try:
            o = json.loads(line)
        except ValueError:
            continue
        if o["step"] > 300 and o["t"] < RESUME_T:
            continue
        out[o["step"]] = o
    return out


def raw_value(o: dict[str, Any], column: str, val: dict[int, float]) -> Any:
    if column == "val_loss":
        return val.get(o["step"])
    for prefix in ("weights", "src_loss"):
        if column.startswith(prefix + "."):
            return o[prefix].get(column[len(prefix) + 1:])
    return o[column]


def same(cell: str, want: Any) -> bool:
    if want is None:
        return cell == ""
    if isinstance(want, bool):
        return cell == ("1" if want else "0")
    got = float(cell)
    return (math.isnan(got) and math.isnan(want)) or got == want


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "andrea_tui.cli", *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_csv_matches_loss_jsonl_value_by_value(tmp_path: Path) -> None:
    run = resumed_run(tmp_path)
    out = tmp_path / "steps.csv"
    r = cli("export", str(run), "--csv", str(out))
    assert r.returncode == 0, r.stderr
    rows = list(csv.reader(out.open()))
    head, body = rows[0], rows[1:]
    raw = surviving_raw(run)
    val = {100: 3.5, 200: 3.25, 305: 2.75}
    assert head[:3] == ["step", "loss", "val_loss"]
    numeric = ["loss", "grad_norm", "clip_scale", "lr", "tokens", "tok_s", "step_ms", "t",
               "phase", "phase_step", "phase_len", "skipped"]
    assert set(numeric) <= set(head)
    assert {f"weights.{s}" for s in raw[1]["weights"]} <= set(head)
    assert {f"src_loss.{s}" for s in raw[1]["src_loss"]} <= set(head)
    assert [int(row[0]) for row in body] == sorted(raw) == list(range(1, 311))
    checked = 0
    for row in body:
        o = raw[int(row[0])]
        for column, cell in zip(head[1:], row[1:], strict=True):
            assert same(cell, raw_value(o, column, val)), (row[0], column, cell)
            checked += 1
    assert checked == len(body) * (len(head) - 1)
    by_step = {int(row[0]): row for row in body}
    assert float(by_step[305][1]) == 1.305  # the resumed timeline's loss, not the abandoned one
    assert by_step[96][1] == "nan" and by_step[96][head.index("grad_norm")] == "inf"
    assert by_step[310][2] == ""  # 310's validation loss was abandoned with its timeline
    assert r.stdout.strip() == f"{out}: 310 steps"


def test_no_overwrite_without_force(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", 50).root
    out = tmp_path / "steps.csv"
    out.write_text("mine\n")
    r = cli("export", str(run), "--csv", str(out))
    assert r.returncode == 2 and out.read_text() == "mine\n"
    assert r.stderr.strip() == f"error: {out}: already exists; pass --force to replace it"
    r = cli("export", str(run), "--csv", str(out), "--force")
    assert r.returncode == 0 and out.read_text().startswith("step,loss,")
    r = cli("export", str(run))
    assert r.returncode == 2 and "--csv FILE, --png FILE or both" in r.stderr
    r = cli("export", str(tmp_path / "nowhere"), "--csv", str(tmp_path / "x.csv"))
    assert r.returncode == 2 and "no such run directory" in r.stderr
    same = tmp_path / "both.out"
    r = cli("export", str(run), "--csv", str(same), "--png", str(same))
    assert r.returncode == 2 and "name the same file" in r.stderr and not same.exists()


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_png_has_the_stated_size(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = resumed_run(tmp_path)
    out = tmp_path / "charts.png"
    r = cli("export", str(run), "--png", str(out), "--size", "900x600")
    assert r.returncode == 0, r.stderr
    assert png_size(out.read_bytes()) == (900, 600)
    r = cli("export", str(run), "--png", str(out), "--size", "12x9000000")
    assert r.returncode == 2 and "--size" in r.stderr


BLOCK_MATPLOTLIB = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("blocked for the test")
sys.meta_path.insert(0, Block())
from andrea_tui.cli import main
main(sys.argv[1:])
"""


def test_png_without_matplotlib_says_how_to_get_it(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", 50).root
    out = tmp_path / "charts.png"
    r = subprocess.run([sys.executable, "-c", BLOCK_MATPLOTLIB, "export", str(run), "--png",
                        str(out), "--csv", str(tmp_path / "s.csv")], capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "matplotlib" in r.stderr and "pip install 'andrea[export]'" in r.stderr
    assert not out.exists() and not (tmp_path / "s.csv").exists()  # nothing half done


def test_e_in_the_dashboard_writes_into_the_run_directory(tmp_path: Path) -> None:
    from andrea_tui.app import AndreaApp

    run = write_run(tmp_path / "run", 120).root

    async def go() -> None:
        app = AndreaApp(run, follow=False)
        async with app.run_test(size=(120, 40)) as pilot:
            for n in (1, 2):
                await pilot.press("e")
                deadline = time.monotonic() + 30
                while len(list(run.glob("export-step00000120*.csv"))) < n:
                    assert time.monotonic() < deadline, "no export written"
                    await pilot.pause(0.1)

    asyncio.run(go())
    first, second = run / "export-step00000120.csv", run / "export-step00000120-2.csv"
    assert first.read_text() == second.read_text()  # the second did not overwrite the first
    assert len(first.read_text().splitlines()) == 121


def charted_run(root: Path, clip: float) -> Path:
    """600 steps with validation every 100 steps, two alerts (steps 200 and 300), a grad norm
    of 6,594 at step 450, a resume at step 400 that moved the lr, and `max_grad_norm` = clip."""
    paths = write_run(root / "run", 600, t0=T0, dt=DT, monitor=True)
    lines = [json.loads(line) for line in paths.loss.read_text().splitlines()]
    for o in lines:
        o["lr"] = 1.41e-4 if o["step"] > 400 else 3e-5
        if o["step"] == 450:
            o["grad_norm"] = 6594.0
    paths.loss.write_text("".join(json.dumps(o) + "\n" for o in lines))
    ev = JsonlWriter(paths.events)
    ev.write(rec.ResumeEvent(t=T0 + 400 * DT + DT / 2, step=400, path="checkpoints/x").to_json())
    ev.close()
    cfg = json.loads(paths.config.read_text())
    cfg["optim"]["max_grad_norm"] = clip
    paths.config.write_text(json.dumps(cfg))
    return paths.root


def shown_ticks(axis) -> list[str]:
    """The labels of an axis's ticks inside its limits (matplotlib labels some beyond them)."""
    lo, hi = sorted(axis.get_view_interval())
    return [t.label1.get_text() for t in axis.get_major_ticks()
            if lo <= t.get_loc() <= hi and t.label1.get_text()]


def legend_texts(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_png_puts_validation_on_the_loss_axes_with_an_lr_panel_and_alert_marks(
        tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from andrea_tui.export import png_figure

    run = charted_run(tmp_path, clip=1e9)
    fig = png_figure(run, (1000, 800))
    assert len(fig.axes) == 3
    ax_loss, ax_grad, ax_lr = fig.axes
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "grad norm", "learning rate"]
    # train and validation on one axes: the gap is read off one scale
    assert legend_texts(ax_loss) == ["loss", "EMA (0.9)", "validation loss", "alerts (2)"]
    val = next(line for line in ax_loss.get_lines() if line.get_label() == "validation loss")
    assert list(val.get_xdata()) == list(range(100, 601, 100))
    # the alerts: a vertical tick at each alert's step, along the top of the loss axes
    marks = next(c for c in ax_loss.collections if c.get_label() == "alerts (2)")
    assert sorted(seg[0][0] for seg in marks.get_segments()) == [200, 300]
    # the grad norm: its axis on the data, not on 6,594 or the clip line at 1e9
    assert ax_grad.get_ylim()[1] < 2.0
    assert "1 above the axis" in legend_texts(ax_grad)
    assert "clip 1.00e9, off scale" in legend_texts(ax_grad)
    # the lr panel: the resume where the lr jumps, the evaluations
    lr = next(line for line in ax_lr.get_lines() if line.get_label() == "learning rate")
    assert min(lr.get_ydata()) == 3e-5 and max(lr.get_ydata()) == 1.41e-4
    resume = next(line for line in ax_lr.get_lines() if line.get_label() == "resume")
    assert list(resume.get_xdata()) == [400, 400]
    assert "evaluation" in legend_texts(ax_lr)
    # round ticks, one format per axis
    fig.canvas.draw()
    xt = shown_ticks(ax_lr.xaxis)
    assert set(xt) <= {"0", "100", "200", "300", "400", "500", "600"} and len(xt) >= 3
    yt = shown_ticks(ax_lr.yaxis)
    assert yt and all(re.fullmatch(r"\d\.\de-\d", t) for t in yt), yt  # 5.0e-5, 1.0e-4
    # a clip line near the data is drawn on its axes
    fig = png_figure(charted_run(tmp_path / "near", clip=1.0), (1000, 800))
    assert "clip 1.000" in legend_texts(fig.axes[1]) and fig.axes[1].get_ylim()[1] < 2.0
