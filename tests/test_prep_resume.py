"""Interrupted prep (SIGTERM, kill -9, a full disk) leaves no shard that looks complete and is
not; the next run continues from the last commit, says so, and writes the same shard as an
uninterrupted run. Memory does not grow with the size of a source. Real processes, real signals.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.data import prep as prep_module
from engine.data.partial import PartialShard
from engine.data.prep import prepare
from engine.errors import RunError
from tests.corpora import prose
from tests.procs import descendants, measure, running
from tests.test_prep_stream import make_config

pytest.importorskip("tiktoken")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokfile(prepared_data):
    return prepared_data / "tokenizer.json"


def write_cfg(tmp_path: Path, data_dir: Path, sources: list[dict], tokfile: Path) -> Path:
    cfg = make_config(data_dir, sources, tokfile)
    path = tmp_path / f"{data_dir.name}.json"
    path.write_text(json.dumps(cfg.to_json()))
    return path


def start_prep(cfg: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "engine.data.prep", str(cfg), *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def committed_parts(journal: Path) -> int:
    try:
        return json.loads(journal.read_text())["parts"]
    except (OSError, ValueError, KeyError):
        return 0


def wait_for_commit(proc: subprocess.Popen[str], journal: Path, more_than: int) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        n = committed_parts(journal)
        if n > more_than:
            return n
        assert proc.poll() is None, f"prep ended before a commit: {proc.stdout.read()}"
        time.sleep(0.01)
    raise AssertionError("no commit within 60 s")


def test_sigterm_then_kill_9_then_a_complete_identical_shard(tmp_path, tokfile):
    src = tmp_path / "book.txt"
    src.write_text(prose(8_000_000), encoding="utf-8")
    sources = [{"name": "book", "paths": [str(src)]}]
    reference = prepare(make_config(tmp_path / "ref", sources, tokfile),
                        progress=lambda e: None, jobs=2, part_bytes=256 << 10)
    cfg = write_cfg(tmp_path, tmp_path / "data", sources, tokfile)
    shards = tmp_path / "data" / "shards"
    journal = shards / ".book.bin.journal"
    slow = ("--encoder", "hf", "--jobs", "1", "--part-mb", "0.25")  # HF: slow enough to catch

    first = start_prep(cfg, *slow)
    n1 = wait_for_commit(first, journal, 0)
    first.send_signal(signal.SIGTERM)
    out, _ = first.communicate(timeout=30)
    assert first.returncode == 130, out
    assert "book: stopped at part" in out and "run andrea-prep again to continue" in out
    assert not (shards / "book.bin").exists()
    n1 = committed_parts(journal)  # the stop committed what was written

    second = start_prep(cfg, *slow)
    n2 = wait_for_commit(second, journal, n1)
    workers = descendants(second.pid)
    assert workers  # the encoder process
    second.kill()  # kill -9: no handler runs
    second.wait(timeout=30)
    deadline = time.monotonic() + 10
    while any(map(running, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(running, workers)), "an encoder process outlived prep"
    assert not (shards / "book.bin").exists()

    third = start_prep(cfg, "--jobs", "2", "--part-mb", "0.25")  # tiktoken: the same ids
    out, _ = third.communicate(timeout=120)
    assert third.returncode == 0, out
    assert "book: resuming at part" in out and "kept from an interrupted run" in out
    kept = int(out.split("book: resuming at part ")[1].split()[0]) - 1
    assert kept >= n2 > n1 > 0
    assert (shards / "book.bin").read_bytes() == reference.shard_paths["book"].read_bytes()
    assert sorted(p.name for p in shards.iterdir()) == ["book.bin"]  # no partial, no tmp


def fill_disk_at_part(monkeypatch, n: int) -> None:
    """The n-th part's write fails as on a full disk (in this process)."""
    append = PartialShard.append
    calls = []

    def full_disk(self, *args):
        calls.append(1)
        if len(calls) == n:
            raise self._error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        append(self, *args)

    monkeypatch.setattr(PartialShard, "append", full_disk)
    monkeypatch.setattr(prep_module, "COMMIT_S", 0.0)  # commit after every part


@pytest.fixture
def book(tmp_path, tokfile):
    src = tmp_path / "book.txt"
    src.write_text(prose(2_000_000), encoding="utf-8")
    sources = [{"name": "book", "paths": [str(src)]}]
    reference = prepare(make_config(tmp_path / "ref", sources, tokfile),
                        progress=lambda e: None, jobs=2, part_bytes=256 << 10)
    return sources, reference.shard_paths["book"].read_bytes()


def test_a_full_disk_keeps_committed_parts_and_the_next_run_continues(tmp_path, tokfile, book,
                                                                     monkeypatch):
    sources, reference = book
    cfg = make_config(tmp_path / "data", sources, tokfile)
    with monkeypatch.context() as m:
        fill_disk_at_part(m, 4)
        with pytest.raises(RunError, match=r"\.book\.bin\.partial: cannot write \(No space left "
                                           r"on device\); 3 part\(s\), .* are kept"):
            prepare(cfg, progress=lambda e: None, jobs=2, part_bytes=256 << 10)
    assert not (tmp_path / "data" / "shards" / "book.bin").exists()
    log = []
    again = prepare(cfg, progress=lambda e: log.append(e.message), jobs=2, part_bytes=256 << 10)
    assert again.resumed == ["book"]
    assert any(m.startswith("book: resuming at part 4 of ") for m in log)
    assert again.shard_paths["book"].read_bytes() == reference


def test_a_crash_before_the_rename_completes_from_the_journal(tmp_path, tokfile, book,
                                                              monkeypatch):
    sources, reference = book
    cfg = make_config(tmp_path / "data", sources, tokfile)
    with monkeypatch.context() as m:
        m.setattr(prep_module, "COMMIT_S", 0.0)

        def crash(self):
            raise self._error(OSError(errno.EIO, os.strerror(errno.EIO)))

        m.setattr(PartialShard, "finish", crash)
        with pytest.raises(RunError, match="Input/output error"):
            prepare(cfg, progress=lambda e: None, jobs=2, part_bytes=256 << 10)
    log = []
    again = prepare(cfg, progress=lambda e: log.append(e.message), jobs=2, part_bytes=256 << 10)
    assert any(m.startswith("book: all ") and "completing the shard" in m for m in log)
    assert again.shard_paths["book"].read_bytes() == reference


def test_an_unfinished_shard_of_other_inputs_is_discarded_and_said(tmp_path, tokfile, book,
                                                                   monkeypatch):
    sources, reference = book
    cfg = make_config(tmp_path / "data", sources, tokfile)
    with monkeypatch.context() as m:
        fill_disk_at_part(m, 3)
        with pytest.raises(RunError):
            prepare(cfg, progress=lambda e: None, jobs=1, part_bytes=256 << 10)
    log = []
    again = prepare(cfg, progress=lambda e: log.append(e.message), jobs=2, part_bytes=100_000)
    assert again.resumed == []
    assert any(m.startswith("book: an unfinished shard from other inputs") for m in log)
    assert again.shard_paths["book"].read_bytes() == reference


def peak_rss_of_prep(cfg: Path, *args: str) -> int:
    _, peak, rc, out = measure([sys.executable, "-m", "engine.data.prep", str(cfg), *args], ROOT,
                               every_s=0.02)
    assert rc == 0, out
    return peak


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_memory_does_not_grow_with_the_size_of_a_single_document(tmp_path, tokfile):
    """One text file is one document; held whole (with its ids as Python ints, 36 bytes a
    token) it would cost its size many times over. Streamed, 40 MB more of it costs nothing
    measurable."""
    peaks = {}
    for mb in (8, 48):
        src = tmp_path / f"one-{mb}.txt"
        src.write_text(prose(mb * 1_000_000, seed=mb), encoding="utf-8")
        cfg = write_cfg(tmp_path, tmp_path / f"d{mb}", [{"name": "one", "paths": [str(src)]}],
                        tokfile)
        peaks[mb] = peak_rss_of_prep(cfg, "--jobs", "2", "--part-mb", "1")
    assert peaks[48] < peaks[8] + 25_000_000, peaks
    assert peaks[48] < 600_000_000, peaks  # three processes: the parent and two encoders


@pytest.mark.parametrize("change", [
    {"tokens": -4}, {"parts": True}, {"nbytes": "12"}, {"parts": 99}, {"tokens": 10**9},
    {"version": 2}, {"key": {"fingerprint": "other"}}, None,
])
def test_a_hostile_journal_is_never_continued(tmp_path, change):
    import numpy as np

    key = {"fingerprint": "f", "tokenizer": "t", "plan": "p", "n_parts": 3}
    sha = "ab" * 32
    shard = PartialShard(tmp_path / "s.bin", 8449, sha, key)
    assert shard.open() == "new"
    shard.append(np.arange(10, dtype=np.uint16), 100, 1)
    shard.commit()
    shard.close()
    record = json.loads(shard.journal.read_text())
    shard.journal.write_text("{not json" if change is None else json.dumps({**record, **change}))
    again = PartialShard(tmp_path / "s.bin", 8449, sha, key)
    assert again.open() == "restarted"
    assert again.committed.tokens == 0
    again.append(np.arange(5, dtype=np.uint16), 50, 1)
    assert again.finish() == 5
    assert not again.partial.exists() and not again.journal.exists()
    assert (tmp_path / "s.bin").stat().st_size == 64 + 2 * 5  # none of the old tokens
