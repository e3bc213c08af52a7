"""The run directory on disk (DESIGN §7): file names, safe writes for the engine, tails for the app.

Where each file lives and how it is written and read safely; what a record holds is
engine.records. Writers append whole lines and replace JSON files atomically; readers tolerate a
torn last line, corrupt lines, truncation and replacement of a file. Standard library only: the
app reads run directories through it.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import infile, jsonio
from engine.errors import UserError
from engine.records import (
    Event,
    ResumeEvent,
    RunStatus,
    StepOrder,
    StepRecord,
    as_int,
    drop_abandoned,
    latest_by_step,
    parse_all,
)

CONFIG = "config.json"
ENGINE = "engine.json"
LOCK = "engine.lock"
LOG = "engine.log"
LOSS = "loss.jsonl"
EVENTS = "events.jsonl"
SAMPLES = "samples.jsonl"
EVAL = "eval.jsonl"
SYSTEM = "system.jsonl"
STATE = "state.json"
GEMM_PLAN = "gemm_plan.json"
CHECKPOINTS = "checkpoints"

SMALL_JSON_BYTES = 1 << 20  # state.json, engine.json, config.json: a few KB each
MAX_LINE_BYTES = 1 << 20  # a record is a few hundred bytes; a longer line is not one of ours
CHUNK_BYTES = 4 << 20  # what one read of a growing file takes at most


@dataclass(frozen=True)
class RunPaths:
    """Where each file of a run directory lives."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def engine(self) -> Path:
        return self.root / ENGINE

    @property
    def lock(self) -> Path:
        return self.root / LOCK

    @property
    def log(self) -> Path:
        return self.root / LOG

    @property
    def loss(self) -> Path:
        return self.root / LOSS

    @property
    def events(self) -> Path:
        return self.root / EVENTS

    @property
    def samples(self) -> Path:
        return self.root / SAMPLES

    @property
    def eval(self) -> Path:
        return self.root / EVAL

    @property
    def system(self) -> Path:
        return self.root / SYSTEM

    @property
    def state(self) -> Path:
        return self.root / STATE

    @property
    def gemm_plan(self) -> Path:
        return self.root / GEMM_PLAN

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS


def has_checkpoints(run_dir: Path) -> bool:
    """True when the run directory holds at least one checkpoint directory (committed or not)."""
    root = Path(run_dir) / CHECKPOINTS
    return root.is_dir() and any(p.name.startswith("step_") for p in root.iterdir())


def refuse_overwrite(run_dir: Path, resume: bool) -> None:
    """A run directory that holds checkpoints is never trained over without --resume (§10)."""
    if not resume and has_checkpoints(run_dir):
        raise UserError(f"{run_dir}: already holds checkpoints; pass --resume to continue this "
                        "run, or choose another --run-dir (nothing was changed)")


# ---------------------------------------------------------------- writing (engine side)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace `path` with `data`: readers see the old file or the new one, never a mix. On
    failure (a full disk, a removed directory) no temporary file is left behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


def write_json_atomic(path: Path, obj: Any, *, durable: bool = True) -> None:
    """Replace `path` with `obj` as JSON, atomically (see write_bytes_atomic)."""
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode(),
                       durable=durable)


def _ends_mid_line(fd: int, path: Path) -> bool:
    """Whether the regular file open on `fd` (at `path`) is not empty and its last byte is not a
    newline: a crash or a full disk cut its last line short."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return False
        with open(path, "rb") as f:
            f.seek(st.st_size - 1)
            return f.read(1) != b"\n"
    except OSError:
        return False


def open_append(path: Path) -> tuple[int, bool]:
    """A descriptor appending to `path` (created when missing), with a torn last line ended
    first: an earlier writer that died or ran out of space mid-line left a fragment, and the
    next line must not be glued onto it. The newline keeps the fragment as one line of its
    own, unparsable, which readers count and skip; nothing written before is lost.

    O_APPEND: a line lands at the end even if another run appended to the file before.
    Returns (fd, torn): `torn` when that newline could not be written yet (a full disk):
    the caller writes it before its first line."""
    # O_NONBLOCK: a FIFO in the file's place fails at once (ENXIO) or opens without waiting
    # for a reader; anything but a regular file is then refused (infile.NotRegularFile).
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK,
                     0o666)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise infile.refusal(path, os.stat(path).st_mode) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise infile.refusal(path, mode)
    os.set_blocking(fd, True)
    torn = _ends_mid_line(fd, Path(path))
    if torn:
        try:
            torn = os.write(fd, b"\n") != 1
        except OSError:
            pass
    return fd, torn


class JsonlWriter:
    """Appends one JSON object per line; each line is written whole and flushed at once, and
    never onto a torn last line left by an earlier writer (see open_append)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        fd, self._torn = open_append(self.path)
        self._f = open(fd, "ab", buffering=0)

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        if self._torn:  # the torn line's end could not be written at open: it goes first
            line = b"\n" + line
        self._f.write(line)
        self._torn = False

    def close(self) -> None:
        self._f.close()


# ---------------------------------------------------------------- reading (TUI and tools)


def read_json(path: Path, max_bytes: int = SMALL_JSON_BYTES) -> dict[str, Any] | None:
    """A JSON object from `path`, or None when it is missing, unreadable, too large, too deep
    or not an object."""
    try:
        obj = jsonio.load_file(Path(path), max_bytes=max_bytes)
    except jsonio.JsonError:
        return None
    return obj if isinstance(obj, dict) else None


def parse_lines(lines: Iterable[bytes]) -> tuple[list[dict[str, Any]], int]:
    """Parse complete JSONL lines; returns (objects, number of corrupt lines skipped)."""
    out: list[dict[str, Any]] = []
    bad = 0
    for raw in lines:
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            bad += 1
            continue
        if isinstance(obj, dict):
            out.append(obj)
        else:
            bad += 1
    return out, bad


class JsonlTail:
    """Incremental reader of a JSONL file that another process appends to, in bounded steps.

    `read_new()` returns the records completed since the last call, reading at most `max_bytes`
    of the file (`more` says whether bytes are left). A torn last line waits for its end; a line
    longer than `max_line` is skipped and counted in `bad_lines` (its bytes are never held); a
    file that shrank (truncated) or was replaced (new inode) is read again from the start, and
    `reset` is set so the caller can drop what it had.
    """

    def __init__(self, path: Path, max_line: int = MAX_LINE_BYTES) -> None:
        self.path = Path(path)
        self.max_line = max_line
        self._ino: int | None = None
        self._offset = 0
        self._partial = b""
        self._skipping = False  # inside an over-long line: drop bytes up to its newline
        self.bad_lines = 0
        self.reset = False
        self.more = False

    def skip_to_end(self, keep_bytes: int) -> None:
        """Start reading at the last `keep_bytes` of the file (a reader that wants only the
        newest records, e.g. telemetry): the line cut by the jump is dropped."""
        try:
            st = os.stat(self.path)
        except OSError:
            return
        if st.st_size > keep_bytes:
            self._ino, self._offset, self._partial = st.st_ino, st.st_size - keep_bytes, b""
            self._skipping = True

    def read_new(self, max_bytes: int = CHUNK_BYTES) -> list[dict[str, Any]]:
        self.reset = False
        self.more = False
        try:
            st = os.stat(self.path)
        except OSError:
            return []
        if self._ino is not None and (st.st_ino != self._ino or st.st_size < self._offset):
            self.reset = True
            self._offset, self._partial, self._skipping = 0, b"", False
        self._ino = st.st_ino
        if st.st_size == self._offset:
            return []
        try:
            with infile.open_regular(self.path) as f:  # a FIFO is refused, never waited on
                f.seek(self._offset)
                data = f.read(max_bytes)
        except OSError:
            return []
        self._offset += len(data)
        self.more = self._offset < st.st_size
        if self._skipping:
            cut = data.find(b"\n")
            if cut < 0:
                return []
            data, self._skipping = data[cut + 1 :], False
        *complete, partial = (self._partial + data).split(b"\n")
        if len(partial) > self.max_line:
            self.bad_lines += 1
            partial, self._skipping = b"", True
        self._partial = partial
        long = [ln for ln in complete if len(ln) > self.max_line]
        if long:
            self.bad_lines += len(long)
            complete = [ln for ln in complete if len(ln) <= self.max_line]
        records, bad = parse_lines(complete)
        self.bad_lines += bad
        return records


def tail_lines(path: Path, max_bytes: int) -> list[bytes]:
    """The complete lines in the last `max_bytes` of a file (none when it cannot be read): the
    first piece is dropped when the seek may have cut it, the last when it is torn."""
    try:
        with infile.open_regular(path) as f:  # a FIFO is refused, never waited on
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - max_bytes)
            f.seek(start)
            data = f.read(max_bytes)
    except OSError:
        return []
    lines = data.split(b"\n")[:-1]  # the last piece is empty or a torn line
    return lines[1:] if start > 0 else lines


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user counts): a temporary file named with a
    dead writer's pid is stale."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """All complete records of a JSONL file and the count of corrupt lines (torn tail ignored)."""
    tail = JsonlTail(path)
    records = tail.read_new()
    while tail.more:
        records += tail.read_new()
    return records, tail.bad_lines


def step_order(run_dir: Path, events: Iterable[Event] = ()) -> StepOrder:
    """The step-sequence rule of a run (engine.records.StepOrder) as its files tell it: the
    (re)starts and max_steps in `events` (its events.jsonl, read by the caller), the
    max_steps of its config.json and state.json."""
    paths = RunPaths(Path(run_dir))
    order = StepOrder()
    order.note(events)
    config, state = read_json(paths.config), read_json(paths.state)
    train = config.get("train") if config else None
    status = RunStatus.from_json(state) if state else None
    order.limit(as_int(train.get("max_steps"), 1) if isinstance(train, dict) else None,
                status.max_steps if isinstance(status, RunStatus) else None)
    return order


def read_steps(path: Path) -> tuple[list[StepRecord], int]:
    """The step records of a `loss.jsonl`, one per step (the later one wins), as the files
    beside it say: abandoned timelines dropped (events.jsonl's resumes), records out of
    sequence left out (`step_order`); and the count of lines skipped."""
    path = Path(path)
    raw, bad = read_jsonl(path)
    steps, unreadable = parse_all(StepRecord, raw)
    events, _ = read_events(path.with_name(EVENTS))
    order = step_order(path.parent, events)
    resumes = [e for e in events if isinstance(e, ResumeEvent)]
    kept = order.admit(drop_abandoned(steps, resumes))
    return latest_by_step(kept), bad + unreadable + order.skipped


def read_events(path: Path) -> tuple[list[Event], int]:
    """The events of an `events.jsonl`, typed, and the count of lines skipped."""
    raw, bad = read_jsonl(path)
    events, unreadable = parse_all(Event, raw)
    return events, bad + unreadable


def tail_text(path: Path, n_lines: int, max_bytes: int = 65536) -> list[str]:
    """The last `n_lines` lines of a text file (the engine log), read from its end."""
    try:
        with infile.open_regular(path) as f:  # a FIFO is refused, never waited on
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    return lines[-n_lines:] if n_lines > 0 else []
