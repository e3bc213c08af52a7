"""`andrea-tui`: launch and watch a run, attach to one, or browse checkpoints (DESIGN §10).

  andrea-tui CONFIG.json [--run-dir DIR] [--resume] [--max-steps N] [--backend auto|numpy|cuda]
  andrea-tui attach RUN_DIR
  andrea-tui ckpt PATH
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.errors import UserError, cli_entry


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # usage errors are bad input: exit 2 via UserError
        raise UserError(f"andrea-tui: {message} (see andrea-tui --help)")


def _launch_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="andrea-tui", description="Start andrea-train and watch it. Other forms: "
                "`andrea-tui attach RUN_DIR`, `andrea-tui ckpt PATH`.")
    p.add_argument("config", help="experiment config (JSON)")
    p.add_argument("--run-dir", help="run directory (default: runs/<experiment name>)")
    p.add_argument("--resume", action="store_true",
                   help="resume from the newest valid checkpoint if there is one")
    p.add_argument("--max-steps", type=int, help="override train.max_steps")
    p.add_argument("--backend", choices=("auto", "numpy", "cuda"), default=None)
    return p


def _run_app(app) -> int:
    result = app.run()
    if result:
        print(result)
    return 0


def attach(run_dir: str) -> int:
    from andrea_tui.app import AndreaApp

    path = Path(run_dir)
    if not path.is_dir():
        raise UserError(f"{path}: not a run directory (it does not exist)")
    return _run_app(AndreaApp(path))


def ckpt(path: str) -> int:
    from andrea_tui.ckpt_screens import CheckpointApp

    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such run directory or checkpoint")
    CheckpointApp(p).run()
    return 0


def launch(argv: list[str]) -> int:
    from andrea_tui.app import AndreaApp
    from andrea_tui.launcher import default_run_dir, train_argv
    from andrea_tui.launcher import launch as start

    args = _launch_parser().parse_args(argv)
    config = Path(args.config)
    if not config.is_file():
        raise UserError(f"{config}: no such config file")
    if args.max_steps is not None and args.max_steps < 1:
        raise UserError(f"--max-steps: expected an integer >= 1, got {args.max_steps}")
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(config)
    proc = start(train_argv(config, run_dir, args.resume, args.max_steps, args.backend), run_dir)
    return _run_app(AndreaApp(run_dir, proc=proc))


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
    if not argv or argv[0] in ("-h", "--help"):
        _launch_parser().print_help()
        return 0 if argv else 2
    return launch(argv)


if __name__ == "__main__":
    main()
