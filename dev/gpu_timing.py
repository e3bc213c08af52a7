"""How dev/bench_gpu.py times a training step on the GPU: each implementation's step as a
callable, its device clock (CUDA events on its own stream), the GPU's energy counter read in a
thread, and the two timed loops, rounds after an untimed lead and long runs back to back.
tests/test_bench_gpu.py checks what they queue, wait for and measure on fakes, without a GPU.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model.optim import clip_scale

# the optimizer step every implementation takes (PyTorch's AdamW gets the same values)
STEP_HP = {"loss_scale": 1.0, "grad_mult": 1.0, "lr": 3e-4, "beta1": 0.9, "beta2": 0.95,
           "eps": 1e-8, "weight_decay": 0.1, "max_norm": 1.0}


def andrea_step(bk: Any) -> Callable[..., None]:
    """One optimizer step as the trainer runs it: the one-graph step when the backend has it
    (given `nxt`, the next step is queued behind it before it is waited for, as andrea-train
    queues it: the device never waits for the host), else zero_grads / forward_backward /
    grad_norm / clip / adamw from the host."""
    hp = STEP_HP

    def step(tok: np.ndarray, t: int, nxt: np.ndarray | None = None) -> None:
        x, y = tok[:, :-1], tok[:, 1:]
        if bk.fused_step:
            if bk.queued_steps == 0:
                bk.launch_step(x, y, t=t, **hp)
            if nxt is not None:
                bk.launch_step(nxt[:, :-1], nxt[:, 1:], t=t + 1, **hp)
            bk.step_result()
            return
        bk.zero_grads()
        bk.forward_backward(x, y)
        norm = bk.grad_norm()
        sc = clip_scale(norm, hp["max_norm"])
        if sc < 1.0:
            bk.grad_scale(sc)
        bk.adamw(hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"], t)
        bk.synchronize()

    return step


@dataclass
class Clock:
    """Device time on one implementation's stream: mark() records an event there now,
    elapsed(a, b) is the ms between two marks once both ran, finish() waits for all queued
    work."""

    mark: Callable[[], Any]
    elapsed: Callable[[Any, Any], float]
    finish: Callable[[], None]


def andrea_clock(bk: Any) -> Clock:
    def mark() -> Any:
        e = bk.drv.Event()
        e.record(bk.stream)
        return e

    def finish() -> None:
        while bk.fused_step and bk.queued_steps:
            bk.step_result()
        bk.synchronize()

    return Clock(mark, lambda a, b: b.time_since(a), finish)


class EnergyMeter:
    """A GPU's total-energy counter (engine.run.telemetry.Nvml.energy_mj: millijoules, moving
    about every 100 ms on the H200), read every `every_s` in a thread:
    `watts(t0, t1)` is the average power between its first and last change inside [t0, t1]
    (time.perf_counter seconds), None when fewer than three changes fall inside (under about
    0.2 s). At the power limit a step's time is its energy over the limit, so the joules per
    step say what a faster step would have to save."""

    def __init__(self, read: Callable[[], int | None], every_s: float = 0.002,
                 on_close: Callable[[], None] | None = None) -> None:
        import threading

        self.read, self.every_s, self.on_close = read, every_s, on_close
        self.points: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="energy", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, index: int = 0) -> EnergyMeter | None:
        """GPU `index`'s meter, or None without NVML (the `nvml` extra) or the counter."""
        from engine.run.telemetry import Nvml

        nvml = Nvml.open([index])
        if nvml is None:
            return None
        if nvml.energy_mj() is None:
            nvml.close()
            return None
        return cls(nvml.energy_mj, on_close=nvml.close)

    def _run(self) -> None:
        last = None
        while not self._stop.is_set():
            e = self.read()
            if e is None:  # the counter went away: no more points
                return
            if e != last:
                self.points.append((time.perf_counter(), e))
                last = e
            self._stop.wait(self.every_s)

    def watts(self, t0: float, t1: float) -> float | None:
        inside = [p for p in self.points if t0 <= p[0] <= t1]
        if len(inside) < 3 or inside[-1][0] <= inside[0][0]:
            return None
        (ta, ea), (tb, eb) = inside[0], inside[-1]
        return (eb - ea) / 1e3 / (tb - ta)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.on_close is not None:
            self.on_close()


def sustained_ms(step: Callable[[int], None], clock: Clock, n: int) -> list[float]:
    """n steps back to back, as a training run takes them (step(i) queues step i and returns
    when the implementation lets the host go on), and each step's device time: the interval
    between the marks recorded on the stream after each step was queued, so a gap in which the
    GPU waits for the host counts too."""
    marks = [clock.mark()]
    for i in range(n):
        step(i)
        marks.append(clock.mark())
    clock.finish()
    return [clock.elapsed(a, b) for a, b in itertools.pairwise(marks)]


def andrea_queued(bk: Any, toks: list[np.ndarray], t0: int) -> Callable[[int], None]:
    """andrea-train's loop: step i is staged and queued, then the host waits for the step
    before it (two steps in flight)."""

    def step(i: int) -> None:
        tok = toks[(t0 + i) % len(toks)]
        bk.launch_step(tok[:, :-1], tok[:, 1:], t=t0 + i, **STEP_HP)
        if bk.queued_steps > 1:
            bk.step_result()

    return step


def gpu_step_ms(bk: Any, toks: list[np.ndarray], t0: int, n: int = 20) -> float:
    """Median device time of the one-graph step (CUDA events around the queued step: its
    copies and graph, not the host's staging before it)."""
    drv = bk.drv
    e0, e1 = drv.Event(), drv.Event()
    times = []
    for i in range(n):
        tok = toks[i % len(toks)]
        bk.prepare_step(tok[:, :-1], tok[:, 1:])
        e0.record(bk.stream)
        bk.launch_step(None, None, t=t0 + i, **STEP_HP)
        e1.record(bk.stream)
        bk.step_result()
        times.append(e1.time_since(e0))
    return statistics.median(times)


def bench_sustained(key: str, impls: dict[str, tuple[Callable[..., None], Any]],
                    clocks: dict[str, Clock], toks: list[np.ndarray], t_counter: dict[str, int],
                    n: int, meter: EnergyMeter | None = None) -> dict[str, dict[str, Any]]:
    """The engine (one-graph step) and each PyTorch mode for n steps back to back, twice, in
    turn (the second pass in reverse order): the median step of all but the first third of
    each run (steps 101..300 of 300, about andrea-train's median of steps 100..300), which is
    where a long run holds the GPU at its power limit while short rounds may not. With a
    meter, each run's average power over the same part ("W", the median of the two runs) and
    the energy of a median step ("J" = W x ms). A run that fails is reported as
    {"failed": why} and not run again; the others go on."""
    names = [n_ for n_ in impls if n_ == "andrea" or n_.startswith("torch")]
    names = [n_ for n_ in names if not (n_ == "andrea" and not impls[n_][1].fused_step)]
    skip = n // 3
    times: dict[str, list[float]] = {n_: [] for n_ in names}
    watts: dict[str, list[float]] = {n_: [] for n_ in names}
    failed: dict[str, str] = {}
    for order in (names, names[::-1]):
        for name in order:
            if name in failed:
                continue
            step, obj = impls[name]
            t0 = t_counter[name] + 1
            t_counter[name] += n
            if name == "andrea":
                one = andrea_queued(obj, toks, t0)
            else:
                def one(i: int, step: Callable[..., None] = step, t0: int = t0) -> None:
                    step(toks[(t0 + i) % len(toks)], t0 + i)
            try:
                clocks[name].finish()
                t0 = time.perf_counter()
                times[name] += sustained_ms(one, clocks[name], n)[skip:]
                t1 = time.perf_counter()
                w = meter.watts(t0 + (t1 - t0) * skip / n, t1) if meter is not None else None
                if w is not None:
                    watts[name].append(w)
            except Exception as e:
                failed[name] = f"failed: {type(e).__name__}: {e}"[:120]
                print(f"  {key} sustained {name}: {failed[name]}", flush=True)
    out: dict[str, dict[str, Any]] = {name: {"failed": why} for name, why in failed.items()}
    for name, t in times.items():
        if name in failed:
            continue
        t = sorted(t)
        out[name] = {"ms": statistics.median(t), "p10": t[len(t) // 10],
                     "p90": t[9 * len(t) // 10], "steps": len(t)}
        energy = ""
        if watts[name]:
            w = statistics.median(watts[name])
            out[name].update(W=w, J=w * out[name]["ms"] / 1e3)
            energy = f"; {w:.0f} W, {out[name]['J']:.2f} J a step"
        print(f"  {key} sustained {name}: median {out[name]['ms']:.2f} ms (p10 "
              f"{out[name]['p10']:.2f}, p90 {out[name]['p90']:.2f}; steps {skip + 1}..{n} of two"
              f" runs of {n}{energy})", flush=True)
    return out


def play(name: str, step: Callable[..., None], toks: list[np.ndarray],
         t_counter: dict[str, int], n: int) -> None:
    """n steps of one implementation back to back, continuing its step count (the engine's with
    the next batch queued behind each, as andrea-train queues it; the last one queues none)."""
    for i in range(n):
        t_counter[name] += 1
        c = t_counter[name]
        ahead = ((toks[(c + 1) % len(toks)],) if name.startswith("andrea") and i + 1 < n
                 else ())
        step(toks[c % len(toks)], c, *ahead)


def timed_round(name: str, step: Callable[..., None], clock: Clock, toks: list[np.ndarray],
                t_counter: dict[str, int], steps: int, lead_s: float,
                now: Callable[[], float] = time.perf_counter) -> float:
    """One round of one implementation: at least lead_s seconds of its own steps, untimed, then
    `steps` steps timed from the first one's start to the last one's end; seconds a step.

    The lead puts the GPU at this implementation's own load before it is timed. Without it a
    round inherits the power limiter's state from the round before it (on an H200 without a
    lead: the engine's first 120M round, after an idle spell, 11.36 ms and its next two, after
    PyTorch's rounds, 11.88 and 12.01; PyTorch reduce-overhead's rounds, after torch.compile's,
    14.26–14.35 ms, against 14.61 in its 300-step runs)."""
    clock.finish()
    end = now() + lead_s
    while now() < end:
        play(name, step, toks, t_counter, steps)
    clock.finish()
    t0 = now()
    play(name, step, toks, t_counter, steps)
    clock.finish()
    return (now() - t0) / steps
