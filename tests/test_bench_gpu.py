"""The GPU benchmark's timing loops (scripts/bench_gpu.py) on fakes: what they queue, wait for
and measure, without a GPU (the times themselves are the benchmark's, never a test's)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "scripts" / "bench_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = mod
    spec.loader.exec_module(mod)
    return mod


class FakeStream:
    """A device stream as a list of what was queued on it, in order."""

    def __init__(self) -> None:
        self.work: list[str] = []


class FakeEvent:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def record(self, stream: FakeStream) -> None:
        stream.work.append("mark")
        self.at = len(stream.work)

    def time_since(self, other: FakeEvent) -> float:  # one ms per step queued in between
        return float(sum(1 for w in self.log[other.at:self.at] if w.startswith("step")))


class FakeBackend:
    """launch_step / step_result / queued_steps as CudaBackend's one-graph step has them."""

    fused_step = True

    def __init__(self) -> None:
        self.stream = FakeStream()
        self.queued: list[int] = []
        self.most_queued = 0
        self.results: list[int] = []
        stream = self.stream

        class Drv:
            @staticmethod
            def Event() -> FakeEvent:  # pycuda's name
                return FakeEvent(stream.work)

        self.drv = Drv

    def launch_step(self, x: np.ndarray, y: np.ndarray, *, t: int, **hp: float) -> None:
        self.stream.work.append(f"step {t}")
        self.queued.append(t)
        self.most_queued = max(self.most_queued, len(self.queued))

    @property
    def queued_steps(self) -> int:
        return len(self.queued)

    def step_result(self) -> None:
        self.results.append(self.queued.pop(0))

    def synchronize(self) -> None:
        pass


def test_sustained_engine_steps_are_queued_two_deep_and_timed_one_by_one():
    b = _bench()
    bk = FakeBackend()
    toks = [np.zeros((2, 5), np.int32)] * 3
    times = b.sustained_ms(b.andrea_queued(bk, toks, t0=7), b.andrea_clock(bk), 6)
    assert times == [1.0] * 6  # one step between consecutive marks
    assert bk.most_queued == 2 and bk.queued == []  # two in flight; every result taken
    assert bk.results == list(range(7, 13))
    steps = [w for w in bk.stream.work if w != "mark"]
    assert steps == [f"step {t}" for t in range(7, 13)]


def test_sustained_marks_follow_each_step():
    b = _bench()
    log: list[str] = []
    stream = FakeStream()
    stream.work = log

    def mark() -> FakeEvent:
        e = FakeEvent(log)
        e.record(stream)
        return e

    finished = []
    clock = b.Clock(mark, lambda a, e: e.time_since(a), lambda: finished.append(True))
    times = b.sustained_ms(lambda i: log.extend([f"step {i}", f"step {i}b"]), clock, 4)
    assert times == [2.0] * 4 and finished == [True]
