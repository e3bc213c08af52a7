"""The user's own words about a run: a note and tags, kept in the run directory (`notes.json`).

The engine never reads or writes this file; the runs browser shows the tags in its table and
the note under it, edits both (`n`, `t`) and filters by tag (`#tag`). The file is small JSON,
`{"note": "...", "tags": ["...", ...]}`, replaced atomically; a missing, unreadable or
hand-broken file reads as no note and no tags (what it cannot say is left out), and a file
that is not a regular file is never replaced. Headless.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.infile import describe
from engine.runfiles import read_json, write_json_atomic

NOTES = "notes.json"
NOTE_CHARS = 2000
TAG_CHARS = 32
MAX_TAGS = 32
NOTES_BYTES = 64 << 10
TAG_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+:/-]*")


class NotesError(ValueError):
    """What the user typed cannot be kept: one line saying why."""


def notes_path(run_dir: Path) -> Path:
    return Path(run_dir) / NOTES


@dataclass(frozen=True)
class RunNotes:
    """A run's note (free text, one line) and tags (short words)."""

    note: str = ""
    tags: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"note": self.note, "tags": list(self.tags)}

    @classmethod
    def from_json(cls, obj: Any) -> RunNotes:
        """What reads well of `obj`; nothing for the rest (never an exception)."""
        if not isinstance(obj, dict):
            return cls()
        note = obj.get("note")
        tags = obj.get("tags")
        good = [t for t in tags[:MAX_TAGS] if isinstance(t, str) and _is_tag(t)] \
            if isinstance(tags, list) else []
        return cls(one_line(note)[:NOTE_CHARS] if isinstance(note, str) else "",
                   tuple(dict.fromkeys(good)))


def _is_tag(text: str) -> bool:
    return len(text) <= TAG_CHARS and TAG_RE.fullmatch(text) is not None


def one_line(text: str) -> str:
    """`text` on one line: each run of white space (line breaks, tabs) one space, control
    characters dropped."""
    text = re.sub(r"\s+", " ", text)
    return "".join(c for c in text if c.isprintable()).strip()


def parse_tags(text: str) -> tuple[str, ...]:
    """Tags as typed: separated by commas or spaces, a leading `#` dropped, each once in the
    order given. A tag is letters, digits and `. _ + : / -` (starting with a letter or digit),
    at most TAG_CHARS long; NotesError names the first that is not."""
    out: list[str] = []
    for word in re.split(r"[,\s]+", text.strip()):
        word = word.removeprefix("#")
        if not word:
            continue
        if not _is_tag(word):
            raise NotesError(f"tag {word[:40]!r}: expected letters, digits and . _ + : / - "
                             f"(starting with a letter or digit), at most {TAG_CHARS} characters")
        if word not in out:
            out.append(word)
    if len(out) > MAX_TAGS:
        raise NotesError(f"{len(out)} tags: at most {MAX_TAGS}")
    return tuple(out)


def parse_note(text: str) -> str:
    """A note as typed, on one line; NotesError when it is longer than NOTE_CHARS."""
    note = one_line(text)
    if len(note) > NOTE_CHARS:
        raise NotesError(f"note of {len(note)} characters: at most {NOTE_CHARS}")
    return note


def read_notes(run_dir: Path) -> RunNotes:
    """The run's notes (empty when it has none or they cannot be read)."""
    return RunNotes.from_json(read_json(notes_path(run_dir), NOTES_BYTES))


def write_notes(run_dir: Path, notes: RunNotes) -> None:
    """Keep `notes` in the run directory, atomically. NotesError (one line) when the file in
    its place is not a regular file (a link, a directory, a FIFO: left as it is) or cannot be
    written."""
    path = notes_path(run_dir)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise NotesError(f"{path}: cannot be read ({e.strerror or e})") from None
    if mode is not None and not stat.S_ISREG(mode):
        what = "a symbolic link" if stat.S_ISLNK(mode) else describe(mode)
        raise NotesError(f"{path}: is {what}, expected a regular file; left as it is")
    try:
        write_json_atomic(path, notes.to_json())
    except OSError as e:
        raise NotesError(f"{path}: cannot be written ({e.strerror or e})") from None
