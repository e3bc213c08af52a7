"""Which rank of how many this process is, read from the launcher's environment.

Three launchers are understood, so a multi-host job needs no code of ours beyond the rendezvous:
- `andrea-train --gpus N` (engine.run.launch) and `torchrun`: RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun's names);
- SLURM's `srun`: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE (MASTER_ADDR
  and MASTER_PORT from the job script, or the file rendezvous in the run directory);
- none of these: a single process, rank 0 of 1.
Bad values are refused with the variable named (exit status 2).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from engine import env as variables
from engine.errors import UserError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class World:
    """This process's place in a data-parallel job."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    launcher: str = "single"  # single | andrea | torchrun | slurm
    job_id: str = ""  # names the file rendezvous of this job
    token: str = ""
    rendezvous: str = "tcp"
    launcher_pid: int | None = None  # `andrea-train --gpus`: the process that holds the lock
    listen_fd: int | None = None  # rank 0 under `andrea-train --gpus`: its bound socket

    @property
    def main(self) -> bool:
        """Rank 0 owns the run directory: records, checkpoints, state."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def describe(self) -> str:
        return (f"rank {self.rank} of {self.size} (local {self.local_rank} of "
                f"{self.local_size}, {self.launcher})")


def _int(env: Mapping[str, str], name: str, lo: int, hi: int | None = None) -> int:
    raw = env[name]
    try:
        v = int(raw)
    except ValueError:
        raise UserError(f"environment {name}: expected an integer, got {raw!r}") from None
    if v < lo or (hi is not None and v > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise UserError(f"environment {name}: expected an integer {bound}, got {v}")
    return v


def world_from_env(env: Mapping[str, str] | None = None) -> World:
    """The World the environment describes (a single process when it describes none)."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env or "RANK" in env:
        launcher = "andrea" if variables.LAUNCHER_PID.is_set(env) else "torchrun"
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        job = env.get("TORCHELASTIC_RUN_ID", "")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        launcher = "slurm"
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")
        job = env.get("SLURM_JOB_ID", "")
    else:
        return World()
    missing = [n for n in names[:2] if n not in env]
    if missing:
        raise UserError(f"environment: {missing[0]} is missing ({launcher} sets {names[0]} and "
                        f"{names[1]} together)")
    size = _int(env, names[1], 1, 1 << 16)
    rank = _int(env, names[0], 0, size - 1)
    local_rank = _int(env, names[2], 0) if names[2] in env else 0
    local_size = size
    if names[3] in env:
        raw = env[names[3]].split("(")[0].split(",")[0]  # SLURM writes e.g. "2(x3)"
        try:
            local_size = int(raw)
        except ValueError:
            local_size = 0
        if not 1 <= local_size <= size:
            raise UserError(f"environment {names[3]}: expected an integer in 1..{size}, got "
                            f"{env[names[3]]!r:.40}")
    if local_rank >= local_size:
        raise UserError(f"environment {names[2]}: expected an integer < {local_size} "
                        f"({names[3]}), got {local_rank}")
    port = _int(env, "MASTER_PORT", 1, 65535) if "MASTER_PORT" in env else DEFAULT_PORT
    rdv = variables.RENDEZVOUS.read(env)
    lpid = variables.LAUNCHER_PID.read(env)
    # the socket `andrea-train --gpus` bound for MASTER_PORT and handed down to rank 0, so that
    # no other process can take the port in between
    lfd = variables.LISTEN_FD.read(env) if rank == 0 else None
    return World(rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                 master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=port,
                 launcher=launcher, job_id=job, token=variables.JOB_TOKEN.read(env),
                 rendezvous=rdv,
                 launcher_pid=lpid, listen_fd=lfd)
