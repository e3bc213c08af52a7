"""Token shards: one file of uint16 tokens per source, with a header that says what they mean.

Layout (little-endian), HEADER_SIZE = 64 bytes, then the tokens:
    magic b"ANDRSHRD" | uint32 version | uint32 vocab size | uint64 token count |
    32 bytes tokenizer sha256 | 8 zero bytes (pad, so tokens start 64-byte aligned)
    n_tokens x uint16
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import UserError
from engine.runfiles import fsync_dir

MAGIC = b"ANDRSHRD"
VERSION = 1
HEADER = struct.Struct("<8sIIQ32s8x")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 64


@dataclass(frozen=True)
class Shard:
    path: Path
    vocab_size: int
    tok_sha: str  # hex sha256 of the tokenizer file the tokens came from
    tokens: np.ndarray  # read-only uint16, memory-mapped

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def _sha_bytes(tok_sha: str) -> bytes:
    raw = bytes.fromhex(tok_sha)
    if len(raw) != 32:
        raise ValueError(f"tokenizer sha256 must be 64 hex digits, got {tok_sha!r}")
    return raw


def pack_header(vocab_size: int, count: int, tok_sha: str) -> bytes:
    """The HEADER_SIZE bytes that start a shard of `count` tokens."""
    return HEADER.pack(MAGIC, VERSION, vocab_size, count, _sha_bytes(tok_sha))


def write_shard(
    path: str | os.PathLike,
    tokens: np.ndarray | Iterable[np.ndarray],
    vocab_size: int,
    tok_sha: str,
) -> int:
    """Write a shard atomically (tmp + fsync + rename); `tokens` may be an array or chunks.

    Returns the token count. Chunks let prep stream a large source without holding it all.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _sha_bytes(tok_sha)
    chunks = [tokens] if isinstance(tokens, np.ndarray) else tokens
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # unique: preps may overlap
    count = 0
    try:
        with open(tmp, "wb") as f:
            f.write(pack_header(vocab_size, 0, tok_sha))
            for chunk in chunks:
                arr = np.asarray(chunk)
                if arr.size and int(arr.max()) >= vocab_size:
                    raise ValueError(f"token {int(arr.max())} out of range for vocab {vocab_size}")
                f.write(arr.astype("<u2", copy=False).tobytes())
                count += int(arr.size)
            f.seek(0)  # the count is known only now
            f.write(pack_header(vocab_size, count, tok_sha))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return count


def open_shard(
    path: str | os.PathLike,
    expect_vocab: int | None = None,
    expect_tok_sha: str | None = None,
) -> Shard:
    """Memory-map a shard after checking its header and size against what the caller expects."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: shard not found (run andrea-prep CONFIG.json)")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_SIZE)
    if head[:8] != MAGIC:
        raise UserError(
            f"{path}: offset 0: expected magic {MAGIC!r}, got {head[:8]!r}: not a shard"
        )
    if len(head) < HEADER_SIZE:
        raise UserError(
            f"{path}: truncated: header needs {HEADER_SIZE} bytes, file has {len(head)}"
        )
    _, version, vocab, count, sha = HEADER.unpack(head)
    if version != VERSION:
        raise UserError(f"{path}: offset 8: version: expected {VERSION}, got {version}")
    expected_size = HEADER_SIZE + 2 * count
    if size != expected_size:
        what = "truncated" if size < expected_size else "too long"
        raise UserError(
            f"{path}: {what}: header says {count} tokens = {expected_size} bytes, "
            f"file has {size} bytes"
        )
    if expect_vocab is not None and vocab != expect_vocab:
        raise UserError(
            f"{path}: offset 12: vocab size: expected {expect_vocab}, got {vocab} "
            "(re-run andrea-prep)"
        )
    if expect_tok_sha is not None and sha.hex() != expect_tok_sha:
        raise UserError(
            f"{path}: offset 24: made with another tokenizer (sha256 {sha.hex()[:12]}..., "
            f"expected {expect_tok_sha[:12]}...): re-run andrea-prep"
        )
    if count == 0:
        tokens = np.zeros(0, dtype="<u2")
    else:
        tokens = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_SIZE, shape=(count,))
    return Shard(path=path, vocab_size=vocab, tok_sha=sha.hex(), tokens=tokens)
