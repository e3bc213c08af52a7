"""Shards: header layout, memory-mapped tokens, and every kind of damaged or foreign file."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from engine.data.shards import HEADER_SIZE, open_shard, write_shard
from engine.errors import UserError

SHA = hashlib.sha256(b"tokenizer A").hexdigest()
OTHER_SHA = hashlib.sha256(b"tokenizer B").hexdigest()
VOCAB = 8449


@pytest.fixture
def tokens():
    return np.random.default_rng(0).integers(0, VOCAB, size=1000).astype(np.uint16)


@pytest.fixture
def shard_file(tmp_path, tokens):
    path = tmp_path / "shards" / "s.bin"
    assert write_shard(path, tokens, VOCAB, SHA) == len(tokens)
    return path


def test_header_layout_by_hand(shard_file, tokens):
    raw = shard_file.read_bytes()
    assert raw[:8] == b"ANDRSHRD"
    assert int.from_bytes(raw[8:12], "little") == 1
    assert int.from_bytes(raw[12:16], "little") == VOCAB
    assert int.from_bytes(raw[16:24], "little") == len(tokens)
    assert raw[24:56].hex() == SHA
    assert len(raw) == 64 + 2 * len(tokens)
    assert raw[64:66] == int(tokens[0]).to_bytes(2, "little")


def test_round_trip_memory_mapped_read_only(shard_file, tokens):
    shard = open_shard(shard_file, expect_vocab=VOCAB, expect_tok_sha=SHA)
    assert len(shard) == len(tokens) and shard.vocab_size == VOCAB and shard.tok_sha == SHA
    np.testing.assert_array_equal(shard.tokens, tokens)
    assert isinstance(shard.tokens, np.memmap)
    with pytest.raises(ValueError):
        shard.tokens[0] = 1
    assert not list(shard_file.parent.glob("*.tmp"))


def test_chunks_write_the_same_bytes(tmp_path, tokens, shard_file):
    path = tmp_path / "c.bin"
    write_shard(path, iter([tokens[:10], tokens[10:10], tokens[10:]]), VOCAB, SHA)
    assert path.read_bytes() == shard_file.read_bytes()


def test_empty_shard(tmp_path):
    path = tmp_path / "e.bin"
    write_shard(path, np.zeros(0, np.uint16), VOCAB, SHA)
    assert len(open_shard(path)) == 0


def test_out_of_range_token_leaves_no_file(tmp_path):
    with pytest.raises(ValueError, match="out of range"):
        write_shard(tmp_path / "x.bin", np.array([1, VOCAB]), VOCAB, SHA)
    assert list(tmp_path.iterdir()) == []


def test_truncated_shard_names_expected_and_actual_bytes(shard_file):
    raw = shard_file.read_bytes()
    shard_file.write_bytes(raw[:-3])
    expected = 64 + 2000
    with pytest.raises(UserError, match=f"truncated: .*{expected} bytes, file has {expected - 3}"):
        open_shard(shard_file)


def test_too_long_shard(shard_file):
    with open(shard_file, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(UserError, match="too long"):
        open_shard(shard_file)


def test_truncated_header(shard_file):
    shard_file.write_bytes(shard_file.read_bytes()[:20])
    with pytest.raises(UserError, match=f"header needs {HEADER_SIZE} bytes, file has 20"):
        open_shard(shard_file)


def test_other_magic(shard_file):
    raw = bytearray(shard_file.read_bytes())
    raw[:8] = b"GPT2DATA"
    shard_file.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="expected magic b'ANDRSHRD', got b'GPT2DATA'"):
        open_shard(shard_file)


def test_other_version(shard_file):
    raw = bytearray(shard_file.read_bytes())
    raw[8:12] = struct.pack("<I", 7)
    shard_file.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="version: expected 1, got 7"):
        open_shard(shard_file)


def test_other_tokenizer(shard_file):
    with pytest.raises(UserError, match="made with another tokenizer"):
        open_shard(shard_file, expect_tok_sha=OTHER_SHA)


def test_other_vocab(shard_file):
    with pytest.raises(UserError, match="vocab size: expected 50257, got 8449"):
        open_shard(shard_file, expect_vocab=50257)


def test_missing(tmp_path):
    with pytest.raises(UserError, match="shard not found"):
        open_shard(tmp_path / "none.bin")
