"""Bounded JSON reading of outside data: configs, run files, checkpoint state, manifests.

Anything a user or another machine wrote can be hostile: huge, truncated, nested a thousand levels
deep. Every JSON read of such data goes through here, with a size bound and a nesting bound, and
ends in a value or a `JsonError` that names the file and what is wrong — never a RecursionError,
a MemoryError or a traceback. Standard library only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.errors import UserError

MAX_DEPTH = 64  # nesting the project's own files never come near (a config is 4 deep)
CONFIG_BYTES = 1 << 20
STATE_BYTES = 16 << 20  # a checkpoint's state.json: tensor table, sampler and bandit state


class JsonError(UserError):
    """Outside JSON that cannot be used; the message names the file and the problem."""


def depth_ok(obj: Any, max_depth: int = MAX_DEPTH) -> bool:
    """True when `obj` nests no deeper than `max_depth` (iterative: no recursion of our own)."""
    stack = [(obj, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            x = x.values()
        elif not isinstance(x, list):
            continue
        if d > max_depth:
            return False
        stack.extend((v, d + 1) for v in x if isinstance(v, (dict, list)))
    return True


def loads(data: bytes | str, what: str, *, max_bytes: int, max_depth: int = MAX_DEPTH,
          object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """Parse one JSON document; JsonError (naming `what`) when it is too large, not JSON, or
    nested deeper than `max_depth`."""
    if len(data) > max_bytes:
        raise JsonError(f"{what}: {len(data):,} bytes, more than the {max_bytes:,} expected")
    try:
        obj = json.loads(data, object_pairs_hook=object_pairs_hook)
    except json.JSONDecodeError as e:
        raise JsonError(f"{what}: line {e.lineno} column {e.colno}: invalid JSON: {e.msg}") from None
    except RecursionError:
        raise JsonError(f"{what}: nested deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise JsonError(f"{what}: invalid JSON: {e}") from None
    if not depth_ok(obj, max_depth):
        raise JsonError(f"{what}: nested deeper than {max_depth} levels")
    return obj


def read_bytes(path: Path, max_bytes: int) -> bytes:
    """A file's bytes, refusing (JsonError) one larger than `max_bytes` before reading it."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise JsonError(f"{path}: {size:,} bytes, more than the {max_bytes:,} expected")
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise JsonError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise JsonError(f"{path}: is a directory, expected a JSON file") from None
    except OSError as e:
        raise JsonError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(data) > max_bytes:  # grew while we read it
        raise JsonError(f"{path}: more than the {max_bytes:,} bytes expected")
    return data


def load_file(path: Path, *, max_bytes: int, max_depth: int = MAX_DEPTH,
              object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """Read and parse a JSON file with both bounds; JsonError names the file."""
    data = read_bytes(Path(path), max_bytes)
    return loads(data, str(path), max_bytes=max_bytes, max_depth=max_depth,
                 object_pairs_hook=object_pairs_hook)
