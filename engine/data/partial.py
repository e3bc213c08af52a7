"""A shard written part by part, so that an interrupted preparation continues where it stopped.

Tokens go to `.NAME.bin.partial`: the shard's header (count still 0), then the tokens. `commit`
fsyncs them, then replaces `.NAME.bin.journal` (tmp + fsync + rename) with what they hold: parts
done, tokens, bytes, documents, under a key (the source's fingerprint, the tokenizer's sha256,
the plan's digest). A later run whose key matches cuts the partial file back to the committed
tokens and goes on with the next part; any other journal, or none, starts the shard over.
`finish` writes the count into the header, fsyncs and renames the file to NAME.bin: the only way
a shard appears. Whatever stops prep (SIGTERM, kill -9, a full disk, a power cut), no file named
like a shard is incomplete, and at most the work since the last commit is redone.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from engine import jsonio
from engine.data.shards import HEADER_SIZE, pack_header
from engine.errors import RunError
from engine.runfiles import fsync_dir, write_bytes_atomic

JOURNAL_VERSION = 1


@dataclass
class Committed:
    """How much of a source a partial shard holds, durably."""

    parts: int = 0
    tokens: int = 0
    nbytes: int = 0
    docs: int = 0


class PartialShard:
    """The shard at `path` being written; `key` says what it is made from (a journal under
    another key is not continued; one counting more parts than the key's `n_parts` neither)."""

    def __init__(self, path: Path, vocab_size: int, tok_sha: str, key: dict[str, Any]) -> None:
        self.path = path
        self.partial = path.with_name(f".{path.name}.partial")
        self.journal = path.with_name(f".{path.name}.journal")
        self.vocab_size = vocab_size
        self.tok_sha = tok_sha
        self.key = key
        self.committed = Committed()
        self.written = Committed()  # committed plus what was appended since
        self._f: BinaryIO | None = None

    def open(self) -> str:
        """Continue a matching partial shard ("resumed"), or start a new one: "new", or
        "restarted" when an unfinished one made from other inputs was there."""
        kept = self._matching_journal()
        state = "resumed" if kept is not None else (
            "restarted" if self.partial.exists() or self.journal.exists() else "new")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if kept is not None:
                self._f = open(self.partial, "r+b")
                self._f.truncate(HEADER_SIZE + 2 * kept.tokens)
                self._f.seek(0, os.SEEK_END)
                self.committed = kept
            else:
                self.journal.unlink(missing_ok=True)
                self._f = open(self.partial, "wb")
                self._f.write(pack_header(self.vocab_size, 0, self.tok_sha))
                self.committed = Committed()
        except OSError as e:
            raise self._error(e) from None
        self.written = Committed(**asdict(self.committed))
        return state

    def _matching_journal(self) -> Committed | None:
        try:
            j = jsonio.load_file(self.journal, max_bytes=1 << 20)
        except jsonio.JsonError:
            return None
        if not isinstance(j, dict) or j.get("version") != JOURNAL_VERSION or j.get(
                "key") != self.key:
            return None
        values = [j.get(k) for k in ("parts", "tokens", "nbytes", "docs")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            return None
        kept = Committed(*values)
        if kept.parts > self.key.get("n_parts", kept.parts):
            return None
        try:
            size = self.partial.stat().st_size
        except OSError:
            return None
        if size < HEADER_SIZE + 2 * kept.tokens:
            return None  # the file lost tokens the journal counts: start over
        try:
            with open(self.partial, "rb") as f:
                if f.read(HEADER_SIZE) != pack_header(self.vocab_size, 0, self.tok_sha):
                    return None
        except OSError:
            return None  # unreadable: start this source over
        return kept

    def append(self, tokens: np.ndarray, nbytes: int, docs: int) -> None:
        """Add one part's tokens (not durable until `commit`)."""
        assert self._f is not None
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            raise ValueError(f"token {int(tokens.max())} out of range for vocab {self.vocab_size}")
        try:
            self._f.write(memoryview(np.ascontiguousarray(tokens, dtype="<u2")))  # no copy
        except OSError as e:
            raise self._error(e) from None
        w = self.written
        self.written = Committed(w.parts + 1, w.tokens + int(tokens.size), w.nbytes + nbytes,
                                 w.docs + docs)

    def commit(self) -> None:
        """Make everything appended so far durable, and record it in the journal."""
        assert self._f is not None
        if self.written == self.committed:
            return
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            record = {"version": JOURNAL_VERSION, "key": self.key, **asdict(self.written)}
            write_bytes_atomic(self.journal, (json.dumps(record, sort_keys=True) + "\n").encode())
        except OSError as e:
            raise self._error(e) from None
        self.committed = self.written

    def finish(self) -> int:
        """Complete the shard: count in the header, fsync, rename to its name. Returns the
        token count."""
        assert self._f is not None
        count = self.written.tokens
        try:
            self._f.seek(0)
            self._f.write(pack_header(self.vocab_size, count, self.tok_sha))
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None
            os.replace(self.partial, self.path)
            fsync_dir(self.path.parent)
            self.journal.unlink(missing_ok=True)
        except OSError as e:
            raise self._error(e) from None
        return count

    def close(self) -> None:
        """Stop writing; what was committed stays for the next run."""
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass  # the journal never counts what this close could lose
            self._f = None

    def discard(self) -> None:
        """Remove the partial shard and its journal."""
        self.close()
        self.partial.unlink(missing_ok=True)
        self.journal.unlink(missing_ok=True)

    def _error(self, e: OSError) -> RunError:
        c = self.committed
        kept = (f"{c.parts} part(s), {c.nbytes / 1e6:.1f} MB of input, are kept"
                if c.parts else "nothing of this source is kept")
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        return RunError(f"{self.partial}: cannot write ({e.strerror or e}); {kept}: "
                        + ("make room and run andrea-prep again to continue" if full else
                           "fix the cause and run andrea-prep again to continue"))
