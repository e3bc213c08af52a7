"""Prep's memory with long JSONL lines: a conversation of 10 MB is read, parsed and encoded one line
at a time and never joined whole (engine.data.reader.read_segments), so a real `andrea-prep`
process tree stays bounded; the text it encodes in pieces gives exactly the ids of the whole
conversation; a line longer than the limit is refused naming its own line."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.data import reader
from engine.data.cuts import next_cut
from engine.data.encoders import make_encoder
from engine.data.plan import Part, Span
from engine.data.pool import SEGMENT_CHARS, encode_part
from engine.data.reader import read_span
from engine.data.sources import render_conversation
from engine.data.tokenizer import load_tokenizer
from engine.errors import UserError
from tests.corpora import hostile_docs
from tests.procs import measure
from tests.test_prep_stream import make_config

ROOT = Path(__file__).resolve().parents[1]
LINE_MB = 10


@pytest.fixture(scope="module")
def tokfile(prepared_data: Path) -> Path:
    return prepared_data / "tokenizer.json"


def long_conversation(nbytes: int, seed: int) -> dict:
    """A Hermes-3 record of about `nbytes` of UTF-8 JSON: turns of words, line breaks and an
    emoji now and then (one character beyond U+FFFF makes Python hold every character of a
    string in 4 bytes: the widest a line's text gets)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9)))
             for _ in range(5000)] + ["café", "naïve", "😀", "\n"]
    block = " ".join(rng.choice(words) for _ in range(60_000))
    turns = [{"from": "system", "value": "You are helpful."}]
    size = 0
    while size < nbytes:
        value = f"turn {len(turns)}: {block}"
        turns.append({"from": "human" if len(turns) % 2 else "gpt", "value": value})
        size += len(json.dumps(value, ensure_ascii=False).encode()) + 30
    return {"conversations": turns}


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_ten_megabyte_conversations_keep_prep_in_bounded_memory(tmp_path: Path,
                                                                 tokfile: Path) -> None:
    """A line is read, decoded, parsed and encoded alone, its conversation never joined: no
    copy of a whole part's text, nor of a whole conversation, is held by the encoder process."""
    src = tmp_path / "long.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        for i in range(3):
            f.write(json.dumps(long_conversation(LINE_MB << 20, i), ensure_ascii=False) + "\n")
    cfg = make_config(tmp_path / "data", [{"name": "chat", "paths": [str(src)],
                                           "format": "jsonl"}], tokfile)
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(cfg.to_json()))
    _, peak, rc, out = measure([sys.executable, "-m", "engine.data.prep", str(cfg_path),
                                "--jobs", "1"], ROOT, every_s=0.02)
    assert rc == 0, out
    assert "chat: 3 docs" in out, out
    # The parent, one encoder process and multiprocessing's helper: about 230 MB here.
    assert peak < 300_000_000, f"peak RSS of the prep process tree: {peak / 1e6:.0f} MB"


@pytest.fixture(scope="module")
def hf(tokfile: Path):
    tok = load_tokenizer(tokfile)
    return tok, make_encoder(tok, "hf")


def test_a_long_conversation_in_pieces_gives_the_ids_of_the_whole(tmp_path: Path, hf) -> None:
    """Values longer than a segment, hostile text (every plane, whitespace runs, CR, the special
    token's text), markers at the joins: the pieces encode to the ids of the rendered record."""
    tok, encoder = hf
    docs = hostile_docs()
    records = [
        {"conversations": [{"from": "system", "value": docs[17]},
                           {"from": "human", "value": docs[20] + "\r\n" + docs[0]},
                           {"from": "gpt", "value": "   "},
                           {"from": "human", "value": docs[18]},
                           {"from": "gpt", "value": docs[22] + docs[24]}]},
        {"conversations": [{"from": "gpt", "value": docs[19] + "x" * (3 * SEGMENT_CHARS)}]},
    ]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    assert max(len(v["value"]) for r in records for v in r["conversations"]) > 3 * SEGMENT_CHARS
    size = src.stat().st_size
    tokens, docs_n = encode_part(encoder, tok.eot_id,
                                 Part(size, spans=(Span(str(src), size, "jsonl", 0, size, 0,
                                                        size),)))
    eot = np.array([tok.eot_id], dtype=np.uint16)
    want = np.concatenate([x for r in records for x in (tok.encode(render_conversation(r, "")),
                                                         eot)])
    assert docs_n == 2 and np.array_equal(tokens, want)


@pytest.mark.parametrize("size", [1, 7, 64, 1000])
def test_split_stream_cuts_only_at_safe_places_whatever_the_chunks(size: int) -> None:
    from engine.data.cuts import split_stream

    rng = random.Random(size)
    text = "".join(hostile_docs()[17:24])[:200_000]
    chunks, at = [], 0
    while at < len(text):
        n = rng.choice([0, 1, 2, 5, 300, 70_000])
        chunks.append(text[at:at + n])
        at += n
    pieces = list(split_stream(iter(chunks), size))
    assert "".join(pieces) == text
    end = 0
    for p in pieces[:-1]:
        end += len(p)
        assert next_cut(text, end) == end, (size, end)  # a safe place in the whole text


def test_a_line_over_the_limit_is_refused_naming_that_line(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Three short lines, then one longer than the limit: the error names line 4 (and not the
    span's first line), and nothing of it is parsed."""
    monkeypatch.setattr(reader, "MAX_LINE_BYTES", 1000, raising=False)
    monkeypatch.setattr(reader, "MAX_UNCUT_BYTES", 1000)
    good = json.dumps({"conversations": [{"from": "human", "value": "hi"}]})
    long = json.dumps({"conversations": [{"from": "gpt", "value": "word " * 400}]})
    p = tmp_path / "c.jsonl"
    p.write_text(f"{good}\n{good}\n{good}\n{long}\n{good}\n", encoding="utf-8")
    size = p.stat().st_size
    with pytest.raises(UserError) as e:
        list(read_span(Span(str(p), size, "jsonl", 0, size, 0, size)))
    assert str(e.value) == (f"{p}:4: a line longer than 1,000 bytes: expected one conversation per "
                            "line"), str(e.value)
