"""Gutenberg books: the licence header and footer are removed, in every marker variant, the same
way whether a book is read whole or through its first and last bytes only."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.data.gutenberg import HEAD_BYTES, TAIL_BYTES, body_of, body_span, read_windows
from engine.data.sources import iter_documents
from tests.conftest import as_source

FIXTURES = Path(__file__).parent / "fixtures" / "gutenberg"


def docs(paths, fmt="gutenberg"):
    return list(iter_documents(as_source({"name": "g", "paths": paths, "format": fmt})))


def test_modern_book_loses_header_and_footer():
    [book] = docs([str(FIXTURES / "modern.txt")])
    assert book.startswith("THE LIGHTHOUSE KEEPER'S ALMANAC\n\nCHAPTER I.\n")
    assert book.endswith("flour and the candles, and found that they would last until Thursday."
                         "\n\nTHE END")
    assert "Gutenberg" not in book and "\ufeff" not in book


def test_old_small_print_book_with_crlf():
    [book] = docs([str(FIXTURES / "old.txt")])
    assert book == ("A SHORT WALK\n\nWe set out after breakfast, by the lane that runs past the "
                    "mill,\nand were on the hill before the dew was off the grass.  From the\n"
                    "top one could see the river, the three bridges and the town.\n\nWe came "
                    "home by the water meadows, tired and very content.")


def test_directory_of_books_takes_txt_files_in_order(tmp_path):
    for name in ("b.txt", "a.txt", "notes.md"):
        (tmp_path / name).write_text(f"*** START OF THE PROJECT GUTENBERG EBOOK {name} ***\n"
                                     f"{name} body\n*** END OF THE PROJECT GUTENBERG EBOOK ***\n")
    assert docs([str(tmp_path)]) == ["a.txt body", "b.txt body"]


def test_the_same_file_as_plain_text_keeps_everything():
    text = (FIXTURES / "modern.txt").read_text(encoding="utf-8")
    assert docs([str(FIXTURES / "modern.txt")], fmt="text") == [text]


@pytest.mark.parametrize("start", [
    "*** START OF THE PROJECT GUTENBERG EBOOK X ***",
    "*** START OF THIS PROJECT GUTENBERG EBOOK X ***",
    "***START OF THE PROJECT GUTENBERG EBOOK X***",
    "*** START OF THE COPYRIGHTED PROJECT GUTENBERG EBOOK X ***",
    "*** start of the project gutenberg etext x ***",
    "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*",
    "*END THE SMALL PRINT! FOR PUBLIC DOMAIN EBOOKS*Ver.02/11/02*END*",
])
@pytest.mark.parametrize("end", [
    "*** END OF THE PROJECT GUTENBERG EBOOK X ***",
    "*** END OF THIS PROJECT GUTENBERG EBOOK X ***",
    "***END OF THE PROJECT GUTENBERG EBOOK X***",
    "End of the Project Gutenberg EBook of X, by Y\n\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***",
    "End of Project Gutenberg's X, by Y",
    "End of The Project Gutenberg Etext of X",
])
def test_marker_variants(start, end):
    data = f"Header\nlines\n{start}\n\n\nBody line one.\nBody line two.\n\n{end}\nLicence\n"
    body = body_of(data.encode())
    assert data.encode()[body.start : body.end] == b"Body line one.\nBody line two."
    assert body.marked


def test_a_file_without_markers_is_kept_whole():
    data = b"  Just a cleaned book.\n"
    assert body_of(data) == (2, len(data) - 1, False)


def test_windows_find_the_body_of_a_large_book(tmp_path):
    middle = "All work and no play makes a dull book.\n" * (3 * (HEAD_BYTES + TAIL_BYTES) // 40)
    text = ((FIXTURES / "modern.txt").read_text(encoding="utf-8")
            .replace("CHAPTER II.", middle + "CHAPTER II."))
    path = tmp_path / "big.txt"
    path.write_text(text, encoding="utf-8")
    data = path.read_bytes()
    head, tail = read_windows(str(path), len(data))
    assert len(head) == HEAD_BYTES and len(tail) == TAIL_BYTES
    whole = body_of(data)
    assert body_span(head, tail, len(data)) == whole
    assert data[whole.start :].startswith(b"THE LIGHTHOUSE")
    assert data[: whole.end].endswith(b"THE END")
