"""Checkpoint format, verification, listing, pruning, background writer, kill -9 and full disk."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import signal
import statistics
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine.errors import UserError
from engine.run import checkpoint_write
from engine.run.checkpoint import (
    CheckpointInvalid,
    load_checkpoint,
    state_digest,
    tensor_stats,
    verify_checkpoint,
)
from engine.run.checkpoint_store import find_resume_checkpoint, list_checkpoints, prune_periodic
from engine.run.checkpoint_write import (
    CheckpointInfo,
    CheckpointWriteError,
    CheckpointWriter,
    cleanup_tmp,
    write_checkpoint,
)

REPO = Path(__file__).resolve().parents[1]
TABLE = [
    {"name": "wte", "shape": [10, 4], "offset": 0},
    {"name": "h.0.ln1.gamma", "shape": [4], "offset": 40},
    {"name": "h.0.mlp.W_1", "shape": [4, 6], "offset": 44},
]
N = 68


def arrays(step: int, n: int = N) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    p = rng.standard_normal(n).astype(np.float32)
    m = rng.standard_normal(n).astype(np.float32) * 1e-3
    v = np.abs(rng.standard_normal(n)).astype(np.float32) * 1e-6
    return p, m, v


def state(step: int) -> dict:
    return {"config": {"name": "t"}, "tokens": step * 1024, "rng": {"np": [1, 2, step]},
            "bandit": {"phase": 2, "weights": {"a": 0.25, "b": 0.75}}, "lr": 1e-3 / 3}


def write(root: Path, step: int, reason: str = "periodic") -> CheckpointInfo:
    return write_checkpoint(root, step, *arrays(step), state(step), reason, TABLE)


def test_round_trip_bytes_match_the_contract(tmp_path: Path) -> None:
    p, m, v = arrays(7)
    info = write_checkpoint(tmp_path, 7, p, m, v, state(7), "snapshot", TABLE)
    assert info.path == tmp_path / "step_00000007"
    raw = (info.path / "model.ckpt").read_bytes()
    assert len(raw) == 8 + 12 * N
    assert struct.unpack("<ii", raw[:8]) == (7, N)
    got = np.frombuffer(raw, dtype="<f4", offset=8)
    np.testing.assert_array_equal(got[:N], p)
    np.testing.assert_array_equal(got[N : 2 * N], m)
    np.testing.assert_array_equal(got[2 * N :], v)
    doc = json.loads((info.path / "state.json").read_bytes())
    assert doc["model_ckpt"] == {"sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)}
    assert (doc["format_version"], doc["step"], doc["n_params"], doc["reason"]) == (
        1, 7, N, "snapshot")
    assert doc["tensor_table"] == TABLE
    assert doc["tokens"] == 7 * 1024 and doc["lr"] == 1e-3 / 3  # floats round-trip exactly
    assert info.bytes == len(raw) + (info.path / "state.json").stat().st_size
    ckpt = load_checkpoint(info.path)
    assert ckpt.step == 7 and ckpt.state["rng"] == {"np": [1, 2, 7]}
    for a, b in ((ckpt.params, p), (ckpt.m, m), (ckpt.v, v)):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, b)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_write_rejects_bad_arguments(tmp_path: Path) -> None:
    p, m, v = arrays(1)
    with pytest.raises(ValueError, match="float32"):
        write_checkpoint(tmp_path, 1, p.astype(np.float64), m, v, {}, "periodic", TABLE)
    with pytest.raises(ValueError, match="reason"):
        write_checkpoint(tmp_path, 1, p, m, v, {}, "whenever", TABLE)
    with pytest.raises(ValueError, match="tensor_table"):
        write_checkpoint(tmp_path, 1, p, m, v, {}, "periodic", TABLE[:2])
    with pytest.raises(ValueError, match="must not set"):
        write_checkpoint(tmp_path, 1, p, m, v, {"step": 3}, "periodic", TABLE)
    assert os.listdir(tmp_path) == []


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _edit_state(path: Path, **changes: object) -> None:
    doc = json.loads((path / "state.json").read_bytes())
    doc.update(changes)
    (path / "state.json").write_text(json.dumps(doc))


def test_verify_catches_each_corruption_with_a_precise_reason(tmp_path: Path) -> None:
    expected_size = 8 + 12 * N
    cases = {
        "flipped": ("sha256", lambda d: _flip(d / "model.ckpt", 8 + 4 * N + 5)),
        "truncated": (f"expected {expected_size} bytes (8 + 12 x n_params {N}), got "
                      f"{expected_size - 3}",
                      lambda d: os.truncate(d / "model.ckpt", expected_size - 3)),
        "header_n": ("offset 4: header n_params 69, state.json says 68",
                     lambda d: _patch(d / "model.ckpt", 4, struct.pack("<i", N + 1))),
        "header_step": ("offset 0: header step 9, state.json says",
                        lambda d: _patch(d / "model.ckpt", 0, struct.pack("<i", 9))),
        "edited_state": ("does not match its state_sha256", lambda d: _edit_state(d, tokens=1)),
        "missing_model": ("model.ckpt: missing", lambda d: (d / "model.ckpt").unlink()),
        "missing_state": ("state.json: missing", lambda d: (d / "state.json").unlink()),
        "unparsable": ("unparsable JSON", lambda d: (d / "state.json").write_text('{"step": 1')),
        "missing_field": ("field 'model_ckpt' missing", lambda d: _drop_field(d, "model_ckpt")),
    }
    for i, (name, (why, corrupt)) in enumerate(cases.items()):
        root = tmp_path / name
        info = write(root, 10 + i)
        verify_checkpoint(info.path)  # valid before
        corrupt(info.path)
        with pytest.raises(CheckpointInvalid, match=re.escape(why)):
            verify_checkpoint(info.path)
        with pytest.raises(CheckpointInvalid):
            load_checkpoint(info.path)
        assert issubclass(CheckpointInvalid, UserError)
        [entry] = list_checkpoints(root)
        assert not entry.valid and entry.invalid_reason


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _drop_field(d: Path, key: str) -> None:
    doc = json.loads((d / "state.json").read_bytes())
    del doc[key]
    doc["state_sha256"] = state_digest(doc)  # a consistent state.json that lacks the field
    (d / "state.json").write_text(json.dumps(doc))


def test_tensor_table_must_cover_n_params(tmp_path: Path) -> None:
    info = write(tmp_path, 3)
    doc = json.loads((info.path / "state.json").read_bytes())
    doc["tensor_table"] = TABLE[:2]
    doc["state_sha256"] = state_digest(doc)
    (info.path / "state.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointInvalid, match=f"tensors cover 44 floats, expected n_params = {N}"):
        verify_checkpoint(info.path)


def test_resume_falls_back_to_older_valid_and_says_why(tmp_path: Path) -> None:
    for s in (10, 20, 30):
        write(tmp_path, s)
    (tmp_path / ".tmp-step_00000040-1-abcd").mkdir()  # half-written: never a candidate
    _flip(tmp_path / "step_00000030" / "model.ckpt", 100)
    os.truncate(tmp_path / "step_00000020" / "model.ckpt", 50)
    path, skipped = find_resume_checkpoint(tmp_path)
    assert path == tmp_path / "step_00000010"
    assert [p.name for p, _ in skipped] == ["step_00000030", "step_00000020"]
    assert "sha256" in skipped[0][1] and "size" in skipped[1][1]
    ckpt = load_checkpoint(path)
    np.testing.assert_array_equal(ckpt.params, arrays(10)[0])
    # a run dir works as well as its checkpoints dir
    assert find_resume_checkpoint(tmp_path)[0] == path
    empty = tmp_path / "empty"
    empty.mkdir()
    assert find_resume_checkpoint(empty) == (None, [])


def test_same_step_gets_a_suffix_never_clobbers(tmp_path: Path) -> None:
    a = write(tmp_path, 5, "periodic")
    b = write(tmp_path, 5, "snapshot")
    c = write(tmp_path, 5, "stop")
    assert [a.path.name, b.path.name, c.path.name] == [
        "step_00000005", "step_00000005-2", "step_00000005-3"]
    entries = list_checkpoints(tmp_path)
    assert [e.path.name for e in entries] == ["step_00000005-3", "step_00000005-2", "step_00000005"]
    assert [e.reason for e in entries] == ["stop", "snapshot", "periodic"]
    assert all(e.valid for e in entries)


def test_prune_keeps_newest_valid_periodic_and_never_others(tmp_path: Path) -> None:
    for s in range(1, 7):
        write(tmp_path, s, "periodic")
    write(tmp_path, 2, "snapshot")
    write(tmp_path, 3, "stop")
    write(tmp_path, 6, "final")
    removed = prune_periodic(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == [f"step_0000000{s}" for s in (1, 2, 3, 4)]
    left = {(e.path.name, e.reason) for e in list_checkpoints(tmp_path)}
    assert left == {("step_00000005", "periodic"), ("step_00000006", "periodic"),
                    ("step_00000002-2", "snapshot"), ("step_00000003-2", "stop"),
                    ("step_00000006-2", "final")}
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    # a corrupt newest periodic does not count toward `keep` and is left for inspection
    write(tmp_path, 7, "periodic")
    _flip(tmp_path / "step_00000007" / "model.ckpt", 20)
    assert prune_periodic(tmp_path, keep=2) == []
    write(tmp_path, 8, "periodic")
    assert [p.name for p in prune_periodic(tmp_path, keep=2)] == ["step_00000005"]
    names = {e.path.name for e in list_checkpoints(tmp_path)}
    assert {"step_00000008", "step_00000007", "step_00000006", "step_00000006-2"} <= names
    with pytest.raises(UserError, match="keep"):
        prune_periodic(tmp_path, keep=0)


def test_cleanup_tmp_removes_only_dead_writers(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f".tmp-step_00000001-{dead.pid}-0a1b").mkdir()
    mine = tmp_path / f".tmp-step_00000002-{os.getpid()}-0a1c"
    mine.mkdir()
    (mine / "model.ckpt").write_bytes(b"x")
    write(tmp_path, 3)
    assert [e.path.name for e in list_checkpoints(tmp_path)] == ["step_00000003"]
    assert cleanup_tmp(tmp_path) == [tmp_path / f".tmp-step_00000001-{dead.pid}-0a1b"]
    assert sorted(os.listdir(tmp_path)) == [mine.name, "step_00000003"]


def test_write_error_leaves_nothing_and_keeps_earlier(tmp_path: Path, monkeypatch) -> None:
    good = write(tmp_path, 1)

    def enospc(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_write.os, "fsync", enospc)
    with pytest.raises(CheckpointWriteError, match="ENOSPC"):
        write(tmp_path, 2)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [good.path.name]
    verify_checkpoint(good.path)


def test_tensor_stats_against_statistics_module(tmp_path: Path) -> None:
    info = write(tmp_path, 4)
    ckpt = load_checkpoint(info.path)
    stats = tensor_stats(ckpt)
    assert [s["name"] for s in stats] == [t["name"] for t in TABLE]
    p, m, v = arrays(4)
    for s in stats:
        lo = s["offset"]
        hi = lo + int(np.prod(s["shape"]))
        for key, arr in (("weights", p), ("m", m), ("v", v)):
            xs = [float(x) for x in arr[lo:hi]]
            ref = {"mean": statistics.fmean(xs), "std": statistics.pstdev(xs),
                   "rms": statistics.fmean([x * x for x in xs]) ** 0.5,
                   "max_abs": max(abs(x) for x in xs)}
            for k, want in ref.items():
                assert s[key][k] == pytest.approx(want, rel=1e-12, abs=1e-300), (s["name"], key, k)


# ---------------------------------------------------------------- background writer


def test_writer_busy_coalesce_wait_and_results(tmp_path: Path, monkeypatch) -> None:
    gate = threading.Event()
    real = checkpoint_write.write_checkpoint

    def gated(*args, **kw):
        gate.wait(5)
        return real(*args, **kw)

    monkeypatch.setattr(checkpoint_write, "write_checkpoint", gated)
    w = CheckpointWriter(tmp_path)
    assert not w.busy
    w.submit(3, *arrays(3), state(3), "snapshot", TABLE)
    assert w.busy
    # the loop's coalescing rule: a snapshot request while busy is merged, not submitted
    requests = [4, 5, 6]
    submitted = [s for s in requests if not w.busy]
    assert submitted == []
    assert not w.wait(timeout=0.05)  # still gated
    gate.set()
    assert w.wait(timeout=5)
    assert not w.busy
    [r] = w.poll()
    assert w.poll() == []
    assert r.error is None and r.info is not None and r.info.reason == "snapshot"
    verify_checkpoint(r.info.path)
    assert [e.path.name for e in list_checkpoints(tmp_path)] == ["step_00000003"]
    w.close()


def test_writer_reports_errors_without_raising(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    w = CheckpointWriter(blocker)
    w.submit(1, *arrays(1), state(1), "snapshot", TABLE)
    w.submit(2, *arrays(2), state(2), "snapshot", TABLE)
    assert w.wait(timeout=5)
    results = w.poll()
    assert [r.step for r in results] == [1, 2]
    assert all(r.info is None and r.error and "not written" in r.error for r in results)
    w.close()


# ---------------------------------------------------------------- real processes

KILL_CHILD = textwrap.dedent("""
    import sys, numpy as np
    from pathlib import Path
    from engine.run.checkpoint_store import prune_periodic, list_checkpoints
    from engine.run.checkpoint_write import write_checkpoint
    root, n = Path(sys.argv[1]), int(sys.argv[2])
    table = [{"name": "w", "shape": [n], "offset": 0}]
    entries = list_checkpoints(root, check_hash=False)
    step = entries[0].step + 1 if entries else 1
    base = np.arange(n, dtype=np.float32)
    print("go", flush=True)
    while True:
        p = base + step
        write_checkpoint(root, step, p, p * 2, p * 3, {"tokens": step}, "periodic", table)
        prune_periodic(root, keep=2, check_hash=False)
        step += 1
""")


@pytest.mark.slow
def test_kill9_at_random_moments_never_yields_a_bad_checkpoint(tmp_path: Path) -> None:
    n = 1 << 18  # 3 MiB per checkpoint: several writes per trial, kills land mid-write
    rng = random.Random(1234)
    trials, mid_write, loaded_steps = 24, 0, []
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for _ in range(trials):
        child = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(tmp_path), str(n)],
                                 stdout=subprocess.PIPE, env=env, cwd=REPO)
        assert child.stdout and child.stdout.readline() == b"go\n"
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
        mid_write += bool(cleanup_tmp(tmp_path))
        entries = list_checkpoints(tmp_path)
        # atomic commit: everything that carries a checkpoint name verifies
        assert all(e.valid for e in entries), [e.invalid_reason for e in entries if not e.valid]
        path, skipped = find_resume_checkpoint(tmp_path)
        assert skipped == []
        if path is None:
            continue
        ckpt = load_checkpoint(path)
        want = np.arange(n, dtype=np.float32) + ckpt.step
        np.testing.assert_array_equal(ckpt.params, want)
        np.testing.assert_array_equal(ckpt.v, want * 3)
        assert ckpt.state["tokens"] == ckpt.step
        loaded_steps.append(ckpt.step)
    assert not [d for d in os.listdir(tmp_path) if d.startswith(".tmp-")]
    assert len(loaded_steps) >= trials - 3 and loaded_steps == sorted(loaded_steps)
    assert mid_write >= 3  # the kills really did interrupt writes (temp dirs were left behind)
    print(f"kill -9 trials: {trials}, interrupted mid-write: {mid_write}, "
          f"last step: {loaded_steps[-1]}")


FULL_DISK_CHILD = textwrap.dedent("""
    import json, resource, signal, sys, numpy as np
    from pathlib import Path
    from engine.run.checkpoint_write import CheckpointWriter, CheckpointWriteError, write_checkpoint
    root, n = Path(sys.argv[1]), 4096
    table = [{"name": "w", "shape": [n], "offset": 0}]
    p = np.ones(n, np.float32)
    write_checkpoint(root, 1, p, p, p, {}, "periodic", table)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))  # < 8 + 12 n = 49160 bytes
    out = {}
    try:
        write_checkpoint(root, 2, p, p, p, {}, "stop", table)
    except CheckpointWriteError as e:
        out["sync_error"] = str(e)
    w = CheckpointWriter(root)
    w.submit(3, p.copy(), p.copy(), p.copy(), {}, "snapshot", table)
    w.wait()
    out["async"] = [[r.step, r.error, r.info is not None] for r in w.poll()]
    print(json.dumps(out))
""")


def test_full_disk_reports_error_and_keeps_earlier(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, str(tmp_path)],
                         capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                         cwd=REPO, timeout=60)
    assert res.returncode == 0, res.stderr.decode()
    out = json.loads(res.stdout)
    assert "EFBIG" in out["sync_error"] and "step 2 (stop) not written" in out["sync_error"]
    [[step, error, committed]] = out["async"]
    assert step == 3 and not committed and "EFBIG" in error
    assert os.listdir(tmp_path) == ["step_00000001"]  # no temp dir, no half checkpoint
    [entry] = list_checkpoints(tmp_path)
    assert entry.valid and entry.step == 1


def test_checkpoint_room_counts_keep_and_the_one_being_written(tmp_path: Path,
                                                               monkeypatch) -> None:
    """checkpoint.keep periodic checkpoints and the one being written (the oldest goes only once
    it is complete), less the valid ones already there, at most as many as the run still writes,
    against the file system's free space (a 1.2B model's checkpoint is ~13.7 GiB)."""
    from engine.run import checkpoint_write as cw

    n = 1_227_560_960
    assert cw.model_file_bytes(n) == 8 + 12 * n
    monkeypatch.setattr(cw, "free_bytes", lambda path: 40 * 2**30)
    room = cw.checkpoint_room(tmp_path / "checkpoints", n, keep=2, existing=0, writes=25)
    each = room.each
    assert each >= cw.model_file_bytes(n) and room.peak == 3 * each and room.more == 3 * each
    assert room.free == 40 * 2**30 and room.short  # 3 x 13.7 GiB do not fit in 40 GiB
    # two valid ones there: the next write still needs a whole checkpoint's room
    assert cw.checkpoint_room(tmp_path, n, keep=2, existing=2, writes=25).more == each
    # more left behind than keep (a run killed before it pruned): still one
    assert cw.checkpoint_room(tmp_path, n, keep=2, existing=5, writes=25).more == each
    # a run with one checkpoint left to write needs room for that one only
    assert cw.checkpoint_room(tmp_path, n, keep=2, existing=0, writes=1).more == each
    monkeypatch.setattr(cw, "free_bytes", lambda path: 3 * each)
    assert not cw.checkpoint_room(tmp_path, n, keep=2, existing=0, writes=25).short
    monkeypatch.setattr(cw, "free_bytes", lambda path: 3 * each - 1)
    assert cw.checkpoint_room(tmp_path, n, keep=2, existing=0, writes=25).short
    monkeypatch.setattr(cw, "free_bytes", lambda path: None)
    assert not cw.checkpoint_room(tmp_path, n, keep=2, existing=0, writes=25).short


def test_free_bytes_is_the_file_systems_and_none_where_it_cannot_say(tmp_path: Path) -> None:
    from engine.run.checkpoint_write import free_bytes

    st = os.statvfs(tmp_path)
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail  # root may use the reserve
    got = free_bytes(tmp_path / "not yet")  # the parent's file system
    assert got is not None and abs(got - blocks * st.f_frsize) < 2**30
    assert free_bytes(tmp_path / "no" / "such" / "dir") is None


def test_an_unreadable_checkpoint_directory_is_listed_as_invalid(tmp_path: Path,
                                                                 monkeypatch) -> None:
    """A step directory this process may not look into (stat's EACCES, which Path.is_file
    raises): listed, invalid, no exception (the start's disk forecast and the pruning list the
    checkpoints). The refusal is made by a stand-in: root may look into a directory of mode
    000, and the tests may run as root."""
    from engine.run.checkpoint_store import list_checkpoints

    d = tmp_path / "checkpoints" / "step_00000010"
    d.mkdir(parents=True)
    (d / "state.json").write_text('{"reason": "periodic"}')
    real = Path.is_file

    def is_file(self: Path) -> bool:
        if self.parent == d:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "is_file", is_file)
    [entry] = list_checkpoints(tmp_path)
    assert not entry.valid and "Permission denied" in entry.invalid_reason
