"""Project Gutenberg plain-text books: the book without the licence header and footer.

The body starts after the first start marker line in the first HEAD_BYTES of the file:
`*** START OF THE PROJECT GUTENBERG EBOOK ... ***` and its variants (`THIS`, no space after the
stars, `COPYRIGHTED`), or the end of the old licence header, `*END*THE SMALL PRINT! ...`. It ends
before the first end marker line after it in the last TAIL_BYTES: `*** END OF THE PROJECT
GUTENBERG EBOOK ... ***` and its variants, preceded where present by the older `End of the
Project Gutenberg EBook of ...` / `End of Project Gutenberg's ...` line. Blank space around the
body is dropped. A file without markers is kept whole (it may be cleaned already).

Only the two windows are read, so a book's span is known without reading it all, and the same
span comes out whether the file is read whole or in pieces.
"""

from __future__ import annotations

import re
from typing import NamedTuple

HEAD_BYTES = 256 << 10
TAIL_BYTES = 256 << 10
OLD_END_WINDOW = 4096  # how far before the end marker an older "End of ..." line is looked for

_LINE_END = rb"[^\r\n]*(?:\r\n|\r|\n|\Z)"
_START = re.compile(
    rb"^[ \t]*(?:\*{3}[ \t]*START OF (?:THE |THIS )?(?:COPYRIGHTED )?PROJECT GUTENBERG"
    rb"|\*END\*?[ \t]*THE SMALL PRINT)" + _LINE_END,
    re.IGNORECASE | re.MULTILINE,
)
_END = re.compile(
    rb"^[ \t]*\*{3}[ \t]*END OF (?:THE |THIS )?(?:COPYRIGHTED )?PROJECT GUTENBERG",
    re.IGNORECASE | re.MULTILINE,
)
_OLD_END = re.compile(
    rb"^[ \t]*(?:END OF (?:THE |THIS )?PROJECT GUTENBERG|ENDE DIESES PROJECT GUTENBERG)",
    re.IGNORECASE | re.MULTILINE,
)
_BLANK = b" \t\r\n\f\v"


class Body(NamedTuple):
    start: int  # byte offsets in the file
    end: int
    marked: bool  # a start or end marker was found


def body_span(head: bytes, tail: bytes, size: int) -> Body:
    """The book's byte span in a file of `size` bytes, from its first HEAD_BYTES (`head`) and its
    last TAIL_BYTES (`tail`; for a small file both are the whole file)."""
    start = 0
    m = _START.search(head)
    if m:
        start = m.end()
    tail_at = size - len(tail)
    end = size
    found_end = False
    search_from = max(start - tail_at, 0)
    m_end = _END.search(tail, search_from)
    if m_end:
        end, found_end = tail_at + m_end.start(), True
        window_from = max(search_from, m_end.start() - OLD_END_WINDOW)
        m_old = _OLD_END.search(tail, window_from, m_end.start())
        if m_old:
            end = tail_at + m_old.start()
    else:
        m_old = _OLD_END.search(tail, search_from)
        if m_old:
            end, found_end = tail_at + m_old.start(), True
    start = _skip_blank(head, tail, tail_at, start, end)
    end = _back_over_blank(head, tail, tail_at, start, end)
    return Body(start, end, bool(m) or found_end)


def _byte_at(head: bytes, tail: bytes, tail_at: int, i: int) -> int | None:
    if i < len(head):
        return head[i]
    if i >= tail_at:
        return tail[i - tail_at]
    return None  # between the windows: not blank as far as we know


def _skip_blank(head: bytes, tail: bytes, tail_at: int, start: int, end: int) -> int:
    while start < end:
        b = _byte_at(head, tail, tail_at, start)
        if b is None or b not in _BLANK:
            break
        start += 1
    return start


def _back_over_blank(head: bytes, tail: bytes, tail_at: int, start: int, end: int) -> int:
    while end > start:
        b = _byte_at(head, tail, tail_at, end - 1)
        if b is None or b not in _BLANK:
            break
        end -= 1
    return end


def body_of(data: bytes) -> Body:
    """The book's span in a whole file's bytes (the same span `body_span` finds from windows)."""
    return body_span(data[:HEAD_BYTES], data[max(0, len(data) - TAIL_BYTES):], len(data))


def read_windows(path: str, size: int) -> tuple[bytes, bytes]:
    """The head and tail windows of a file of `size` bytes."""
    with open(path, "rb") as f:
        head = f.read(min(size, HEAD_BYTES))
        if size <= HEAD_BYTES:
            return head, head[max(0, size - TAIL_BYTES):]
        f.seek(max(0, size - TAIL_BYTES))
        return head, f.read()
