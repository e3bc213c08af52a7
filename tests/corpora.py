"""Test corpora: hostile text for the encoders and the cutting rule, and files made from it."""

from __future__ import annotations

import json
import random
from pathlib import Path

EOT = "<|endoftext|>"
WHITESPACE = " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u200a\u2028\u2029\u202f\u205f\u3000"


def plane_text(plane: int, step: int) -> str:
    """Every `step`-th code point of a Unicode plane (no surrogates), each in letter, digit,
    punctuation and whitespace company."""
    parts = []
    for cp in range(plane << 16, (plane + 1) << 16, step):
        if 0xD800 <= cp < 0xE000:
            continue
        c = chr(cp)
        parts.append(f"a{c}b 1{c}2 !{c}? {c}x  {c} \n{c}'s")
    return " ".join(parts)


def hostile_docs(seed: int = 0) -> list[str]:
    """Documents a tokenizer can get wrong: every plane, very long lines and runs, the special
    token's text inside, whitespace runs of every kind, CR/LF mixes, contractions."""
    rng = random.Random(seed)
    docs = [plane_text(0, 7)] + [plane_text(p, 509) for p in range(1, 17)]
    words = ["the", "Olá", "perché", "данные", "数据", "😀", "👩‍💻", "e\u0301", "x1", "don't",
             "WE'LL", "it’s", "naïve", "\u200b", "\x00", "a\u0300\u0301", "İ", "ß", "ﬁ"]
    docs.append(" ".join(rng.choice(words) for _ in range(60_000)))  # one very long line
    docs.append("x" * 200_000 + " y" + "1" * 50_000 + "!" * 30_000)  # long single pre-tokens
    docs.append(" " * 100_000 + "tail")  # a long whitespace run
    docs.append("\n" * 5_000 + "\t" * 3_000 + "end\n\n\n")
    docs.append("".join(rng.choice(WHITESPACE) * rng.randint(1, 9) + rng.choice(words)
                        for _ in range(5_000)))
    docs.append(f"{EOT}start {EOT} middle{EOT}glued\n{EOT}\n  {EOT}  {EOT}{EOT} <|endoftext| "
                f"<|endoftext|>'s end{EOT}")
    docs.append("a\r\nb\rc\n\rd\r\r\ne\r\n\r\nf \r g\t\r\n" * 500)
    docs.append("\ufeffBOM first, then 's 't 're 've 'm 'll 'd ’s 'S 'T'RE'S ''s '''")
    docs.append("".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(20_000)))
    docs.append("def f(x):\n\treturn x  # trailing   \n\n\n    \n" * 2_000)
    return docs


def write_hostile_tree(root: Path) -> dict[str, list[str]]:
    """Files in every format made from the hostile corpus, under `root`: returns the config
    `paths` for a source per format ("text", "docs", "jsonl", "gutenberg")."""
    docs = hostile_docs()
    text = root / "text"
    text.mkdir(parents=True)
    for i, d in enumerate(docs):
        newline = "\r\n" if i % 3 == 1 else "\n"  # some files with CRLF line ends
        (text / f"h{i:02d}.txt").write_bytes(d.replace("\n", newline).encode("utf-8"))
    (text / "zz-big.txt").write_text("\n".join(docs[17:]), encoding="utf-8")
    (text / "zz-blank.txt").write_text(" \n\t\u3000\n", encoding="utf-8")
    site = root / "docs" / "guide"
    site.mkdir(parents=True)
    (site / "index.md").write_text("# Guide\n\n" + docs[20], encoding="utf-8")
    (site / "api.rst").write_text("API\n===\n\n" + docs[22], encoding="utf-8")
    (site / "skip.jsonl").write_text("not part of a docs source\n", encoding="utf-8")
    chat = root / "chat.jsonl"
    with open(chat, "w", encoding="utf-8", newline="") as f:
        for i, d in enumerate(docs):
            for j in range(0, len(d), 20_000):
                conv = [{"from": "system", "value": "Be brief."},
                        {"from": "human", "value": d[j : j + 20_000]},
                        {"from": "gpt", "value": f"{i}:{j}"}]
                f.write(json.dumps({"conversations": conv}, ensure_ascii=i % 2 == 0)
                        + ("\r\n" if j % 40_000 else "\n"))
            f.write("\n   \n")
    books = root / "books"
    books.mkdir()
    for i, d in enumerate(docs[17:24]):
        (books / f"pg{i}.txt").write_text(
            f"The Project Gutenberg eBook of Book {i}\n\n*** START OF THE PROJECT GUTENBERG "
            f"EBOOK BOOK {i} ***\n\n\n{d}\n\n*** END OF THE PROJECT GUTENBERG EBOOK BOOK {i} "
            "***\n\nSection 1. General Terms of Use\n", encoding="utf-8")
    return {"text": [str(text)], "docs": [str(root / "docs")], "jsonl": [str(chat)],
            "gutenberg": [str(books)]}


def prose(nbytes: int, seed: int = 0) -> str:
    """About `nbytes` of plain English-like text with line breaks (a 256 KB block, varied and
    repeated, so that even a large file is quick to make)."""
    rng = random.Random(seed)
    words = ["the", "keeper", "lamp", "of", "and", "wrote", "hour", "in", "his", "book", "fog",
             "came", "from", "west", "horn", "answered", "it", "twice", "a", "minute", "boat",
             "did", "not", "come", "oil", "flour", "candles", "Thursday", "river", "bridge"]
    lines = []
    size = 0
    while size < 256 << 10:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(3, 16))).capitalize() + "."
        lines.append(line)
        size += len(line) + 1
    block = "\n".join(lines) + "\n"
    out = []
    for i in range(max(1, nbytes // len(block))):
        out.append(f"Part {i}.\n{block}")
    return "".join(out)
