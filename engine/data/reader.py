"""Reading a part (engine.data.plan) as text pieces: the documents of `iter_documents`, cut at
safe places, with bounded memory.

`read_segments` is what prep encodes: (text, ends_document) pairs of at most about `size`
characters, cut only at safe places (engine.data.cuts); encode each and put `<|endoftext|>` after
those that end a document. A JSONL line is read, decoded and parsed alone, and its conversation
goes out in segments without ever being joined, so a long conversation costs its encoder process
about its line in bytes plus twice its text (the line's characters, then the parsed values),
once, whatever the size of the part: lines of up to MAX_LINE_BYTES, longer ones refused with
the file and line. `read_part` gives the same text in whole documents (a test's reference).
Errors name the file and the byte, or the line for JSONL.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO

from engine.data.cuts import MAX_UNCUT_BYTES, next_cut_in_file, next_line_start, split_stream
from engine.data.gutenberg import body_of
from engine.data.plan import Part, Span
from engine.data.sources import conversation_pieces, decode_text
from engine.errors import UserError

Piece = tuple[str, bool]
Chunks = tuple[Sequence[str], bool]  # a piece's text as strings to take one after the other
MAX_LINE_BYTES = MAX_UNCUT_BYTES  # one JSONL line (a conversation) is held whole while read


def read_segments(part: Part, size: int) -> Iterator[Piece]:
    """The part's text in pieces of about `size` characters cut at safe places, each with
    whether it ends a document (the last piece of a document; it may be empty)."""
    for chunks, ends in _read_chunks(part):
        if sum(map(len, chunks)) <= size:  # most documents: one piece, as it is
            yield "".join(chunks), ends
            continue
        held: str | None = None
        for segment in split_stream(chunks, size):
            if held is not None:
                yield held, False
            held = segment
        del chunks  # not held while the next document is read
        yield held or "", ends


def read_part(part: Part) -> Iterator[Piece]:
    """The part's text as whole pieces (a document, or the piece of a large one in this part)."""
    for chunks, ends in _read_chunks(part):
        yield "".join(chunks), ends


def _read_chunks(part: Part) -> Iterator[Chunks]:
    for text in part.texts:
        yield (text,), True
    for span in part.spans:
        yield from _span_chunks(span)


def read_span(span: Span) -> Iterator[Piece]:
    """The span's text as whole pieces (read_part for one span)."""
    for chunks, ends in _span_chunks(span):
        yield "".join(chunks), ends


def _span_chunks(span: Span) -> Iterator[Chunks]:
    try:
        f = open(span.path, "rb")
        size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise UserError(f"{span.path}: cannot read ({e.strerror})") from None
    with f:
        if size != span.size:
            raise UserError(
                f"{span.path}: changed while being prepared ({size} bytes, was {span.size}): "
                "run andrea-prep again"
            )
        if span.kind == "jsonl":
            yield from _jsonl(f, span)
        elif span.kind == "gutenberg":
            data = f.read()
            body = body_of(data)
            text = decode_text(data[body.start : body.end], span.path, body.start)
            del data
            if text.strip():
                yield (text,), True
        else:
            yield from _text(f, span)


def _text(f: BinaryIO, span: Span) -> Iterator[Chunks]:
    first, last = span.lo == span.doc_lo, span.hi == span.doc_hi
    start = span.lo if first else next_cut_in_file(f, span.lo, span.doc_hi, span.path)
    end = span.hi if last else next_cut_in_file(f, span.hi, span.doc_hi, span.path)
    f.seek(start)
    text = decode_text(f.read(end - start), span.path, start)
    if first and last and not text.strip():
        return  # a blank document is left out
    yield (text,), last


def _jsonl(f: BinaryIO, span: Span) -> Iterator[Chunks]:
    """The conversations of the lines that start in the span, one line in memory at a time."""
    start = next_line_start(f, span.lo, span.size) if span.lo else 0
    end = next_line_start(f, span.hi, span.size) if span.hi < span.size else span.size
    first_line: list[int] = []  # counted only when an error needs it

    def where(i: int) -> str:
        if not first_line:
            first_line.append(_line_at(f, start))
        return f"{span.path}:{first_line[0] + i}"

    at, i = start, 0  # the byte and the line (counted from `start`) being read
    f.seek(start)
    while at < end:
        raw = f.readline(min(end - at, MAX_LINE_BYTES + 2))
        if not raw:
            break
        line_at, at = at, at + len(raw)
        n = len(raw) - raw.endswith(b"\n")
        n -= raw.endswith(b"\r\n")  # CRLF ends one line
        if n > MAX_LINE_BYTES:
            raise UserError(f"{where(i)}: {_too_long()}")
        try:
            text = str(memoryview(raw)[:n], "utf-8")
        except UnicodeDecodeError as e:
            bad = line_at + e.start
            raise UserError(
                f"{span.path}:{_line_at(f, bad)}: byte {bad}: expected UTF-8 text"
            ) from None
        del raw
        lines = text.split("\r") if "\r" in text else [text]  # a lone CR ends a line too
        del text
        for k in range(len(lines)):
            line, lines[k] = lines[k], ""  # held here only until it is parsed
            i += 1
            if not line or line.isspace():  # blank (strip() would copy a long line)
                continue
            record = _parse(line, where, i - 1)
            del line
            try:
                chunks = conversation_pieces(record, "")
            except UserError:
                conversation_pieces(record, where(i - 1))  # raises again, naming the line
                raise
            del record
            yield chunks, True
            del chunks


def _too_long() -> str:
    limit = (f"{MAX_LINE_BYTES >> 20} MB" if MAX_LINE_BYTES >= 1 << 20
             else f"{MAX_LINE_BYTES:,} bytes")
    return f"a line longer than {limit}: expected one conversation per line"


def _parse(line: str, where: Callable[[int], str], i: int) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where(i)}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise UserError(f"{where(i)}: JSON nested too deeply") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise UserError(f"{where(i)}: not usable JSON ({e})") from None


def _line_at(f: BinaryIO, offset: int) -> int:
    """The 1-based line number of byte `offset` (LF, CRLF and lone CR each end a line)."""
    f.seek(0)
    breaks = 0
    at = 0
    prev_cr = False
    while at < offset:
        block = f.read(min(1 << 20, offset - at))
        if not block:
            break
        breaks += block.count(b"\n") + block.count(b"\r") - block.count(b"\r\n")
        if prev_cr and block[:1] == b"\n":
            breaks -= 1  # a CRLF split across two blocks
        prev_cr = block[-1:] == b"\r"
        at += len(block)
    return breaks + 1
