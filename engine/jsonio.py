"""Bounded JSON reading of outside data: configs, run files, checkpoint state, manifests.

Anything a user or another machine wrote can be hostile: huge, truncated, nested a thousand levels
deep. Every JSON read of such data goes through here, with a size bound and a nesting bound, and
ends in a value or a `JsonError` that names the file and what is wrong — never a RecursionError,
a MemoryError or a traceback — nor a wait for ever: a FIFO or a device is never opened
(engine.infile). Standard library only, besides engine.infile and engine.errors.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine import infile
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


def read_bytes(path: Path, max_bytes: int, *, pipe_ok: bool = False) -> bytes:
    """A file's bytes, refusing (JsonError) one larger than `max_bytes` before reading it, and
    anything but a regular file before opening it (engine.infile: a FIFO, a device, a socket
    never hang the reader). `pipe_ok`: a pipe is read too, to its end, for at most
    engine.infile.PIPE_WAIT_S (a config given as `<(cat cfg.json)`)."""
    try:
        fd, st = infile.open_fd(path, pipe_ok=pipe_ok)
    except infile.NotRegularFile as e:
        raise JsonError(str(e)) from None
    except FileNotFoundError:
        raise JsonError(f"{path}: no such file") from None
    except OSError as e:
        raise JsonError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "rb") as f:
            if stat.S_ISFIFO(st.st_mode):
                return infile.read_pipe(fd, path, max_bytes)
            if st.st_size > max_bytes:
                raise JsonError(f"{path}: {st.st_size:,} bytes, more than the {max_bytes:,} "
                                "expected")
            data = f.read(max_bytes + 1)
    except JsonError:
        raise
    except UserError as e:  # a pipe that did not deliver a config
        raise JsonError(str(e)) from None
    except OSError as e:
        raise JsonError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(data) > max_bytes:  # grew while we read it
        raise JsonError(f"{path}: more than the {max_bytes:,} bytes expected")
    return data


def load_file(path: Path, *, max_bytes: int, max_depth: int = MAX_DEPTH,
              object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
              pipe_ok: bool = False) -> Any:
    """Read and parse a JSON file with both bounds; JsonError names the file. `pipe_ok`: see
    read_bytes (configs only)."""
    data = read_bytes(Path(path), max_bytes, pipe_ok=pipe_ok)
    return loads(data, str(path), max_bytes=max_bytes, max_depth=max_depth,
                 object_pairs_hook=object_pairs_hook)
