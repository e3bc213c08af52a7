"""Reading a part (engine.data.plan) as text pieces: the documents of `iter_documents`, cut at
safe places, with bounded memory.

`read_part` yields (text, ends_document) pairs: encode each text, and put `<|endoftext|>` after
the pieces that end a document. Errors name the file and the byte, or the line for JSONL.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import BinaryIO

from engine.data.cuts import MAX_UNCUT_BYTES, next_cut_in_file, next_line_start
from engine.data.gutenberg import body_of
from engine.data.plan import Part, Span
from engine.data.sources import decode_text, render_conversation
from engine.errors import UserError

Piece = tuple[str, bool]


def read_part(part: Part) -> Iterator[Piece]:
    for text in part.texts:
        yield text, True
    for span in part.spans:
        yield from read_span(span)


def read_span(span: Span) -> Iterator[Piece]:
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
            if text.strip():
                yield text, True
        else:
            yield from _text(f, span)


def _text(f: BinaryIO, span: Span) -> Iterator[Piece]:
    first, last = span.lo == span.doc_lo, span.hi == span.doc_hi
    start = span.lo if first else next_cut_in_file(f, span.lo, span.doc_hi, span.path)
    end = span.hi if last else next_cut_in_file(f, span.hi, span.doc_hi, span.path)
    f.seek(start)
    text = decode_text(f.read(end - start), span.path, start)
    if first and last and not text.strip():
        return  # a blank document is left out
    yield text, last


def _jsonl(f: BinaryIO, span: Span) -> Iterator[Piece]:
    start = next_line_start(f, span.lo, span.size) if span.lo else 0
    end = next_line_start(f, span.hi, span.size) if span.hi < span.size else span.size
    if end - start > span.hi - span.lo + MAX_UNCUT_BYTES:
        raise UserError(f"{span.path}:{_line_at(f, start)}: a line longer than "
                        f"{MAX_UNCUT_BYTES >> 20} MB: expected one conversation per line")
    f.seek(start)
    data = f.read(end - start)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        at = start + e.start
        raise UserError(
            f"{span.path}:{_line_at(f, at)}: byte {at}: expected UTF-8 text"
        ) from None
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    if lines and not lines[-1]:
        lines.pop()  # the text after the last line break
    first_line: list[int] = []  # counted only when an error needs it

    def where(i: int) -> str:
        if not first_line:
            first_line.append(_line_at(f, start))
        return f"{span.path}:{first_line[0] + i}"

    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where(i)}: not valid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise UserError(f"{where(i)}: JSON nested too deeply") from None
        except ValueError as e:  # e.g. an integer of more digits than Python converts
            raise UserError(f"{where(i)}: not usable JSON ({e})") from None
        try:
            doc = render_conversation(record, "")
        except UserError:
            render_conversation(record, where(i))  # raises again, naming the line
            raise
        yield doc, True


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
