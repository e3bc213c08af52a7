"""The GPU benchmark's timing loops (dev/gpu_timing.py, run by dev/bench_gpu.py and so by
`make gpu-check`) on fakes: what they queue, wait for and measure, without a GPU (the times
themselves are the benchmark's, never a test's); its PyTorch variants' names and its command
line's errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT, dev_module


def _timing():
    return dev_module("gpu_timing")


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
        self.tokens: list[int] = []  # the first token of each launched step's batch
        stream = self.stream

        class Drv:
            @staticmethod
            def Event() -> FakeEvent:  # pycuda's name
                return FakeEvent(stream.work)

        self.drv = Drv

    def launch_step(self, x: np.ndarray, y: np.ndarray, *, t: int, **hp: float) -> None:
        assert len(self.queued) < 2, "CudaBackend refuses a third queued step"
        self.stream.work.append(f"step {t}")
        self.queued.append(t)
        self.tokens.append(int(x[0, 0]))
        self.most_queued = max(self.most_queued, len(self.queued))

    @property
    def queued_steps(self) -> int:
        return len(self.queued)

    def step_result(self) -> None:
        self.results.append(self.queued.pop(0))

    def synchronize(self) -> None:
        pass


def batches(n: int) -> list[np.ndarray]:
    """n batches told apart by their values: batch k is all k."""
    return [np.full((2, 5), k, np.int32) for k in range(n)]


def test_sustained_engine_steps_are_queued_two_deep_and_timed_one_by_one():
    b = _timing()
    bk = FakeBackend()
    toks = batches(3)
    times = b.sustained_ms(b.andrea_queued(bk, toks, t0=7), b.andrea_clock(bk), 6)
    assert times == [1.0] * 6  # one step between consecutive marks
    assert bk.most_queued == 2 and bk.queued == []  # two in flight; every result taken
    assert bk.results == list(range(7, 13))
    assert bk.tokens == [t % 3 for t in range(7, 13)]  # step t trains on batch t
    steps = [w for w in bk.stream.work if w != "mark"]
    assert steps == [f"step {t}" for t in range(7, 13)]


def test_sustained_marks_follow_each_step():
    b = _timing()
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


def test_rounds_and_long_runs_take_each_step_once_in_order():
    """The rounds' step function (the next batch queued ahead) and bench_sustained's two passes
    leave nothing queued, and the engine's Adam steps t run 1, 2, 3, ... with batch t each."""
    b = _timing()
    bk = FakeBackend()
    toks = batches(4)
    step = b.andrea_step(bk)
    rounds = {"andrea": 0}
    for _ in range(2):  # two rounds of 5 steps, as bench_model's timed_round plays them
        b.play("andrea", step, toks, rounds, 5)
        assert bk.queued == []
    t = rounds["andrea"]
    torch_steps: list[int] = []
    log: list[str] = []
    tstream = FakeStream()
    tstream.work = log

    def torch_like(tok: np.ndarray, t: int) -> None:
        log.append(f"step {t}")
        torch_steps.append(t)

    def mark() -> FakeEvent:
        e = FakeEvent(log)
        e.record(tstream)
        return e

    clocks = {"andrea": b.andrea_clock(bk),
              "torch x": b.Clock(mark, lambda a, e: e.time_since(a), lambda: None)}
    counter = {"andrea": t, "torch x": 100}
    out = b.bench_sustained("T", {"andrea": (step, bk), "torch x": (torch_like, None)}, clocks,
                            toks, counter, 9)
    assert bk.queued == [] and bk.most_queued == 2
    assert [s for s in bk.stream.work if s != "mark"] == [f"step {i}" for i in range(1, 29)]
    assert bk.tokens == [i % 4 for i in range(1, 29)]
    assert torch_steps == list(range(101, 119)) and counter == {"andrea": 28, "torch x": 118}
    for name in ("andrea", "torch x"):  # steps 4..9 of each of the two runs
        assert out[name]["steps"] == 12 and out[name]["ms"] == 1.0


def test_a_round_is_timed_after_its_own_untimed_lead():
    """timed_round runs the implementation's own steps for at least lead_s (whole rounds of
    them, the step count going on), waits for them, and only then times `steps` steps; the
    engine's next batch is queued behind each step and nothing is left queued."""
    b = _timing()
    bk = FakeBackend()
    toks = batches(4)
    step = b.andrea_step(bk)
    t = [0.0]
    waits: list[int] = []  # the steps launched when the clock waited for all queued work

    def now() -> float:  # each reading of the clock one tenth of a second later
        t[0] += 0.1
        return t[0]

    def finish() -> None:  # waiting for the queued work takes a second
        waits.append(len([w for w in bk.stream.work if w != "mark"]))
        t[0] += 1.0

    clock = b.Clock(lambda: None, lambda a, e: 0.0, finish)
    counter = {"andrea": 0}
    per_step = b.timed_round("andrea", step, clock, toks, counter, 5, lead_s=0.25, now=now)
    # end = 1.1 + 0.25; readings 1.2 and 1.3 are before it, 1.4 is not: two lead rounds
    assert waits == [0, 10, 15] and counter == {"andrea": 15}
    assert [w for w in bk.stream.work if w != "mark"] == [f"step {i}" for i in range(1, 16)]
    assert bk.tokens == [i % 4 for i in range(1, 16)] and bk.queued == []
    assert bk.most_queued == 2  # the next batch queued behind each step
    # the timed steps from the clock's reading after the lead's wait to the one after theirs
    assert per_step == pytest.approx(1.1 / 5)
    no_lead = b.timed_round("andrea", step, clock, toks, counter, 5, lead_s=0.0, now=now)
    assert counter == {"andrea": 20} and waits[-3:] == [15, 15, 20]
    assert no_lead == pytest.approx(1.1 / 5)


def test_energy_meter_averages_power_between_counter_changes():
    """watts() takes the counter's first and last change inside the window (the counter moves
    in steps, so the window's own ends would cut a step in two), and says None when too few
    changes fall inside."""
    b = _timing()
    m = b.EnergyMeter(lambda: 0, every_s=0.001)
    m.close()
    m.points = [(0.95, 900), (1.0, 1000), (1.1, 71000), (1.2, 141000), (1.3, 211000),
                (1.35, 246000)]
    assert m.watts(1.0, 1.3) == pytest.approx(700.0)  # 210 J over 0.3 s
    assert m.watts(0.99, 1.31) == pytest.approx(700.0)
    assert m.watts(1.05, 1.25) is None  # two changes inside


def test_energy_meter_reads_in_a_thread_until_closed():
    b = _timing()
    import time

    count = [0]

    def read() -> int:
        count[0] += 1
        return count[0] // 3  # the counter changes every third read

    closed = []
    m = b.EnergyMeter(read, every_s=0.001, on_close=lambda: closed.append(True))
    time.sleep(0.05)
    m.close()
    n = count[0]
    time.sleep(0.01)
    assert count[0] == n and len(m.points) >= 3 and closed == [True]
    assert [e for _, e in m.points] == sorted({e for _, e in m.points})
    gone = b.EnergyMeter(lambda: None, every_s=0.001)  # a counter NVML stops reporting
    gone._thread.join(timeout=1)
    assert not gone._thread.is_alive() and gone.points == []
    gone.close()


def test_energy_meter_opens_through_telemetry_nvml(monkeypatch):
    """EnergyMeter.open reads the counter through engine.run.telemetry.Nvml: None where NVML
    is missing or the GPU does not report the counter (NVML then shut down), else a meter that
    shuts NVML down when closed."""
    from engine.run import telemetry

    b = _timing()
    shut: list[str] = []

    class FakeNvml:
        def __init__(self, energy: int | None) -> None:
            self.energy = energy

        def energy_mj(self) -> int | None:
            return self.energy

        def close(self) -> None:
            shut.append("closed")

    monkeypatch.setattr(telemetry.Nvml, "open", classmethod(lambda cls, idx: None))
    assert b.EnergyMeter.open() is None
    monkeypatch.setattr(telemetry.Nvml, "open", classmethod(lambda cls, idx: FakeNvml(None)))
    assert b.EnergyMeter.open() is None and shut == ["closed"]
    monkeypatch.setattr(telemetry.Nvml, "open", classmethod(lambda cls, idx: FakeNvml(5)))
    m = b.EnergyMeter.open()
    assert m is not None
    m.close()
    assert shut == ["closed", "closed"] and m.points[0][1] == 5


def test_a_long_run_that_fails_is_reported_and_the_others_go_on():
    b = _timing()
    bk = FakeBackend()

    def broken(tok: np.ndarray, t: int) -> None:
        raise RuntimeError("out of memory")

    clocks = {"andrea": b.andrea_clock(bk),
              "torch x": b.Clock(lambda: None, lambda a, e: 0.0, lambda: None)}
    out = b.bench_sustained("T", {"andrea": (b.andrea_step(bk), bk), "torch x": (broken, None)},
                            clocks, batches(2), {"andrea": 0, "torch x": 0}, 6)
    assert out["torch x"] == {"failed": "failed: RuntimeError: out of memory"}
    assert out["andrea"]["steps"] == 8 and bk.queued == []


@pytest.mark.parametrize(("name", "want"), [
    ("reduce-overhead", ("reduce-overhead", True, False, False)),
    ("reduce-overhead-cudnn", ("reduce-overhead", True, True, False)),
    ("compile-sepqkv-cudnn-sync", ("compile", False, True, True)),
    ("eager-sync", ("eager", True, False, True)),
    ("max-autotune-sepqkv", ("max-autotune", False, False, False)),
])
def test_torch_variant_names(name, want):
    v = dev_module("torch_peer").torch_variant(name)
    assert (v.mode, v.fused_qkv, v.cudnn_sdpa, v.sync) == want


@pytest.mark.parametrize("name", ["reduce-overhead-sync-cudnn", "reduce_overhead", "-cudnn",
                                  "compile-cudnn-sepqkv", ""])
def test_a_misspelt_torch_variant_is_refused(name):
    with pytest.raises(ValueError, match="expected one of eager"):
        dev_module("torch_peer").torch_variant(name)


@pytest.mark.parametrize(("args", "says"), [
    (["--steps", "0"], "--steps: expected at least 1, got 0"),
    (["--rounds", "-1"], "--rounds: expected at least 1, got -1"),
    (["--sustained", "2"], "--sustained: expected 0 (none) or at least 3 steps, got 2"),
    (["--lead-s", "-1"], "--lead-s: expected seconds from 0 to 60, got -1.0"),
    (["--lead-s", "nan"], "--lead-s: expected seconds from 0 to 60, got nan"),
    (["--torch", "reduce-overhead,eagre"], "--torch: PyTorch variant 'eagre': expected one of"),
])
def test_bad_arguments_get_one_line_and_exit_status_2(args, says):
    p = subprocess.run([sys.executable, str(ROOT / "dev" / "bench_gpu.py"), *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr
