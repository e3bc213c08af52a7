"""Errors that end a command with a clear message instead of a traceback.

`UserError` is bad input (usage, config, data, checkpoint): exit status 2, as DESIGN §10 says.
`RunError` is a failure at run time: exit status 1.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class UserError(Exception):
    """Bad input. The message names the file and the field or offset, and what was expected."""

    exit_status = 2


class RunError(Exception):
    """A failure while running (not the user's input)."""

    exit_status = 1


def cli_entry(main: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap a console-script `main` so known errors print one line and exit with their status."""

    @functools.wraps(main)
    def wrapper(*args: object, **kwargs: object) -> int:
        try:
            status = main(*args, **kwargs)
        except (UserError, RunError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(e.exit_status)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)
        except BrokenPipeError:
            # The reader went away (`andrea-ckpt inspect RUN | head`): not an error of ours.
            # Point stdout at /dev/null so the interpreter's final flush stays quiet.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            sys.exit(141)
        sys.exit(status or 0)

    return wrapper
