"""Synthetic run directories and a stand-in engine, for the TUI's tests and benchmark.

`write_run()` writes a complete run directory (DESIGN §7 records) with deterministic values.
`python -m tests.fakerun RUN_DIR [--rate HZ] [--steps N]` behaves like andrea-train towards
a controller: holds engine.lock, writes engine.json with its real identity, appends one loss
record per tick, writes a `snapshot` checkpoint event on SIGUSR1 and on SIGTERM a `stop`
checkpoint event, a stop event and status "stopped", then exits 0. It trains nothing. Like the
engine it writes system.jsonl (each second), eval.jsonl (every 10 steps) and raises alerts
through the engine's own detectors (engine.run.alerts): `--spike-at S` makes step S's loss and
grad norm jump, `--nan-at S` makes step S non-finite, `--stall-at S --stall-s X` stops for X
seconds after step S (the watchdog, at `--stall-min-s`, raises the stall).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from engine import records as rec
from engine.runfiles import JsonlWriter, RunPaths, write_json_atomic

SOURCES = ("python-reference", "stdlib-docstrings", "stdlib-code")
PHASE_LEN = 14

CONFIG = {
    "name": "ANDREA-fake",
    "model": {"n_layer": 2, "d_model": 64, "n_head": 2, "d_ff": 256, "vocab_size": 8449,
              "seq_len": 64},
    "train": {"batch_size": 4, "grad_accum": 1, "max_steps": 2000, "precision": "fp32",
              "seed": 1},
    "optim": {"lr": 1e-3, "warmup_steps": 10, "min_lr_frac": 0.1, "betas": [0.9, 0.95],
              "eps": 1e-8, "weight_decay": 0.1, "max_grad_norm": 1.0},
    "data": {"dir": "/nonexistent/fake-data",
             "tokenizer": {"path": "tokenizer.json", "vocab_size": 8449, "train_bytes": 1024},
             "sources": [{"name": s, "builtin": s} for s in SOURCES]},
    "bandit": {"phase_lengths": [PHASE_LEN], "eta": 0.5, "floor": 0.05, "seed": 1},
    "checkpoint": {"every": 100, "keep": 3},
    "samples": {"every_steps": 50, "prompts": ["def "], "length": 8, "top_k": 40,
                "temperature": 0.9},
}
TOKENS_PER_STEP = 256


def loss_record(step: int, t: float) -> dict[str, Any]:
    """A deterministic loss.jsonl record for `step` (every 97th step is a skipped one), as the
    JSON object the engine writes (engine.records.StepRecord.to_json)."""
    phase = step // PHASE_LEN
    skipped = step % 97 == 96
    grad = 0.6 + 0.8 * abs(math.sin(step * 0.37))
    loss = 9.0 * math.exp(-step / 400.0) + 2.0 + 0.1 * math.sin(step * 0.9)
    w = [0.2 + 0.1 * ((phase + i) % 3) for i in range(3)]
    tot = sum(w)
    return rec.StepRecord(
        step=step, loss=math.nan if skipped else round(loss, 6),
        grad_norm=math.inf if skipped else round(grad, 6),
        clip_scale=round(min(1.0, 1.0 / grad), 6), lr=1e-3, tokens=step * TOKENS_PER_STEP,
        tok_s=5120.0, step_ms=50.0, phase=phase, phase_step=step % PHASE_LEN + 1,
        phase_len=PHASE_LEN,
        weights={s: round(x / tot, 4) for s, x in zip(SOURCES, w, strict=True)},
        src_loss={s: round(loss + 0.1 * i, 4) for i, s in enumerate(SOURCES)},
        skipped=skipped, t=t).to_json()


def eval_record(step: int, t: float) -> dict[str, Any]:
    """A deterministic eval.jsonl record for `step` (a little above the training loss)."""
    base = 9.0 * math.exp(-step / 400.0) + 2.15
    return rec.EvalRecord(step=step, t=t, val_loss=round(base + 0.1, 6), src_val_loss={
        s: round(base + 0.1 * i, 4) for i, s in enumerate(SOURCES)}).to_json()


def system_record(step: int, t: float) -> dict[str, Any]:
    return rec.SystemRecord(t=t, step=step, cpu_pct=97.5, rss_bytes=412 << 20).to_json()


def write_run(run_dir: Path, n_steps: int, *, t0: float = 1_700_000_000.0, dt: float = 0.1,
              status: str = "finished", max_steps: int = 2000,
              monitor: bool = False) -> RunPaths:
    """A complete run directory with `n_steps` steps, as an engine would leave it; `monitor`
    adds validation records (every 100 steps), a telemetry sample and two alerts."""
    paths = RunPaths(Path(run_dir))
    paths.root.mkdir(parents=True, exist_ok=True)
    cfg = {**CONFIG, "train": {**CONFIG["train"], "max_steps": max_steps}}
    write_json_atomic(paths.config, cfg, durable=False)
    with open(paths.loss, "w") as f:
        for s in range(1, n_steps + 1):
            f.write(json.dumps(loss_record(s, t0 + s * dt), separators=(",", ":")) + "\n")
    ev = JsonlWriter(paths.events)
    ev.write(rec.StartEvent(t=t0, pid=4242, argv=["andrea-train"], name=cfg["name"],
                            backend="numpy", device="cpu", run_id="fake").to_json())
    ev.write(rec.ReadyEvent(t=t0, memory_plan={
        "weights": 4 << 20, "grads": 4 << 20, "adam_m": 4 << 20, "adam_v": 4 << 20,
        "activations": 12 << 20, "scratch": 1 << 20, "total": 29 << 20},
        n_params=1048576, backend="numpy", device="cpu", step=0, max_steps=max_steps,
        tokens_per_step=TOKENS_PER_STEP).to_json())
    for s in range(100, n_steps + 1, 100):
        ev.write(rec.CheckpointEvent(t=t0 + s * dt, step=s, reason="periodic",
                                     path=str(paths.checkpoints / f"step_{s:08d}"),
                                     bytes=12_582_920, seconds=0.25).to_json())
    if monitor:
        for s, kind, value in ((n_steps // 3, "loss_spike", 7.5), (n_steps // 2, "grad_spike", 9.0)):
            ev.write(rec.AlertEvent(t=t0 + s * dt, alert=kind, step=s, value=value, baseline=2.5,
                                    threshold=3.0, message=f"{kind} at step {s}").to_json())
        with open(paths.eval, "w") as f:
            for s in range(100, n_steps + 1, 100):
                f.write(json.dumps(eval_record(s, t0 + s * dt)) + "\n")
        with open(paths.system, "w") as f:
            f.write(json.dumps(system_record(n_steps, t0 + n_steps * dt)) + "\n")
    ev.close()
    smp = JsonlWriter(paths.samples)
    for s in range(50, n_steps + 1, 50):
        smp.write(rec.Sample(step=s, t=t0 + s * dt, prompt="def ",
                             text=f"def f{s}(x):\n    return x + {s}").to_json())
    smp.close()
    with open(paths.log, "w") as f:
        for s in range(0, n_steps + 1, max(1, n_steps // 5)):
            f.write(f"12:00:{s % 60:02d} step {s} loss ok\n")
    write_json_atomic(paths.state, rec.RunStatus(
        rec.Status(status), step=n_steps, max_steps=max_steps, backend="numpy", device="cpu",
        pid=4242, updated=t0 + n_steps * dt).to_json(), durable=False)
    return paths


class FakeEngine:
    """The control-facing behaviour of andrea-train, with no training."""

    def __init__(self, run_dir: Path, rate: float, steps: int, start: int,
                 spike_at: int = -1, nan_at: int = -1, stall_at: int = -1, stall_s: float = 0.0,
                 stall_min_s: float = 1.0) -> None:
        from engine.run.identity import EngineLock

        self.spike_at, self.nan_at, self.stall_at, self.stall_s = spike_at, nan_at, stall_at, stall_s
        self.stall_min_s = stall_min_s
        self.paths = RunPaths(Path(run_dir))
        self.paths.root.mkdir(parents=True, exist_ok=True)
        self.rate, self.steps, self.step = rate, steps, start
        self.usr1 = 0
        self.stop = False
        signal.signal(signal.SIGUSR1, self._on_usr1)
        signal.signal(signal.SIGTERM, self._on_term)
        self.lock = EngineLock().acquire(self.paths.root)

    def _on_usr1(self, *_: object) -> None:
        self.usr1 += 1

    def _on_term(self, *_: object) -> None:
        self.stop = True

    def _status(self, status: rec.Status, last: rec.CheckpointRef | None = None) -> None:
        write_json_atomic(self.paths.state, rec.RunStatus(
            status, step=self.step, max_steps=self.steps, backend="numpy", device="cpu",
            pid=os.getpid(), last_checkpoint=last, updated=time.time()).to_json(), durable=False)

    def _checkpoint(self, ev: JsonlWriter, reason: str) -> rec.CheckpointRef:
        path = self.paths.checkpoints / f"step_{self.step:08d}"
        path.mkdir(parents=True, exist_ok=True)
        (path / "fake").write_text(reason)
        ev.write(rec.CheckpointEvent(t=time.time(), step=self.step, reason=reason,
                                     path=str(path), bytes=4, seconds=0.01).to_json())
        return rec.CheckpointRef(str(path), self.step, reason)

    def run(self) -> int:
        from engine.run.identity import write_engine_json

        if not self.paths.config.exists():
            write_json_atomic(self.paths.config, CONFIG, durable=False)
        write_engine_json(self.paths.root, sys.argv, "fake")
        ev, loss = JsonlWriter(self.paths.events), JsonlWriter(self.paths.loss)
        ev.write(rec.StartEvent(t=time.time(), pid=os.getpid(), argv=sys.argv,
                                name=CONFIG["name"], backend="numpy", device="cpu",
                                run_id="fake").to_json())
        self._status(rec.Status.RUNNING)
        last = None
        from engine.run.alerts import AlertMonitor, AlertSink, Watchdog

        sink = AlertSink(lambda a: ev.write(a.to_json()), lambda m: None)
        monitor = AlertMonitor()
        watchdog = Watchdog(sink.emit, factor=5, min_s=self.stall_min_s, poll_s=0.1)
        watchdog.start()
        evals, system = JsonlWriter(self.paths.eval), JsonlWriter(self.paths.system)
        sampled = 0.0
        while not self.stop and self.step < self.steps:
            time.sleep(1.0 / self.rate)
            self.step += 1
            obj = loss_record(self.step, time.time())
            if self.step == self.spike_at:
                obj.update(loss=obj["loss"] * 4, grad_norm=obj["grad_norm"] * 30, skipped=False)
            if self.step == self.nan_at:
                obj.update(loss=math.nan, grad_norm=math.inf, skipped=True)
            elif obj["skipped"] and self.nan_at >= 0:
                obj.update(loss=obj["loss"] if math.isfinite(obj["loss"]) else 3.0,
                           grad_norm=1.0, skipped=False)  # only the asked-for NaN
            loss.write(obj)
            for alert in monitor.observe(rec.StepRecord.from_json(obj)):  # type: ignore[arg-type]
                sink.emit(alert)
            watchdog.beat(self.step, 1.0 / self.rate)
            if self.step % 10 == 0:
                evals.write(eval_record(self.step, time.time()))
            if time.time() - sampled >= 1.0:
                sampled = time.time()
                system.write(system_record(self.step, sampled))
            if self.step == self.stall_at:
                time.sleep(self.stall_s)
            if self.usr1:
                ev.write(rec.SignalEvent(t=time.time(), signal="SIGUSR1", step=self.step,
                                         action="snapshot", count=self.usr1).to_json())
                self.usr1 = 0
                last = self._checkpoint(ev, "snapshot")
            self._status(rec.Status.RUNNING, last)
        watchdog.stop()
        if self.stop:
            ev.write(rec.SignalEvent(t=time.time(), signal="SIGTERM", step=self.step,
                                     action="stop").to_json())
            last = self._checkpoint(ev, "stop")
            ev.write(rec.StopEvent(t=time.time(), step=self.step, status="stopped").to_json())
            self._status(rec.Status.STOPPED, last)
        else:
            ev.write(rec.FinishedEvent(t=time.time(), step=self.step,
                                       status="finished").to_json())
            self._status(rec.Status.FINISHED, last)
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fakerun")
    p.add_argument("run_dir")
    p.add_argument("--rate", type=float, default=20.0, help="steps per second")
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--spike-at", type=int, default=-1)
    p.add_argument("--nan-at", type=int, default=-1)
    p.add_argument("--stall-at", type=int, default=-1)
    p.add_argument("--stall-s", type=float, default=0.0)
    p.add_argument("--stall-min-s", type=float, default=1.0)
    a = p.parse_args(argv)
    return FakeEngine(Path(a.run_dir), a.rate, a.steps, a.start, a.spike_at, a.nan_at,
                      a.stall_at, a.stall_s, a.stall_min_s).run()


if __name__ == "__main__":
    raise SystemExit(main())
