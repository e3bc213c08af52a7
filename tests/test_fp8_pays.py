"""FP8's start-up verdict (engine/backends/cuda/fp8_pays.py) without a GPU: the two paths'
passes timed as the step runs them (each captured once as a CUDA graph and its replays timed,
or, where the step runs without graphs or the capture fails, the passes themselves), nothing
timed inside a capture, the graphs freed whatever happens, and the note's verdict from the
figures. The capture and the timer are stand-ins: a "graph" runs its pass when launched, and
the timer returns the time a test gives each call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.backends.cuda import fp8_pays
from engine.errors import RunError


class Graph:
    def __init__(self, issue: Callable[[], None], log: list[str]) -> None:
        self.issue, self.log, self.closed = issue, log, False

    def launch(self) -> None:
        assert not self.closed, "launched after close"
        self.log.append("launch")
        self.issue()

    def close(self) -> None:
        self.closed = True


class Path:
    """A linear map's path (QkvRows, AttnOut, GemmMlp and their FP8 twins): fwd and bwd, each
    call logged with the path's precision and map."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def fwd(self, *args: Any) -> None:
        self.log.append(f"{self.name} fwd")

    def bwd(self, *args: Any) -> None:
        self.log.append(f"{self.name} bwd")


MAPS = ("qkv", "proj", "mlp")


def one_pass(precision: str) -> list[str]:
    """The log of one layer_pass on a precision's paths."""
    return ([f"{precision} {m} fwd" for m in MAPS]
            + [f"{precision} {m} bwd" for m in reversed(MAPS)])


class Fp8:
    def __init__(self, times: dict[str, tuple[float, float]]) -> None:
        self.times = times

    def gemm_times(self) -> dict[str, tuple[float, float]]:
        return self.times


class Gemm:
    tuning = True  # as the start-up pass leaves it


class Net:
    def __init__(self, log: list[str], gemm: Gemm) -> None:
        self.train_qkv, self.train_proj, self.train_mlp = (Path(f"fp8 {m}", log) for m in MAPS)
        self.qkv, self.proj, self.mlp = (Path(f"bf16 {m}", log) for m in MAPS)
        self.shapes = type("Shapes", (), {"d_model": 2048})()
        self.flat = type("Flat", (), {"w": staticmethod(lambda name: 0),
                                      "gw": staticmethod(lambda name: 0)})()
        self.o = type("Ops", (), {"gemm": gemm})()


class Buffers:
    B = 8

    def layer(self, l: int) -> dict[str, int]:
        return {"ln2": 0, "pre": 0, "act": 0}

    def at(self, name: str) -> int:
        return 0


def setup(ms: dict[str, float], fail_at: int = -1) -> tuple[list[str], list[Graph], Gemm,
                                                           Callable[..., str]]:
    """A log of the passes' calls, the graphs made, the GEMM library, and measure() over them,
    where timing a call of the fp8 (bf16) path takes ms["fp8"] (ms["bf16"]); the capture
    number fail_at (from 0) fails as the driver's refusal does."""
    log: list[str] = []
    made: list[Graph] = []
    gemm = Gemm()

    def capture(issue: Callable[[], None]) -> Graph:
        assert gemm.tuning is False, "a GEMM could time itself inside the capture"
        if len(made) == fail_at:
            raise RunError("cuStreamEndCapture: CUDA error 901")
        log.append("capture")
        made.append(Graph(issue, log))
        return made[-1]

    def timer(fn: Callable[[], None]) -> float:
        start = len(log)
        fn()
        ran = [x for x in log[start:] if x != "launch"]
        precision = ran[0].split()[0]
        assert ran == one_pass(precision), log[start:]
        return ms[precision]

    fp8 = Fp8({"fc1 fwd": (0.2, 0.36)})

    def measure(graphs: bool = True) -> str:
        return fp8_pays.measure(fp8, Net(log, gemm), Buffers(), 1024, timer,
                                capture if graphs else None)

    return log, made, gemm, measure


def test_each_path_is_captured_once_and_its_graph_replays_are_timed() -> None:
    log, made, gemm, measure = setup({"fp8": 1.5, "bf16": 2.0})
    note = measure()
    assert gemm.tuning is True  # as it was, once the captures are made
    # one untimed pass each (algorithms picked outside any capture), then one capture each
    assert log[:14] == [*one_pass("fp8"), *one_pass("bf16"), "capture", "capture"]
    # every timed call is a graph launch, never a pass issued from the host
    timed = log[14:]
    assert timed and all(x == "launch" for x in timed[::7]), timed
    assert len(made) == 2 and all(g.closed for g in made)
    assert "1.500 ms" in note and "2.000 ms in bf16" in note and "1.33x" in note
    assert "a CUDA graph, as the step runs it" in note and "does not pay" not in note


def test_fp8_slower_in_its_graph_says_it_does_not_pay() -> None:
    _, _, _, measure = setup({"fp8": 0.70, "bf16": 0.64})
    note = measure()
    assert note.startswith("FP8 at d 2048") and "FP8 does not pay at this size" in note


def test_without_graphs_the_passes_are_timed_as_launched() -> None:
    log, made, _, measure = setup({"fp8": 1.0, "bf16": 1.2})
    note = measure(graphs=False)
    assert made == [] and "capture" not in log and "launch" not in log
    assert "launched one by one, as the step runs it" in note


def test_a_failed_capture_frees_the_graph_made_before_it_and_times_the_passes() -> None:
    log, made, gemm, measure = setup({"fp8": 1.0, "bf16": 1.2}, fail_at=1)
    note = measure()
    assert len(made) == 1 and made[0].closed and gemm.tuning is True
    assert "launch" not in log
    assert "launched one by one (its capture failed: cuStreamEndCapture: CUDA error 901)" in note
