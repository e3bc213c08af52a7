"""The engine's monitoring: telemetry, validation loss and alerts, their records, and
a resume with validation on that stays bit-exact."""

from __future__ import annotations

import json
import math
import signal
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from engine import records as rec
from engine.config import ConfigError, parse_config
from engine.data.sampler import Sampler
from engine.data.shards import Shard
from engine.data.validation import held_out, train_length, validation_windows
from engine.errors import UserError
from engine.run.alerts import AlertMonitor, AlertSink, CommandRunner, Watchdog
from engine.run.telemetry import CpuMeter, Nvml, SystemSampler, nvml_indices
from tests.conftest import (
    loss_records,
    micro_config_dict,
    run_engine,
    start_engine,
    tiny_config_dict,
    wait_for_step,
)

# ---------------------------------------------------------------- records


def test_new_records_round_trip_and_tolerate_bad_fields() -> None:
    a = rec.AlertEvent(t=5.0, alert="loss_spike", step=7, value=9.0, baseline=2.0,
                       threshold=3.0, message="loss 9")
    j = a.to_json()
    assert j["event"] == "alert" and j["kind"] == "loss_spike"
    assert rec.Event.from_json(j) == a
    bad = rec.Event.from_json({"event": "alert", "kind": 3, "step": -1, "value": "x"})
    assert isinstance(bad, rec.AlertEvent) and bad.alert == "" and bad.step is None
    assert math.isnan(bad.value)
    e = rec.EvalRecord(step=10, t=1.0, val_loss=2.5, src_val_loss={"a": 2.0, "b": 3.0})
    assert rec.EvalRecord.from_json(e.to_json()) == e
    assert not rec.EvalRecord.from_json({"step": "ten"})
    assert rec.EvalRecord.from_json({"step": 3, "src_val_loss": {"a": "x"}}).src_val_loss == {}
    g = rec.GpuSample(index=0, name="NVIDIA H200", util=97.0, mem_used=10, mem_total=20,
                      power_w=650.0, temp_c=61.0, sm_clock_mhz=1980.0)
    s = rec.SystemRecord(t=3.0, step=4, cpu_pct=101.0, rss_bytes=1 << 30, gpus=[g])
    assert rec.SystemRecord.from_json(json.loads(json.dumps(s.to_json()))) == s
    assert not rec.SystemRecord.from_json({"gpus": []})  # no time
    odd = rec.SystemRecord.from_json({"t": 1, "gpus": [{"index": "0"}, 5, {"index": 1}]})
    assert [x.index for x in odd.gpus] == [1]


# ---------------------------------------------------------------- alerts


def step_rec(step: int, loss: float, grad: float = 1.0, tok_s: float = 1000.0,
             skipped: bool = False) -> rec.StepRecord:
    return rec.StepRecord(step=step, loss=loss, grad_norm=grad, clip_scale=1.0, lr=1e-3,
                          tokens=step, tok_s=tok_s, step_ms=10.0, phase=0, phase_step=1,
                          phase_len=10, weights={}, src_loss={}, skipped=skipped, t=step)


def test_alert_monitor_spikes_nonfinite_slow_and_cooldown() -> None:
    m = AlertMonitor(spike_mads=8)
    rng = np.random.default_rng(0)
    seen: list[rec.AlertEvent] = []
    for s in range(1, 200):
        loss = 3.0 + 0.05 * rng.standard_normal()
        grad = 1.0 + 0.05 * rng.standard_normal()
        tok_s = 1000.0 + 10 * rng.standard_normal()
        if s == 60:
            loss = 9.0  # a loss spike
        if s == 61:
            loss = 5.0  # within the cooldown, and not twice as far off: no second alert
        if s == 80:
            grad = 40.0
        if s == 100:
            r = step_rec(s, math.nan, math.inf, tok_s, skipped=True)
        elif 150 <= s < 150 + 12:
            r = step_rec(s, loss, grad, 300.0)  # throughput drop
        else:
            r = step_rec(s, loss, grad, tok_s)
        seen += m.observe(r)
    kinds = [(a.alert, a.step) for a in seen]
    assert kinds == [("loss_spike", 60), ("grad_spike", 80), ("nonfinite", 100),
                     ("slow", 159)], kinds
    spike = seen[0]
    assert spike.value == 9.0 and abs(spike.baseline - 3.0) < 0.05
    assert spike.baseline < spike.threshold < spike.value
    assert "median" in spike.message
    # Nothing in a quiet run (the cooldown after an alert: step 61 above).
    quiet = AlertMonitor()
    assert not [a for s in range(1, 300) for a in quiet.observe(step_rec(s, 3.0 - s * 1e-3))]


def test_watchdog_raises_one_stall_per_stall() -> None:
    now = [0.0]
    got: list[rec.AlertEvent] = []
    w = Watchdog(got.append, factor=10, min_s=2.0, clock=lambda: now[0])
    assert w.check() is None  # no step yet
    for s in range(1, 6):
        now[0] += 0.1
        w.beat(s, 0.1)
    now[0] += 1.9
    assert w.check() is None  # max(10 x 0.1, 2.0) = 2 s not yet reached
    now[0] += 0.2
    a = w.check()
    assert a is not None and a.alert == "stall" and a.step == 5 and a.value > 2.0
    assert a.threshold == 2.0 and abs(a.baseline - 0.1) < 1e-9
    now[0] += 10
    assert w.check() is None  # told once
    w.beat(6, 0.1)
    now[0] += 3
    assert w.check() is not None  # a new stall after the next step


def test_alert_command_gets_json_on_stdin_with_timeout_and_bounded_queue(tmp_path: Path) -> None:
    out = tmp_path / "got.jsonl"
    log: list[str] = []
    runner = CommandRunner([sys.executable, "-c",
                            f"import sys; open({str(out)!r}, 'a').write(sys.stdin.read() + "
                            "'\\n')"], 10, log.append)
    events: list[rec.AlertEvent] = []
    sink = AlertSink(events.append, log.append, runner)
    sink.emit(rec.AlertEvent(alert="stall", step=3, value=99.0, message="no step"))
    sink.stop()
    got = json.loads(out.read_text().splitlines()[0])
    assert got["event"] == "alert" and got["kind"] == "stall" and got["step"] == 3
    assert events[0].alert == "stall" and math.isfinite(events[0].t)
    assert any("alert stall" in x for x in log)
    slow = CommandRunner(["sleep", "5"], 0.2, log.append)
    t0 = time.monotonic()
    offered = [slow.offer({"n": i}) for i in range(40)]
    # never blocks the caller: offers that waited for the command would take at least its
    # 0.2 s timeout each (8 s for 40)
    assert time.monotonic() - t0 < 4.0
    assert not all(offered) and slow.dropped > 0
    deadline = time.monotonic() + 10
    while not any("killed after" in x for x in log) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any("killed after 0.2 s" in x for x in log)


# ---------------------------------------------------------------- telemetry


class FakeNvml(types.ModuleType):
    """A stand-in for pynvml (nvidia-ml-py) with two GPUs, the second without power readings."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.shut = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        return {"GPU-aaaa": 0, "GPU-bbbb": 1}[uuid]

    def nvmlDeviceGetIndex(self, h: int) -> int:
        return h

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H200"

    def nvmlDeviceGetUtilizationRates(self, h: int):
        return types.SimpleNamespace(gpu=90 + h, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h: int):
        return types.SimpleNamespace(used=(h + 1) << 30, total=141 << 30, free=0)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        if h == 1:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 612_000

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 58

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        assert clock == self.NVML_CLOCK_SM
        return 1980

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        if h == 1:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 123_456_789


def test_telemetry_reads_nvml_through_a_stand_in(monkeypatch) -> None:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    got: list[rec.SystemRecord] = []
    sampler = SystemSampler(got.append, lambda: 42, gpus=[0, 1], every_s=0.05)
    sampler.start()
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    assert fake.shut and len(got) >= 2
    s = got[-1]
    assert s.step == 42 and s.rss_bytes and s.rss_bytes > 1 << 20
    g0, g1 = s.gpus
    assert (g0.name, g0.util, g0.mem_used, g0.mem_total) == ("NVIDIA H200", 90.0, 1 << 30,
                                                             141 << 30)
    assert (g0.power_w, g0.temp_c, g0.sm_clock_mhz) == (612.0, 58.0, 1980.0)
    assert g1.util == 91.0 and math.isnan(g1.power_w)  # not supported: NaN, not an error
    assert rec.SystemRecord.from_json(json.loads(json.dumps(s.to_json()))) is not None


def test_telemetry_finds_the_gpu_cuda_visible_devices_names_by_uuid(monkeypatch) -> None:
    """CUDA_VISIBLE_DEVICES=GPU-bbbb,GPU-aaaa makes CUDA's ordinal 0 NVML's device 1: found by
    its UUID (NVML ignores the variable), not taken as NVML's device 0."""
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert nvml_indices([0], "GPU-bbbb,GPU-aaaa") == ["GPU-bbbb"]
    assert nvml_indices([0, 1], "0,GPU-aaaa") == [0, 1]  # a mixed list: as CUDA numbers them
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb,GPU-aaaa")
    (g,) = SystemSampler(lambda r: None, lambda: 1, gpus=[0]).sample().gpus
    assert g.index == 1 and g.util == 91.0


def test_nvml_energy_counter_of_the_first_gpu(monkeypatch) -> None:
    """Nvml.energy_mj (dev/bench_gpu.py's EnergyMeter reads it): the first GPU's counter,
    None where the GPU does not report it."""
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    assert Nvml.open([0, 1]).energy_mj() == 123_456_789
    assert Nvml.open([1]).energy_mj() is None


def test_telemetry_without_nvml_and_cpu_meter(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert Nvml.open([0]) is None
    s = SystemSampler(lambda r: None, lambda: None, gpus=[0]).sample()
    assert s.gpus == [] and s.rss_bytes
    assert nvml_indices([0, 1], "3,5") == [3, 5] and nvml_indices([1], "") == [1]
    t = [0.0]
    meter = CpuMeter(clock=lambda: t[0])
    x = sum(range(2_000_000))  # burn a little CPU
    t[0] = 10.0
    assert x and 0 <= meter.read() < 100


# ---------------------------------------------------------------- validation split


def shard(n: int) -> Shard:
    return Shard(Path(f"/x/{n}.bin"), 100, "0" * 64, np.arange(n, dtype=np.uint16) % 100)


def test_holdout_keeps_validation_tokens_out_of_training() -> None:
    sh = [Shard(Path("/x/a.bin"), 65536, "0" * 64, np.arange(2000, dtype=np.uint16)),
          Shard(Path("/x/b.bin"), 65536, "0" * 64, np.arange(3000, dtype=np.uint16))]
    s = Sampler(sh, 16, seed=3, holdout=0.1)
    for _ in range(50):
        tokens, src = s.sample(8, np.array([0.5, 0.5]))
        for row, i in zip(tokens, src, strict=True):
            assert row.max() < train_length(len(sh[i]), 0.1)  # tokens are their own positions
    w = validation_windows(sh[1], 16, 0.1, 6)
    assert w.shape == (6, 17) and w.min() >= 3000 - held_out(3000, 0.1) and w.max() < 3000
    assert np.array_equal(w, validation_windows(sh[1], 16, 0.1, 6))  # fixed windows
    # No holdout: the sampler draws from the whole source, the same windows as holdout=0.0.
    a, b = Sampler(sh, 16, 5), Sampler(sh, 16, 5, holdout=0.0)
    assert all(np.array_equal(a.sample(4, np.array([1.0, 1.0]))[0],
                              b.sample(4, np.array([1.0, 1.0]))[0]) for _ in range(5))
    with pytest.raises(UserError, match=r"eval\.holdout"):
        Sampler([shard(40)], 16, 1, holdout=0.3)


def test_eval_config_is_optional_and_checked() -> None:
    c = tiny_config_dict()
    del c["eval"]  # shipped on; absent is off
    cfg = parse_config(c, "x.json", ".", check_paths=False)
    assert cfg.eval is None and cfg.alerts is None and "eval" not in cfg.to_json()
    c["eval"] = {"every_steps": 50}
    cfg = parse_config(c, "x.json", ".", check_paths=False)
    assert (cfg.eval.every_steps, cfg.eval.batches, cfg.eval.holdout) == (50, 4, 0.05)
    assert parse_config(cfg.to_json(), "x", ".", check_paths=False) == cfg
    c["eval"] = {"every_steps": 50, "holdout": 0.9}
    with pytest.raises(ConfigError, match=r"x.json: eval.holdout: must be <= 0.5, got 0.9"):
        parse_config(c, "x.json", ".", check_paths=False)
    c["eval"] = {"every_steps": 50}
    c["alerts"] = {"command": "notify-send"}
    with pytest.raises(ConfigError, match=r"alerts.command: must be a list"):
        parse_config(c, "x.json", ".", check_paths=False)


# ---------------------------------------------------------------- the real engine

N = 30


def events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x]


@pytest.mark.slow
def test_eval_records_and_resume_with_eval_is_bit_exact(write_config, tmp_path: Path) -> None:
    c = micro_config_dict(max_steps=N)
    c["eval"] = {"every_steps": 5, "batches": 1, "holdout": 0.05}
    cfg = write_config(c)
    straight = tmp_path / "straight"
    r = run_engine(cfg, straight)
    assert r.returncode == 0, r.stdout + r.stderr
    evals = [json.loads(x) for x in (straight / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == list(range(5, N + 1, 5))
    names = {s["name"] for s in c["data"]["sources"]}
    for e in map(rec.EvalRecord.from_json, evals):
        assert set(e.src_val_loss) == names and math.isfinite(e.val_loss)
        assert min(e.src_val_loss.values()) <= e.val_loss <= max(e.src_val_loss.values())
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]  # it learns
    system = [json.loads(x) for x in (straight / "system.jsonl").read_text().splitlines()]
    assert system and system[0]["rss_bytes"] > 0 and system[0]["gpus"] == []

    run = tmp_path / "stopped"
    proc = start_engine(cfg, run)
    wait_for_step(run, 12, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    r = run_engine(cfg, run, "--resume")
    assert r.returncode == 0, r.stdout + r.stderr
    key = [(x.step, x.loss, x.grad_norm, x.src_loss) for x in loss_records(straight)]
    assert [(x.step, x.loss, x.grad_norm, x.src_loss) for x in loss_records(run)] == key
    ck = f"checkpoints/step_{N:08d}/model.ckpt"
    assert (run / ck).read_bytes() == (straight / ck).read_bytes()
    again = {e["step"]: e["val_loss"] for e in
             map(json.loads, (run / "eval.jsonl").read_text().splitlines())}
    assert again == {e["step"]: e["val_loss"] for e in evals}
    assert not [e for e in events(straight) if e.get("kind") in ("loss_spike", "nonfinite")]
