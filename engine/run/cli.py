"""`andrea-train CONFIG.json [--run-dir DIR] [--resume] [--max-steps N] [--backend auto|numpy|cuda] [--precision P] [--attention auto|cudnn|classic] [--retune] [--gpus N]`

The engine's command line: parse, validate the config, pick the run directory, hand over to
`TrainingRun` (engine.run.loop). Bad input ends here with one line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path

from engine.config import ATTENTIONS, PRECISIONS, load_config
from engine.errors import UserError, cli_entry
from engine.run.identity import EngineLock, make_run_dir, unmade_on_refusal
from engine.run.loop import RunOptions, TrainingRun
from engine.run.signals import SignalFlags
from engine.runfiles import refuse_overwrite

MAX_LOCAL_RANKS = 256  # --gpus: one process each, on this host

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="andrea-train", description=__doc__.splitlines()[0])
    p.add_argument("config", help="experiment config (JSON), e.g. experiments/ANDREA-tiny-TRAIN.json")
    p.add_argument("--run-dir", help="run directory (default: runs/<experiment name>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest valid checkpoint in the run directory "
                        "(starts fresh when there is none)")
    p.add_argument("--max-steps", type=int, help="override train.max_steps (the lr schedule too)")
    p.add_argument("--backend", default="auto", choices=("auto", "numpy", "cuda"))
    p.add_argument("--precision", choices=PRECISIONS,
                   help="override train.precision (on --resume too: the checkpoint holds fp32 "
                        "masters, so a run may go on in another precision); fp8: the linear "
                        "maps' GEMMs on FP8 values with delayed scaling, one GPU or CPU process "
                        "(CUDA: compute capability 8.9+, the rest in bf16; numpy: emulated, the "
                        "rest in fp32)")
    p.add_argument("--attention", choices=ATTENTIONS,
                   help="override gpu.attention (on --resume too): cuDNN's fused attention "
                        "(auto: when installed and it accepts the model) or the engine's own "
                        "(classic)")
    p.add_argument("--retune", action="store_true",
                   help="CUDA backend: time the GEMM algorithms again instead of using the run "
                        "directory's gemm_plan.json on --resume (the bits may then differ)")
    p.add_argument("--gpus", type=int, default=1,
                   help="data parallel: N ranks on this host, one GPU each (with --backend "
                        "numpy, N CPU processes); under torchrun or srun leave it out")
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors already, 0 on --help
        raise SystemExit(e.code) from None
    if args.max_steps is not None and args.max_steps < 1:
        raise UserError(f"--max-steps: must be >= 1, got {args.max_steps}")
    if not 1 <= args.gpus <= MAX_LOCAL_RANKS:
        raise UserError(f"--gpus: must be in 1..{MAX_LOCAL_RANKS} (processes on this host), "
                        f"got {args.gpus}")
    if args.gpus > 1 and ("WORLD_SIZE" in os.environ or "SLURM_NTASKS" in os.environ):
        raise UserError("--gpus: this process is already one rank of a launcher's job "
                        "(WORLD_SIZE or SLURM_NTASKS is set): leave --gpus out")
    if args.gpus > 1 and _is_pipe(args.config):
        raise UserError(f"{args.config}: --gpus {args.gpus} needs the config as a file (each "
                        "rank reads it; a pipe such as <(cat cfg.json) gives its bytes once)")
    return args


def _is_pipe(path: str) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False  # load_config says what is wrong


@cli_entry
def main(argv: list[str] | None = None) -> int:
    flags = SignalFlags()
    flags.install()  # first: SIGUSR1's default action would kill us
    args = _parse(argv)
    with flags.interrupting():  # a config from a pipe may keep us waiting: a stop ends it
        cfg = load_config(args.config)
    if args.max_steps is not None:
        cfg = cfg.with_max_steps(args.max_steps)
    if args.precision is not None:
        cfg = cfg.with_precision(args.precision)
    if args.attention is not None:
        cfg = cfg.with_attention(args.attention)
    run_dir = Path(args.run_dir or Path("runs") / cfg.name)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"{run_dir}: exists and is not a directory")
    refuse_overwrite(run_dir, args.resume)
    created = make_run_dir(run_dir)
    options = RunOptions(resume=args.resume, max_steps=args.max_steps, backend=args.backend,
                         attention=args.attention, retune=args.retune, precision=args.precision)
    # A refusal removes only what this process created, and only while it holds the run's
    # lock (TrainingRun, _launch); refused because another engine holds it, it removes nothing.
    with unmade_on_refusal(run_dir, created):
        require_writable(run_dir)
    if args.gpus > 1:
        return _launch(args, run_dir, created)
    return TrainingRun(cfg, run_dir, options, flags, argv if argv is not None else sys.argv,
                       created_dir=created).run()


def _launch(args: argparse.Namespace, run_dir: Path, created: bool) -> int:
    """`--gpus N`: hold the run's lock and run N ranks of this command (engine.run.launch).
    Rank 0 refused its input (exit status 2): it put its files back; the lock file goes too if
    this process made it, and the run directory if it made that and it is empty."""
    from engine.backends import gpu_count, resolve_backend
    from engine.run.launch import run_ranks

    with unmade_on_refusal(run_dir, created):
        backend = resolve_backend(args.backend)
        if backend.on_gpu and gpu_count() < args.gpus:
            raise UserError(f"--gpus {args.gpus}: this host has {gpu_count()} GPU(s)")
    lock = EngineLock().acquire(run_dir)  # the job's lock, for as long as any rank runs
    rank_argv = [args.config, "--run-dir", str(run_dir), "--backend", backend.name]
    if args.resume:
        rank_argv.append("--resume")
    if args.max_steps is not None:
        rank_argv += ["--max-steps", str(args.max_steps)]
    if args.precision is not None:
        rank_argv += ["--precision", args.precision]
    rank_argv += (["--attention", args.attention] if args.attention else []) + \
        (["--retune"] if args.retune else [])
    code = 1
    try:
        code = run_ranks(args.gpus, rank_argv, run_dir, cuda=backend.on_gpu)
        return code
    finally:
        if code == 2:
            lock.discard(remove_dir=created)
        lock.release()


def require_writable(run_dir: Path) -> None:
    """A run directory the engine cannot write (read-only mount, no permission) is refused up
    front with one line, not a traceback from the first file it opens."""
    if not os.access(run_dir, os.W_OK | os.X_OK):
        try:
            os.statvfs(run_dir)
            why = "read-only file system" if os.statvfs(run_dir).f_flag & os.ST_RDONLY else \
                "permission denied"
        except OSError as e:
            why = e.strerror or str(e)
        raise UserError(f"{run_dir}: cannot write here ({why}); a run directory can be watched "
                        f"read-only with `andrea-tui attach {run_dir}`, but training needs one "
                        "it can write (choose another --run-dir)")

if __name__ == "__main__":
    main()
