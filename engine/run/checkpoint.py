"""Checkpoints (DESIGN §6): write atomically, verify, list, load, prune, write in the background.

A checkpoint is `checkpoints/step_XXXXXXXX/` with `model.ckpt` (the seed's binary format,
`[int32 step][int32 n_params][w f32][m f32][v f32]`, little-endian, `8 + 12·n` bytes) and
`state.json` (everything else resume needs, plus the sha256 and size of `model.ckpt`).

Commit protocol: both files go into `checkpoints/.tmp-step_XXXXXXXX-<pid>-<nonce>/`, each is
fsynced, the temp dir is fsynced, renamed to its final name, and `checkpoints/` is fsynced. A
name that starts with `.tmp-` is never a checkpoint. Verification does not trust the name: size,
header against state.json, tensor table and sha256 are all checked. state.json also carries
`state_sha256`, a digest of its own canonical content, so an edited RNG/sampler state is caught too.

Name collisions (a snapshot and a periodic checkpoint at the same step): an existing checkpoint is
never clobbered. The new one gets the next free suffix, `step_XXXXXXXX-2`, `-3`, ... The rename
itself decides (renaming a directory onto a non-empty one fails), so two writers cannot race.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import re
import resource
import secrets
import shutil
import stat
import struct
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine import infile, jsonio
from engine.errors import RunError, UserError
from engine.runfiles import CHECKPOINTS, fsync_dir, pid_alive

FORMAT_VERSION = 1
MODEL_FILE = "model.ckpt"
STATE_FILE = "state.json"
HEADER = struct.Struct("<ii")
REASONS = ("periodic", "snapshot", "stop", "final")
CHUNK_BYTES = 8 << 20  # large enough for full disk bandwidth, small enough to stay out of the way

WRITER_NICENESS = 10

_NAME_RE = re.compile(r"^step_(\d{8})(?:-(\d+))?$")
_TMP_RE = re.compile(r"^\.tmp-.*-(\d+)-[0-9a-f]+$")
# Fields written by this module; the trainer's `state` must not shadow them.
CORE_FIELDS = (
    "format_version", "step", "n_params", "model_ckpt", "tensor_table", "reason", "wall_time",
    "state_sha256",
)
_INT32_MAX = 2**31 - 1
NAMED_SKIPPED = 5  # a resume names this many of the entries it passed over, then counts the rest


class CheckpointInvalid(UserError):
    """A checkpoint that must not be loaded; the message says exactly why."""


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


@dataclass(frozen=True)
class CheckpointEntry:
    """One directory of `checkpoints/` as seen by a lister (never raises on bad entries)."""

    path: Path
    step: int
    reason: str | None
    wall_time: float | None
    bytes: int
    valid: bool
    invalid_reason: str | None


@dataclass
class Checkpoint:
    """A loaded, verified checkpoint. `state` is the whole state.json object."""

    path: Path
    step: int
    params: np.ndarray
    m: np.ndarray
    v: np.ndarray
    state: dict[str, Any]

    @property
    def tensor_table(self) -> list[dict[str, Any]]:
        return self.state["tensor_table"]


def checkpoint_dirname(step: int) -> str:
    return f"step_{step:08d}"


def ckpt_root_of(path: Path) -> Path:
    """`path/checkpoints` when `path` is a run directory, else `path` itself."""
    path = Path(path)
    return path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path


# ---------------------------------------------------------------- writing


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
    if reason not in REASONS:
        raise ValueError(f"checkpoint: reason: expected one of {REASONS}, got {reason!r}")
    n = np.asarray(params).size
    if not (0 <= step <= _INT32_MAX and 0 < n <= _INT32_MAX):
        raise ValueError(f"checkpoint: step {step} / n_params {n} do not fit the int32 header")
    arrays = [_as_f32(k, a, n) for k, a in (("params", params), ("m", m), ("v", v))]
    table = normalize_tensor_table(tensor_table)
    problem = _table_problem(table, n)
    if problem:
        raise ValueError(f"checkpoint: tensor_table: {problem}")
    shadowed = sorted(set(state) & set(CORE_FIELDS))
    if shadowed:
        raise ValueError(f"checkpoint: state must not set {shadowed} (written by the checkpointer)")

    root = Path(ckpt_root)
    tmp = root / f".tmp-{checkpoint_dirname(step)}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        sha, size = _write_model_file(tmp / MODEL_FILE, step, arrays)
        doc = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "n_params": n,
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


ROOM_MARGIN_BYTES = 1 << 16  # state.json and the directory entries, beyond model.ckpt


def check_room(ckpt_root: Path, step: int, reason: str, n_params: int) -> None:
    """Raise CheckpointWriteError when a checkpoint of `n_params` cannot be written at all, as
    known before a byte is written: model.ckpt is above this process's file-size limit
    (`ulimit -f`), or larger than the free space of the file system. Anything else that fails
    (or a disk filled meanwhile) is reported by the write itself."""
    root = Path(ckpt_root)
    size = HEADER.size + 12 * n_params
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and size > limit:
        why = (f"{os.strerror(errno.EFBIG)} [EFBIG]: {MODEL_FILE} is {size:,} bytes, above the "
               f"file-size limit (ulimit -f) of {limit:,}")
    else:
        try:
            st = os.statvfs(root if root.is_dir() else root.parent)
        except OSError:
            return
        free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
        if st.f_blocks == 0 or size + ROOM_MARGIN_BYTES <= free:
            return  # (a file system that reports no blocks says nothing of its room)
        why = (f"{os.strerror(errno.ENOSPC)} [ENOSPC]: {MODEL_FILE} needs {size:,} bytes, the "
               f"file system has {free:,} free")
    raise CheckpointWriteError(f"{root}: checkpoint step {step} ({reason}) not written: {why}")


def cleanup_tmp(ckpt_root: Path) -> list[Path]:
    """Remove leftover `.tmp-*-<pid>-<nonce>` dirs whose writer pid is dead; return them."""
    root = Path(ckpt_root)
    removed: list[Path] = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return removed
    for name in names:
        mt = _TMP_RE.match(name)
        if mt and not pid_alive(int(mt.group(1))):
            shutil.rmtree(root / name, ignore_errors=True)
            removed.append(root / name)
    return removed


# ---------------------------------------------------------------- verification


def normalize_tensor_table(table: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tensor table as a list of {name: str, shape: [int], offset: int} (extra keys dropped)."""
    return [{"name": str(t["name"]), "shape": [int(s) for s in t["shape"]],
             "offset": int(t["offset"])} for t in table]


def _table_problem(table: list[dict[str, Any]], n: int) -> str | None:
    """None when the tensors tile [0, n) exactly in order, else what is wrong."""
    pos = 0
    for t in sorted(table, key=lambda t: t["offset"]):
        if t["offset"] != pos:
            return f"tensor {t['name']!r} starts at offset {t['offset']}, expected {pos}"
        pos += int(np.prod(t["shape"], dtype=np.int64))
    if pos != n:
        return f"tensors cover {pos} floats, expected n_params = {n}"
    return None


def state_digest(doc: dict[str, Any]) -> str:
    """sha256 of state.json's content without its own digest field (canonical JSON).

    Catches any edit of state.json (RNG states, sampler, ...), not just of the fields that the
    size and header checks bind. Python's JSON floats round-trip exactly, so this is stable.
    """
    body = {k: v for k, v in doc.items() if k != "state_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_structure(path: Path, doc: Any = None) -> tuple[dict[str, Any], int]:
    """Every check but the hash; returns (state.json object, n_params). Raises CheckpointInvalid.
    `doc`: state.json as the caller already read it (None: read it here)."""
    try:
        return _check_structure_unguarded(Path(path), doc)
    except OSError as e:
        raise CheckpointInvalid(f"{path}: unreadable ({e})") from None


def _require_file(f: Path) -> None:
    """CheckpointInvalid unless `f` is a regular file (a FIFO, a device or a socket is never
    opened: reading one could wait for ever)."""
    try:
        mode = os.stat(f).st_mode
    except FileNotFoundError:
        raise CheckpointInvalid(f"{f}: missing") from None
    if not stat.S_ISREG(mode):
        raise CheckpointInvalid(str(infile.refusal(f, mode)))


def _read_state(state_path: Path) -> Any:
    try:
        return jsonio.load_file(state_path, max_bytes=jsonio.STATE_BYTES)
    except jsonio.JsonError as e:
        raise CheckpointInvalid(f"unparsable JSON: {e}") from None


def _check_structure_unguarded(path: Path, doc: Any = None) -> tuple[dict[str, Any], int]:
    model, state_path = path / MODEL_FILE, path / STATE_FILE
    if not path.is_dir():
        raise CheckpointInvalid(f"{path}: not a checkpoint directory")
    for f in (state_path, model):
        _require_file(f)
    if doc is None:
        doc = _read_state(state_path)
    if not isinstance(doc, dict):
        raise CheckpointInvalid(f"{state_path}: expected a JSON object")
    for k in CORE_FIELDS:
        if k not in doc:
            raise CheckpointInvalid(f"{state_path}: field {k!r} missing")
    if state_digest(doc) != doc["state_sha256"]:
        raise CheckpointInvalid(f"{state_path}: content does not match its state_sha256 (edited?)")
    if doc["format_version"] != FORMAT_VERSION:
        raise CheckpointInvalid(
            f"{state_path}: format_version: expected {FORMAT_VERSION}, got {doc['format_version']!r}"
        )
    step, n, mc = doc["step"], doc["n_params"], doc["model_ckpt"]
    if not (_is_int(step) and _is_int(n) and step >= 0 and n > 0):
        raise CheckpointInvalid(f"{state_path}: step/n_params: expected integers, got {step!r}/{n!r}")
    if not (isinstance(mc, dict) and isinstance(mc.get("sha256"), str) and _is_int(mc.get("size"))):
        raise CheckpointInvalid(f"{state_path}: model_ckpt: expected {{sha256, size}}, got {mc!r}")
    mt = _NAME_RE.match(path.name)
    if mt and int(mt.group(1)) != step:
        raise CheckpointInvalid(f"{state_path}: step: {step} does not match directory {path.name}")
    expected = HEADER.size + 12 * n
    actual = model.stat().st_size
    if actual != expected:
        raise CheckpointInvalid(
            f"{model}: size: expected {expected} bytes (8 + 12 x n_params {n}), got {actual}"
        )
    if mc["size"] != actual:
        raise CheckpointInvalid(f"{state_path}: model_ckpt.size {mc['size']} != file size {actual}")
    with infile.open_regular(model) as f:
        h_step, h_n = HEADER.unpack(f.read(HEADER.size))
    if h_step != step:
        raise CheckpointInvalid(f"{model}: offset 0: header step {h_step}, state.json says {step}")
    if h_n != n:
        raise CheckpointInvalid(f"{model}: offset 4: header n_params {h_n}, state.json says {n}")
    try:
        table = normalize_tensor_table(doc["tensor_table"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointInvalid(f"{state_path}: tensor_table: malformed ({e!r})") from None
    problem = _table_problem(table, n)
    if problem:
        raise CheckpointInvalid(f"{state_path}: tensor_table: {problem}")
    return doc, n


def _hash_mismatch(path: Path, expected: str, got: str) -> CheckpointInvalid:
    return CheckpointInvalid(
        f"{path / MODEL_FILE}: sha256 {got[:16]}... does not match state.json {expected[:16]}..."
    )


def verify_checkpoint(path: Path, *, check_hash: bool = True,
                      doc: Any = None) -> dict[str, Any]:
    """Raise CheckpointInvalid(reason) unless `path` is a complete, consistent checkpoint;
    returns its state.json object. `doc`: that object as the caller already read it."""
    doc, _ = _check_structure(Path(path), doc)
    if check_hash:
        h = hashlib.sha256()
        try:
            with infile.open_regular(Path(path) / MODEL_FILE) as f:
                while chunk := f.read(CHUNK_BYTES):
                    h.update(chunk)
        except OSError as e:
            raise CheckpointInvalid(f"{path}: unreadable ({e})") from None
        if h.hexdigest() != doc["model_ckpt"]["sha256"]:
            raise _hash_mismatch(Path(path), doc["model_ckpt"]["sha256"], h.hexdigest())
    return doc


# ---------------------------------------------------------------- listing and loading


def checkpoint_entry(path: Path, *, check_hash: bool = True) -> CheckpointEntry:
    """One checkpoint directory as a lister shows it (never raises on a bad one); state.json is
    read once."""
    mt = _NAME_RE.match(path.name)
    step = int(mt.group(1)) if mt else -1
    size = 0
    for f in (MODEL_FILE, STATE_FILE):
        try:
            st = (path / f).stat()
            size += st.st_size if stat.S_ISREG(st.st_mode) else 0
        except OSError:
            pass
    doc: Any = None
    try:
        if (path / STATE_FILE).is_file():
            doc = _read_state(path / STATE_FILE)
        # turns OSError into CheckpointInvalid
        verify_checkpoint(path, check_hash=check_hash, doc=doc)
        valid, why = True, None
    except CheckpointInvalid as e:
        valid, why = False, str(e)
    doc = doc if isinstance(doc, dict) else {}
    reason = doc.get("reason") if isinstance(doc.get("reason"), str) else None
    wall = doc.get("wall_time") if isinstance(doc.get("wall_time"), (int, float)) else None
    return CheckpointEntry(path, step, reason, wall, size, valid, why)


def _sort_key(path: Path) -> tuple[int, int]:
    mt = _NAME_RE.match(path.name)
    assert mt
    return int(mt.group(1)), int(mt.group(2) or 1)


def _checkpoint_dirs(root: Path) -> list[Path]:
    try:
        with os.scandir(root) as it:  # the directory test comes from the listing itself
            dirs = [root / e.name for e in it if _NAME_RE.match(e.name) and _is_dir(e)]
    except OSError:
        return []
    return sorted(dirs, key=_sort_key, reverse=True)


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def checkpoint_dirs(path: Path) -> list[Path]:
    """The `step_*` directories of a run dir or a checkpoints dir, newest first: names and
    directory tests only, nothing opened (what a browser shows before verifying)."""
    return _checkpoint_dirs(ckpt_root_of(Path(path)))


def list_checkpoints(path: Path, *, check_hash: bool = True) -> list[CheckpointEntry]:
    """Checkpoints of a run dir or a checkpoints dir, newest first (by step, then suffix).

    Temp dirs (`.tmp-*`) are never listed. `check_hash=False` skips the sha256 (fast listing).
    """
    return [checkpoint_entry(p, check_hash=check_hash) for p in checkpoint_dirs(path)]


def find_resume_checkpoint(ckpt_root: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint that verifies (None if none does) and the newer ones skipped, why.

    The skipped list names the first NAMED_SKIPPED; one more item, for the checkpoints
    directory, counts the rest (a run directory may hold thousands of broken `step_*` entries:
    one line each would drown the log; `andrea-ckpt verify` lists them all)."""
    skipped: list[tuple[Path, str]] = []
    root = ckpt_root_of(Path(ckpt_root))
    found = None
    more: list[Path] = []
    for p in _checkpoint_dirs(root):
        try:
            verify_checkpoint(p)
        except CheckpointInvalid as e:
            if len(skipped) < NAMED_SKIPPED:
                skipped.append((p, str(e)))
            else:
                more.append(p)
            continue
        found = p
        break
    if more:
        skipped.append((root, f"and {len(more):,} more that do not verify ({more[0].name} down "
                              f"to {more[-1].name}; andrea-ckpt verify {root} lists each)"))
    return found, skipped



def resume_point(ckpt_root: Path) -> str:
    """Where a `--resume` of the run continues, in words: its newest valid checkpoint."""
    path, _ = find_resume_checkpoint(ckpt_root)
    if path is None:
        return "no checkpoint of this run is valid: `--resume` would start it afresh"
    return f"the newest valid checkpoint is {path}: `--resume` continues from it"

def summarize(items: Sequence[str], first: int = NAMED_SKIPPED, sep: str = ", ") -> str:
    """`a, b, c` or, for a long list, its first few and `and N more`."""
    head = sep.join(items[:first])
    return head if len(items) <= first else f"{head} and {len(items) - first:,} more"


def load_checkpoint(path: Path) -> Checkpoint:
    """Read and verify a checkpoint in one pass over model.ckpt (hash computed while reading)."""
    path = Path(path)
    doc, n = _check_structure(path)
    buf = np.empty(3 * n, dtype="<f4")
    raw = memoryview(buf).cast("B")
    h = hashlib.sha256()
    try:
        with infile.open_regular(path / MODEL_FILE, buffering=0) as f:
            h.update(f.read(HEADER.size))
            pos = 0
            while pos < len(raw):
                got = f.readinto(raw[pos : pos + CHUNK_BYTES])
                if not got:
                    raise CheckpointInvalid(
                        f"{path / MODEL_FILE}: offset {8 + pos}: file ended early"
                    )
                h.update(raw[pos : pos + got])
                pos += got
    except OSError as e:
        raise CheckpointInvalid(f"{path}: unreadable ({e})") from None
    if h.hexdigest() != doc["model_ckpt"]["sha256"]:
        raise _hash_mismatch(path, doc["model_ckpt"]["sha256"], h.hexdigest())
    buf = buf.astype(np.float32, copy=False)  # native order (a no-op on little-endian hosts)
    return Checkpoint(path, doc["step"], buf[:n], buf[n : 2 * n], buf[2 * n :], doc)


def _remove_checkpoint(path: Path) -> None:
    """Rename out of the checkpoint namespace first, so a crash mid-delete leaves only a temp dir."""
    doomed = path.parent / f".tmp-{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _unwritable(d: Path) -> str | None:
    """Why entries of directory `d` cannot be renamed or removed; None when they can."""
    if os.access(d, os.W_OK | os.X_OK):
        return None
    try:
        if os.statvfs(d).f_flag & os.ST_RDONLY:
            return "read-only file system"
    except OSError as e:
        return e.strerror or str(e)
    return "permission denied"


def prune(ckpt_root: Path, keep: int, reasons: Collection[str], *, check_hash: bool = True,
          dry_run: bool = False, all_or_nothing: bool = False) -> list[Path]:
    """Delete checkpoints whose reason is in `reasons` beyond the newest `keep` valid ones;
    return what was (or, with dry_run, would be) deleted.

    Never touches a checkpoint of another reason or whose reason cannot be read, nor the newest
    valid checkpoint of the run (what a resume starts from). Invalid ones older than the oldest
    kept one go too; newer invalid ones stay for inspection. Call it only after a newer
    checkpoint is committed. `all_or_nothing` (andrea-ckpt prune): where one of them could not
    be deleted (a read-only directory), UserError before any is, naming the directory and why.
    """
    if keep < 1:
        raise UserError(f"--keep: expected an integer >= 1, got {keep}")
    root = ckpt_root_of(Path(ckpt_root))
    entries = list_checkpoints(root, check_hash=check_hash)  # newest first
    newest_valid = next((e.path for e in entries if e.valid), None)
    kept = 0
    doomed: list[Path] = []
    for e in entries:
        if e.reason not in reasons:
            continue
        if kept < keep or e.path == newest_valid:
            kept += e.valid
            continue
        doomed.append(e.path)
    if dry_run or not doomed:
        return doomed
    if all_or_nothing:
        # a checkpoint goes by a rename in `root`, then its files by unlinks in its own directory
        for d in (root, *doomed):
            why = _unwritable(d)
            if why is not None:
                raise UserError(f"{d}: cannot delete checkpoints here ({why}); nothing was "
                                "removed")
    removed: list[Path] = []
    for path in doomed:
        try:
            _remove_checkpoint(path)
        except OSError as e:
            if not all_or_nothing:
                raise
            raise UserError(f"{path.parent}: cannot delete {path.name} ({e.strerror or e}); "
                            f"{len(removed)} checkpoint(s) removed before it, each whole, the "
                            "others left as they were") from None
        removed.append(path)
    fsync_dir(root)
    return removed


def prune_periodic(ckpt_root: Path, keep: int, *, check_hash: bool = True) -> list[Path]:
    """checkpoint.keep: periodic checkpoints beyond the newest `keep` valid ones go."""
    return prune(ckpt_root, keep, ("periodic",), check_hash=check_hash)


MANUAL_REASONS = ("snapshot", "stop")


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
    done: threading.Event = field(default_factory=threading.Event)


class CheckpointWriter:
    """One worker thread that writes checkpoints the training loop has already copied.

    `submit` returns at once; the arrays it gets must stay untouched until the result arrives
    (the trainer hands over its copies). Results are collected with `poll()`. A write error is a WriteResult with `error` set, never an exception in the
    loop. The thread is a daemon: call `wait()` (or `close()`) before exiting so writes finish.
    The worker thread runs at niceness +10 so hashing and writing yield the cores to training.
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


# ---------------------------------------------------------------- statistics


def _stats(x: np.ndarray) -> dict[str, float]:
    x64 = x.astype(np.float64)
    if x64.size == 0:
        return {"mean": 0.0, "std": 0.0, "rms": 0.0, "max_abs": 0.0}
    return {
        "mean": float(x64.mean()),
        "std": float(x64.std()),
        "rms": float(np.sqrt(np.mean(x64 * x64))),
        "max_abs": float(np.max(np.abs(x64))),
    }


def tensor_stats(ckpt: Checkpoint) -> list[dict[str, Any]]:
    """Per tensor: name, shape, offset, and mean/std/rms/max_abs of weights, m and v (float64)."""
    out = []
    for t in normalize_tensor_table(ckpt.tensor_table):
        size = int(np.prod(t["shape"], dtype=np.int64))
        sl = slice(t["offset"], t["offset"] + size)
        out.append({
            **t,
            "weights": _stats(ckpt.params[sl]),
            "m": _stats(ckpt.m[sl]),
            "v": _stats(ckpt.v[sl]),
        })
    return out
