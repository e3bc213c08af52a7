"""A training run's checkpoints and its end (DESIGN §6, §8): when the run writes one (periodic,
a snapshot on SIGUSR1, a stop checkpoint on SIGTERM/SIGINT/SIGHUP, the final one), what it holds,
and what the run does with the background writer's results (the log, the events, state.json,
pruning); a checkpoint that cannot be written stops the run, and its end says where a `--resume`
continues.

The checkpoint's format is engine.run.checkpoint, its writing engine.run.checkpoint_write and the
run's set of checkpoints engine.run.checkpoint_store. `RunCheckpoints` is a part of `TrainingRun`
(engine.run.loop), which sets the attributes declared below.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine import records as rec
from engine.config import Config
from engine.records import Status

if TYPE_CHECKING:
    from engine.data.bandit import Bandit
    from engine.data.sampler import Sampler
    from engine.run.checkpoint_write import CheckpointWriter, WriteResult
    from engine.run.comm import Channel
    from engine.run.signals import SignalFlags
    from engine.run.world import World
    from engine.run.writer import RunWriter
    from engine.train.trainer import Trainer

CRASH_WRITE_WAIT_S = 120.0  # a crash waits this long for a checkpoint being written to end


def format_bytes(n: float) -> str:
    """`n` bytes in B, KiB, MiB, GiB or TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class RunCheckpoints:
    """The checkpoints of a TrainingRun and its end (`_finish`)."""

    cfg: Config
    out: RunWriter
    world: World
    flags: SignalFlags
    channel: Channel | None
    trainer: Trainer
    ckpt_root: Path
    run_id: str
    data_identity: dict[str, Any]
    sampler: Sampler
    bandit: Bandit
    writer: CheckpointWriter | None  # rank 0 writes the checkpoints
    snap: dict[str, np.ndarray]  # host buffers a checkpoint is copied into: params, m, v
    inflight: list[str]  # reasons of checkpoints submitted, not yet collected
    snapshot_pending: bool
    write_error: WriteResult | None  # the first checkpoint that could not be written
    steps_run: int
    _stop: bool
    _snapshots: int
    _drawn: list[np.ndarray] | None
    _sampler_state: dict[str, Any]

    def _state(self) -> dict[str, Any]:
        """A checkpoint's state.json: everything but the arrays that a resume needs to go on as
        the run would have (DESIGN §6)."""
        tr = self.trainer
        return {
            "config": self.cfg.to_json(),
            "data": self.data_identity,
            "trainer": tr.state_dict(),
            # the state before a batch drawn ahead for the next step (a resume draws it again)
            "sampler": self._sampler_state if self._drawn else self.sampler.state_dict(),
            "bandit": self.bandit.state_dict(),
            rec.STATE_MIXTURE: self.mixture.state_dict(),
            "schedule": {"step": tr.step_count, "lr": tr.lr_at(max(tr.step_count, 1)),
                         "warmup_steps": self.cfg.optim.warmup_steps,
                         "max_steps": self.cfg.train.max_steps},
            "tokens": tr.tokens,
            "run_id": self.run_id,
            "backend": tr.backend.name,
            "world_size": self.world.size,
            "versions": {"python": platform.python_version(), "numpy": np.__version__},
            # train/precision "fp8": the GEMMs that ran in FP8, none where every one was faster
            # in bf16 (only then: the key says so)
            **({rec.STATE_FP8_GEMMS: list(tr.backend.fp8_gemms)}
               if self.cfg.train.precision == "fp8" else {}),
            # train/precision "fp8": the delayed scales' amax history (a resume goes on from it)
            **({rec.STATE_FP8_HISTORY: h.to_json()}
               if (h := tr.backend.fp8_history()) is not None else {}),
            # what the GPU ran of the gpu section (a resume compares: gpu_differences)
            **({rec.STATE_GPU_RAN: dict(tr.backend.resolved)} if tr.backend.resolved else {}),
        }

    def _copy_state(self) -> None:
        """The trainer's weights and Adam moments into the host buffers (`snap`)."""
        self.trainer.backend.copy_state_into(self.snap["params"], self.snap["m"], self.snap["v"])

    def _checkpoint(self, reason: str, wait: bool) -> None:
        """Copy the state (the only stall) and hand it to the background writer."""
        from engine.run.checkpoint_write import CheckpointWriteError, WriteResult, check_room

        if self.writer.busy:
            self.writer.wait()  # one set of copy buffers: never overwrite one being written
            self._collect_writes()
        step = self.trainer.step_count
        try:  # a checkpoint that cannot fit is known now: no step is trained past it
            check_room(self.ckpt_root, step, reason, self.trainer.n_params)
        except CheckpointWriteError as e:
            self._write_failed(WriteResult(step, reason, error=str(e)))
            return
        self._copy_state()
        self.inflight.append(reason)
        self.writer.submit(self.trainer.step_count, self.snap["params"], self.snap["m"],
                           self.snap["v"], self._state(), reason, self.trainer.tensor_table)
        if wait:
            self.writer.wait()
            self._collect_writes()

    def _collect_writes(self) -> None:
        """The writer's finished checkpoints: each in the log, the events and state.json, the
        older ones pruned as the config keeps them; a failed one stops the run."""
        from engine.run.checkpoint_store import MANUAL_REASONS, prune, prune_periodic

        if self.writer is None:
            return
        for res in self.writer.poll():
            if res.reason in self.inflight:
                self.inflight.remove(res.reason)
            if res.error is not None:
                self._write_failed(res)
                continue
            info = res.info
            self.out.log(f"checkpoint {info.reason} step {info.step}: {info.path} "
                         f"({format_bytes(info.bytes)} in {info.seconds:.2f} s)")
            self.out.event(rec.CheckpointEvent(step=info.step, reason=info.reason,
                                               path=str(info.path), bytes=info.bytes,
                                               seconds=info.seconds))
            self.out.set_status(last_checkpoint=rec.CheckpointRef(str(info.path), info.step,
                                                                  info.reason))
            # Structure checks only: hashing every checkpoint here would stall training.
            if info.reason == "periodic":
                prune_periodic(self.ckpt_root, self.cfg.checkpoint.keep, check_hash=False)
            elif info.reason in MANUAL_REASONS and self.cfg.checkpoint.keep_manual:
                prune(self.ckpt_root, self.cfg.checkpoint.keep_manual, MANUAL_REASONS,
                      check_hash=False)

    def _write_failed(self, res: WriteResult) -> None:
        """A checkpoint was not written (`res`). Training on
        would only pile up steps that no checkpoint keeps: the run stops, before its next
        step is queued (one process) or at the next step boundary, agreed (_exchange)."""
        self.out.log(f"checkpoint ({res.reason}, step {res.step}) failed: {res.error}")
        self.out.event(rec.CheckpointErrorEvent(step=res.step, reason=res.reason,
                                                error=str(res.error)))
        if self.write_error is None:
            self.write_error = res
            if self.channel is None:
                self._stop = True

    def _handle_snapshot_requests(self, periodic_due: bool = False) -> bool:
        """SIGUSR1 → a snapshot at this step boundary. Requests that arrive while a snapshot is
        pending or being written coalesce into it; one that arrives while another kind of
        checkpoint is being written waits for it (a periodic one may be pruned later). A
        snapshot due with a periodic one is written once, as the snapshot. True when written."""
        n, self._snapshots = self._snapshots, 0
        step = self.trainer.step_count
        if n:
            if self.snapshot_pending or "snapshot" in self.inflight:
                self.out.event(rec.SignalEvent(signal="SIGUSR1", step=step, action="coalesced",
                                               count=n))
                self.out.log(f"SIGUSR1 x{n}: a snapshot is already pending, coalesced")
            else:
                self.out.event(rec.SignalEvent(signal="SIGUSR1", step=step, action="snapshot",
                                               count=n))
                self.out.log(f"SIGUSR1 x{n}: snapshot at step {step}")
                self.snapshot_pending = True
        if self.snapshot_pending and (periodic_due or not self.writer.busy):
            self.snapshot_pending = False
            self._checkpoint("snapshot", wait=False)
            return True
        return False

    def _coalesce_pending_snapshots(self, into: str) -> None:
        """A snapshot asked for at the last step is covered by the stop or final checkpoint."""
        n = self._snapshots + self.flags.take_snapshot_requests() + int(self.snapshot_pending)
        self._snapshots = 0
        self.snapshot_pending = False
        if n:
            self.out.event(rec.SignalEvent(signal="SIGUSR1", step=self.trainer.step_count,
                                           action="coalesced", count=n))
            self.out.log(f"SIGUSR1 x{n}: covered by the {into} checkpoint")

    def _finish(self, max_steps: int) -> int:
        """The run's end, after the loop: a stop checkpoint (a stop asked for before
        `max_steps`) or the final one, the end event, the status; its exit status."""
        step = self.trainer.step_count
        if self.out.failed is not None:
            return self._unwritable()
        if not self.world.main:
            return 0  # rank 0 writes the run's end
        if self.write_error is not None:
            return self._checkpoint_failed(step)
        sig = self.flags.stop_name or "stop (asked of another rank)"
        if self._stop and self.steps_run == 0:
            self.out.event(rec.SignalEvent(signal=sig, step=step, action="stop"))
            self.out.log(f"{sig} before any step: stopping without a new checkpoint")
            status = Status.STOPPED
        elif self._stop and step < max_steps:
            self.out.event(rec.SignalEvent(signal=sig, step=step, action="stop"))
            self.out.log(f"{sig}: writing a stop checkpoint at step {step}")
            self.out.set_status(status=Status.STOPPING)
            self._coalesce_pending_snapshots("stop")
            self._checkpoint("stop", wait=True)
            status = Status.STOPPED
        else:
            self._coalesce_pending_snapshots("final")
            if self._has_final(step):
                self.out.log(f"already at max_steps ({max_steps}); nothing to train (to go "
                             f"on, resume with --max-steps N, N above {max_steps})")
                self.writer.wait()
                self._collect_writes()
            else:
                self._checkpoint("final", wait=True)
            status = Status.FINISHED
        if self.write_error is not None:
            return self._checkpoint_failed(step)
        end = rec.FinishedEvent if status is Status.FINISHED else rec.StopEvent
        self.out.event(end(step=step, status=status.value))
        self.out.set_status(status=status, step=step)
        self.out.log(f"{status} at step {step}")
        return 0 if status in (Status.STOPPED, Status.FINISHED) else 1

    def _checkpoint_failed(self, step: int) -> int:
        """A checkpoint could not be written (a full disk, a file-size limit): training stopped
        at once. The log, stderr and an error event say which checkpoint, why, and where
        `--resume` continues; state.json says failed, with the same words. Exit status 1."""
        res = self.write_error
        msg = (f"{res.error}; training stopped at step {step}; {self._resume_point()}")
        self.out.log(f"error: {msg}", echo=False)
        self.out.event(rec.ErrorEvent(message=msg))
        print(f"error: {msg}", file=sys.stderr, flush=True)
        self.out.set_failed(msg, step=step)
        return 1

    def _resume_point(self) -> str:
        """Where a `--resume` of this run directory continues: its newest valid checkpoint."""
        from engine.run.checkpoint_store import resume_point

        where = resume_point(self.ckpt_root)
        return where + (" once the run directory has room again" if "newest" in where else "")

    def _resume_point_or_none(self) -> str:
        """`_resume_point` for a crash, once a checkpoint being written is done (it may be the
        newest): whatever failed may fail this too, and the first error is the one to tell."""
        from engine.run.checkpoint_store import resume_point

        try:
            if self.writer is not None:
                self.writer.wait(timeout=CRASH_WRITE_WAIT_S)
                self._collect_writes()
            return resume_point(self.ckpt_root)
        except Exception:
            return "see `andrea-ckpt verify` for a checkpoint to resume from"

    def _has_final(self, step: int) -> bool:
        """Whether a valid final or stop checkpoint of `step` exists already (a run resumed at
        its max_steps has nothing to write)."""
        from engine.run.checkpoint_store import list_checkpoints

        return any(e.step == step and e.reason in ("final", "stop") and e.valid
                   for e in list_checkpoints(self.ckpt_root, check_hash=False))
