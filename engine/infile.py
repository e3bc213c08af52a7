"""Opening outside files for reading without ever hanging in open() or read().

A path a user or another machine gave may name a FIFO (its open() waits for a writer, for ever),
a device (/dev/zero never ends, a terminal waits for a line), a socket or a directory.
`open_fd` opens with O_NONBLOCK, looks at what it opened (fstat, so a file swapped in between
counts too) and hands back a regular file; anything else is refused at once with one line that
names the path and what it is. A config alone may come through a pipe (`andrea-train <(cat
cfg.json)`, bash's process substitution): `read_pipe` reads one to its end, waiting at most
PIPE_WAIT_S for it. Standard library only.
"""

from __future__ import annotations

import os
import select
import stat
import time
from pathlib import Path
from typing import BinaryIO

from engine.errors import UserError

PIPE_WAIT_S = 10.0  # a pipe's writer has this long to deliver a whole config and close
_POLL_S = 0.1  # how often a wait for a pipe looks at the clock (a stop signal ends it sooner)
_PIPE_HINT = "expected a regular file, or a pipe that delivers a whole config (e.g. <(cat cfg.json))"


class NotRegularFile(UserError, OSError):
    """A path that names something other than a regular file (exit status 2). Also an OSError,
    so that a reader that takes an unreadable file for a missing one does so for this one too."""


def describe(mode: int) -> str | None:
    """None for a regular file, else what `mode` (st_mode) says the thing is."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISFIFO(mode):
        return "a FIFO (a named pipe)"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def refusal(path: str | os.PathLike[str], mode: int) -> NotRegularFile:
    return NotRegularFile(f"{path}: is {describe(mode)}, expected a regular file")


def check_regular(path: str | os.PathLike[str]) -> os.stat_result:
    """stat(path), following links; NotRegularFile unless it is a regular file (a missing file
    raises FileNotFoundError as stat does)."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise refusal(path, st.st_mode)
    return st


def open_fd(path: str | os.PathLike[str], *, pipe_ok: bool = False) -> tuple[int, os.stat_result]:
    """A descriptor open for reading on a regular file (blocking, as usual), or with `pipe_ok`
    also on a FIFO or pipe (left non-blocking: read it with `read_pipe`), and its fstat.
    Anything else is refused before open() (a socket cannot be opened at all) and, should the
    path change in between, after it; open() itself never waits."""
    st = os.stat(path)
    if not (stat.S_ISREG(st.st_mode) or (pipe_ok and stat.S_ISFIFO(st.st_mode))):
        raise refusal(path, st.st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            os.set_blocking(fd, True)
        elif not (pipe_ok and stat.S_ISFIFO(st.st_mode)):
            raise refusal(path, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def open_regular(path: str | os.PathLike[str], buffering: int = -1) -> BinaryIO:
    """`open(path, "rb")` for a regular file only (NotRegularFile otherwise, at once)."""
    fd, _ = open_fd(path)
    return os.fdopen(fd, "rb", buffering=buffering)


def read_regular(path: str | os.PathLike[str]) -> bytes:
    """A regular file's bytes (NotRegularFile for anything else, at once)."""
    with open_regular(path) as f:
        return f.read()


def read_pipe(fd: int, path: str | os.PathLike[str], max_bytes: int,
              wait_s: float | None = None) -> bytes:
    """Everything a non-blocking pipe `fd` delivers up to its end, at most `max_bytes`. A pipe
    with nothing in it and no writer (a named FIFO nobody writes to) is refused at once; one whose
    writer has not ended within `wait_s` is refused then. A signal handler that raises (a stop)
    ends the wait at once. `wait_s`: PIPE_WAIT_S unless given."""
    wait_s = PIPE_WAIT_S if wait_s is None else wait_s
    chunks: list[bytes] = []
    got = 0
    deadline = time.monotonic() + wait_s
    where = Path(path)
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:  # a writer is there, with nothing more yet
            left = deadline - time.monotonic()
            if left <= 0:
                raise NotRegularFile(f"{where}: is a pipe whose writer did not finish within "
                                     f"{wait_s:g} s; {_PIPE_HINT}") from None
            select.select([fd], [], [], min(_POLL_S, left))
            continue
        if not data:
            if got == 0:
                raise NotRegularFile(f"{where}: is a FIFO (a named pipe) with no writer and "
                                     f"nothing to read; {_PIPE_HINT}")
            return b"".join(chunks)
        got += len(data)
        if got > max_bytes:
            raise UserError(f"{where}: a pipe that delivers more than the {max_bytes:,} bytes "
                            "expected")
        chunks.append(data)
