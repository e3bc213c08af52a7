"""Where a document may be cut so that encoding the pieces gives exactly the ids of the whole.

The rule: cut at i when text[i-1] is a printable ASCII character other than space (0x21..0x7E)
and text[i] is one of space, tab, LF, CR. The ids of text[:i] followed by those of text[i:] are
then the ids of text.

Why. The tokenizer (engine.data.tokenizer) first takes out the special token's text, then splits
the rest into pre-tokens with GPT-2's pattern

    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+

(leftmost-first, no look-behind), and runs BPE inside each pre-token alone. So the ids of a text
are those of its pre-tokens, and a cut keeps them iff the pre-tokens of both pieces are the
pre-tokens of the whole. At such an i:
- the pre-token holding text[i-1] cannot take text[i]: only the two whitespace alternatives take
  whitespace, and they cannot hold text[i-1], which is not whitespace; a space is only ever taken
  in front (` ?`), never behind. So a pre-token ends at i in the whole text.
- the matches up to i looked at no character past i except text[i] itself, to stop there. In the
  left piece the end of the text stops them the same way; the look-ahead `(?!\\S)` belongs only
  to the whitespace alternatives, which none of these matches used. So the left piece splits the
  same way.
- matching from i on never looks before i (no look-behind, no anchors), so the right piece
  splits as the rest of the whole text does.
- the special token's text has no whitespace, so no cut falls inside it; one next to a cut is
  taken out the same in the piece as in the whole.
The rule needs only ASCII classes, so it holds whatever a regex engine counts as \\s, \\p{L} or
\\p{N}. A CR before LF is whitespace, so no cut falls between them: newline translation
(CRLF and lone CR to LF, as Python's text mode does) gives the same text piecewise as whole. The
byte form of the rule finds the same places in UTF-8, where every ASCII byte is a character.

tests/test_cuts.py checks it against the tokenizer on hostile text, and that cuts breaking the
rule do change ids (so the test can fail).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import BinaryIO

from engine.errors import UserError

_CUT = re.compile(r"[\x21-\x7e](?=[ \t\n\r])")
_CUT_BYTES = re.compile(rb"[\x21-\x7e](?=[ \t\n\r])")
SCAN_BLOCK = 1 << 20
MAX_UNCUT_BYTES = 64 << 20  # a document with no place to cut for this long is refused


def next_cut(text: str, pos: int) -> int:
    """The first safe cut at or after `pos`, or len(text) when there is none."""
    if pos <= 0:
        return 0
    m = _CUT.search(text, pos - 1)
    return m.start() + 1 if m else len(text)


def split_text(text: str, size: int) -> list[str]:
    """`text` in pieces of about `size` characters (longer where no cut is near), cut only at
    safe places: encoding the pieces one by one gives the ids of the whole."""
    pieces = []
    start = 0
    while len(text) - start > size:
        cut = next_cut(text, start + size)
        if cut >= len(text):
            break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def split_stream(chunks: Iterable[str], size: int) -> Iterator[str]:
    """The text that `chunks` make one after the other, in pieces of about `size` characters
    cut only at safe places (as split_text), never joined whole: beyond the chunks themselves
    it holds about `size` characters at a time (more only where no safe cut is near). The
    chunks may be cut anywhere; the pieces may be encoded one by one."""
    held: list[str] = []
    n_held = 0
    want = size  # look for a cut once this much is held
    for chunk in chunks:
        for at in range(0, len(chunk), size):
            piece = chunk if len(chunk) <= size else chunk[at : at + size]
            held.append(piece)
            n_held += len(piece)
            if n_held < want:
                continue
            pieces = split_text("".join(held), size)
            yield from pieces[:-1]
            rest = pieces[-1]  # its end is not known to be a safe place until more comes
            held, n_held = [rest], len(rest)
            want = size if n_held < size else 2 * n_held  # no cut near: wait for twice as much
    if n_held:
        yield "".join(held)


def next_cut_in_file(f: BinaryIO, pos: int, limit: int, where: str) -> int:
    """The first safe cut at or after byte `pos` of an open file, or `limit` (the document's end)
    when there is none before it. `where` names the file in the error for a document that runs
    MAX_UNCUT_BYTES with no place to cut."""
    if pos <= 0:
        return 0
    if pos >= limit:
        return limit
    at = pos - 1  # the cut needs the byte before it
    carry = b""
    while at < limit:
        f.seek(at)
        block = f.read(min(SCAN_BLOCK, limit - at))
        if not block:
            return limit
        m = _CUT_BYTES.search(carry + block)
        if m:
            return at - len(carry) + m.start() + 1
        carry = block[-1:]
        at += len(block)
        if at - pos > MAX_UNCUT_BYTES:
            raise UserError(
                f"{where}: byte {pos}: no place to cut this document within "
                f"{MAX_UNCUT_BYTES >> 20} MB (expected text with spaces or line breaks; split it "
                "into smaller files)"
            )
    return limit


def next_line_start(f: BinaryIO, pos: int, limit: int) -> int:
    """The first line start (the byte after a LF) at or after `pos`, or `limit`."""
    if pos <= 0:
        return 0
    at = pos - 1
    while at < limit:
        f.seek(at)
        block = f.read(min(SCAN_BLOCK, limit - at))
        if not block:
            return limit
        i = block.find(b"\n")
        if i >= 0:
            return at + i + 1
        at += len(block)
    return limit
