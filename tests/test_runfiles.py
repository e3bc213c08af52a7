"""Reading run files as another process appends to them: torn lines, corrupt lines, truncation."""

from __future__ import annotations

from pathlib import Path

from engine.runfiles import JsonlTail, JsonlWriter, read_jsonl


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
