"""tiktoken gives exactly HF's ids where `tiktoken_ranks` says it does, and is refused where not."""

from __future__ import annotations

import numpy as np
import pytest

from engine.data.encoders import (
    TiktokenEncoder,
    choose_encoder,
    make_encoder,
    tiktoken_ranks,
)
from engine.data.tokenizer import BYTE_CHARS, EOT, _build, _write_atomic, load_tokenizer
from engine.errors import UserError
from tests.corpora import hostile_docs

pytest.importorskip("tiktoken")


@pytest.fixture(scope="module")
def tok(prepared_data):
    return load_tokenizer(prepared_data / "tokenizer.json")


@pytest.fixture(scope="module")
def fast(tok):
    enc = make_encoder(tok, "tiktoken")
    assert isinstance(enc, TiktokenEncoder)
    return enc


def assert_same_ids(tok, fast, docs):
    slow = [np.asarray(e.ids, dtype=np.uint16)
            for e in tok.hf.encode_batch(docs, add_special_tokens=False)]
    for i, (doc, ref) in enumerate(zip(docs, slow, strict=True)):
        got = fast.encode(doc)
        assert got.dtype == np.uint16
        if not np.array_equal(got, ref):
            at = int(np.argmax(got[: len(ref)] != ref[: len(got)])) if min(len(got), len(ref)) else 0
            raise AssertionError(f"document {i}: ids differ at {at}: "
                                 f"{tok.decode(ref[max(at - 3, 0) : at + 3])!r}")
    return sum(len(d.encode()) for d in docs)


def test_the_trained_tokenizer_is_exact_for_tiktoken(tok):
    ranks, why = tiktoken_ranks(tok)
    assert ranks is not None, why
    assert len(ranks) == tok.vocab_size - 1 and sorted(ranks.values()) == list(range(8448))
    assert choose_encoder(tok, "auto") == ("tiktoken", "exact for this tokenizer")
    assert choose_encoder(tok, "hf")[0] == "hf"


# The built-in sources are compared through the whole pipeline (cut, parallel, tiktoken) against
# the whole-document reference in tests/test_prep_stream.py.


def test_same_ids_on_hostile_text(tok, fast):
    docs = hostile_docs()
    assert assert_same_ids(tok, fast, docs) > 1_000_000
    assert fast.encode(f"a{EOT}b").tolist() == [ord("a"), tok.eot_id, ord("b")]


def _conflicting_tokenizer(path):
    """Merges b+c, a+b, ab+c (and filler): HF makes [a, bc] of "abc", tiktoken would make [abc]."""
    a, b, c = BYTE_CHARS[ord("a")], BYTE_CHARS[ord("b")], BYTE_CHARS[ord("c")]
    merges = [(b, c), (a, b), (a + b, c)]
    for x in BYTE_CHARS[128:]:
        for y in BYTE_CHARS[128:]:
            if len(merges) < 8192:
                merges.append((x, y))
    hf = _build(merges)
    _write_atomic(path, hf.to_str().encode())
    return load_tokenizer(path)


def test_a_tokenizer_tiktoken_would_get_wrong_is_refused(tmp_path):
    tok = _conflicting_tokenizer(tmp_path / "tok.json")
    ranks, why = tiktoken_ranks(tok)
    assert ranks is None and "not what BPE makes of its own bytes" in why
    name, reason = choose_encoder(tok, "auto")
    assert name == "hf" and "would not give this tokenizer's ids" in reason
    with pytest.raises(UserError, match="--encoder tiktoken: would not give"):
        choose_encoder(tok, "tiktoken")
    # and the check matters: forced, tiktoken does differ from HF on this vocabulary
    import tiktoken

    from engine.data.encoders import GPT2_PATTERN

    forced = tiktoken.Encoding("x", pat_str=GPT2_PATTERN, special_tokens={EOT: 8448},
                               mergeable_ranks={bytes(BYTE_CHARS.index(ch) for ch in t): i
                                                for t, i in tok.hf.get_vocab().items()
                                                if t != EOT})
    assert forced.encode("abc") != tok.encode("abc").tolist()


def test_unknown_encoder_name(tok):
    with pytest.raises(UserError, match="--encoder: expected one of auto, tiktoken, hf"):
        choose_encoder(tok, "fastest")
