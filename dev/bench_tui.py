#!/usr/bin/env python3
"""Benchmark the dashboard: first frame on a big run, follow latency, CPU use.

  .venv/bin/python dev/bench_tui.py [--records 200000] [--follow-s 20] [--rate 10]

1. Attach to a run directory with N loss.jsonl records: time from starting the app to the
   first full frame (every panel and both charts drawn, showing the last step), and to the
   whole history being loaded.
2. A loss file of N records swapped in under an attached app (a run directory replaced): how
   late the UI loop runs a callback due every 10 ms while the history reloads in its worker
   (p95 and max: what a key press waits at most), and how long the reload takes.
3. A writer appends records at RATE steps/s while the app (a separate headless process) follows
   it: latency from each append to the first frame showing that step (p50/p95/max), and the
   app process's CPU time over the follow period as a share of one core.
4. The engine's monitoring cost, on this CPU: one telemetry sample (engine.run.telemetry: /proc
   reads, plus NVML where there are GPUs), as a share of a core at its 5 s interval; and the
   alert detectors' work per step (engine.run.alerts.AlertMonitor.observe, on the loop's thread).
Headless means Textual renders every frame but writes no terminal output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fakerun import loss_record, write_run  # noqa: E402
from tests.procs import cpu_seconds  # noqa: E402

CHILD = r"""
import sys, time, json
from pathlib import Path
from andrea_tui.app import AndreaApp
out = open(sys.argv[2], "w", buffering=1)
def frame(step):
    out.write(json.dumps([step, time.time(), app.history_loaded]) + "\n")
app = AndreaApp(Path(sys.argv[1]), on_frame=frame)
app.run(headless=True, size=(140, 45))
"""


def first_frame(run_dir: Path, n: int) -> tuple[float, float]:
    from andrea_tui.app import AndreaApp

    t0 = time.perf_counter()
    seen: dict[str, float] = {}

    def on_frame(step: int | None) -> None:
        if step == n and "first" not in seen:
            seen["first"] = time.perf_counter() - t0

    async def go() -> None:
        app = AndreaApp(run_dir, on_frame=on_frame, follow=False)
        async with app.run_test(size=(140, 45)) as pilot:
            while "first" not in seen or not app.history_loaded:
                await pilot.pause(0.01)
            seen["history"] = time.perf_counter() - t0
            await pilot.pause()

    asyncio.run(go())
    return seen["first"], seen["history"]


def swap_lag(run_dir: Path, n: int) -> dict[str, float]:
    """Attach to `run_dir`, swap in a loss file of `n` records, and measure the UI loop's lag
    until the whole new history is shown."""
    from andrea_tui.app import AndreaApp

    big = run_dir.parent / "swap.jsonl"
    write_run(run_dir.parent / "swap-src", n, status="finished")
    os.replace(run_dir.parent / "swap-src" / "loss.jsonl", big)
    lags: list[float] = []
    out: dict[str, float] = {}

    async def probe(stop: asyncio.Event) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - t0 - 0.01)

    async def go() -> None:
        app = AndreaApp(run_dir, follow=False)
        async with app.run_test(size=(140, 45)) as pilot:
            while not app.history_loaded:
                await pilot.pause(0.01)
            stop = asyncio.Event()
            task = asyncio.create_task(probe(stop))
            t0 = time.perf_counter()
            os.replace(big, run_dir / "loss.jsonl")
            app.pacer.poll_all()
            while app.state.series.n != n:
                await pilot.pause(0.01)
            out["reload"] = time.perf_counter() - t0
            stop.set()
            await task

    asyncio.run(go())
    lags.sort()
    out["p95"] = lags[int(0.95 * (len(lags) - 1))]
    out["max"] = lags[-1]
    return out


def follow(run_dir: Path, start: int, rate: float, seconds: float) -> dict[str, float]:
    frames = run_dir.parent / "frames.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir), str(frames)], env=env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=open(run_dir.parent / "child.err", "w"))
    try:
        # Wait for the whole history to be loaded and on screen before following.
        deadline = time.time() + 120
        while time.time() < deadline:
            if frames.exists() and any(json.loads(x)[2] for x in
                                       frames.read_text().splitlines()[-5:]):
                break
            time.sleep(0.1)
        time.sleep(1.0)
        appended: dict[int, float] = {}
        cpu0, wall0 = cpu_seconds(child.pid), time.monotonic()
        with open(run_dir / "loss.jsonl", "ab", buffering=0) as f:
            step = start
            next_t = time.monotonic()
            while time.monotonic() - wall0 < seconds:
                step += 1
                now = time.time()
                f.write((json.dumps(loss_record(step, now)) + "\n").encode())
                appended[step] = now
                next_t += 1.0 / rate
                time.sleep(max(0.0, next_t - time.monotonic()))
        time.sleep(1.0)
        cpu = (cpu_seconds(child.pid) - cpu0) / (time.monotonic() - wall0)
    finally:
        child.terminate()
        child.wait(timeout=20)
    shown: list[tuple[int, float]] = [tuple(json.loads(x)[:2]) for x in frames.read_text().splitlines()
                                      if x.strip()]
    lat = []
    for s, t_app in sorted(appended.items()):
        t_show = next((t for st, t in shown if st is not None and st >= s and t >= t_app), None)
        if t_show is not None:
            lat.append(t_show - t_app)
    lat.sort()
    missing = len(appended) - len(lat)

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else float("nan")

    return {"appended": len(appended), "missing": missing, "p50": pct(0.5), "p95": pct(0.95),
            "max": lat[-1] if lat else float("nan"), "cpu": cpu}


def engine_monitoring(n: int = 500) -> dict[str, float]:
    from engine import records as rec
    from engine.run.alerts import AlertMonitor
    from engine.run.telemetry import SAMPLE_EVERY_S, SystemSampler

    sampler = SystemSampler(lambda r: None, lambda: 0, gpus=[])
    sampler.sample()
    t0 = time.perf_counter()
    for _ in range(n):
        sampler.sample()
    per_sample = (time.perf_counter() - t0) / n
    monitor = AlertMonitor()
    recs = [rec.StepRecord.from_json(loss_record(s, float(s))) for s in range(1, n + 1)]
    t0 = time.perf_counter()
    for r in recs:
        monitor.observe(r)
    per_step = (time.perf_counter() - t0) / n
    return {"sample": per_sample, "share": per_sample / SAMPLE_EVERY_S, "observe": per_step,
            "every": SAMPLE_EVERY_S}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--follow-s", type=float, default=20.0)
    p.add_argument("--rate", type=float, default=10.0)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        write_run(run_dir, a.records, status="running", max_steps=10 * a.records)
        size = (run_dir / "loss.jsonl").stat().st_size
        first, history = first_frame(run_dir, a.records)
        swap_dir = Path(tmp) / "swap" / "run"
        write_run(swap_dir, 200, status="finished", max_steps=a.records)
        swap = swap_lag(swap_dir, a.records)
        fol = follow(run_dir, a.records, a.rate, a.follow_s)
    mon = engine_monitoring()
    rows = [
        ("loss.jsonl", f"{a.records:,} records, {size / 1e6:.1f} MB", ""),
        ("first full frame (attach)", f"{first * 1000:.0f} ms", "< 1 s"),
        ("whole history loaded", f"{history * 1000:.0f} ms", ""),
        (f"loss file of {a.records:,} records swapped in: reloaded", f"{swap['reload'] * 1000:.0f} ms",
         ""),
        ("UI loop lag meanwhile, p95", f"{swap['p95'] * 1000:.0f} ms", "< 250 ms"),
        ("UI loop lag meanwhile, max", f"{swap['max'] * 1000:.0f} ms", ""),
        (f"follow {a.rate:g} steps/s for {a.follow_s:g} s",
         f"{fol['appended']} appended, {fol['missing']} never shown", ""),
        ("append-to-screen latency p50", f"{fol['p50'] * 1000:.0f} ms", ""),
        ("append-to-screen latency p95", f"{fol['p95'] * 1000:.0f} ms", "< 250 ms"),
        ("append-to-screen latency max", f"{fol['max'] * 1000:.0f} ms", ""),
        ("TUI CPU while following", f"{fol['cpu'] * 100:.1f}% of a core", "< 5%"),
        ("engine: one telemetry sample (CPU)", f"{mon['sample'] * 1e6:.0f} µs", ""),
        (f"engine: telemetry every {mon['every']:g} s", f"{mon['share'] * 100:.4f}% of a core",
         ""),
        ("engine: alert checks per step", f"{mon['observe'] * 1e6:.0f} µs", ""),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"| {'measure':<{w0}} | {'value':<{w1}} | goal     |")
    print(f"|{'-' * (w0 + 2)}|{'-' * (w1 + 2)}|----------|")
    for name, val, goal in rows:
        print(f"| {name:<{w0}} | {val:<{w1}} | {goal:<8} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
