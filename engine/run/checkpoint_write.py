"""Writing checkpoints: atomically and durably, in a background thread, after a room check.

Commit protocol: both files go into `checkpoints/.tmp-step_XXXXXXXX-<pid>-<nonce>/`, each is
fsynced, the temp dir is fsynced, renamed to its final name, and `checkpoints/` is fsynced, so a
checkpoint directory exists complete or not at all; `cleanup_tmp` removes what a crashed writer
left. An existing checkpoint is never clobbered (a snapshot and a periodic checkpoint at the same
step): the new one gets the next free suffix, `step_XXXXXXXX-2`, `-3`, ... The rename itself
decides (renaming a directory onto a non-empty one fails), so two writers cannot race. The
training loop hands its copies to a CheckpointWriter and goes on; `check_room` refuses a write
that cannot succeed before a byte of it is written. The format is engine.run.checkpoint.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import resource
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import RunError
from engine.run.checkpoint import (
    CHUNK_BYTES,
    CORE_FIELDS,
    FORMAT_VERSION,
    HEADER,
    MODEL_FILE,
    REASONS,
    STATE_FILE,
    TMP_RE,
    checkpoint_dirname,
    normalize_tensor_table,
    state_digest,
    table_problem,
    temp_dirname,
)
from engine.runfiles import fsync_dir, pid_alive

WRITER_NICENESS = 10
ROOM_MARGIN_BYTES = 1 << 16  # state.json and the directory entries, beyond model.ckpt
_INT32_MAX = 2**31 - 1


class CheckpointWriteError(RunError):
    """Writing a checkpoint failed (disk full, file too large, I/O error); nothing was committed."""


@dataclass(frozen=True)
class CheckpointInfo:
    """The result of one committed write."""

    path: Path
    step: int
    reason: str
    bytes: int  # model.ckpt + state.json
    seconds: float


def _as_f32(name: str, a: np.ndarray, n: int) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise ValueError(f"checkpoint: {name}: expected float32, got {a.dtype}")
    if a.size != n:
        raise ValueError(f"checkpoint: {name}: expected {n} values, got {a.size}")
    # '<f4' and C order: a view (no copy) for the trainer's flat float32 buffers.
    return np.ascontiguousarray(a.reshape(-1), dtype="<f4")


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _write_model_file(path: Path, step: int, arrays: Sequence[np.ndarray]) -> tuple[str, int]:
    """Stream header + arrays to `path` in chunks, hashing as it goes; fsync. -> (sha256, size)."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    size = 0
    try:
        header = HEADER.pack(step, arrays[0].size)
        h.update(header)
        _write_all(fd, memoryview(header))
        size += len(header)
        for a in arrays:
            raw = memoryview(a).cast("B")
            for start in range(0, len(raw), CHUNK_BYTES):
                chunk = raw[start : start + CHUNK_BYTES]
                h.update(chunk)
                _write_all(fd, chunk)
                size += len(chunk)
        os.fsync(fd)
    finally:
        os.close(fd)
    return h.hexdigest(), size


def _write_bytes_durable(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        _write_all(fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def _empty(d: Path) -> bool:
    return not any(d.iterdir())


def _commit(tmp: Path, root: Path, step: int) -> Path:
    """Rename `tmp` to the first free `step_XXXXXXXX[-k]`; a committed one is never replaced."""
    base = checkpoint_dirname(step)
    for k in range(1, 10_000):
        final = root / (base if k == 1 else f"{base}-{k}")
        if final.is_symlink() or (final.exists() and not (final.is_dir() and _empty(final))):
            continue
        try:
            os.rename(tmp, final)  # onto an existing non-empty dir this fails: no clobbering
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                continue
            raise
        return final
    raise CheckpointWriteError(f"{root}: no free name for {base}")


def _checked_arrays(
    step: int, params: np.ndarray, m: np.ndarray, v: np.ndarray, state: dict[str, Any],
    reason: str, tensor_table: list[dict[str, Any]],
) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
    """The three arrays as little-endian float32 and the normalized tensor table; ValueError
    for arguments that do not make a checkpoint (a caller's bug, not an I/O failure)."""
    if reason not in REASONS:
        raise ValueError(f"checkpoint: reason: expected one of {REASONS}, got {reason!r}")
    n = np.asarray(params).size
    if not (0 <= step <= _INT32_MAX and 0 < n <= _INT32_MAX):
        raise ValueError(f"checkpoint: step {step} / n_params {n} do not fit the int32 header")
    arrays = [_as_f32(k, a, n) for k, a in (("params", params), ("m", m), ("v", v))]
    table = normalize_tensor_table(tensor_table)
    problem = table_problem(table, n)
    if problem:
        raise ValueError(f"checkpoint: tensor_table: {problem}")
    shadowed = sorted(set(state) & set(CORE_FIELDS))
    if shadowed:
        raise ValueError(f"checkpoint: state must not set {shadowed} (written by the checkpointer)")
    return arrays, table


def write_checkpoint(
    ckpt_root: Path,
    step: int,
    params: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    state: dict[str, Any],
    reason: str,
    tensor_table: list[dict[str, Any]],
) -> CheckpointInfo:
    """Write one checkpoint atomically and durably; raise CheckpointWriteError on I/O failure.

    On failure the temp dir is removed (best effort; `cleanup_tmp` gets the rest after a crash)
    and nothing new is committed, so every earlier checkpoint stays as it was.
    """
    t0 = time.perf_counter()
    arrays, table = _checked_arrays(step, params, m, v, state, reason, tensor_table)
    root = Path(ckpt_root)
    tmp = root / temp_dirname(checkpoint_dirname(step))
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        sha, size = _write_model_file(tmp / MODEL_FILE, step, arrays)
        doc = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "n_params": arrays[0].size,
            "model_ckpt": {"sha256": sha, "size": size},
            "tensor_table": table,
            "reason": reason,
            "wall_time": time.time(),
            **state,
        }
        doc["state_sha256"] = state_digest(doc)
        state_bytes = (json.dumps(doc, indent=1) + "\n").encode()
        _write_bytes_durable(tmp / STATE_FILE, state_bytes)
        fsync_dir(tmp)
        final = _commit(tmp, root, step)
        fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(
            f"{root}: checkpoint step {step} ({reason}) not written: "
            f"{e.strerror or e} [{errno.errorcode.get(e.errno or 0, e.errno)}]"
        ) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return CheckpointInfo(final, step, reason, size + len(state_bytes), time.perf_counter() - t0)


def check_room(ckpt_root: Path, step: int, reason: str, n_params: int) -> None:
    """Raise CheckpointWriteError when a checkpoint of `n_params` cannot be written at all, as
    known before a byte is written: model.ckpt is above this process's file-size limit
    (`ulimit -f`), or larger than the free space of the file system. Anything else that fails
    (or a disk filled meanwhile) is reported by the write itself."""
    root = Path(ckpt_root)
    size = model_file_bytes(n_params)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and size > limit:
        why = (f"{os.strerror(errno.EFBIG)} [EFBIG]: {MODEL_FILE} is {size:,} bytes, above the "
               f"file-size limit (ulimit -f) of {limit:,}")
    else:
        free = free_bytes(root)
        if free is None or size + ROOM_MARGIN_BYTES <= free:
            return
        why = (f"{os.strerror(errno.ENOSPC)} [ENOSPC]: {MODEL_FILE} needs {size:,} bytes, the "
               f"file system has {free:,} free")
    raise CheckpointWriteError(f"{root}: checkpoint step {step} ({reason}) not written: {why}")


def model_file_bytes(n_params: int) -> int:
    """The size of a checkpoint's model.ckpt: its header, then fp32 weights, Adam's m and v."""
    return HEADER.size + 12 * n_params


def free_bytes(path: Path) -> int | None:
    """Bytes this process may still write on the file system of `path` (or of its parent, when
    it does not exist yet); None when that is unknown (no such file system, or one that reports
    no blocks)."""
    try:
        st = os.statvfs(path if path.is_dir() else path.parent)
    except OSError:
        return None
    if st.f_blocks == 0:
        return None
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


@dataclass(frozen=True)
class Room:
    """The disk the periodic checkpoints of `checkpoint.keep` need, against the free space: one
    checkpoint is `each` bytes; `peak` is keep of them and the one being written (the oldest
    goes only once the new one is complete); `more` is what the run still adds to the valid
    periodic checkpoints already there (`existing`, of which keep count), at most as many as
    it will still write (`writes`); `free` None when the file system does not say."""

    each: int
    keep: int
    existing: int
    peak: int
    more: int
    free: int | None

    @property
    def short(self) -> bool:
        return self.free is not None and self.more > self.free


def checkpoint_room(ckpt_root: Path, n_params: int, keep: int, existing: int,
                    writes: int) -> Room:
    each = model_file_bytes(n_params) + ROOM_MARGIN_BYTES
    more = max(0, min(keep + 1 - min(existing, keep), writes)) * each
    return Room(each, keep, existing, (keep + 1) * each, more, free_bytes(Path(ckpt_root)))


def cleanup_tmp(ckpt_root: Path) -> list[Path]:
    """Remove leftover `.tmp-*-<pid>-<nonce>` dirs whose writer pid is dead; return them."""
    root = Path(ckpt_root)
    removed: list[Path] = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return removed
    for name in names:
        mt = TMP_RE.match(name)
        if mt and not pid_alive(int(mt.group(1))):
            shutil.rmtree(root / name, ignore_errors=True)
            removed.append(root / name)
    return removed


# ---------------------------------------------------------------- background writer


@dataclass
class WriteResult:
    """A finished background write: `info` on success, `error` (a message) on failure."""

    step: int
    reason: str
    info: CheckpointInfo | None = None
    error: str | None = None


@dataclass
class _Job:
    ckpt_root: Path
    step: int
    params: np.ndarray
    m: np.ndarray
    v: np.ndarray
    state: dict[str, Any]
    reason: str
    tensor_table: list[dict[str, Any]]


class CheckpointWriter:
    """One worker thread that writes checkpoints the training loop has already copied.

    `submit` returns at once; the arrays it gets must stay untouched until the result arrives
    (the trainer hands over its copies). Results are collected with `poll()`. A write error is
    a WriteResult with `error` set, never an exception in the loop. The thread is a daemon: call
    `wait()` (or `close()`) before exiting so writes finish. The worker thread runs at niceness
    +10 so hashing and writing yield the cores to training.
    """

    def __init__(self, ckpt_root: Path) -> None:
        self.ckpt_root = Path(ckpt_root)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._results: list[WriteResult] = []
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A write is queued or in flight (the loop coalesces snapshot requests on this)."""
        with self._lock:
            return self._pending > 0

    def submit(
        self,
        step: int,
        params: np.ndarray,
        m: np.ndarray,
        v: np.ndarray,
        state: dict[str, Any],
        reason: str,
        tensor_table: list[dict[str, Any]],
    ) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("CheckpointWriter is closed")
        with self._lock:
            self._pending += 1
        job = _Job(self.ckpt_root, step, params, m, v, state, reason, tensor_table)
        self._queue.put(job)

    def poll(self) -> list[WriteResult]:
        """Results delivered since the last poll, oldest first."""
        with self._lock:
            out, self._results = self._results, []
        return out

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or in flight; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self.wait()
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        try:
            # Niceness is per thread on Linux: the training loop keeps priority for the cores.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        except (AttributeError, OSError):
            pass
        while (job := self._queue.get()) is not None:
            try:
                info = write_checkpoint(
                    job.ckpt_root, job.step, job.params, job.m, job.v, job.state, job.reason,
                    job.tensor_table,
                )
                result = WriteResult(job.step, job.reason, info=info)
            except Exception as e:  # reported to the loop, which turns it into an error event
                result = WriteResult(job.step, job.reason, error=str(e) or repr(e))
            job = None  # drop the arrays before announcing idleness
            with self._idle:
                self._results.append(result)
                self._pending -= 1
                self._idle.notify_all()
