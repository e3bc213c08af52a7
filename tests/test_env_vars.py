"""The engine's environment variables: declared once, in engine/env.py (name, meaning, default,
parser), and read nowhere else under engine/; docs/configuration.md names exactly these (beside
the few that only the test suite reads)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from engine import config as cfgmod
from engine import env
from engine.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"
NAME = re.compile(r"(?<![A-Za-z0-9_])ANDREA_[A-Z][A-Z_]*(?![A-Za-z0-9_{])")
NOT_VARIABLES = {"ANDREA_ACT"}  # nvcc's -DANDREA_ACT=n, the kernels' activation type
DOC_ROW = re.compile(r"^\| `(ANDREA_[A-Z_]+)` \|", re.M)


def engine_modules() -> list[Path]:
    return sorted(p for p in ENGINE.rglob("*.py") if p != ENGINE / "env.py")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _is_environ(node: ast.AST) -> bool:
    """os.environ, environ, os.getenv, getenv."""
    if isinstance(node, ast.Attribute):
        return node.attr in ("environ", "getenv") or _is_environ(node.value)
    return isinstance(node, ast.Name) and node.id in ("environ", "getenv")


def environ_reads_by_name(source: str) -> list[str]:
    """The statements of `source` that touch the environment (os.environ, os.getenv) and
    name an ANDREA_* variable in a string of their own: reads that belong in engine/env.py."""
    tree = ast.parse(source)
    found = []
    for stmt in ast.walk(tree):
        if not isinstance(stmt, ast.stmt) or isinstance(stmt, (ast.FunctionDef, ast.ClassDef,
                                                               ast.AsyncFunctionDef, ast.If,
                                                               ast.For, ast.While, ast.With,
                                                               ast.Try)):
            continue
        nodes = list(ast.walk(stmt))
        if any(_is_environ(n) for n in nodes) and any(
                isinstance(n, ast.Constant) and isinstance(n.value, str) and "ANDREA_" in n.value
                for n in nodes):
            found.append(ast.unparse(stmt).splitlines()[0])
    return found


def names_in_strings(source: str) -> set[str]:
    """ANDREA_* names in the string constants of `source` (not its docstrings), bare names
    (a variable named by its literal) marked with a leading "=". """
    tree = ast.parse(source)
    skip = _docstrings(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if NAME.fullmatch(node.value):
                out.add("=" + node.value)
            out.update(NAME.findall(node.value))
    return out - NOT_VARIABLES - {"=" + n for n in NOT_VARIABLES}


def test_the_scan_finds_what_it_looks_for() -> None:
    source = '''"""ANDREA_DOC in a docstring."""
import os
X = os.environ.get("ANDREA_READ", "1")
Y = f"set {NAME} or ANDREA_SAID"
os.environ.pop("ANDREA_" "POP", None)
Z = {"a": 1}.get("ANDREA_NOT_ENV")
'''
    assert environ_reads_by_name(source) == ["X = os.environ.get('ANDREA_READ', '1')",
                                             "os.environ.pop('ANDREA_POP', None)"]
    assert names_in_strings(source) == {"ANDREA_READ", "=ANDREA_READ", "ANDREA_SAID",
                                        "ANDREA_POP", "=ANDREA_POP", "ANDREA_NOT_ENV",
                                        "=ANDREA_NOT_ENV"}


def test_each_variable_is_declared_once_with_its_meaning_default_and_kind() -> None:
    assert len(env.VARIABLES) <= 15
    assert len(set(env.NAMES)) == len(env.NAMES)
    for v in env.VARIABLES:
        assert NAME.fullmatch(v.name), v.name
        assert v.kind in env.KINDS and v.meaning and v.default, v.name


def test_no_other_engine_module_reads_an_andrea_variable() -> None:
    reads = {str(p.relative_to(ROOT)): r for p in engine_modules()
             if (r := environ_reads_by_name(p.read_text(encoding="utf-8")))}
    assert reads == {}, "read these through engine/env.py"


def test_the_engine_names_only_declared_variables() -> None:
    """A message may name a variable (from engine/env.py); no module names one by its literal
    alone (it takes `env.X.name`), and none names one that is not declared. The exception:
    the keys of a checkpoint record written before the config's gpu section, which
    engine/config.py reads by their suffixes."""
    found: dict[str, set[str]] = {}
    for p in engine_modules():
        names = names_in_strings(p.read_text(encoding="utf-8"))
        bare = {n for n in names if n.startswith("=")}
        undeclared = {n for n in names if not n.startswith("=")} - set(env.NAMES)
        if bare or undeclared:
            found[str(p.relative_to(ROOT))] = bare | undeclared
    assert found == {}
    assert not {cfgmod.RECORD_PREFIX + k for k in cfgmod.RECORDED_SWITCHES} & set(env.NAMES)


def test_docs_name_exactly_the_declared_variables() -> None:
    """docs/configuration.md's tables name every variable of engine/env.py; any other name
    there is one only the test suite reads (a test's own switch, never the engine's)."""
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    section = doc[doc.index("## Environment variables"):]
    documented = set(DOC_ROW.findall(section))
    assert sorted(set(env.NAMES) - documented) == [], "document these in docs/configuration.md"
    tests = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "tests").rglob("*.py"))
    engine = "\n".join(p.read_text(encoding="utf-8") for p in ENGINE.rglob("*.py"))
    for name in sorted(documented - set(env.NAMES)):
        assert name in tests and name not in engine, name


@pytest.mark.parametrize(("var", "raw", "value"), [
    (env.CUDA_GRAPHS, "0", False), (env.CUDA_GRAPHS, None, True), (env.CUDA_SYNC, "1", True),
    (env.CUDA_DEVICE, "3", 3), (env.CUDA_DEVICE, None, 0), (env.JOIN_TIMEOUT, "2.5", 2.5),
    (env.RENDEZVOUS, "file", "file"), (env.CUBIN_CACHE, "", None),
    (env.TEST_MEM_AVAILABLE, "1048576", 1 << 20), (env.TEST_MEM_AVAILABLE, "", None),
    (env.LAUNCHER_PID, None, None), (env.JOB_TOKEN, None, ""),
])
def test_a_value_is_parsed_or_the_default(var: env.Variable, raw: str | None, value) -> None:
    environ = {} if raw is None else {var.name: raw}
    assert var.read(environ) == value
    assert var.is_set(environ) == (raw is not None)


@pytest.mark.parametrize(("var", "raw"), [
    (env.CUDA_GRAPHS, "yes"), (env.CUDA_SYNC, "2"), (env.CUDA_DEVICE, "-1"),
    (env.CUDA_DEVICE, "gpu0"), (env.JOIN_TIMEOUT, "0"), (env.JOIN_TIMEOUT, "soon"),
    (env.RENDEZVOUS, "dns"), (env.LISTEN_FD, "x"), (env.TEST_MEM_AVAILABLE, "1 GB"),
])
def test_a_bad_value_is_bad_input_naming_the_variable(var: env.Variable, raw: str) -> None:
    with pytest.raises(UserError, match=rf"^environment {var.name}: expected "):
        var.read({var.name: raw})


def test_usable_cores_is_the_affinity_or_every_cpu_where_there_is_none(monkeypatch) -> None:
    import os

    from engine.env import usable_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert usable_cores() == 3
    monkeypatch.delattr(os, "sched_getaffinity")  # macOS and Windows have none
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert usable_cores() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert usable_cores() == 1
