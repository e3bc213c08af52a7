"""Sources: built-in arms, text / markdown / directories / globs, Hermes-3 JSONL, bad input."""

from __future__ import annotations

import inspect
import json
import os
import sys

import pytest

from engine.data import builtin
from engine.data.sources import iter_documents, source_fingerprint
from engine.errors import UserError
from tests.conftest import as_source


def _docs(source):
    return list(iter_documents(as_source(source)))


@pytest.fixture(scope="module")
def arms():
    return {n: _docs({"name": n, "builtin": n}) for n in builtin.BUILTINS}


def test_builtin_arms_non_empty_capped_and_distinct(arms):
    for name, docs in arms.items():
        size = sum(len(d.encode()) for d in docs)
        assert len(docs) >= 50, name
        assert 300_000 < size <= builtin.ARM_CAP_BYTES, (name, size)
    sets = [set(d) for d in arms.values()]
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])


def test_python_reference_is_pydoc_topics(arms):
    from pydoc_data.topics import topics

    assert arms["python-reference"] == [topics[k].strip() + "\n" for k in sorted(topics)]


def test_stdlib_docstrings_match_imported_docstrings(arms):
    import json as json_module

    doc = next(d for d in arms["stdlib-docstrings"] if d.startswith("json\n\n"))
    assert inspect.cleandoc(json_module.__doc__) in doc
    assert f"json.dumps\n\n{inspect.cleandoc(json_module.dumps.__doc__)}" in doc


def test_stdlib_code_is_stdlib_files_without_tests(arms):
    root = builtin.stdlib_root()
    contents = {}
    for dirpath, _, files in os.walk(root):
        if "site-packages" in dirpath:
            continue
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(dirpath, f)
                with open(p, encoding="utf-8", errors="replace") as fh:
                    contents.setdefault(fh.read(), []).append(p)

    def is_test(path):
        rel = os.path.relpath(path, root).split(os.sep)
        return "test" in rel or "tests" in rel or rel[-1].startswith("test_")

    for doc in arms["stdlib-code"]:
        paths = contents[doc]  # KeyError if a document is not a stdlib file
        assert not all(is_test(p) for p in paths), paths


def test_even_selection_spreads_over_the_list():
    sizes = [10] * 100
    keep = builtin.even_selection(sizes, 250)
    assert len(keep) == 25
    assert keep[0] < 10 and keep[-1] >= 90  # from both ends, not a prefix
    assert builtin.even_selection([5, 5], 100) == [0, 1]


def test_missing_pydoc_data_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)  # makes the import fail
    with pytest.raises(UserError, match=r"no module pydoc_data\.topics"):
        builtin.python_reference_docs()


def test_unknown_builtin():
    with pytest.raises(UserError, match=r"builtin: expected one of .* got 'nope'"):
        _docs({"name": "x", "builtin": "nope"})


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    files = {
        "a.txt": "alpha text\n",
        "b.md": "# Bee\n\nmarkdown\n",
        "sub/c.rst": "Cee\n===\n",
        "sub/deeper/d.markdown": "dee\n",
        "sub/ignored.py": "print('not text')\n",
        "sub/empty.txt": "   \n",
    }
    for rel, text in files.items():
        (tmp_path / rel).write_text(text, encoding="utf-8")
    return tmp_path


def test_text_file(tree):
    assert _docs({"name": "t", "paths": [str(tree / "a.txt")]}) == ["alpha text\n"]


def test_directory_recursive_sorted_known_suffixes(tree):
    docs = _docs({"name": "t", "paths": [str(tree)]})
    assert docs == ["alpha text\n", "# Bee\n\nmarkdown\n", "Cee\n===\n", "dee\n"]


def test_glob(tree):
    docs = _docs({"name": "t", "paths": [str(tree / "**" / "*.rst"), str(tree / "*.md")]})
    assert docs == ["Cee\n===\n", "# Bee\n\nmarkdown\n"]


def test_format_text_forces_jsonl_file_as_text(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"not": "a conversation"}\n')
    assert _docs({"name": "t", "paths": [str(p)], "format": "text"}) == [p.read_text()]


def _write_jsonl(path, records):
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in records))


def test_jsonl_conversation_rendering(tmp_path):
    p = tmp_path / "chat.jsonl"
    conv = {"conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Olá?"},
        {"from": "gpt", "value": "Ciao!"},
    ]}
    _write_jsonl(p, [conv, "\n", {"conversations": [{"from": "human", "value": "x"}]}])
    docs = _docs({"name": "c", "paths": [str(p)]})
    assert docs == [
        "<|system|>\nBe brief.\n<|user|>\nOlá?\n<|assistant|>\nCiao!",
        "<|user|>\nx",
    ]


GOOD = {"conversations": [{"from": "human", "value": "hi"}]}


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{oops\n", "not valid JSON"),
        ('[1, 2]\n', "expected a JSON object, got list"),
        ({"messages": []}, "conversations: expected a non-empty list"),
        ({"conversations": ["hi"]}, r"conversations\[0\]: expected an object, got str"),
        ({"conversations": [{"from": "bot", "value": "x"}]}, r"\.from: expected one of .*'bot'"),
        ({"conversations": [{"from": "gpt", "value": 3}]}, r"\.value: expected a string, got int"),
        ('{"conversations": [{"from": "gpt", "value": "x"}], "n": ' + "1" * 5000 + "}\n",
         r"not usable JSON \(Exceeds the limit"),
        ({"conversations": [{"from": "gpt", "value": "a\ud800b"}]},
         r"conversations\[0\]\.value: character 1: expected text, got a lone surrogate"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path, bad, message):
    p = tmp_path / "bad.jsonl"
    _write_jsonl(p, [GOOD, GOOD, bad])
    with pytest.raises(UserError, match=message) as e:
        _docs({"name": "c", "paths": [str(p)]})
    assert f"{p}:3:" in str(e.value)


def test_path_matching_nothing_names_source_and_path(tmp_path):
    missing = str(tmp_path / "nothing*.txt")
    with pytest.raises(UserError, match=r"data\.sources\[mine\]\.paths: .*nothing\*\.txt"):
        _docs({"name": "mine", "paths": [missing]})


def test_directory_without_text_files(tmp_path):
    (tmp_path / "x.py").write_text("pass\n")
    with pytest.raises(UserError, match="matches no file"):
        _docs({"name": "mine", "paths": [str(tmp_path)]})


def test_non_utf8_text(tmp_path):
    p = tmp_path / "latin.txt"
    p.write_bytes(b"caf\xe9\n")
    with pytest.raises(UserError, match="byte 3: expected UTF-8"):
        _docs({"name": "t", "paths": [str(p)]})


def test_fingerprint_follows_file_changes(tree):
    src = as_source({"name": "t", "paths": [str(tree)]})
    first = source_fingerprint(src)
    assert source_fingerprint(src) == first
    (tree / "a.txt").write_text("alpha text, longer now\n")
    assert source_fingerprint(src) != first


def test_builtin_fingerprints_differ_per_arm():
    fps = {source_fingerprint(as_source({"name": n, "builtin": n})) for n in builtin.BUILTINS}
    assert len(fps) == len(builtin.BUILTINS)
