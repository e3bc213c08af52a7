"""The engine's environment variables: each declared once, here, with its meaning, its default
and its parser; no other module under engine/ reads an `ANDREA_*` variable.

Everything that decides what a run computes is in the experiment config (engine/config.py,
`gpu` among its sections), so that a run records it and a resume computes with it. What is left
here says where things are on this machine, helps to debug, or is how a launcher talks to the
ranks it starts (those write them for their children, by these names: `Variable.name`):

- location: ANDREA_CUBIN_CACHE, ANDREA_FLEX_CACHE, ANDREA_FLEX_LIB, ANDREA_FLEX_PYTHON,
  ANDREA_CUDA_DEVICE;
- debugging: ANDREA_CUDA_GRAPHS, ANDREA_CUDA_SYNC, ANDREA_CUDNN;
- launchers: ANDREA_RENDEZVOUS, ANDREA_JOIN_TIMEOUT, ANDREA_JOB_TOKEN, ANDREA_LISTEN_FD,
  ANDREA_LAUNCHER_PID;
- tests: ANDREA_TEST_MEM_AVAILABLE.

`VARIABLES` lists them all (docs/configuration.md documents exactly these). A value that does
not parse is bad input: a UserError naming the variable (exit status 2).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from engine.errors import UserError

T = TypeVar("T")

KINDS = ("location", "debugging", "launcher", "test")


def _text(name: str, raw: str) -> str | None:
    """Any text; empty is the same as unset."""
    return raw or None


def _switch(name: str, raw: str) -> bool:
    if raw not in ("0", "1"):
        raise UserError(f"environment {name}: expected 0 or 1, got {raw!r:.40}")
    return raw == "1"


def _integer(lo: int, hi: int) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        text = raw.strip()
        if not (text.isascii() and text.isdigit() and len(text) <= 12
                and lo <= int(text) <= hi):
            raise UserError(f"environment {name}: expected an integer from {lo} to {hi}, "
                            f"got {raw!r:.40}")
        return int(text)

    return parse


def _bytes(name: str, raw: str) -> int | None:
    """A number of bytes; empty is the same as unset."""
    return _integer(0, 2**62)(name, raw) if raw else None


def _seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value < 1e7:
        raise UserError(f"environment {name}: expected seconds > 0, got {raw!r:.40}")
    return value


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        if raw not in choices:
            raise UserError(f"environment {name}: expected {' or '.join(choices)}, got "
                            f"{raw!r:.40}")
        return raw

    return parse


@dataclass(frozen=True)
class Variable(Generic[T]):
    """One environment variable: `name`, what it is for (`kind`: KINDS), what it means, the
    default in words, the parser (a UserError naming the variable for a value it refuses) and
    the value when it is unset."""

    name: str
    kind: str
    meaning: str
    default: str
    parse: Callable[[str, str], T]
    unset: T

    def read(self, environ: Mapping[str, str] | None = None) -> T:
        """The value in `environ` (default: this process's environment), parsed."""
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None:
            return self.unset
        value = self.parse(self.name, raw)
        return self.unset if value is None else value

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        return self.name in (os.environ if environ is None else environ)


def _var(name: str, kind: str, meaning: str, default: str, parse: Callable[[str, str], Any],
         unset: Any) -> Variable[Any]:
    assert kind in KINDS, kind
    return Variable(name, kind, meaning, default, parse, unset)


CUBIN_CACHE: Variable[str | None] = _var(
    "ANDREA_CUBIN_CACHE", "location", "the folder of the compiled CUDA kernels",
    "$XDG_CACHE_HOME/andrea/cubin (~/.cache/andrea/cubin)", _text, None)
FLEX_CACHE: Variable[str | None] = _var(
    "ANDREA_FLEX_CACHE", "location", "the folder where the flex attention backward is built",
    "$XDG_CACHE_HOME/andrea/flex (~/.cache/andrea/flex)", _text, None)
FLEX_LIB: Variable[str | None] = _var(
    "ANDREA_FLEX_LIB", "location",
    "a built flex attention backward library to load instead of building one", "unset (build)",
    _text, None)
FLEX_PYTHON: Variable[str | None] = _var(
    "ANDREA_FLEX_PYTHON", "location",
    "the interpreter that builds the flex attention backward (andrea[flex] installed)",
    "this interpreter", _text, None)
CUDA_DEVICE: Variable[int] = _var(
    "ANDREA_CUDA_DEVICE", "location", "the CUDA device a process trains on", "0",
    _integer(0, 1023), 0)
CUDA_GRAPHS: Variable[bool] = _var(
    "ANDREA_CUDA_GRAPHS", "debugging",
    "0: launch every kernel from the host instead of replaying captured CUDA graphs", "1",
    _switch, True)
CUDA_SYNC: Variable[bool] = _var(
    "ANDREA_CUDA_SYNC", "debugging",
    "1: wait for every launch and name the one that fails (no CUDA graphs; slow)", "0",
    _switch, False)
CUDNN: Variable[bool] = _var(
    "ANDREA_CUDNN", "debugging", "0: act as if cuDNN's frontend were not installed", "1",
    _switch, True)
RENDEZVOUS: Variable[str] = _var(
    "ANDREA_RENDEZVOUS", "launcher",
    "how the ranks of a job meet: tcp (MASTER_ADDR:MASTER_PORT) or file (the run directory)",
    "tcp", _choice("tcp", "file"), "tcp")
JOIN_TIMEOUT: Variable[float] = _var(
    "ANDREA_JOIN_TIMEOUT", "launcher", "seconds a rank waits for the others to join", "120",
    _seconds, 120.0)
JOB_TOKEN: Variable[str] = _var(
    "ANDREA_JOB_TOKEN", "launcher", "a secret the ranks of one job show each other",
    "unset (none)", lambda name, raw: raw, "")
LISTEN_FD: Variable[int | None] = _var(
    "ANDREA_LISTEN_FD", "launcher",
    "set by andrea-train --gpus for rank 0: the descriptor of the socket it bound for "
    "MASTER_PORT", "unset", _integer(0, 1 << 30), None)
LAUNCHER_PID: Variable[int | None] = _var(
    "ANDREA_LAUNCHER_PID", "launcher",
    "set by andrea-train --gpus for its ranks: the process that holds the run's lock", "unset",
    _integer(1, 2**31 - 1), None)
TEST_MEM_AVAILABLE: Variable[int | None] = _var(
    "ANDREA_TEST_MEM_AVAILABLE", "test",
    "bytes of host memory the memory check takes as available (for tests)",
    "unset (what the host says)", _bytes, None)

VARIABLES: tuple[Variable[Any], ...] = (
    CUBIN_CACHE, FLEX_CACHE, FLEX_LIB, FLEX_PYTHON, CUDA_DEVICE, CUDA_GRAPHS, CUDA_SYNC, CUDNN,
    RENDEZVOUS, JOIN_TIMEOUT, JOB_TOKEN, LISTEN_FD, LAUNCHER_PID, TEST_MEM_AVAILABLE)
NAMES: tuple[str, ...] = tuple(v.name for v in VARIABLES)


def cache_home() -> str:
    """$XDG_CACHE_HOME, else ~/.cache: the base of the default cache folders."""
    return os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity where the OS has one, else every CPU)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1
