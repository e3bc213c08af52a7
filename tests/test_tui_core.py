"""Headless core of the TUI: series maths, the run reader, the launcher. No screen."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from andrea_tui.launcher import launch, train_argv
from andrea_tui.runreader import RunReader
from andrea_tui.runstate import LossHistory, RunState
from andrea_tui.series import StepSeries, downsample_minmax, eta_seconds
from andrea_tui.textfmt import bar, fmt_duration, fmt_num
from engine.records import StepRecord, parse_all
from tests.fakerun import loss_record, write_run


def ema_reference(xs: list[float], a: float) -> list[float]:
    """Debiased EMA by its closed form: sum a^(k-i)(1-a)x_i / (1 - a^k) over finite values."""
    out, finite = [], []
    for x in xs:
        if math.isfinite(x):
            finite.append(x)
        k = len(finite)
        if k == 0:
            out.append(math.nan)
            continue
        num = sum(a ** (k - 1 - i) * (1 - a) * v for i, v in enumerate(finite))
        out.append(num / (1 - a**k))
    return out


def typed(objects: list[dict]) -> list[StepRecord]:
    """Loss-file JSON objects read as the app reads them (unusable ones left out)."""
    return parse_all(StepRecord, objects)[0]


def recs(losses: list[float], start: int = 1) -> list[StepRecord]:
    return typed([{"step": start + i, "loss": v, "grad_norm": 1.0, "clip_scale": 1.0,
                   "t": float(i)} for i, v in enumerate(losses)])


def test_ema_matches_closed_form_and_holds_over_nan() -> None:
    rng = np.random.default_rng(0)
    xs = list(rng.normal(3.0, 1.0, 60))
    xs[7] = math.nan
    xs[30] = math.inf
    s = StepSeries(ema_alpha=0.8)
    s.add(recs(xs[:25]))
    s.ema()  # computed once part-way: the rest must continue incrementally
    s.add(recs(xs[25:], start=26))
    np.testing.assert_allclose(s.ema(), ema_reference(xs, 0.8), rtol=1e-12)
    assert s.ema()[0] == pytest.approx(xs[0])  # debiased: no pull towards zero


def test_later_record_wins_and_ema_recomputes() -> None:
    s = StepSeries(ema_alpha=0.5)
    s.add(recs([5.0, 4.0, 3.0, 2.0]))
    s.ema()
    s.add(recs([9.0, 8.0], start=3))  # a resume re-logs steps 3 and 4
    assert s.steps.tolist() == [1, 2, 3, 4]
    assert s.col("loss").tolist() == [5.0, 4.0, 9.0, 8.0]
    np.testing.assert_allclose(s.ema(), ema_reference([5.0, 4.0, 9.0, 8.0], 0.5))
    s.add(typed([{"step": 0, "loss": 7.0}]))  # a missing earlier step is inserted in order
    assert s.steps.tolist() == [0, 1, 2, 3, 4]
    np.testing.assert_allclose(s.ema(), ema_reference([7.0, 5.0, 4.0, 9.0, 8.0], 0.5))


def test_from_records_equals_incremental() -> None:
    objects = [r.to_json() for r in recs([float(i % 7) for i in range(300)])
               + recs([1.5, 2.5], start=100)]
    records = typed([*objects, {"step": "bad"}, {"step": True, "loss": 1.0}])
    assert len(records) == len(objects)
    a = StepSeries.from_records(records, 0.9)
    b = StepSeries(0.9, capacity=16)  # grows (doubling) five times on the way
    b.add(records)
    assert a.steps.tolist() == b.steps.tolist() == list(range(1, 301))
    np.testing.assert_array_equal(a.col("loss"), b.col("loss"))
    assert a.col("loss")[99] == 1.5 and a.col("loss")[100] == 2.5
    np.testing.assert_allclose(a.ema(), b.ema())


def test_growing_keeps_every_column_and_the_ema_already_computed() -> None:
    """Rows added after the EMA was computed grow the arrays: the steps (int64), the skipped
    flags (bool), every column and the EMA so far are carried over, equal to a series that
    never grew."""
    records = recs([float(i % 5) + 0.25 for i in range(40)])
    a = StepSeries.from_records(records, 0.9)
    b = StepSeries(0.9, capacity=16)
    b.add(records[:10])
    first = b.ema().copy()  # computed before the growth, kept through it
    b.add(records[10:])  # 16 -> 32 -> 64 rows
    assert b.steps.dtype == np.int64 and b._skipped.dtype == bool
    assert b.steps.tolist() == a.steps.tolist()
    for c in ("loss", "grad_norm", "lr"):
        np.testing.assert_array_equal(b.col(c), a.col(c))
    np.testing.assert_array_equal(b.ema()[:10], first)
    np.testing.assert_allclose(b.ema(), a.ema())


def test_downsample_keeps_each_columns_min_and_max() -> None:
    rng = np.random.default_rng(1)
    n, cols = 10_000, 37
    x = np.arange(n)
    y = rng.normal(size=n)
    y[1234] = 50.0  # a spike must survive
    y[4321] = math.nan
    dx, dy = downsample_minmax(x, y, cols)
    assert len(dx) <= 2 * cols
    edges = np.linspace(0, n, cols + 1).astype(int)
    for j in range(cols):
        bucket = y[edges[j]:edges[j + 1]]
        assert dy[2 * j] == np.nanmin(bucket) and dy[2 * j + 1] == np.nanmax(bucket)
        assert dx[2 * j] == x[edges[j]]
    assert 50.0 in dy
    _sx, sy = downsample_minmax(x[:50], y[:50], cols)  # short: returned as is
    np.testing.assert_array_equal(sy, y[:50])


def test_clip_share_skipped_rate_and_eta() -> None:
    s = StepSeries()
    rows = [{"step": i, "loss": 1.0, "clip_scale": 0.5 if i % 4 == 0 else 1.0,
             "skipped": i == 7, "t": 100.0 + 0.5 * i} for i in range(1, 201)]
    s.add(typed(rows))
    last100 = rows[-100:]
    assert s.clip_share(100) == sum(r["clip_scale"] < 1 for r in last100) / 100
    assert s.skipped_count() == 1
    assert s.steps_per_second() == pytest.approx(2.0)
    assert eta_seconds(200, 1000, 2.0) == pytest.approx(400.0)
    assert eta_seconds(200, None, 2.0) is None and eta_seconds(1, 10, math.nan) is None


def test_formats() -> None:
    assert fmt_num(1_234_567) == "1.23M" and fmt_num(5120) == "5.12k"
    assert fmt_num(None) == "–" and fmt_num(math.nan) == "–" and fmt_num(0.5) == "0.5"
    assert fmt_duration(3723) == "1h02m03s" and fmt_duration(65) == "1m05s"
    assert bar(0.5, 4) == "██  " and bar(1.5, 2) == "██"


# ---------------------------------------------------------------- reading a run directory


def test_reader_history_and_appends(tmp_path: Path) -> None:
    paths = write_run(tmp_path / "run", 300, status="running")
    st = RunState()
    rd = RunReader(paths.root, st)
    preview = rd.read_preview(max_bytes=5000)
    assert preview and preview[-1]["step"] == 300 and len(preview) < 300
    st.set_history(rd.read_history())
    rd.poll()
    assert st.series.n == 300 and st.step == 300 and st.name == "ANDREA-fake"
    assert st.max_grad_norm == 1.0
    assert st.series.skipped_count() == sum(loss_record(s, 0)["skipped"] for s in range(1, 301))
    assert st.last_sample.step == 300 and st.memory_plan["total"] == 29 << 20
    assert [c.phase for c in st.phase_changes][-1] == 300 // 14

    with open(paths.loss, "ab") as f:  # a torn line, completed later
        line = json.dumps(loss_record(301, 1.0)).encode()
        f.write(line[:20])
        f.flush()
        rd.poll()
        assert st.series.n == 300
        f.write(line[20:] + b"\n{not json\n")
        f.write(json.dumps({**loss_record(150, 2.0), "loss": 42.0}).encode() + b"\n")
    rd.poll()
    assert st.series.n == 301 and st.series.last_step == 301
    # A step behind the last with no resume to explain it is out of sequence: skipped, counted.
    assert st.series.col("loss")[149] != 42.0
    assert st.bad_lines == 1 and st.skipped_lines == 2


def poll_like_the_app(rd: RunReader) -> None:
    """A poll, then (as the app does in a thread) the history anew when the loss file asks."""
    rd.poll()
    if rd.loss_backlog:
        rd.state.set_history(rd.read_history())
        rd.loss_backlog = False


def test_reader_truncation_replacement_late_files(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    st = RunState()
    rd = RunReader(root, st)
    st.set_history(rd.read_history())
    assert rd.poll() is False and st.series.n == 0  # nothing there yet: no crash
    (root / "state.json").write_text("{half")  # corrupt small file: ignored
    rd.poll()
    assert st.status == "starting"
    (root / "loss.jsonl").write_text("".join(json.dumps(loss_record(s, 0)) + "\n"
                                             for s in range(1, 11)))
    rd.poll()
    assert st.series.n == 10
    (root / "loss.jsonl").write_text(json.dumps(loss_record(1, 0)) + "\n")  # truncated
    poll_like_the_app(rd)
    assert st.series.n == 1
    tmp = root / "loss.new"
    tmp.write_text("".join(json.dumps(loss_record(s, 0)) + "\n" for s in range(1, 4)))
    os.replace(tmp, root / "loss.jsonl")  # replaced (new inode)
    poll_like_the_app(rd)
    assert st.series.steps.tolist() == [1, 2, 3]
    (root / "state.json").write_text(json.dumps({"status": "stopped", "step": 3}))
    rd.poll()
    assert st.status == "stopped"


def test_history_build_from_records() -> None:
    records = [loss_record(s, float(s)) for s in range(1, 60)]
    h = LossHistory.build(records)
    assert h.last_record.step == 59
    assert [c.step for c in h.phase_changes] == [14, 28, 42, 56]
    assert h.src_loss["stdlib-code"] == records[-1]["src_loss"]["stdlib-code"]


# ---------------------------------------------------------------- launching


def test_train_argv() -> None:
    argv = train_argv(Path("c.json"), Path("runs/x"), resume=True, max_steps=5, backend="numpy")
    assert argv[:3] == [sys.executable, "-m", "engine.run.cli"]
    assert argv[3:] == ["c.json", "--run-dir", "runs/x", "--resume", "--max-steps", "5",
                        "--backend", "numpy"]


def test_launch_detaches_and_logs(tmp_path: Path) -> None:
    code = ("import os,sys; print('sid', os.getsid(0), flush=True); "
            "print('stdin', os.readlink('/proc/self/fd/0'), flush=True); "
            "print('err', file=sys.stderr, flush=True)")
    run_dir = tmp_path / "run"
    proc = launch([sys.executable, "-c", code], run_dir)
    assert proc.wait(timeout=20) == 0
    text = (run_dir / "engine.log").read_text()
    assert f"sid {proc.pid}" in text  # its own session: the child leads it
    assert os.getsid(0) != proc.pid
    assert "stdin /dev/null" in text and "err" in text


def test_cli_bad_input_exits_2(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    for args in (["attach", str(tmp_path / "nope")], [str(tmp_path / "none.json")],
                 ["ckpt", str(tmp_path / "nothing")]):
        r = subprocess.run([sys.executable, "-m", "andrea_tui.cli", *args], env=env,
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr
