"""Start `andrea-train` as a child that outlives the terminal.

The child gets its own session (a dropped SSH connection's SIGHUP does not reach it), stdin from
/dev/null (it must never fight the TUI for the keyboard) and stdout+stderr appended to
`RUN_DIR/engine.log` (the TUI owns the terminal). `sys.executable -m engine.run.cli` works with no
PATH and in the same interpreter as the TUI.

A config the TUI could read only once (a pipe: `andrea-tui <(cat cfg.json)`) reaches the child
through a pipe of its own (`config_pipe`). When the engine refuses its start, `LaunchTrace` puts
back what the launch made: the run directory and engine.log (andrea-train puts back the rest).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.config import Config
from engine.errors import UserError
from engine.run.control import lock_held
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


def config_pipe(data: bytes) -> int:
    """The read end of a pipe that delivers `data` and ends (a thread writes it, so a config
    larger than the pipe's buffer waits for its reader): for the child, as /dev/fd/N with
    `launch(..., pass_fds=(N,))`. Close it here once the child has started."""
    r, w = os.pipe()

    def feed() -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(w, view):]
        except OSError:  # BrokenPipeError: the child ended without reading it all
            pass
        finally:
            os.close(w)

    threading.Thread(target=feed, name="andrea-config-pipe", daemon=True).start()
    return r


@dataclass(frozen=True)
class LaunchTrace:
    """What a launch is about to make in a run directory, taken before it: the directories it
    will create (deepest first) and engine.log's size (None: it will create the file)."""

    run_dir: Path
    made: tuple[Path, ...]
    log_size: int | None

    @classmethod
    def before(cls, run_dir: Path) -> LaunchTrace:
        run_dir = Path(run_dir)
        made: list[Path] = []
        d = run_dir.absolute()
        while not d.exists() and d != d.parent:
            made.append(d)
            d = d.parent
        try:
            size: int | None = (run_dir / LOG).stat().st_size
        except OSError:
            size = None
        return cls(run_dir, tuple(made), size)

    def undo(self) -> None:
        """The engine refused its start (exit status 2) and put its own files back: take back
        engine.log (removed if the launch made it, else cut back to its old size) and the
        directories the launch made, once empty. Nothing is touched while an engine holds the
        run's lock (another one may have started there since), nor any file but engine.log."""
        try:
            if lock_held(self.run_dir):
                return
        except OSError:  # no directory to look in (it could not be made): nothing was made
            return
        log = self.run_dir / LOG
        with contextlib.suppress(OSError):
            if self.log_size is None:
                log.unlink(missing_ok=True)
            elif log.stat().st_size > self.log_size:
                os.truncate(log, self.log_size)
        for d in self.made:
            try:
                d.rmdir()  # fails unless empty: whatever another process put there stays
            except OSError:
                return


def launch(argv: Sequence[str], run_dir: Path, cwd: Path | None = None,
           pass_fds: Sequence[int] = ()) -> subprocess.Popen:
    """Start `argv` detached from the terminal, logging into RUN_DIR/engine.log; `pass_fds`: open
    descriptors the child keeps (a config pipe)."""
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
            pass_fds=tuple(pass_fds),
        )
