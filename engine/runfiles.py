"""The run-directory protocol (DESIGN §7): file names, writers for the engine, readers for the TUI.

One module shared by both sides so the format lives in one place. Writers append whole lines and
replace JSON files atomically; readers tolerate a torn last line, corrupt lines, truncation,
replacement of a file, and repeated steps (after a resume the later record for a step wins).
This module imports only the standard library: the TUI reads run directories through it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import UserError

CONFIG = "config.json"
ENGINE = "engine.json"
LOCK = "engine.lock"
LOG = "engine.log"
LOSS = "loss.jsonl"
EVENTS = "events.jsonl"
SAMPLES = "samples.jsonl"
STATE = "state.json"
CHECKPOINTS = "checkpoints"


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
    def state(self) -> Path:
        return self.root / STATE

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


def write_json_atomic(path: Path, obj: Any, *, durable: bool = True) -> None:
    """Replace `path` with `obj` as JSON: readers see the old file or the new one, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    data = (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


class JsonlWriter:
    """Appends one JSON object per line; each line is written whole and flushed at once."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        # O_APPEND: a line lands at the end even if the file was appended to by an earlier run.
        self._f = open(self.path, "ab", buffering=0)

    def write(self, record: dict[str, Any]) -> None:
        self._f.write((json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        self._f.close()


# ---------------------------------------------------------------- reading (TUI and tools)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`, or None when it is missing, unreadable or not an object."""
    try:
        obj = json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
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
        except ValueError:
            bad += 1
            continue
        if isinstance(obj, dict):
            out.append(obj)
        else:
            bad += 1
    return out, bad


class JsonlTail:
    """Incremental reader of a JSONL file that another process appends to.

    `read_new()` returns the records completed since the last call. A torn last line waits for
    its end; a file that shrank (truncated) or was replaced (new inode) is read again from the
    start, and `reset` is set so the caller can drop what it had.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._ino: int | None = None
        self._offset = 0
        self._partial = b""
        self.bad_lines = 0
        self.reset = False

    def read_new(self, max_bytes: int | None = None) -> list[dict[str, Any]]:
        self.reset = False
        try:
            st = os.stat(self.path)
        except OSError:
            return []
        if self._ino is not None and (st.st_ino != self._ino or st.st_size < self._offset):
            self.reset = True
            self._offset, self._partial = 0, b""
        self._ino = st.st_ino
        if st.st_size == self._offset:
            return []
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(max_bytes) if max_bytes else f.read()
        except OSError:
            return []
        self._offset += len(data)
        *complete, self._partial = (self._partial + data).split(b"\n")
        records, bad = parse_lines(complete)
        self.bad_lines += bad
        return records


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """All complete records of a JSONL file and the count of corrupt lines (torn tail ignored)."""
    tail = JsonlTail(path)
    records = tail.read_new()
    return records, tail.bad_lines


def latest_by_step(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step, the later one winning (a resumed run re-logs steps), sorted by step."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in records:
        step = r.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            by_step[step] = r
    return [by_step[s] for s in sorted(by_step)]


def drop_abandoned(records: Iterable[dict[str, Any]],
                   events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop loss records of an abandoned timeline.

    After a crash the engine resumes from its newest checkpoint, at step k, and the records it
    had written past k (before the `resume` event) describe a future that never happened. Steps
    it trains again are replaced anyway (`latest_by_step`); this also removes those it never
    reaches again, e.g. when the resumed run is stopped early.
    """
    resumes = [(e["t"], e["step"]) for e in events
               if e.get("event") == "resume" and isinstance(e.get("t"), (int, float))
               and isinstance(e.get("step"), int)]
    if not resumes:
        return list(records)
    out = []
    for r in records:
        t, step = r.get("t"), r.get("step")
        if isinstance(t, (int, float)) and isinstance(step, int) and any(
                t < tr and step > k for tr, k in resumes):
            continue
        out.append(r)
    return out


def tail_text(path: Path, n_lines: int, max_bytes: int = 65536) -> list[str]:
    """The last `n_lines` lines of a text file (the engine log), read from its end."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    return lines[-n_lines:] if n_lines > 0 else []
