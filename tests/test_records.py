"""The run-directory contract (engine.records): writer and reader agree; hostile input reads as
neutral values or Unreadable, never an exception; one abandoned-timeline rule for every reader."""

from __future__ import annotations

import json
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import records as rec
from engine.runfiles import JsonlWriter, read_steps

STEP = rec.StepRecord(step=3, loss=2.5, grad_norm=0.7, clip_scale=1.0, lr=1e-3, tokens=768,
                      tok_s=5120.0, step_ms=50.0, phase=1, phase_step=2, phase_len=7,
                      weights={"a": 0.6, "b": 0.4}, src_loss={"a": 2.4, "b": None},
                      skipped=False, t=1_700_000_000.5)

EVENTS = [
    rec.StartEvent(t=1.0, pid=42, argv=["andrea-train", "x.json"], name="x", backend="numpy",
                   device="cpu", run_id="r1", resumed=True),
    rec.PrepEvent(t=2.0, message="tokenizer: unchanged"),
    rec.PrepEvent(t=2.5, message="  books: 12.0 of 48.0 MB (25%), 6.00 MB/s, ETA 6s",
                  source="books", bytes_done=12_000_000, bytes_total=48_000_000, mb_s=6.0,
                  eta_s=6.0),
    rec.ReadyEvent(t=3.0, memory_plan={"weights": 8, "total": 16}, n_params=2, backend="cuda",
                   device="H200", step=0, max_steps=10, tokens_per_step=256,
                   attention="cudnn (cuDNN 91900; deterministic backward)"),
    rec.ResumeEvent(t=4.0, step=20, path="c/step_00000020",
                    skipped=[rec.SkippedCheckpoint("c/step_00000030", "sha256 mismatch")]),
    rec.SignalEvent(t=5.0, signal="SIGUSR1", step=21, action="snapshot", count=2),
    rec.CheckpointEvent(t=6.0, step=21, reason="snapshot", path="c/step_00000021",
                        bytes=1000, seconds=0.5),
    rec.CheckpointErrorEvent(t=7.0, step=22, reason="periodic", error="disk full"),
    rec.PhaseEvent(t=8.0, step=28, phase=2, phase_len=14, weights={"a": 1.0},
                   scores={"a": 0.1}),
    rec.MixtureEvent(t=8.5, step=29, before={"a": 0.5, "b": 0.5}, after={"a": 0.1, "b": 0.9}),
    rec.SkippedEvent(t=9.0, step=29, grad_norm=math.inf),
    rec.AlertEvent(t=9.5, alert="grad_spike", step=29, value=40.0, baseline=1.0, threshold=3.0,
                   message="grad norm 40 at step 29"),
    rec.HealthEvent(t=9.6, state=rec.Health.WARNING, step=29, reason="grad norm 40 at step 29"),
    rec.StopEvent(t=10.0, step=30, status="stopped"),
    rec.FinishedEvent(t=11.0, step=40, status="finished"),
    rec.ErrorEvent(t=12.0, message="boom"),
]


def roundtrip(obj: dict) -> dict:
    return json.loads(json.dumps(obj))


def test_every_record_reads_back_what_it_wrote() -> None:
    assert rec.StepRecord.from_json(roundtrip(STEP.to_json())) == STEP
    for e in EVENTS:
        assert rec.Event.from_json(roundtrip(e.to_json())) == e, e
    status = rec.RunStatus(rec.Status.RUNNING, step=5, max_steps=9, backend="numpy",
                           device="cpu", pid=7, run_id="r",
                           last_checkpoint=rec.CheckpointRef("p", 4, "periodic"), updated=1.5)
    assert rec.RunStatus.from_json(roundtrip(status.to_json())) == status
    info = rec.EngineInfo(pid=7, start_time=123, boot_id="b", host="h", run_id="r",
                          argv=["a"], started_at=2.5)
    assert rec.EngineInfo.from_json(roundtrip(info.to_json())) == info
    sample = rec.Sample(step=5, t=1.0, prompt="def ", text="def f(): pass")
    assert rec.Sample.from_json(roundtrip(sample.to_json())) == sample


def test_every_event_kind_has_a_class() -> None:
    assert set(rec.Event.KINDS) == {e.KIND for e in EVENTS}


def test_live_statuses() -> None:
    assert {s.value for s in rec.Status if s.live} == {"starting", "running", "stopping"}
    assert not rec.Status.FINISHED.live


def test_hostile_fields_become_neutral_values() -> None:
    r = rec.StepRecord.from_json({"step": 4, "loss": "x", "tokens": [1], "phase": True,
                                  "weights": {"a": "z", "b": 0.5}, "src_loss": "q",
                                  "skipped": 1, "t": 10**400})
    assert isinstance(r, rec.StepRecord) and math.isnan(r.loss) and r.tokens is None
    assert r.phase is None and r.weights == {"b": 0.5} and r.src_loss == {}
    assert r.skipped is False and r.t == math.inf and math.isnan(r.number("tokens"))
    for bad in ({}, {"step": -1}, {"step": True}, {"step": 2**63}, {"step": "3"}, [], "x"):
        assert not rec.StepRecord.from_json(bad)
        assert isinstance(rec.StepRecord.from_json(bad), rec.Unreadable)
    assert isinstance(rec.Event.from_json({"event": 5}), rec.Unreadable)
    other = rec.Event.from_json({"event": "from_the_future", "t": 1, "x": 2})
    assert isinstance(other, rec.OtherEvent) and other.kind == "from_the_future"
    assert other.details() == {"x": 2}
    assert not rec.RunStatus.from_json({"status": "sleeping"})
    assert not rec.EngineInfo.from_json({"pid": "12", "boot_id": "b"})
    p = rec.Event.from_json({"event": "prep", "message": 3, "source": ["x"], "bytes_done": -1,
                             "bytes_total": True, "mb_s": "fast", "eta_s": math.inf})
    assert isinstance(p, rec.PrepEvent) and p.message == "" and p.source == ""
    assert p.bytes_done is None and p.bytes_total is None and p.mb_s is None and p.eta_s is None


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(), c, max_size=4),
                    max_leaves=20)
FIELDS = ["step", "loss", "t", "event", "status", "pid", "weights", "src_loss", "skipped",
          "memory_plan", "last_checkpoint", "argv", "phase", "path", "boot_id", "bytes_done",
          "mb_s", "eta_s", "source"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS) | st.text(), JSON, max_size=8),
       st.sampled_from([None, *rec.Event.KINDS]))
def test_readers_never_raise(obj: dict, kind: str | None) -> None:
    if kind is not None:
        obj = {**obj, "event": kind}
    for reader in (rec.StepRecord, rec.Event, rec.RunStatus, rec.EngineInfo, rec.Sample):
        reader.from_json(obj)


def test_the_abandoned_rule_on_numbers_and_arrays() -> None:
    assert rec.abandoned(25, 100.0, 20, 150.0)  # past k, written before the resume
    assert not rec.abandoned(25, 200.0, 20, 150.0)  # written after: the new timeline
    assert not rec.abandoned(20, 100.0, 20, 150.0)  # the checkpoint's own step survives
    assert not rec.abandoned(25, math.nan, 20, 150.0)  # unknown time: kept
    steps, t = np.array([19, 21, 21, 25]), np.array([1.0, 1.0, 300.0, math.nan])
    assert rec.abandoned(steps, t, 20, 150.0).tolist() == [False, True, False, False]


def test_abandoned_timeline_is_dropped(tmp_path) -> None:
    # Trained to 27, crashed, resumed from the checkpoint at 20 and stopped at 22.
    before = [{"step": s, "loss": 3.0, "t": 100.0 + s} for s in range(1, 28)]
    after = [{"step": s, "loss": 2.0, "t": 200.0 + s} for s in (21, 22)]
    w = JsonlWriter(tmp_path / "loss.jsonl")
    for r in before + after:
        w.write(r)
    w.close()
    w = JsonlWriter(tmp_path / "events.jsonl")
    w.write(rec.ResumeEvent(t=150.0, step=20, path="p").to_json())
    w.close()
    kept, bad = read_steps(tmp_path / "loss.jsonl")
    assert [r.step for r in kept] == list(range(1, 23)) and bad == 0
    assert all(r.t > 200 for r in kept if r.step > 20)


def test_later_record_for_a_step_wins() -> None:
    recs = [rec.StepRecord.from_json(o) for o in
            ({"step": 1, "loss": 9.0}, {"step": 2, "loss": 8.0}, {"step": 2, "loss": 7.5})]
    assert [r.loss for r in rec.latest_by_step(recs)] == [9.0, 7.5]


def test_ready_event_without_attention_reads_empty() -> None:
    """A run file from before the field (or a fake run) has no attention: read as ""."""
    obj = next(e for e in EVENTS if isinstance(e, rec.ReadyEvent)).to_json()
    del obj["attention"]
    e = rec.Event.from_json(obj)
    assert isinstance(e, rec.ReadyEvent) and e.attention == ""
    obj["attention"] = 42
    assert rec.Event.from_json(obj).attention == ""


def test_what_ran_is_read_back_from_a_checkpoint_state_and_compared() -> None:
    from engine.run.start import gpu_differences

    state = {rec.STATE_GPU_RAN: {"attention": "classic", "fusions": True, "x" * 100: 1,
                                 "bad": [1], "long": "y" * 100}}
    ran = rec.gpu_ran_of(state)
    assert ran == {"attention": "classic", "fusions": True, "x" * 64: 1}
    assert rec.gpu_ran_of({}) == {} and rec.gpu_ran_of("no") == {}
    assert gpu_differences(ran, {"attention": "cudnn", "fusions": True, "qkv_rows": True}) == [
        'gpu.attention ran as "classic" before the checkpoint and runs as "cudnn" now (where '
        "the GPU could not honour the config, or can now): the bits differ from an "
        "uninterrupted run"]
