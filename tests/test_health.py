"""The run's health and the alerts behind it: divergence told with no baseline, a spike that
breaks through a cooldown, a mixture change that is no spike, the health state machine, and a
few faults injected into real engine runs (the quick share of scripts/fault_suite.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine import records as rec
from engine.config import AlertsConfig, OptimConfig
from engine.records import Health
from engine.run.alerts import AlertMonitor, Watchdog
from engine.run.health import NONFINITE_RUN, HealthMonitor
from engine.run.writer import RunWriter
from tests.conftest import ROOT

OPTIM = OptimConfig(lr=5.0, warmup_steps=1, min_lr_frac=0.1, betas=(0.9, 0.95), eps=1e-8,
                    weight_decay=0.1, max_grad_norm=1.0)


def step_rec(step: int, loss: float, grad: float = 1.0, *, weights: dict[str, float] | None = None,
             src: dict[str, float | None] | None = None, tok_s: float = 1000.0,
             skipped: bool = False) -> rec.StepRecord:
    return rec.StepRecord(step=step, loss=loss, grad_norm=grad, clip_scale=1.0, lr=1e-3,
                          tokens=step, tok_s=tok_s, step_ms=10.0, phase=0, phase_step=1,
                          phase_len=10, weights=weights or {}, src_loss=src or {},
                          skipped=skipped, t=float(step))


def feed(m: AlertMonitor, records: list[rec.StepRecord]) -> list[rec.AlertEvent]:
    return [a for r in records for a in m.observe(r)]


def noisy(n: int, level: float, sd: float, seed: int = 0, first: int = 1) -> list[rec.StepRecord]:
    rng = np.random.default_rng(seed)
    return [step_rec(first + i, level + sd * float(rng.standard_normal()),
                     1.0 + 0.05 * float(rng.standard_normal())) for i in range(n)]


# ---------------------------------------------------------------- divergence, no baseline


def test_a_loss_above_the_uniform_guess_is_diverging_at_its_first_step() -> None:
    m = AlertMonitor(vocab_size=8449, optim=OPTIM)
    got = feed(m, [step_rec(1, 9.06), step_rec(2, 1084.0)])
    assert [(a.alert, a.step) for a in got] == [("diverging", 2)]
    a = got[0]
    assert a.value == 1084.0 and a.baseline == pytest.approx(math.log(8449))
    assert a.threshold == pytest.approx(math.log(8449) + 1.0)
    assert a.message.startswith("loss 1,084 at step 2 is above ln(8449) = 9.04, the loss of a "
                                "uniform guess")
    assert "lower optim.lr (now 5) or raise optim.warmup_steps (now 1)" in a.message
    assert m.diverging == a.message
    # told once: the run goes on diverging without another alert (or spikes) at every step
    assert not feed(m, [step_rec(s, 900.0 + s, 80.0) for s in range(3, 60)])
    assert m.diverging == a.message


def test_a_run_that_starts_at_zero_loss_is_judged_without_dividing_by_it() -> None:
    """A memorised set resumed at loss 0: the start rule has no multiple to judge by."""
    m = AlertMonitor(vocab_size=8449, optim=OPTIM)
    feed(m, [step_rec(1, 0.0), *[step_rec(s, 0.01) for s in range(2, 30)]])


def test_a_fresh_run_at_the_uniform_level_is_not_diverging() -> None:
    m = AlertMonitor(vocab_size=8449)
    assert not feed(m, [step_rec(s, 9.06 + 0.5 * math.sin(s)) for s in range(1, 40)])
    assert m.diverging is None


def test_one_odd_batch_is_a_spike_and_a_jump_that_stays_is_a_divergence() -> None:
    m = AlertMonitor(vocab_size=8449)
    base = [step_rec(1, 9.0), *noisy(99, 3.0, 0.05, first=2)]  # a fresh run's start, long ago
    odd = [step_rec(101, 9.5)]  # x3 in one step, back at the next
    after = noisy(60, 3.0, 0.05, seed=1, first=102)
    got = feed(m, base + odd + after)
    assert [(a.alert, a.step) for a in got] == [("loss_spike", 101)]
    assert m.diverging is None
    got = feed(m, [step_rec(162, 9.5), step_rec(163, 9.8)])  # x3 for two steps
    assert [(a.alert, a.step) for a in got] == [("loss_spike", 162), ("diverging", 163)]
    assert "x the smoothed loss before it" in got[1].message and "2 steps in a row" in \
        got[1].message


def test_a_resumed_run_is_judged_from_the_loss_it_resumed_at() -> None:
    m = AlertMonitor(vocab_size=8449)  # its first record is step 5001, at loss 3
    recs = [step_rec(5000 + i, 3.0 + 0.02 * math.sin(i)) for i in range(1, 6)]
    assert not feed(m, [*recs, step_rec(5006, 6.9)])  # one step at 2.3x: not yet
    got = feed(m, [step_rec(5007, 7.2)])
    assert [(a.alert, a.step) for a in got] == [("diverging", 5007)]
    assert "2.4x the first loss of this run, 3.017 at step 5001" in got[0].message


def test_a_sustained_rise_is_diverging_until_the_loss_comes_back() -> None:
    m = AlertMonitor(vocab_size=8449)
    rng = np.random.default_rng(3)
    flat = [step_rec(s, 4.0 + 0.3 * float(rng.standard_normal())) for s in range(1, 301)]
    assert not feed(m, flat)  # noise alone: nothing
    rise = [step_rec(s, 4.0 + 0.04 * (s - 300) + 0.3 * float(rng.standard_normal()))
            for s in range(301, 361)]
    got = feed(m, rise)
    assert [a.alert for a in got] == ["diverging"]
    a = got[0]
    assert a.step is not None and a.step < 350  # under 2 nats above the flat level
    assert "above the best smoothed loss" in a.message and a.value > a.threshold > a.baseline
    back = [step_rec(s, 4.0 + 0.3 * float(rng.standard_normal())) for s in range(361, 500)]
    feed(m, back)
    assert m.diverging is None


# ---------------------------------------------------------------- cooldown, mixture


def test_a_spike_far_larger_than_the_one_that_began_a_cooldown_breaks_through() -> None:
    m = AlertMonitor()
    recs = noisy(180, 3.0, 0.05)
    grads = {176: 134.7, 215: 6594.0, 225: 300.0}  # 215: 39 steps after 176; 225: quiet
    recs += noisy(60, 3.0, 0.05, seed=2, first=181)
    recs = [rec.StepRecord(**{**r.__dict__, "grad_norm": grads.get(r.step, r.grad_norm)})
            for r in recs]
    got = [a for a in feed(m, recs) if a.alert == "grad_spike"]
    assert [a.step for a in got] == [176, 215]
    assert "inside the quiet period after the alert at step 176" in got[1].message
    assert "134.7" in got[0].message and "6,594" in got[1].message
    # without the break-through, the 50-step quiet period swallowed the larger spike
    quiet = AlertMonitor(AlertsConfig(breakthrough=1e6))
    assert [a.step for a in feed(quiet, recs) if a.alert == "grad_spike"] == [176]


def mixture_run(with_sources: bool, easy: float = 3.0) -> list[rec.StepRecord]:
    """Two sources, `easy` at loss 3 and `hard` at 6 (each with noise, neither changing); at
    step 150 the mixture moves from 90% easy to 90% hard."""
    rng = np.random.default_rng(5)
    out = []
    for s in range(1, 301):
        w = {"easy": 0.9, "hard": 0.1} if s <= 150 else {"easy": 0.1, "hard": 0.9}
        src = {"easy": easy + 0.1 * float(rng.standard_normal()),
               "hard": 6.0 + 0.1 * float(rng.standard_normal())}
        loss = sum(w[k] * src[k] for k in w)
        out.append(step_rec(s, loss, weights=w, src=src if with_sources else {}))
    return out


def test_a_mixture_change_onto_a_harder_source_is_no_loss_spike() -> None:
    got = feed(AlertMonitor(vocab_size=8449), mixture_run(with_sources=True))
    assert not got, [(a.alert, a.step, a.message) for a in got]
    # nor a divergence when the new mixture's loss is over twice the run's first loss
    got = feed(AlertMonitor(vocab_size=8449), mixture_run(with_sources=True, easy=2.0))
    assert not got, [(a.alert, a.step, a.message) for a in got]
    # judged against the old window's median (no per-source losses), the same run "spikes"
    blind = feed(AlertMonitor(vocab_size=8449), mixture_run(with_sources=False))
    assert [a.alert for a in blind][:1] == ["loss_spike"] and blind[0].step == 151


def test_a_spike_is_judged_against_what_the_mixture_predicts() -> None:
    m = AlertMonitor(vocab_size=8449)
    recs = mixture_run(with_sources=True)
    odd = recs[199]  # a step of the hard mixture whose loss is 2 nats above its sources
    recs[199] = rec.StepRecord(**{**odd.__dict__, "loss": odd.loss + 2.0})
    got = feed(m, recs)
    assert [(a.alert, a.step) for a in got] == [("loss_spike", 200)]
    assert got[0].baseline == pytest.approx(0.1 * 3.0 + 0.9 * 6.0, abs=0.1)
    assert "what this step's mixture predicts from each source's recent loss" in \
        got[0].message


# ---------------------------------------------------------------- the health state machine


def test_health_moves_through_its_states_and_says_why() -> None:
    told: list[tuple[rec.HealthEvent, bool]] = []
    h = HealthMonitor(lambda e, changed: told.append((e, changed)), quiet_steps=10)
    spike = rec.AlertEvent(alert="grad_spike", step=3, value=50.0, message="grad 50 at step 3")
    h.observe(step_rec(1, 3.0), [], None)
    assert h.state is Health.HEALTHY and not told  # healthy from the start: nothing to say
    h.observe(step_rec(3, 3.0), [spike], None)
    assert (h.state, h.reason) == (Health.WARNING, "grad 50 at step 3")
    for s in range(4, 13):
        h.observe(step_rec(s, 3.0), [], None)
    assert h.state is Health.WARNING  # 9 quiet steps: not yet
    h.observe(step_rec(13, 3.0), [], None)
    assert (h.state, h.reason) == (Health.HEALTHY, "")
    h.observe(step_rec(14, 90.0), [], "loss 90 at step 14: the run is diverging")
    assert h.state is Health.DIVERGING
    h.observe(step_rec(15, 3.0), [], None, recovered="the loss came back at step 15")
    assert (h.state, h.reason) == (Health.WARNING, "the loss came back at step 15")
    stall = rec.AlertEvent(alert="stall", step=15, value=70.0, message="no step for 70 s")
    h.stalled(stall)
    assert (h.state, h.reason) == (Health.STALLED, "no step for 70 s")
    h.observe(step_rec(16, 3.0), [], None)
    assert h.state is Health.WARNING and h.reason == "no step for 70 s; steps went on at step 16"
    h.failed(16, "MemoryError")
    h.observe(step_rec(17, 3.0), [], None)
    h.stalled(stall)
    assert (h.state, h.reason) == (Health.FAILED, "MemoryError")  # nothing after failed
    states = [e.state for e, changed in told if changed]
    assert states == [Health.WARNING, Health.HEALTHY, Health.DIVERGING, Health.WARNING,
                      Health.STALLED, Health.WARNING, Health.FAILED]
    assert all(e.step is not None for e, _ in told)


def test_a_run_of_non_finite_steps_is_diverging() -> None:
    h = HealthMonitor(lambda e, changed: None)
    for s in range(1, NONFINITE_RUN + 1):
        h.observe(step_rec(s, math.nan, math.inf, skipped=True), [], None)
    assert h.state is Health.DIVERGING and f"the last {NONFINITE_RUN} steps" in h.reason
    h.observe(step_rec(NONFINITE_RUN + 1, 3.0), [], None)
    assert h.state is Health.WARNING and h.reason.startswith("recovered at step 6")


def test_a_stall_the_watchdog_thread_could_not_see_is_told_by_the_next_step() -> None:
    now = [0.0]
    got: list[rec.AlertEvent] = []
    w = Watchdog(got.append, factor=10, min_s=2.0, clock=lambda: now[0])
    for s in range(1, 6):
        now[0] += 0.1
        w.beat(s, 0.1)
    now[0] += 30.0  # the whole process stopped: the thread never checked meanwhile
    w.beat(6, 0.1)
    assert [(a.alert, a.step) for a in got] == [("stall", 5)]
    assert "did not run meanwhile" in got[0].message and "went on at step 6" in got[0].message
    now[0] += 0.1
    w.beat(7, 0.1)
    assert w.check() is None and len(got) == 1  # told once


def test_a_failed_run_says_so_in_its_health_and_events(tmp_path: Path) -> None:
    w = RunWriter(tmp_path / "run")
    w.set_status(status=rec.Status.RUNNING, step=7)
    assert w.set_health(rec.HealthEvent(state=Health.DIVERGING, step=7, reason="loss 90"), True)
    assert w.set_health(rec.HealthEvent(state=Health.DIVERGING, step=7, reason="loss 95"), False)
    w.set_failed("MemoryError: out of memory; resume from step 5")
    # a stall told by the watchdog's thread after the failure changes nothing
    assert not w.set_health(rec.HealthEvent(state=Health.STALLED, step=7, reason="no step"), True)
    w.close()
    state = rec.RunStatus.from_json(json.loads((tmp_path / "run" / "state.json").read_text()))
    assert isinstance(state, rec.RunStatus) and state.health is Health.FAILED
    assert state.health_reason == "MemoryError: out of memory; resume from step 5"
    events = [rec.Event.from_json(json.loads(x))
              for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [(e.state, e.step, e.reason) for e in events if isinstance(e, rec.HealthEvent)] == \
        [(Health.DIVERGING, 7, "loss 90"),
         (Health.FAILED, 7, "MemoryError: out of memory; resume from step 5")]


# ---------------------------------------------------------------- real engine runs


def suite() -> Any:
    spec = importlib.util.spec_from_file_location("fault_suite",
                                                  ROOT / "scripts" / "fault_suite.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fault_suite"] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def faults() -> Any:
    return suite()


def health_events(run: Path) -> list[rec.HealthEvent]:
    out = []
    for line in (run / "events.jsonl").read_text().splitlines():
        e = rec.Event.from_json(json.loads(line))
        if isinstance(e, rec.HealthEvent):
            out.append(e)
    return out


def test_lr_5_is_told_diverging_within_5_steps(tmp_path: Path, prepared_data: Path,
                                                faults: Any) -> None:
    f = faults.Fault("lr 5", "micro", 12, changes={"optim": {"lr": 5.0, "warmup_steps": 1}},
                     began=1, expect="diverging")
    r = faults.run_fault(f, tmp_path)
    assert r.ok, (r.alerts, r.note)
    a = r.first("diverging")
    assert a["step"] <= 6 and "the run is diverging; lower optim.lr (now 5)" in a["message"]
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["status"] == "finished" and state["health"] == "diverging"
    assert state["health_reason"] == a["message"]
    assert [(e.state, e.step) for e in health_events(tmp_path / "run")] == \
        [(Health.DIVERGING, a["step"])]


def test_a_grad_spike_inside_a_cooldown_breaks_through(tmp_path: Path, prepared_data: Path,
                                                       faults: Any) -> None:
    f = faults.Fault("spikes", "micro", 60, spec={"grad_scale": {"40": 100, "55": 5000}},
                     began=55, expect="grad_spike", within=0)
    r = faults.run_fault(f, tmp_path)
    spikes = [a for a in r.alerts if a["kind"] == "grad_spike" and a["step"] >= 40]
    assert [a["step"] for a in spikes] == [40, 55], r.alerts
    assert "inside the quiet period after the alert at step 40" in spikes[1]["message"]
    assert spikes[1]["value"] > 1000 * spikes[0]["baseline"]


def test_a_hung_step_shows_stalled_while_it_hangs(tmp_path: Path, prepared_data: Path,
                                                  faults: Any) -> None:
    f = faults.Fault("hang", "micro", 30, changes={"alerts": {"stall_min_s": 1.0}},
                     spec={"hang_step": 25, "hang_s": 3.0}, began=24, expect="stall", within=0)
    r = faults.run_fault(f, tmp_path)
    assert r.ok, (r.alerts, r.health, r.note)
    assert "stalled" in r.health  # state.json said so while the step hung
    states = [(e.state, e.step) for e in health_events(tmp_path / "run")]
    assert (Health.STALLED, 24) in states and states[-1][0] is Health.WARNING


@pytest.mark.parametrize(("args", "says"), [
    (["--jobs", "0"], "--jobs: expected a positive integer, got 0"),
    (["--only", "no-such-fault"], "--only 'no-such-fault': no fault's name contains it"),
    (["--inject", "{nope", "--", "cfg.json"], "--inject: not JSON"),
])
def test_the_suite_refuses_bad_arguments_in_one_line(args: list[str], says: str) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "fault_suite.py"), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr and not r.stdout


def test_the_mixture_moving_is_told_once_per_move_and_a_slow_drift_too() -> None:
    from engine.run.mixture import MixtureWatch

    w = MixtureWatch()
    even = {"a": 0.34, "b": 0.33, "c": 0.33}
    assert w.observe(1, even) is None  # the first mixture is the reference
    assert w.observe(2, {"a": 0.40, "b": 0.30, "c": 0.30}) is None  # a phase's small step
    jump = w.observe(3, {"a": 0.05, "b": 0.90, "c": 0.05})
    assert jump is not None and jump.step == 3 and jump.before == even
    assert jump.moves()[0] == ("b", 0.33, 0.90)  # the largest move first
    assert w.observe(4, {"a": 0.05, "b": 0.90, "c": 0.05}) is None  # told once
    drift = [w.observe(5 + i, {"a": 0.05 + 0.05 * i, "b": 0.90 - 0.05 * i, "c": 0.05})
             for i in range(6)]
    told = [e for e in drift if e is not None]  # 0.05 a step: told when it adds up to 0.2
    assert [e.step for e in told] == [9]
    stamped = dataclasses.replace(told[0], t=12.5)  # (the writer stamps the time)
    assert rec.Event.from_json(json.loads(json.dumps(stamped.to_json()))) == stamped


def test_the_events_panel_shows_mixture_moves_and_leaves_phases_to_its_panel() -> None:
    from andrea_tui import panels
    from andrea_tui.runstate import RunState

    st = RunState()
    st.add_events([
        rec.AlertEvent(t=1.0, alert="grad_spike", step=40, message="gradient norm 9").to_json(),
        *[rec.PhaseEvent(t=2.0 + i, step=50 + 14 * i, phase=i + 2,
                         weights={"a": 0.3, "b": 0.7}).to_json() for i in range(30)],
        rec.MixtureEvent(t=40.0, step=251, before={"a": 0.6, "b": 0.4},
                         after={"a": 0.1, "b": 0.9}).to_json()])
    lines = panels.events(st, 3).plain.splitlines()
    assert "alert grad_spike: gradient norm 9" in lines[0]  # not pushed out by 30 phases
    assert lines[1].endswith("mixture moved at step 251: a 0.60 → 0.10, b 0.40 → 0.90")
    assert len(lines) == 2
    assert "phase" in panels.all_events(st).plain  # the events screen keeps every phase
    only_phases = RunState()
    only_phases.add_events([rec.PhaseEvent(t=1.0, step=14, phase=2, weights={"a": 1.0}).to_json()])
    assert panels.events(only_phases, 3).plain == "only the bandit's phases lately (v: every event)"


def test_the_mixture_reference_survives_a_checkpoint_and_ignores_what_is_not_a_weight() -> None:
    from engine.run.mixture import MixtureWatch

    w = MixtureWatch()
    assert w.observe(1, {"a": 0.5, "b": 0.5}) is None
    assert w.observe(2, {"a": math.nan, "b": 0.5}) is None  # a non-finite weight is no move
    again = MixtureWatch()
    again.load_state_dict(json.loads(json.dumps(w.state_dict())))  # through state.json
    moved = again.observe(3, {"a": 0.7, "b": 0.3})  # 0.2 less float rounding is still 0.2
    assert moved is not None and moved.before == {"a": 0.5, "b": 0.5}
    fresh = MixtureWatch()
    fresh.load_state_dict(None)  # a checkpoint from before the reference was kept
    assert fresh.observe(4, {"a": 0.9, "b": 0.1}) is None and fresh.reference == {"a": 0.9,
                                                                                   "b": 0.1}
