"""Documents of a configured source: a built-in arm, or local text / markdown / JSONL files.

A source is a validated `engine.config.SourceConfig`: a `builtin` arm, or `paths` in a `format`
("auto" | "text" | "jsonl"). A path is a file, a directory (searched recursively for
TEXT_SUFFIXES and .jsonl) or a glob. A text file is one document; a JSONL file holds one
Hermes-3 conversation per line, rendered with role markers (ROLE_MARKERS).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from engine.config import SourceConfig
from engine.data.builtin import builtin_fingerprint, iter_builtin
from engine.errors import UserError

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst")
JSONL_SUFFIXES = (".jsonl",)
ROLE_MARKERS = {"system": "<|system|>", "human": "<|user|>", "gpt": "<|assistant|>"}


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def resolve_paths(source: SourceConfig) -> list[Path]:
    """The files of a path-based source, sorted within each configured path, no duplicates."""
    name = source.name
    files: list[Path] = []
    seen: set[Path] = set()
    for pattern in source.paths or ():
        expanded = os.path.expanduser(pattern)
        if _is_glob(expanded):
            matched = [Path(p) for p in sorted(glob.glob(expanded, recursive=True))]
            matched = [p for p in matched if p.is_file()]
        elif os.path.isdir(expanded):
            suffixes = TEXT_SUFFIXES + JSONL_SUFFIXES
            matched = sorted(
                p for p in Path(expanded).rglob("*") if p.is_file() and p.suffix in suffixes
            )
        elif os.path.isfile(expanded):
            matched = [Path(expanded)]
        else:
            matched = []
        if not matched:
            raise UserError(f"data.sources[{name}].paths: {pattern!r} matches no file")
        for p in matched:
            if p not in seen:
                seen.add(p)
                files.append(p)
    return files


def _file_format(source: SourceConfig, path: Path) -> str:
    fmt = source.format
    if fmt == "auto":
        return "jsonl" if path.suffix in JSONL_SUFFIXES else "text"
    return fmt


def render_conversation(record: object, where: str) -> str:
    """One Hermes-3 record as text with role markers; `where` (file:line) names it in errors."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: conversations: expected a non-empty list, got {turns!r:.60}")
    parts = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise UserError(
                f"{where}: conversations[{i}]: expected an object, got {type(turn).__name__}"
            )
        role, value = turn.get("from"), turn.get("value")
        if role not in ROLE_MARKERS:
            raise UserError(
                f"{where}: conversations[{i}].from: expected one of "
                f"{', '.join(ROLE_MARKERS)}, got {role!r}"
            )
        if not isinstance(value, str):
            raise UserError(
                f"{where}: conversations[{i}].value: expected a string, got "
                f"{type(value).__name__}"
            )
        parts.append(f"{ROLE_MARKERS[role]}\n{value}")
    return "\n".join(parts)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: byte {e.start}: expected UTF-8 text") from None


def _iter_jsonl(path: Path) -> Iterator[str]:
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    with f:
        lineno = 0
        while True:
            lineno += 1
            try:
                line = f.readline()
            except UnicodeDecodeError:
                raise UserError(f"{path}:{lineno}: expected UTF-8 text") from None
            if not line:
                return
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})"
                ) from None
            except RecursionError:
                raise UserError(f"{path}:{lineno}: JSON nested too deeply") from None
            yield render_conversation(record, f"{path}:{lineno}")


def iter_documents(source: SourceConfig) -> Iterator[str]:
    """Every document of a config source, in a fixed order."""
    if source.builtin is not None:
        yield from iter_builtin(source.builtin)
        return
    for path in resolve_paths(source):
        if _file_format(source, path) == "jsonl":
            yield from _iter_jsonl(path)
        else:
            text = _read_text(path)
            if text.strip():
                yield text


def source_fingerprint(source: SourceConfig) -> str:
    """A hash that changes when the source's content may have changed (for idempotent prep)."""
    h = hashlib.sha256()
    if source.builtin is not None:
        h.update(builtin_fingerprint(source.builtin).encode())
    else:
        h.update(f"format={source.format}\n".encode())
        for path in resolve_paths(source):
            st = path.stat()
            h.update(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()
