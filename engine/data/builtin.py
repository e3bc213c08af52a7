"""Built-in sources: text present on every CPython install, so the demo needs no download.

Three arms of different character:
- `python-reference`: the language reference topics shipped in `pydoc_data.topics` (prose).
- `stdlib-docstrings`: docstrings of the pure-Python stdlib, read with `ast` (never imported, so
  no module side effects), one document per module.
- `stdlib-code`: the stdlib's .py source files, minus tests, one document per file.
Each arm is capped at `ARM_CAP_BYTES` by an even, deterministic selection over the sorted file list
(not a prefix, which would hold only the modules early in the alphabet).
"""

from __future__ import annotations

import ast
import functools
import importlib
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from engine.errors import UserError

ARM_CAP_BYTES = 8_000_000
# Bump when the extraction changes, so prepared shards are rebuilt (see sources.source_fingerprint).
BUILTIN_VERSION = 1

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_py_files() -> list[Path]:
    """The stdlib's .py files in sorted order, without tests and third-party packages."""
    root = stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-")
        )
        for name in filenames:
            if name.endswith(".py") and not name.startswith("test_"):
                found.append(Path(dirpath) / name)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def even_selection(sizes: list[int], cap: int) -> list[int]:
    """Indices of items to keep so their total is about `cap`, spread evenly over the list.

    Each item earns `size * cap / total` credit; an item is taken when the running credit covers
    it. Deterministic, and every region of the list contributes in proportion to its size.
    """
    total = sum(sizes)
    if total <= cap:
        return list(range(len(sizes)))
    frac = cap / total
    credit = 0.0
    keep = []
    for i, size in enumerate(sizes):
        credit += size * frac
        if credit >= size:
            keep.append(i)
            credit -= size
    return keep


def _read_source(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # a few files are not UTF-8 or unreadable: not worth a failure


@functools.lru_cache(maxsize=1)
def _stdlib_texts() -> tuple[tuple[str, str], ...]:
    """(relative path, source text) of every readable stdlib file, sorted."""
    root = stdlib_root()
    out = []
    for path in stdlib_py_files():
        text = _read_source(path)
        if text:
            out.append((path.relative_to(root).as_posix(), text))
    return tuple(out)


def _capped(docs: list[str], cap: int) -> list[str]:
    sizes = [len(d.encode("utf-8")) for d in docs]
    return [docs[i] for i in even_selection(sizes, cap)]


def python_reference_docs() -> list[str]:
    try:
        topics = importlib.import_module("pydoc_data.topics").topics
    except ImportError:
        raise UserError(
            "builtin source python-reference: this Python has no module pydoc_data.topics "
            "(some distributions strip it): use the other built-in sources or your own files"
        ) from None
    docs = [topics[key].strip() + "\n" for key in sorted(topics)]
    return _capped([d for d in docs if d.strip()], ARM_CAP_BYTES)


def _module_docstrings(relpath: str, text: str) -> str | None:
    try:
        tree = ast.parse(text, filename=relpath)
    except (SyntaxError, ValueError):
        return None
    module = relpath[: -len(".py")].replace("/", ".").removesuffix(".__init__")
    parts: list[str] = []

    def visit(node: ast.AST, qualname: str) -> None:
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                parts.append(f"{qualname}\n\n{doc}\n")
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, f"{qualname}.{child.name}")

    visit(tree, module)
    return "\n".join(parts) if parts else None


def stdlib_docstring_docs() -> list[str]:
    docs = []
    for relpath, text in _stdlib_texts():
        doc = _module_docstrings(relpath, text)
        if doc:
            docs.append(doc)
    return _capped(docs, ARM_CAP_BYTES)


def stdlib_code_docs() -> list[str]:
    return _capped([text for _, text in _stdlib_texts()], ARM_CAP_BYTES)


BUILTINS = {
    "python-reference": python_reference_docs,
    "stdlib-docstrings": stdlib_docstring_docs,
    "stdlib-code": stdlib_code_docs,
}


@functools.lru_cache(maxsize=len(BUILTINS))
def _builtin_docs(name: str) -> tuple[str, ...]:
    return tuple(BUILTINS[name]())


def iter_builtin(name: str) -> Iterator[str]:
    """Documents of built-in arm `name`, in a fixed order."""
    if name not in BUILTINS:
        raise UserError(
            f"data.sources: builtin: expected one of {', '.join(sorted(BUILTINS))}, got {name!r}"
        )
    yield from _builtin_docs(name)


def builtin_fingerprint(name: str) -> str:
    """What the arm's content depends on: its name, our extraction version, the Python build."""
    return f"builtin:{name}:v{BUILTIN_VERSION}:{sys.version}:{stdlib_root()}"
