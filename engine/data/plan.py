"""A source cut into parts: bounded units of work, in document order, planned without reading
the documents.

A part is a few whole small files grouped to about `part_bytes`, one piece of a large file, or a
group of built-in documents. A large text document is cut into nominal byte ranges of
`part_bytes`; the reader moves each end to the next safe cut (engine.data.cuts), so the pieces
tile the document and their ids are those of the whole. A large JSONL file is cut the same way
at line starts. A large Gutenberg book is first narrowed to its body (engine.data.gutenberg).

The plan depends only on the files (their sizes, and a large book's first and last bytes) and
`part_bytes` — never on how many processes encode it — and its `digest` names it, so an
interrupted preparation can continue exactly where it stopped.
"""

from __future__ import annotations

import codecs
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.config import SourceConfig
from engine.data.builtin import iter_builtin
from engine.data.gutenberg import body_span, read_windows
from engine.data.sources import file_kind, resolve_paths
from engine.errors import UserError

PART_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes [lo, hi) of a file, part of the document [doc_lo, doc_hi) (for "jsonl", the file).

    `kind` is "text", "jsonl", or "gutenberg" (a whole small book: the reader finds its body).
    An end that is not the document's is nominal: the reader moves it to the next safe cut."""

    path: str
    size: int  # the file's size when planned: a file that changes is refused
    kind: str
    lo: int
    hi: int
    doc_lo: int
    doc_hi: int


@dataclass(frozen=True, slots=True)
class Part:
    """One unit of work: file spans, or built-in documents (`texts`); `nbytes` of input."""

    nbytes: int
    spans: tuple[Span, ...] = ()
    texts: tuple[str, ...] = ()


@dataclass
class Plan:
    parts: list[Part] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def digest(self) -> str:
        """Names the plan: the same files, cut the same way, give the same digest."""
        h = hashlib.sha256()
        for part in self.parts:
            h.update(f"part {part.nbytes}\n".encode())
            for s in part.spans:
                h.update(f"{s.path}\0{s.size}\0{s.kind}\0{s.lo}\0{s.hi}\0{s.doc_lo}\0"
                         f"{s.doc_hi}\n".encode())
            for t in part.texts:
                h.update(hashlib.sha256(t.encode("utf-8", "surrogatepass")).digest())
        return h.hexdigest()


def plan_source(source: SourceConfig, part_bytes: int = PART_BYTES, group: bool = True) -> Plan:
    """The parts of a source in document order. `group=False` keeps every small file (and
    built-in document) a part of its own (the tokenizer's sample picks among them)."""
    if part_bytes < 1:
        raise ValueError(f"part_bytes must be >= 1, got {part_bytes}")
    plan = Plan()
    if source.builtin is not None:
        _group(plan, ((len(d.encode("utf-8")), d) for d in iter_builtin(source.builtin)),
               part_bytes, group)
        return plan
    pending: list[Span] = []
    pending_bytes = 0
    for path in resolve_paths(source):
        kind = file_kind(source, path)
        p = str(path)
        try:
            size = path.stat().st_size
        except OSError as e:
            raise UserError(f"{path}: cannot read ({e.strerror})") from None
        if size <= part_bytes:
            pending.append(Span(p, size, kind, 0, size, 0, size))
            pending_bytes += size
            if not group or pending_bytes >= part_bytes:
                plan.parts.append(Part(pending_bytes, spans=tuple(pending)))
                pending, pending_bytes = [], 0
            continue
        if pending:
            plan.parts.append(Part(pending_bytes, spans=tuple(pending)))
            pending, pending_bytes = [], 0
        plan.parts.extend(_pieces(p, size, kind, part_bytes))
    if pending:
        plan.parts.append(Part(pending_bytes, spans=tuple(pending)))
    return plan


def _group(plan: Plan, docs: Iterator[tuple[int, str]], part_bytes: int, group: bool) -> None:
    texts: list[str] = []
    nbytes = 0
    for size, doc in docs:
        texts.append(doc)
        nbytes += size
        if not group or nbytes >= part_bytes:
            plan.parts.append(Part(nbytes, texts=tuple(texts)))
            texts, nbytes = [], 0
    if texts:
        plan.parts.append(Part(nbytes, texts=tuple(texts)))


def _pieces(path: str, size: int, kind: str, part_bytes: int) -> list[Part]:
    """The parts of one file larger than a part."""
    lo, hi = 0, size
    if kind == "gutenberg":
        try:
            head, tail = read_windows(path, size)
        except OSError as e:
            raise UserError(f"{path}: cannot read ({e.strerror})") from None
        lo, hi, _ = body_span(head, tail, size)
        kind = "text"
    if kind == "text" and not has_text(path, lo, hi):
        return []  # a blank document is left out, as a small one is
    parts = []
    for start in range(lo, hi, part_bytes):
        end = min(start + part_bytes, hi)
        parts.append(Part(end - start, spans=(Span(path, size, kind, start, end, lo, hi),)))
    return parts


def has_text(path: str, lo: int, hi: int) -> bool:
    """Whether bytes [lo, hi) of a file hold anything but whitespace (reads only until they do;
    a byte that is not UTF-8 counts as text: the reader will name it)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    try:
        with open(path, "rb") as f:
            f.seek(lo)
            at = lo
            while at < hi:
                block = f.read(min(1 << 20, hi - at))
                if not block:
                    break
                at += len(block)
                if decoder.decode(block, final=at >= hi).strip():
                    return True
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    return False
