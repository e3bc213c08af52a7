"""The run-directory reader rules of DESIGN §7: torn lines, repeated steps, abandoned timelines."""

from __future__ import annotations

from pathlib import Path

from engine.runfiles import JsonlTail, JsonlWriter, drop_abandoned, latest_by_step, read_jsonl


def test_later_record_for_a_step_wins() -> None:
    recs = [{"step": 1, "loss": 9.0}, {"step": 2, "loss": 8.0}, {"step": 2, "loss": 7.5}]
    assert [r["loss"] for r in latest_by_step(recs)] == [9.0, 7.5]


def test_abandoned_timeline_is_dropped() -> None:
    # Trained to 27, crashed, resumed from the checkpoint at 20 and stopped at 22.
    before = [{"step": s, "t": 100.0 + s} for s in range(1, 28)]
    after = [{"step": s, "t": 200.0 + s} for s in (21, 22)]
    events = [{"event": "resume", "step": 20, "t": 150.0}]
    kept = latest_by_step(drop_abandoned(before + after, events))
    assert [r["step"] for r in kept] == list(range(1, 23))
    assert all(r["t"] > 200 for r in kept if r["step"] > 20)
    assert drop_abandoned(before, []) == before


def test_torn_line_waits_for_its_end_and_corrupt_lines_are_counted(tmp_path: Path) -> None:
    p = tmp_path / "loss.jsonl"
    w = JsonlWriter(p)
    w.write({"step": 1})
    w.close()
    with p.open("ab") as f:
        f.write(b'not json\n{"step": 2, "lo')
    tail = JsonlTail(p)
    assert [r["step"] for r in tail.read_new()] == [1]
    assert tail.bad_lines == 1
    with p.open("ab") as f:
        f.write(b'ss": 1.5}\n')
    assert tail.read_new() == [{"step": 2, "loss": 1.5}]
    p.write_text('{"step": 9}\n')  # truncated and rewritten: read again from the start
    assert tail.read_new() == [{"step": 9}] and tail.reset
    assert read_jsonl(p) == ([{"step": 9}], 0)
