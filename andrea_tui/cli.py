"""`andrea-tui`: launch and watch a run, attach to one, or browse checkpoints (DESIGN §10).

  andrea-tui CONFIG.json [--run-dir DIR] [--resume] [--max-steps N] [--backend auto|numpy|cuda]
             [--precision fp32|bf16|fp16|fp8]
             [--gpus N]
  andrea-tui attach RUN_DIR
  andrea-tui ckpt PATH
  andrea-tui runs [DIR]
  andrea-tui compare RUN_DIR RUN_DIR ... [--metric M] [--x X] [--smoothing A] [--log-y]
             [--csv FILE] [--png FILE] [--size WxH] [--force]
  andrea-tui export RUN_DIR [--csv FILE] [--png FILE] [--size WxH] [--force]
  andrea-tui serve CONFIG.json|RUN_DIR [--host H] [--port P] [--public] [launch flags]
"""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import PRECISIONS
from engine.errors import UserError, cli_entry
from engine.run.control import engine_alive, lock_held
from engine.run.identity import read_engine_info
from engine.runfiles import RunPaths, read_json, refuse_overwrite, tail_text

ACCEPT_TIMEOUT_S = 30.0  # a resume hashes its checkpoint first: seconds for a large one

if TYPE_CHECKING:  # the app (and Textual) load only when a dashboard is wanted
    from andrea_tui.app import AndreaApp
    from andrea_tui.launcher import LaunchTrace


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # usage errors are bad input: exit 2 via UserError
        raise UserError(f"andrea-tui: {message} (see andrea-tui --help)")


def _launch_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="andrea-tui", description="Start andrea-train and watch it. Other forms: "
                "`andrea-tui attach RUN_DIR`, `andrea-tui ckpt PATH`, `andrea-tui runs [DIR]`, "
                "`andrea-tui compare RUN_DIR RUN_DIR ...`, `andrea-tui export RUN_DIR ...`, "
                "`andrea-tui serve CONFIG|RUN_DIR ...`.")
    p.add_argument("config", help="experiment config (JSON)")
    _launch_flags(p)
    p.add_argument("--gpus", type=int, default=1, help="data parallel over N GPUs of this host")
    return p


def _launch_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", help="run directory (default: runs/<experiment name>)")
    p.add_argument("--resume", action="store_true",
                   help="resume from the newest valid checkpoint if there is one")
    p.add_argument("--max-steps", type=int, help="override train.max_steps")
    p.add_argument("--backend", choices=("auto", "numpy", "cuda"), default=None)
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="override train.precision (fp8: the linear maps' GEMMs in FP8, CUDA "
                        "sm_89+)")


def _run_app(app: AndreaApp) -> int:
    result = app.run()
    if app.supervisor.engine_error:
        # The launched engine refused to start (bad input, exit 2): its one line is the answer.
        print(app.supervisor.engine_error, file=sys.stderr)
    elif result:
        print(result)
    return app.supervisor.exit_status


def require_dir(path: Path, what: str) -> Path:
    """`path` when it is a directory; else a UserError that says what it is instead."""
    if path.is_dir():
        return path
    if not path.exists():
        raise UserError(f"{path}: no such {what}")
    raise UserError(f"{path}: not a directory, expected a {what}")


def attach(run_dir: str) -> int:
    from andrea_tui.app import AndreaApp

    return _run_app(AndreaApp(require_run_dir(require_dir(Path(run_dir), "run directory"))))


def require_run_dir(path: Path) -> Path:
    """`path` when it holds a run's files; else a UserError that says it is not a run directory,
    and whether an engine is creating one there right now."""
    paths = RunPaths(path)
    if any(f.is_file() for f in (paths.engine, paths.state, paths.config, paths.loss,
                                 paths.events)):
        return path
    if lock_held(path):
        raise UserError(f"{path}: not a run directory yet: an engine holds its lock and is "
                        "starting there; attach again in a moment")
    raise UserError(f"{path}: not a run directory (no engine.json, state.json, config.json, "
                    "loss.jsonl or events.jsonl in it)")


def ckpt(path: str) -> int:
    from andrea_tui.ckpt_screens import CheckpointApp

    p = require_dir(Path(path), "run directory, checkpoints directory or checkpoint directory")
    CheckpointApp(p).run()
    return 0


def refuse_busy_run_dir(run_dir: Path, resume: bool) -> None:
    """Refuse, before anything starts, what andrea-train would refuse after we had opened a
    dashboard on it: another engine on this directory (whose keys the dashboard would then
    steer), or an old run's checkpoints without --resume (same words as the engine)."""
    if not run_dir.is_dir():
        return
    alive, _ = engine_alive(run_dir)
    if alive:
        info = read_json(RunPaths(run_dir).engine) or {}
        raise UserError(f"an engine (pid {info.get('pid', '?')}) is already running on {run_dir}; "
                        f"use `andrea-tui attach {run_dir}`")
    refuse_overwrite(run_dir, resume)


def launch(argv: list[str]) -> int:
    from andrea_tui.app import AndreaApp

    began = time.time()  # this session's news: what the engine writes from now on
    proc, run_dir, trace = _start_engine(_launch_parser().parse_args(argv))
    app = AndreaApp(run_dir, proc=proc, session_start=began)
    code = _run_app(app)
    if app.supervisor.engine_error is not None:  # refused after it said who it was
        trace.undo()
    return code


def start_engine(args: argparse.Namespace) -> tuple[subprocess.Popen, Path]:
    """Validate the launch flags, start andrea-train detached and wait until it accepted its
    input: (the engine's process, its run directory). Its refusal is a UserError (what the
    launch made in the run directory taken back)."""
    proc, run_dir, _ = _start_engine(args)
    return proc, run_dir


OWN_FDS = ("/dev/fd/", "/proc/self/fd/", "/dev/stdin")  # paths that name this process's files


def config_for_child(config: Path) -> tuple[Path, bytes | None]:
    """How the engine gets the config the user named: (the path it reads, None) for a file it
    can open as we do; (no path, the bytes read here) for a pipe (`<(cat cfg.json)`), which gives
    its bytes once, so the engine is handed these same bytes. A regular file named through one
    of this process's descriptors (/dev/stdin) is the file it resolves to: the child has other
    descriptors. A missing path is left to load_config to refuse."""
    from engine import jsonio

    try:
        regular = stat.S_ISREG(os.stat(config).st_mode)
    except OSError:
        return config, None
    if not regular:
        return Path(), jsonio.read_bytes(config, jsonio.CONFIG_BYTES, pipe_ok=True)
    return (config.resolve() if str(config).startswith(OWN_FDS) else config), None


def _start_engine(args: argparse.Namespace) -> tuple[subprocess.Popen, Path, LaunchTrace]:
    """start_engine, and the trace of what the launch made (to take back on a later refusal)."""
    from andrea_tui.launcher import LaunchTrace, config_pipe, default_run_dir, train_argv
    from andrea_tui.launcher import launch as start
    from engine import load_config
    from engine.config import config_from_bytes

    config = Path(args.config)
    if args.max_steps is not None and args.max_steps < 1:
        raise UserError(f"--max-steps: expected an integer >= 1, got {args.max_steps}")
    # Validate before anything starts: a bad config is a one-line error (UserError, exit 2), not
    # a dead engine, and the run directory comes from the validated name (never an unchecked
    # path). load_config reads and checks JSON only; it builds nothing. A piped config's
    # relative paths are taken from the current directory, the engine's too (load_config).
    child_config, data = config_for_child(config)
    cfg = (load_config(str(config)) if data is None
           else config_from_bytes(data, str(config), Path.cwd()))
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"{run_dir}: not a directory, expected a run directory")
    refuse_busy_run_dir(run_dir, args.resume)
    gpus = getattr(args, "gpus", 1)
    if gpus < 1:
        raise UserError(f"--gpus: expected an integer >= 1, got {gpus}")
    trace = LaunchTrace.before(run_dir)
    fd = config_pipe(data) if data is not None else None
    if fd is not None:
        child_config = Path(f"/dev/fd/{fd}")
    try:
        proc = start(train_argv(child_config, run_dir, args.resume, args.max_steps,
                                args.backend, gpus, getattr(args, "precision", None)),
                     run_dir, pass_fds=() if fd is None else (fd,))
    except BaseException:
        trace.undo()
        raise
    finally:
        if fd is not None:
            os.close(fd)  # the child has its own; the pipe ends when it has read it
    refusal = wait_for_acceptance(proc, run_dir)
    if refusal is not None:  # bad input the engine refused: its one line, before any screen
        trace.undo()
        raise UserError(refusal.removeprefix("error: "))
    return proc, run_dir, trace


def wait_for_acceptance(proc: subprocess.Popen, run_dir: Path,
                        timeout: float = ACCEPT_TIMEOUT_S) -> str | None:
    """Wait until the launched engine has accepted its input (engine.json names it: the config,
    the checkpoint to resume and the backend are settled) or has exited. Its error line when it
    refused its input (exit status 2), else None; after `timeout` the dashboard takes over."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            if code != 2:
                return None  # a failure at run time: the dashboard shows it, andrea-tui exits 1
            lines = tail_text(RunPaths(run_dir).log, 20)
            errors = [x for x in lines if x.startswith("error: ")]
            return (errors or lines or ["error: the engine refused its input (exit status 2)"])[-1]
        info = read_engine_info(run_dir)
        if info and info.pid == proc.pid:
            return None
        time.sleep(0.05)
    return None


def runs(root: str) -> int:
    """The runs browser; enter opens a run's dashboard, and leaving it comes back here (escape
    or d: the engine trains on; q: it stops)."""
    from andrea_tui.app import AndreaApp
    from andrea_tui.runs_screen import BrowserState, RunsApp
    from andrea_tui.runscan import RunScanner

    path = require_dir(Path(root), "directory of runs")
    state, scanner = BrowserState(), RunScanner(path)
    while True:
        chosen = RunsApp(path, state, scanner).run()
        if chosen is None:
            return 0
        try:
            app = AndreaApp(require_run_dir(require_dir(chosen, "run directory")),
                            from_browser=True)
        except UserError as e:
            state.message = str(e)
            continue
        result = app.run()
        state.message = result or app.supervisor.engine_error or None


def compare(argv: list[str]) -> int:
    from andrea_tui import export as ex
    from andrea_tui.compare import METRICS, XAXES

    p = _Parser(prog="andrea-tui compare", description="overlay runs and diff their configs; "
                "with --csv or --png, write the overlay instead (export's rules: a file that "
                "exists is replaced only with --force, and only a regular file; - is standard "
                "output)")
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--metric", choices=list(METRICS), default="loss")
    p.add_argument("--x", dest="xaxis", choices=list(XAXES), default="step",
                   help="the x axis (default step; the CSV is by step)")
    p.add_argument("--log-y", action="store_true")
    p.add_argument("--smoothing", type=float, default=None, metavar="ALPHA",
                   help="EMA weight on the past, 0 <= ALPHA < 1 (default: the dashboard's)")
    p.add_argument("--csv", metavar="FILE", help="step, then each run's metric (and its EMA "
                   "when smoothed)")
    p.add_argument("--png", metavar="FILE", help="the overlay (needs matplotlib)")
    p.add_argument("--size", default="1200x900", help="PNG size in pixels (default 1200x900)")
    p.add_argument("--force", action="store_true", help="replace regular files that exist")
    a = p.parse_args(argv)
    if a.smoothing is not None and not 0 <= a.smoothing < 1:
        raise UserError(f"--smoothing: expected 0 <= ALPHA < 1, got {a.smoothing:g}")
    if len(a.run_dirs) < 2:
        raise UserError("andrea-tui compare: give two or more run directories")
    dirs = [require_run_dir(require_dir(Path(d), "run directory")) for d in a.run_dirs]
    options = {"metric": a.metric, "xaxis": a.xaxis, "log_y": a.log_y, "smoothing": a.smoothing}
    if not a.csv and not a.png:
        from andrea_tui.compare_screen import CompareApp

        CompareApp(dirs, **options).run()
        return 0
    from andrea_tui import compare_export as cx
    from andrea_tui import settings as user_settings
    from andrea_tui.compare import load_curves, run_labels

    size = ex.parse_size(a.size)
    outs = _export_targets("andrea-tui compare", a.csv, a.png, a.force)
    if a.png and not ex.have_matplotlib():
        raise UserError(ex.NO_MATPLOTLIB)
    alpha = user_settings.load().smoothing if a.smoothing is None else a.smoothing
    runs = [load_curves(d, label) for d, label in zip(dirs, run_labels(dirs), strict=True)]
    say = sys.stderr if ex.STDOUT in outs else sys.stdout
    if a.csv:
        text = cx.csv_text(runs, a.metric, alpha)
        _put(ex, a.csv, text.encode(), a.force)
        rows = text.count("\n") - 1
        print(f"{_where(ex, a.csv)}: {len(runs)} runs, {rows} steps", file=say)
    if a.png:
        _put(ex, a.png, cx.png_bytes(runs, a.metric, a.xaxis, alpha, a.log_y, size), a.force)
        print(f"{_where(ex, a.png)}: {size[0]}x{size[1]} PNG", file=say)
    return 0


def _export_targets(prog: str, csv_out: str | None, png_out: str | None,
                    force: bool) -> list[str]:
    """Check --csv and --png before any work (export's rules); the targets given."""
    from andrea_tui import export as ex

    outs = [o for o in (csv_out, png_out) if o]
    to_stdout = [o for o in outs if o == ex.STDOUT]
    if len(to_stdout) == 2:
        raise UserError(f"{prog}: --csv and --png cannot both go to standard output")
    if not to_stdout and len(outs) == 2 and Path(outs[0]).resolve() == Path(outs[1]).resolve():
        raise UserError(f"{prog}: --csv and --png name the same file ({csv_out})")
    if to_stdout and sys.stdout is None:
        raise UserError(f"{prog}: - : standard output is closed")
    if png_out == ex.STDOUT and sys.stdout.isatty():
        raise UserError(f"{prog}: --png -: standard output is a terminal; redirect it "
                        "(> FILE, | PROGRAM) or give a file name")
    for out in outs:
        if out != ex.STDOUT:
            ex.refuse_existing(Path(out), force)  # before any work: nothing half done
    return outs


def _put(ex, out: str, data: bytes, force: bool) -> None:
    if out == ex.STDOUT:
        ex.write_stdout(data)
    else:
        ex.write_file(Path(out), data, force)


def _where(ex, out: str) -> str:
    return "standard output" if out == ex.STDOUT else out


def export(argv: list[str]) -> int:
    from andrea_tui import export as ex

    p = _Parser(prog="andrea-tui export", description="a run's step records as CSV, its charts "
                "as PNG. A file that exists is replaced only with --force, and only when it is "
                "a regular file: a symbolic link, a directory, a device, a FIFO or a socket is "
                "refused (name the file itself). - is standard output.")
    p.add_argument("run_dir")
    p.add_argument("--csv", metavar="FILE", help="write one row per step here (- : standard "
                   "output; this command's own lines then go to standard error)")
    p.add_argument("--png", metavar="FILE", help="write the loss, validation loss and grad norm "
                   "charts here (needs matplotlib: pip install 'andrea[export]'; - : standard "
                   "output, when it is not a terminal)")
    p.add_argument("--size", default="1200x900", help="PNG size in pixels (default 1200x900)")
    p.add_argument("--force", action="store_true", help="replace regular files that exist")
    a = p.parse_args(argv)
    if not a.csv and not a.png:
        raise UserError("andrea-tui export: give --csv FILE, --png FILE or both")
    run_dir = require_run_dir(require_dir(Path(a.run_dir), "run directory"))
    size = ex.parse_size(a.size)
    to_stdout = ex.STDOUT in _export_targets("andrea-tui export", a.csv, a.png, a.force)
    if a.png and not ex.have_matplotlib():
        raise UserError(ex.NO_MATPLOTLIB)
    say = sys.stderr if to_stdout else sys.stdout  # standard output may carry the data
    if a.csv == ex.STDOUT:
        text, steps = ex.csv_text(run_dir)
        ex.write_stdout(text.encode())
        print(f"standard output: {len(steps)} steps", file=say)
    elif a.csv:
        n = ex.write_csv(run_dir, Path(a.csv), a.force)
        print(f"{a.csv}: {n} steps", file=say)
    if a.png == ex.STDOUT:
        ex.write_stdout(ex.png_bytes(run_dir, size))
        print(f"standard output: {size[0]}x{size[1]} PNG", file=say)
    elif a.png:
        ex.write_png(run_dir, Path(a.png), a.force, size)
        print(f"{a.png}: {size[0]}x{size[1]} PNG", file=say)
    return 0


def serve(argv: list[str]) -> int:
    from andrea_tui import serve as sv

    p = _Parser(prog="andrea-tui serve", description="the dashboard in a browser "
                "(textual-serve), on 127.0.0.1 unless --host and --public say otherwise")
    p.add_argument("target", help="a run directory to attach to, or an experiment config to "
                   "start (then the launch flags below apply)")
    p.add_argument("--host", default=sv.DEFAULT_HOST, help="address to listen on "
                   f"(default {sv.DEFAULT_HOST}; another than loopback needs --public)")
    p.add_argument("--port", type=int, default=sv.DEFAULT_PORT)
    p.add_argument("--public", action="store_true", help="allow a non-loopback --host: "
                   "whoever reaches the port can stop the run")
    _launch_flags(p)
    a = p.parse_args(argv)
    sv.check_host(a.host, a.public)
    sv.require_textual_serve()
    sv.check_port(a.host, a.port)  # all before an engine is started for it
    target = Path(a.target)
    if target.is_dir():
        if a.run_dir or a.resume or a.max_steps is not None or a.backend or a.precision:
            raise UserError(f"{target}: a run directory is attached to as it is; --run-dir, "
                            "--resume, --max-steps, --backend and --precision go with a CONFIG")
        return sv.serve(require_run_dir(target), a.host, a.port, a.public)
    a.config = a.target
    proc, run_dir = start_engine(a)
    return sv.serve(run_dir, a.host, a.port, a.public, proc)


@cli_entry
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["attach"]:
        p = _Parser(prog="andrea-tui attach", description="watch and steer a run directory")
        p.add_argument("run_dir")
        return attach(p.parse_args(argv[1:]).run_dir)
    if argv[:1] == ["ckpt"]:
        p = _Parser(prog="andrea-tui ckpt", description="browse checkpoints")
        p.add_argument("path", help="run directory, checkpoints directory or one checkpoint")
        return ckpt(p.parse_args(argv[1:]).path)
    if argv[:1] == ["runs"]:
        p = _Parser(prog="andrea-tui runs", description="every run under a directory")
        p.add_argument("dir", nargs="?", default="runs", help="default: runs/")
        return runs(p.parse_args(argv[1:]).dir)
    if argv[:1] == ["compare"]:
        return compare(argv[1:])
    if argv[:1] == ["export"]:
        return export(argv[1:])
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    if not argv or argv[0] in ("-h", "--help"):
        _launch_parser().print_help()
        return 0 if argv else 2
    return launch(argv)


if __name__ == "__main__":
    main()
