"""Documents of a configured source: a built-in arm, or local files in a `format`.

A source is a validated `engine.config.SourceConfig`: a `builtin` arm, or `paths` (files,
directories searched recursively, globs) in a `format`:
- "auto": `.jsonl` files are conversations, the rest plain text;
- "text": each file is one document;
- "docs": a documentation tree: each Markdown / reStructuredText / text file is one document;
- "gutenberg": each file is a Project Gutenberg book, its licence header and footer removed
  (engine.data.gutenberg);
- "jsonl": one Hermes-3 conversation per line, rendered with role markers (ROLE_MARKERS).
Text is read as UTF-8 with CRLF and lone CR turned into LF (Python's text mode).

`iter_documents` reads every document whole, in order: the reference for what `andrea-prep`
writes (tests and benchmarks compare against it). Prep itself reads the same documents in bounded
pieces (engine.data.plan, engine.data.reader), so a source of any size streams.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from engine.config import SourceConfig
from engine.data.builtin import builtin_fingerprint, iter_builtin
from engine.data.gutenberg import body_of
from engine.errors import UserError

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst")
JSONL_SUFFIXES = (".jsonl",)
DIR_SUFFIXES = {  # what a directory contributes, by format
    "auto": TEXT_SUFFIXES + JSONL_SUFFIXES,
    "text": TEXT_SUFFIXES + JSONL_SUFFIXES,
    "docs": TEXT_SUFFIXES,
    "gutenberg": (".txt",),
    "jsonl": JSONL_SUFFIXES,
}
# Bump a format's version when what it makes of a file changes, so prepared shards are rebuilt.
FORMAT_VERSIONS = {"gutenberg": 1}
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
            suffixes = DIR_SUFFIXES[source.format]
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


def file_kind(source: SourceConfig, path: Path) -> str:
    """How a file of a path source is read: "text", "gutenberg" or "jsonl"."""
    fmt = source.format
    if fmt == "auto":
        return "jsonl" if path.suffix in JSONL_SUFFIXES else "text"
    return "text" if fmt == "docs" else fmt


def render_conversation(record: object, where: str) -> str:
    """One Hermes-3 record as text with role markers; `where` (file:line) names it in errors."""
    return "".join(conversation_pieces(record, where))


def conversation_pieces(record: object, where: str) -> list[str]:
    """The text of render_conversation as consecutive strings (markers, line breaks and the
    turns' values themselves, not copied): a long conversation need not be joined to be encoded
    (engine.data.cuts.split_stream). The whole record is checked before anything is returned."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: conversations: expected a non-empty list, got {turns!r:.60}")
    parts: list[str] = []
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
        bad = _lone_surrogate(value)
        if bad >= 0:  # JSON can escape a lone surrogate; it is not text
            raise UserError(
                f"{where}: conversations[{i}].value: character {bad}: expected text, got "
                f"a lone surrogate (\\u{ord(value[bad]):04x})"
            )
        parts += [*(["\n"] if parts else []), ROLE_MARKERS[role], "\n", value]
    return parts


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value: str) -> int:
    """The index of the first lone surrogate in `value`, or -1 (found without an encoded copy
    of a value that may be megabytes long)."""
    if value.isascii():  # known without a look at the characters
        return -1
    m = _SURROGATE.search(value)
    return m.start() if m else -1


def decode_text(data: bytes, where: str, offset: int = 0) -> str:
    """UTF-8 bytes (at byte `offset` of file `where`) as text, CRLF and lone CR as LF."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: byte {offset + e.start}: expected UTF-8 text") from None
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None


def _read_document(path: Path, kind: str) -> str:
    data = _read_bytes(path)
    if kind == "gutenberg":
        body = body_of(data)
        return decode_text(data[body.start : body.end], str(path), body.start)
    return decode_text(data, str(path))


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
            except ValueError as e:  # e.g. an integer of more digits than Python converts
                raise UserError(f"{path}:{lineno}: not usable JSON ({e})") from None
            yield render_conversation(record, f"{path}:{lineno}")


def iter_documents(source: SourceConfig) -> Iterator[str]:
    """Every document of a config source, in a fixed order."""
    if source.builtin is not None:
        yield from iter_builtin(source.builtin)
        return
    for path in resolve_paths(source):
        kind = file_kind(source, path)
        if kind == "jsonl":
            yield from _iter_jsonl(path)
        else:
            text = _read_document(path, kind)
            if text.strip():
                yield text


def source_fingerprint(source: SourceConfig) -> str:
    """A hash that changes when the source's content may have changed (for idempotent prep)."""
    h = hashlib.sha256()
    if source.builtin is not None:
        h.update(builtin_fingerprint(source.builtin).encode())
    else:
        version = FORMAT_VERSIONS.get(source.format)
        fmt = source.format if version is None else f"{source.format}:v{version}"
        h.update(f"format={fmt}\n".encode())
        for path in resolve_paths(source):
            st = path.stat()
            h.update(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()
