"""docs/configuration.md against the code: every config field is in its tables with its default,
every `ANDREA_*` name the code uses is documented there, and it documents no name the code does
not use.

A config field is found by walking `engine.config.Config`'s dataclasses (a `Section` is an
object, a `List` of `Section`s a list of them, written `data.sources[].name`). A name the code
uses is an `ANDREA_*` word in a string literal of a Python file under engine/, andrea_tui/ or
scripts/ that git tracks or would add (not a comment or a docstring, which describe rather than
use; not the prefix of a formatted name, `f"ANDREA_S{i}"`), or a literal under tests/ that is one
such name and nothing else (how a test sets or reads a variable), except the kernels'
compile-time macro ANDREA_ACT, which nvcc gets as `-D` and no process reads, and the made-up
names of the tests of such scanners (SCANNER_TESTS).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any

import pytest

from engine import config as cfgmod

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
CODE_DIRS = ("engine", "andrea_tui", "tests", "scripts")
NOT_VARIABLES = {"ANDREA_ACT"}  # nvcc's -DANDREA_ACT=n, the kernels' activation type
# tests of scanners like this one, whose literals are made-up names and sources to scan
SCANNER_TESTS = {"tests/test_docs.py", "tests/test_env_vars.py"}
NAME = re.compile(r"(?<![A-Za-z0-9_])ANDREA_[A-Z_]+(?![A-Za-z0-9_{])")
FIELD_HEADER = "| field | type | range | default | meaning |"
ROW = re.compile(r"^\| `([a-z_][a-z0-9_.\[\]]*)` \|(.*)$")


# ---------------------------------------------------------------- config fields


def config_fields(cls: type = cfgmod.Config, prefix: str = "") -> dict[str, Any]:
    """Dotted path of every field of the config tree -> its default (MISSING when required)."""
    out: dict[str, Any] = {}
    for f in fields(cls):
        path = prefix + f.name
        out[path] = f.default_factory() if f.default_factory is not MISSING else f.default
        check = f.metadata["check"]
        if isinstance(check, cfgmod.Section):
            out.update(config_fields(check.cls, path + "."))
        elif isinstance(check, cfgmod.List) and isinstance(check.item, cfgmod.Section):
            out.update(config_fields(check.item.cls, path + "[]."))
    return out


def documented_fields(text: str) -> dict[str, list[str]]:
    """The rows of the field tables (those headed FIELD_HEADER): the dotted path in the first
    cell -> the row's cells (path, type, range, default, meaning)."""
    rows: dict[str, list[str]] = {}
    in_table = False
    for line in text.splitlines():
        if not line.startswith("|"):
            in_table = False
        elif line == FIELD_HEADER:
            in_table = True
        elif in_table and (m := ROW.match(line)):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", m.group(2))[:-1]]
            assert m.group(1) not in rows, f"{m.group(1)}: documented twice"
            rows[m.group(1)] = [m.group(1), *cells]
    return rows


def default_in_cell(cell: str) -> Any:
    """The default a table cell states: MISSING for `required`, None for `absent ...`, else the
    JSON value in its first backticks (a bare word where that is not JSON: `auto`)."""
    if cell == "required":
        return MISSING
    if cell.startswith("absent"):
        return None
    m = re.search(r"`([^`]*)`", cell)
    assert m, f"default cell {cell!r}: expected required, absent (...) or a `value`"
    try:
        return json.loads(m.group(1))
    except json.JSONDecodeError:
        return m.group(1)


def states(stated: Any, default: Any) -> bool:
    """Whether a cell's stated default is the field's: `required` for none, `absent` for an
    optional key (None, or a section whose fields all take their defaults), else equal and of
    the same kind (`1` is not `true`)."""
    if default is MISSING or stated is MISSING:
        return stated is default
    if default is None or is_dataclass(default):
        return stated is None
    expected = list(default) if isinstance(default, tuple) else default
    if isinstance(expected, bool) or isinstance(stated, bool):
        return stated is expected
    return stated == expected


def test_the_walk_reaches_nested_sections_and_lists() -> None:
    found = config_fields()
    assert found["eval.holdout"] == 0.05
    assert found["data.tokenizer.vocab_size"] is MISSING
    assert found["data.sources[].format"] == "auto"


def test_every_config_field_is_documented_with_its_default() -> None:
    code = config_fields()
    fields_only = documented_fields(DOC.read_text(encoding="utf-8"))
    assert sorted(set(code) - set(fields_only)) == [], "fields missing from docs/configuration.md"
    assert sorted(set(fields_only) - set(code)) == [], "docs/configuration.md names no such field"
    wrong = {}
    for path, default in code.items():
        cells = fields_only[path]
        assert len(cells) == 5, f"{path}: expected 5 cells (field, type, range, default, meaning)"
        if not states(default_in_cell(cells[3]), default):
            wrong[path] = (cells[3], default)
    assert wrong == {}, "defaults in docs/configuration.md that differ from engine/config.py"


def test_a_default_cell_is_read_as_stated() -> None:
    assert default_in_cell("required") is MISSING
    assert default_in_cell("absent (all kept)") is None
    assert default_in_cell("`0.05`") == 0.05
    assert default_in_cell("`auto`") == "auto"
    assert default_in_cell('`""`') == ""
    assert default_in_cell("`true`") is True
    assert states(10, 10.0) and states([0.9, 0.95], (0.9, 0.95)) and states(None, None)
    assert not states(1, True) and not states(MISSING, 8) and not states("auto", "cudnn")


# ---------------------------------------------------------------- ANDREA_* names


def python_files() -> list[Path]:
    """The Python files under CODE_DIRS that git tracks or would add (not ignored ones)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z",
                          "--", *CODE_DIRS], cwd=ROOT, capture_output=True, check=True).stdout
    paths = {ROOT / p for p in out.decode().split("\0") if p.endswith(".py")}
    return sorted(p for p in paths if p.is_file())


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (a module's, a class's, a function's)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.add(id(body[0].value))
    return out


def names_in_source(source: str, whole: bool = False) -> set[str]:
    """The ANDREA_* names in the string literals of a Python source (module doc). `whole`: only
    literals that are one name and nothing else, the way a test sets or reads a variable (a
    test's longer strings may be made-up sources for a scanner of its own)."""
    tree = ast.parse(source)
    skip = docstrings(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):  # an f-string: "{}" where a value goes
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            found.update(NAME.findall(text) if not whole else ())
            skip.update(id(v) for v in node.values)  # its parts are read here, whole
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if not whole:
                found.update(NAME.findall(node.value))
            elif NAME.fullmatch(node.value):
                found.add(node.value)
    return found - NOT_VARIABLES


def names_in_code() -> dict[str, list[str]]:
    """Every ANDREA_* name the code uses -> the files that use it."""
    out: dict[str, list[str]] = {}
    for path in python_files():
        if path.relative_to(ROOT).as_posix() in SCANNER_TESTS:
            continue
        whole = path.relative_to(ROOT).parts[0] == "tests"
        for name in names_in_source(path.read_text(encoding="utf-8"), whole):
            out.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return out


def test_names_are_taken_from_literals_only() -> None:
    source = '''"""ANDREA_DOC is described here."""
# ANDREA_COMMENT in a comment
import os
def f(i):
    """ANDREA_FUNCDOC"""
    os.environ.get("ANDREA_READ", "ANDREA_ACT")
    return {f"ANDREA_S{i}": "-DANDREA_ACT=1", "ANDREA_" + "X": f"x {i} ANDREA_FMT"}
'''
    assert names_in_source(source) == {"ANDREA_READ", "ANDREA_FMT"}
    assert names_in_source(source, whole=True) == {"ANDREA_READ"}


def test_the_walk_finds_a_known_use() -> None:
    assert "tests/test_tui_golden.py" in names_in_code().get("ANDREA_UPDATE_GOLDEN", [])


def documented_variables(text: str) -> set[str]:
    """The ANDREA_* names of the doc's `## Environment variables` section (the doc also names
    the keys of older checkpoints' records elsewhere, which are no variables)."""
    section = text.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    return set(NAME.findall(section))


def test_every_name_the_code_uses_is_documented_and_every_documented_variable_is_used() -> None:
    code = names_in_code()
    text = DOC.read_text(encoding="utf-8")
    named = set(NAME.findall(text))
    undocumented = {n: files for n, files in sorted(code.items()) if n not in named}
    assert undocumented == {}, "ANDREA_* names the code uses that docs/configuration.md lacks"
    assert sorted(documented_variables(text) - set(code)) == [], \
        "docs/configuration.md documents variables that no code uses"


def test_every_variable_engine_env_declares_is_documented() -> None:
    from engine import env

    documented = documented_variables(DOC.read_text(encoding="utf-8"))
    assert sorted(set(env.NAMES) - documented) == []


OTHER_DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")
                                  if p != DOC)]


@pytest.mark.parametrize("name", OTHER_DOCS)
def test_other_docs_name_only_documented_variables(name: str) -> None:
    """A variable named anywhere in the docs is one docs/configuration.md documents."""
    documented = set(NAME.findall(DOC.read_text(encoding="utf-8")))
    named = set(NAME.findall((ROOT / name).read_text(encoding="utf-8"))) - NOT_VARIABLES
    assert sorted(named - documented) == [], f"{name} names variables the docs do not document"
