"""The cutting rule (engine.data.cuts): pieces encode to the ids of the whole, in str and in files;
cuts that break the rule do change ids (so these tests can fail)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.data import cuts
from engine.data.cuts import next_cut, next_cut_in_file, next_line_start, split_text
from engine.data.tokenizer import load_tokenizer
from engine.errors import UserError
from tests.corpora import EOT, WHITESPACE, hostile_docs

PIECES = st.sampled_from([
    "a", "Z", "é", "数", "😀", "1", "٣", "!", ".", "'", "'s", "'ll", "’", "-", "_", "#", "\x00",
    "\u0301", "\u200b", EOT, "<|", "|>", "def", " the", "\r\n", *WHITESPACE,
])
TEXT = st.lists(PIECES, max_size=80).map("".join)


@pytest.fixture(scope="module")
def tok(prepared_data):
    return load_tokenizer(prepared_data / "tokenizer.json")


def ids(tok, text):
    return tok.encode(text).tolist()


def cut_points(text):
    out, i = [], next_cut(text, 1)
    while i < len(text):
        out.append(i)
        i = next_cut(text, i + 1)
    return out


@settings(max_examples=300, deadline=None)
@given(TEXT)
def test_every_safe_cut_keeps_the_ids(tok, text):
    whole = ids(tok, text)
    for i in cut_points(text):
        assert "\x21" <= text[i - 1] <= "\x7e" and text[i] in " \t\n\r"
        assert ids(tok, text[:i]) + ids(tok, text[i:]) == whole, (text[:i], text[i:])


@settings(max_examples=100, deadline=None)
@given(TEXT, st.integers(1, 40))
def test_split_text_pieces_tile_and_keep_the_ids(tok, text, size):
    pieces = split_text(text, size)
    assert "".join(pieces) == text
    assert [i for p in pieces for i in ids(tok, p)] == ids(tok, text)


def test_cuts_against_the_rule_change_ids(tok):
    # After a line break that follows whitespace, or before a letter after a space, the pieces
    # tokenize differently: these are the cuts the rule leaves out.
    for text, at in [("a\n\nb", 3), ("x \n    return", 3), ("say hello", 4), ("it's", 3)]:
        assert ids(tok, text[:at]) + ids(tok, text[at:]) != ids(tok, text), text
        assert at not in cut_points(text)


def test_hostile_documents_cut_small_keep_their_ids(tok):
    for doc in hostile_docs()[17:]:
        pieces = split_text(doc, 1000)
        assert "".join(pieces) == doc
        got = np.concatenate([tok.encode(p) for p in pieces])
        assert np.array_equal(got, tok.encode(doc))


def test_file_cuts_find_the_same_places_as_text_cuts():
    text = "abc def\r\nghi  \n\njkl\tm" * 3000
    data = text.encode()
    f = io.BytesIO(data)
    for pos in range(0, len(data), 997):
        assert next_cut_in_file(f, pos, len(data), "x.txt") == next_cut(text, pos)
    assert next_cut_in_file(f, 5, 6, "x.txt") == 6  # none before the limit: the limit


def test_file_cut_across_read_blocks(monkeypatch):
    monkeypatch.setattr(cuts, "SCAN_BLOCK", 4)
    f = io.BytesIO(b"a" * 12 + b"b cd")  # read from byte 1 in blocks of 4: [9, 13) ends in b
    assert next_cut_in_file(f, 2, 16, "x.txt") == 13  # and the space starts the next block


def test_a_document_with_no_place_to_cut_is_refused(monkeypatch):
    monkeypatch.setattr(cuts, "MAX_UNCUT_BYTES", 1000)
    monkeypatch.setattr(cuts, "SCAN_BLOCK", 256)
    f = io.BytesIO(b"\x00" * 5000)
    with pytest.raises(UserError, match=r"big\.txt: byte 10: no place to cut this document"):
        next_cut_in_file(f, 10, 5000, "big.txt")


def test_line_starts():
    data = b'{"a": 1}\r\n{"b": 2}\n\n{"c": 3}'
    f = io.BytesIO(data)
    assert next_line_start(f, 0, len(data)) == 0
    assert next_line_start(f, 1, len(data)) == 10
    assert next_line_start(f, 10, len(data)) == 10
    assert next_line_start(f, 11, len(data)) == 19
    assert next_line_start(f, 21, len(data)) == len(data)
