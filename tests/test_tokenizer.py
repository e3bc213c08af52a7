"""Tokenizer: id layout, exact round trip, deterministic training, clear errors on bad files."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from engine.data.prep import training_texts
from engine.data.tokenizer import EOT, load_tokenizer, train_tokenizer
from engine.errors import UserError
from tests.conftest import as_source

# About 1 MB of built-in text: enough distinct pairs for 8192 merges, trains in well under 1 s.
SOURCES = [
    as_source({"name": "ref", "builtin": "python-reference"}),
    as_source({"name": "code", "builtin": "stdlib-code"}),
]
TRAIN_BYTES = 1_000_000


def _train(path):
    return train_tokenizer(training_texts(SOURCES, TRAIN_BYTES), path)


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_exactly_8449_ids_with_eot_last(tok):
    assert tok.vocab_size == 8449
    assert tok.eot_id == 8448
    assert tok.encode(EOT).tolist() == [8448]
    assert tok.decode([8448]) == EOT


def test_ids_below_256_are_the_raw_bytes(tok):
    # Independent of the vocab table: a string's UTF-8 bytes, used as ids, decode to the string.
    text = "Olá, perché così? 😀 naïve\x00\x1f\r\n\tend"
    assert tok.decode(list(text.encode("utf-8"))) == text
    for b in range(128):  # a single ASCII character cannot be merged with anything
        assert tok.encode(chr(b)).tolist() == [b]


def test_merges_compress_text(tok):
    text = "def function(self, argument):\n    return self.value\n"
    ids = tok.encode(text)
    assert ids.dtype.name == "uint16"
    assert len(ids) < len(text.encode()) / 2
    assert ids.max() >= 256


SPECIAL = st.sampled_from(
    ["é", "à", "ç", "ã", "õ", "ò", "è", "ì", "ù", "😀", "👩‍💻",
     "\x00", "\x7f", "\u200b",
     "\r\n", "\t", " ", "  ", "<|endoftext|>", "<|user|>", "ß", "€"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.text(), SPECIAL), max_size=8).map("".join))
def test_encode_decode_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text
    assert bytes(tok.decode(tok.encode(text)), "utf-8") == text.encode("utf-8")


def test_encode_batch_matches_encode(tok):
    texts = ["", "a", "Ciao mondo", "import os\n", "Você já foi à praia?"]
    batch = tok.encode_batch(texts)
    assert [b.tolist() for b in batch] == [tok.encode(t).tolist() for t in texts]


def test_training_is_deterministic(tmp_path, tok):
    a = _train(tmp_path / "a.json")
    assert (tmp_path / "a.json").read_bytes() == tok.path.read_bytes()
    assert a.sha256 == tok.sha256


def test_load_gives_same_tokenizer(tok):
    again = load_tokenizer(tok.path)
    assert again.sha256 == tok.sha256
    assert again.encode("hello world").tolist() == tok.encode("hello world").tolist()


def test_too_little_text_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="distinct merges, expected 8192"):
        train_tokenizer(["just a little text"] * 10, tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


def test_train_wrong_vocab_size(tmp_path):
    with pytest.raises(UserError, match="vocab_size: expected 8449"):
        train_tokenizer(["x"], tmp_path / "t.json", vocab_size=1000)


def test_load_missing(tmp_path):
    with pytest.raises(UserError, match="tokenizer file not found"):
        load_tokenizer(tmp_path / "nope.json")


def test_load_not_json(tmp_path):
    p = tmp_path / "t.json"
    p.write_text("{ not json")
    with pytest.raises(UserError, match="not a tokenizer JSON file"):
        load_tokenizer(p)


def test_load_foreign_model_kind(tmp_path):
    p = tmp_path / "t.json"
    HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(p))
    with pytest.raises(UserError, match="expected a byte-level BPE"):
        load_tokenizer(p)


def test_load_wrong_size(tmp_path):
    p = tmp_path / "t.json"
    small = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate("abc")}, merges=[]))
    small.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    small.save(str(p))
    with pytest.raises(UserError, match="expected 8449 ids, got 3"):
        load_tokenizer(p)


def test_load_bytes_not_at_their_ids(tmp_path, tok):
    # The same merges with bytes 0 and 1 swapped: encodings would silently mean other bytes.
    spec = json.loads(tok.path.read_text())
    vocab = spec["model"]["vocab"]
    c0, c1 = (c for c, i in vocab.items() if i in (0, 1))
    vocab[c0], vocab[c1] = vocab[c1], vocab[c0]
    p = tmp_path / "t.json"
    p.write_text(json.dumps(spec))
    with pytest.raises(UserError, match="byte 0: expected id 0, got 1"):
        load_tokenizer(p)
