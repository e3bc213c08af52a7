"""Start `andrea-train` as a child that outlives the terminal.

The child gets its own session (a dropped SSH connection's SIGHUP does not reach it), stdin from
/dev/null (it must never fight the TUI for the keyboard) and stdout+stderr appended to
`RUN_DIR/engine.log` (the TUI owns the terminal). `sys.executable -m engine.run.cli` works with no
PATH and in the same interpreter as the TUI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.config import Config
from engine.errors import UserError
from engine.runfiles import LOG


def default_run_dir(config: Config) -> Path:
    """`runs/<experiment name>` of a config validated by engine.load_config (whose name pattern
    admits no path separator), the same default andrea-train uses (DESIGN §7)."""
    return Path("runs") / config.name


def train_argv(config: Path, run_dir: Path, resume: bool = False, max_steps: int | None = None,
               backend: str | None = None, gpus: int = 1,
               precision: str | None = None) -> list[str]:
    """The andrea-train command line (run dir always explicit, so both sides agree on it)."""
    argv = [sys.executable, "-m", "engine.run.cli", str(config), "--run-dir", str(run_dir)]
    if resume:
        argv.append("--resume")
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    if precision:
        argv += ["--precision", precision]
    if backend:
        argv += ["--backend", backend]
    if gpus > 1:
        argv += ["--gpus", str(gpus)]
    return argv


def child_env() -> dict[str, str]:
    """Our environment with the project root on PYTHONPATH, so `-m engine.run.cli` resolves even
    when the project is not installed (a plain checkout)."""
    import engine

    root = str(Path(engine.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def launch(argv: Sequence[str], run_dir: Path, cwd: Path | None = None) -> subprocess.Popen:
    """Start `argv` detached from the terminal, logging into RUN_DIR/engine.log."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # bad input (a file in the path, /proc, no permission): one line, exit 2
        raise UserError(f"--run-dir {run_dir}: cannot create it: {e.strerror or e}") from None
    try:
        log = open(run_dir / LOG, "ab")
    except OSError as e:
        raise UserError(f"{run_dir}: cannot write here ({e.strerror or e}); a run directory "
                        f"can be watched read-only with `andrea-tui attach {run_dir}`") from None
    with log, open("/dev/null", "rb") as devnull:
        return subprocess.Popen(
            list(argv), stdin=devnull, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=cwd, close_fds=True, env=child_env(),
        )
