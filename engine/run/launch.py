"""`andrea-train CONFIG --gpus N`: one rank process per GPU on this host, supervised.

The launcher holds the run directory's lock for the whole job and is the process a controller
signals (rank 0 names it in `engine.json`): SIGUSR1, SIGTERM, SIGINT and SIGHUP are passed on to
every rank, which agree at one step boundary on what to do (engine.run.loop). The ranks get
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), a job token, and one GPU each. When a rank ends badly the others are given
GRACE_S to notice (they see its connection close and stop with a message naming it), then
killed; a rank 0 that could not write the run's end itself gets it written here.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from engine import env as variables
from engine import records as rec
from engine.run.checkpoint_store import resume_point
from engine.run.topology import pin_reduction_order
from engine.runfiles import JsonlWriter, RunPaths, read_json, write_json_atomic

GRACE_S = 30.0
FORWARDED = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_socket() -> socket.socket:
    """Rank 0's rendezvous socket, bound and listening on a free local port before any rank
    starts (rank 0 inherits it: another job cannot take the port in between, as it could a
    number chosen here and bound later)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    return s


def rank_env(rank: int, n: int, port: int, token: str, job: str, cuda: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), variables.LAUNCHER_PID.name: str(os.getpid()),
                variables.JOB_TOKEN.name: token,
                "TORCHELASTIC_RUN_ID": job})
    if cuda:
        env[variables.CUDA_DEVICE.name] = str(rank)
    elif "OPENBLAS_NUM_THREADS" not in env:
        # n numpy ranks on this host share its cores: OpenBLAS's threads would otherwise be
        # the cores' count in each rank, spinning against each other (measured 37x slower with
        # two processes on two cores)
        env["OPENBLAS_NUM_THREADS"] = str(max(1, variables.usable_cores() // n))
    return pin_reduction_order(env, n)


def _how(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


def _mark_failed(run_dir: Path, message: str) -> None:
    """Rank 0 ended without writing the run's end: write it, so nothing calls the run live."""
    paths = RunPaths(run_dir)
    state = rec.RunStatus.from_json(read_json(paths.state))
    if isinstance(state, rec.RunStatus) and not state.status.live:
        return
    try:
        w = JsonlWriter(paths.events)
        w.write(rec.ErrorEvent(t=time.time(), message=message).to_json())
        w.close()
        if isinstance(state, rec.RunStatus):
            write_json_atomic(paths.state, dataclasses.replace(
                state, status=rec.Status.FAILED, updated=time.time(),
                error=f"{message}; {resume_point(paths.checkpoints)}").to_json())
    except OSError:
        pass


def run_ranks(n: int, argv: list[str], run_dir: Path, cuda: bool) -> int:
    """Start `n` ranks of `python -m engine.run.cli *argv`, pass signals on, wait for them.
    Exit status: 0 when every rank succeeded, 2 when rank 0 refused its input, else 1."""
    token, job = secrets.token_hex(16), uuid.uuid4().hex
    srv = listening_socket()
    port = srv.getsockname()[1]
    procs: list[subprocess.Popen] = []

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    for s in FORWARDED:
        signal.signal(s, forward)
    try:
        for r in range(n):
            env = rank_env(r, n, port, token, job, cuda)
            if r == 0:
                env[variables.LISTEN_FD.name] = str(srv.fileno())
            procs.append(subprocess.Popen([sys.executable, "-m", "engine.run.cli", *argv],
                                          env=env, stdin=subprocess.DEVNULL,
                                          pass_fds=(srv.fileno(),) if r == 0 else ()))
    finally:
        srv.close()  # rank 0 holds its own copy
    first_bad: tuple[int, int] | None = None
    deadline: float | None = None
    while any(p.poll() is None for p in procs):
        for r, p in enumerate(procs):
            code = p.poll()
            if code not in (None, 0) and first_bad is None:
                first_bad = (r, code)
                deadline = time.monotonic() + GRACE_S  # the others should see it and stop
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    codes = [p.wait() for p in procs]
    if codes[0] == 2:
        return 2  # refused before it started: its one line is already on stderr
    if all(c == 0 for c in codes):
        return 0
    r, code = first_bad if first_bad is not None else (0, codes[0])
    message = f"rank {r} ended ({_how(code)}); the job stopped"
    print(f"error: {message}", file=sys.stderr)
    _mark_failed(run_dir, message)
    return 1
