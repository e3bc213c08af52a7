"""The checkpoints of a run as a collection: list them, choose where a resume starts, prune.

A run directory's `checkpoints/` holds `step_*` directories, valid or not (a crash, a full disk
or a hand edit leaves broken ones), and `.tmp-*` directories, which are never listed. A listing
never raises on a bad entry: it says why the entry is invalid. A resume starts from the newest
checkpoint that verifies and names the newer ones it passed over. Pruning (`checkpoint.keep`,
`checkpoint.keep_manual`, `andrea-ckpt prune`) deletes old checkpoints of the reasons it is
given, never the newest valid one, and deletes each by first renaming it out of the checkpoint
namespace, so a crash mid-delete leaves only a temp dir. The format is engine.run.checkpoint.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import UserError
from engine.run.checkpoint import (
    MODEL_FILE,
    NAME_RE,
    STATE_FILE,
    CheckpointInvalid,
    ckpt_root_of,
    read_state,
    temp_dirname,
    verify_checkpoint,
)
from engine.runfiles import fsync_dir

NAMED_SKIPPED = 5  # a resume names this many of the entries it passed over, then counts the rest
MANUAL_REASONS = ("snapshot", "stop")


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


# ---------------------------------------------------------------- listing


def checkpoint_entry(path: Path, *, check_hash: bool = True) -> CheckpointEntry:
    """One checkpoint directory as a lister shows it (never raises on a bad one); state.json is
    read once."""
    mt = NAME_RE.match(path.name)
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
            doc = read_state(path / STATE_FILE)
        # turns OSError into CheckpointInvalid
        verify_checkpoint(path, check_hash=check_hash, doc=doc)
        valid, why = True, None
    except CheckpointInvalid as e:
        valid, why = False, str(e)
    except OSError as e:  # is_file() itself: a directory this process may not look into
        valid, why = False, f"{path}: {e.strerror or e}"
    doc = doc if isinstance(doc, dict) else {}
    reason = doc.get("reason") if isinstance(doc.get("reason"), str) else None
    wall = doc.get("wall_time") if isinstance(doc.get("wall_time"), (int, float)) else None
    return CheckpointEntry(path, step, reason, wall, size, valid, why)


def _sort_key(path: Path) -> tuple[int, int]:
    mt = NAME_RE.match(path.name)
    assert mt
    return int(mt.group(1)), int(mt.group(2) or 1)


def _checkpoint_dirs(root: Path) -> list[Path]:
    try:
        with os.scandir(root) as it:  # the directory test comes from the listing itself
            dirs = [root / e.name for e in it if NAME_RE.match(e.name) and _is_dir(e)]
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


# ---------------------------------------------------------------- where a resume starts


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


# ---------------------------------------------------------------- pruning


def _remove_checkpoint(path: Path) -> None:
    """Rename out of the checkpoint namespace first, so a crash mid-delete leaves only a temp dir."""
    doomed = path.parent / temp_dirname(path.name)
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


def _doomed(entries: list[CheckpointEntry], keep: int, reasons: Collection[str]) -> list[Path]:
    """Of `entries` (newest first), those of `reasons` beyond the newest `keep` valid ones,
    except the newest valid checkpoint of all."""
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
    return doomed


def _remove_all_or_none(root: Path, doomed: list[Path]) -> list[Path]:
    """Remove each of `doomed`; UserError before any is removed where one could not be, and
    naming the one that failed (and how many went before it) where a removal fails anyway."""
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
            raise UserError(f"{path.parent}: cannot delete {path.name} ({e.strerror or e}); "
                            f"{len(removed)} checkpoint(s) removed before it, each whole, the "
                            "others left as they were") from None
        removed.append(path)
    return removed


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
    doomed = _doomed(list_checkpoints(root, check_hash=check_hash), keep, reasons)
    if dry_run or not doomed:
        return doomed
    if all_or_nothing:
        removed = _remove_all_or_none(root, doomed)
    else:
        for path in doomed:
            _remove_checkpoint(path)
        removed = doomed
    fsync_dir(root)
    return removed


def prune_periodic(ckpt_root: Path, keep: int, *, check_hash: bool = True) -> list[Path]:
    """checkpoint.keep: periodic checkpoints beyond the newest `keep` valid ones go."""
    return prune(ckpt_root, keep, ("periodic",), check_hash=check_hash)
