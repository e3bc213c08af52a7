"""The training run: one process bound to one run directory (`andrea-train`, engine.run.cli).

The loop: data → trainer step → records → alerts → bandit → validation → samples → checkpoints,
with the signals of DESIGN §8 acted on between steps. Beside it, on rank 0, two daemon threads:
the telemetry sampler (system.jsonl) and the stall watchdog (engine.run.monitors); the run's
health (engine.run.health) follows the alerts. Everything the loop writes goes to the run
directory (DESIGN §7); everything it needs to continue goes into each checkpoint (DESIGN §6).

`TrainingRun` is one object in five modules, one job each: this one holds its life (`run`: the
start, the loop, a crash) and the loop with what the ranks agree on between steps;
engine.run.resume the resume, engine.run.start the start-up, engine.run.step_output what each
step writes, engine.run.checkpointing the checkpoints and the run's end.
"""

from __future__ import annotations

import collections
import struct
import sys
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine import records as rec
from engine.config import Config
from engine.errors import UserError
from engine.records import Status
from engine.run.checkpoint_write import cleanup_tmp
from engine.run.checkpointing import RunCheckpoints
from engine.run.comm import Channel, JoinInterrupted
from engine.run.ddp import my_micro_batches
from engine.run.mixture import MixtureWatch
from engine.run.resume import RunResume
from engine.run.signals import SignalFlags
from engine.run.start import RunStartup
from engine.run.step_output import StepOutput
from engine.run.world import world_from_env
from engine.run.writer import QuietWriter

# A step queued or run: its micro-batches' sources, the mixture they were drawn with, and the
# bandit's (phase, step in the phase, phase length) for its record.
Phase = tuple[int, int, int]
Queued = tuple[list[np.ndarray], np.ndarray, Phase]


@dataclass(frozen=True)
class RunOptions:
    """What the command line asks of a run beyond its config."""

    resume: bool = False
    max_steps: int | None = None  # overrides train.max_steps (and so the lr schedule)
    backend: str = "auto"
    # overrides gpu.attention (auto | cudnn | classic; a resumed run's too)
    attention: str | None = None
    retune: bool = False  # CUDA backend: time the GEMMs again instead of the recorded plan
    precision: str | None = None  # overrides train.precision (a resumed run's too)


class TrainingRun(RunResume, RunStartup, StepOutput, RunCheckpoints):
    """One training process bound to one run directory."""

    def __init__(self, cfg: Config, run_dir: Path, args: RunOptions,
                 flags: SignalFlags, argv: list[str], created_dir: bool = False) -> None:
        """`created_dir`: this process made the run directory (a new run): a refusal for bad
        input removes it again, if nothing but this process's files was ever in it."""
        from engine.run.identity import EngineLock, unmade_on_refusal
        from engine.run.writer import RunWriter

        self.cfg, self.run_dir, self.args, self.flags = cfg, run_dir, args, flags
        self.created_dir = created_dir
        self.ckpt_root = run_dir / "checkpoints"
        with unmade_on_refusal(run_dir, created_dir):  # bad input before the lock is taken
            self.world = world = world_from_env()
        self.channel: Channel | None = None  # the other ranks, when there are any
        # Rank 0 owns the run directory; `andrea-train --gpus` holds its lock for the job.
        self.lock = (EngineLock().acquire(run_dir)  # refuses when another engine holds the run
                     if world.main and world.launcher_pid is None else None)
        self.run_id = world.job_id[:12] if world.distributed and world.job_id else \
            uuid.uuid4().hex[:12]
        self.argv = list(argv)
        try:
            self.out = RunWriter(run_dir) if world.main else QuietWriter(run_dir)
        except OSError as e:
            self._discard_lock()
            raise UserError(f"{run_dir}: cannot write the run's files: {e.strerror or e}") from None
        self.writer = None
        self.steps_run = 0  # optimizer steps taken by this process
        self.inflight = []
        self.snapshot_pending = False
        # the first checkpoint that could not be written: the run stops at once, at the next
        # step boundary, and says where a resume continues
        self.write_error = None
        self._stop = False  # the job agreed to stop at this step boundary
        self._snapshots = 0  # snapshot requests the job agreed on, not acted on yet
        self._hold = False  # a rank asked for one step at a time (agreed in _exchange)
        # a completed step's (record, bandit change), written while the next step runs
        self._pending: tuple[rec.StepRecord, Any] | None = None
        self._last_print = 0.0
        self._notes_logged = 0
        self._drawn = None  # sources of a batch drawn ahead (_draw)
        self._sampler_state = {}  # the sampler's state before that draw
        self.world_size_was = None
        self._ranks = []
        self.monitors = None  # engine.run.monitors.RunMonitors, on rank 0
        self.mixture = MixtureWatch()
        self.evaluator = None
        self.trainer: Any = None  # engine.train.trainer.Trainer, once built

    # -- the run's life ------------------------------------------------------------------

    def _refuse_fp8_across_ranks(self) -> None:
        """train.precision fp8 trains on one GPU (or CPU process) only: its delayed scales
        follow the amax history of the rank's own passes (engine.model.fp8), so ranks would
        scale their copies differently, and neither a resume nor the equality of N ranks with N
        accumulated micro-batches could hold."""
        if self.world.distributed and self.cfg.train.precision == "fp8":
            raise UserError(
                f"train.precision fp8 with data parallelism ({self.world.size} ranks): each "
                f"rank's delayed FP8 scales would follow its own batches, so the ranks would not "
                f"compute alike; train fp8 on one GPU (train.grad_accum gives the same tokens "
                f"a step) or use bf16 across GPUs")

    def run(self) -> int:
        """Start, train and end the run; its exit status: 0 finished or stopped, 1 failed (bad
        input raises UserError, with the run's files as they were before)."""
        from engine.backends import resolve_backend
        from engine.data.prep import PrepInterrupted
        from engine.run.identity import engine_info

        try:
            try:
                cleanup_tmp(self.ckpt_root)  # half-written dirs of writers that died
                resume = self._pick_resume()
                self._refuse_fp8_across_ranks()
                backend = resolve_backend(self.args.backend)
                ranks = self._ranks = self._join(backend)
                # Only now, with the quick refusals behind it, does the engine say who it is: a
                # launcher that waits for engine.json knows the engine has accepted its input.
                info = engine_info(self.argv, self.run_id, self.world, ranks)
                self.out.write_json(self.out.paths.engine, info.to_json())
                self._start(resume, backend)
            except UserError:
                # Bad input, found before anything was trained: the run's files go back to what
                # they were, and what this process created goes, while it holds the lock
                # (cli_entry prints the one line on stderr).
                self.out.rollback()
                self._discard_lock()
                raise
            except (KeyboardInterrupt, PrepInterrupted, JoinInterrupted):  # a stop at start-up
                how = self.flags.stop_name or "interrupted"
                self.out.log(f"{how} during start-up; nothing was trained")
                self.out.event(rec.StopEvent(step=self.out.status.step,
                                             status=Status.STOPPED.value))
                self.out.set_status(status=Status.STOPPED)
                return 0
            except Exception as e:
                return self._crashed(e)
            if self.out.failed is not None:
                return self._unwritable()
            self.flags.starting = False
            try:
                return self._loop()
            except Exception as e:
                return self._crashed(e)
            finally:
                self._stop_monitors()
                if self.writer is not None:
                    self.writer.wait()  # never leave a write half done on the way out
                    self._collect_writes()
        finally:
            self._stop_monitors()
            self.out.close()

    def _discard_lock(self) -> None:
        """A refused start: the lock file goes if this process created it, and so does the run
        directory it created, if empty; nobody else's file is touched (EngineLock.discard)."""
        if self.lock is not None:
            self.lock.discard(remove_dir=self.created_dir)

    def _crashed(self, e: BaseException) -> int:
        """An unexpected error `e`: said in the log (its traceback), an error event, state.json
        (failed, and where a resume continues) and one line on stderr; exit status 1."""
        if self._pending is not None:  # the last step that completed keeps its record
            try:
                self._after_step(*self._pending)
            except Exception:
                pass  # the run directory may be what failed: the first error is the one to tell
            self._pending = None
        lost = self.channel.lost if self.channel is not None else None
        what = lost or f"{type(e).__name__}: {e}"  # a rank that died explains what followed
        self.out.log("error: " + "".join(traceback.format_exception(e)).rstrip(), echo=False)
        self.out.event(rec.ErrorEvent(message=what))
        self.out.set_failed(f"{what}; {self._resume_point_or_none()}")
        where = f" (traceback in {self.out.paths.log})" if self.world.main else ""
        print(f"error: [{self.world.describe()}] {what}{where}", file=sys.stderr)
        return 1

    def _unwritable(self) -> int:
        """The run directory stopped taking writes: say what was kept and end (exit 1). The
        first failed write is on stderr already (RunWriter); this adds where a resume goes on."""
        step = self.trainer.step_count if self.trainer is not None else 0
        what = f"run directory not writable: {self.out.failed}"
        if self.write_error is not None:
            what += f"; {self.write_error.error}"
        msg = f"{what}; stopped at step {step}"
        if self.run_dir.is_dir():  # (removed: nothing of it is left to resume from)
            msg += f"; {self._resume_point()}"
            print(f"  {msg}", file=sys.stderr, flush=True)
        self.out.log(msg, echo=False)
        self.out.event(rec.ErrorEvent(message=msg))
        self.out.set_failed(msg, step=step)
        return 1

    def _stop_monitors(self) -> None:
        """The watchdog's and the telemetry's threads end (rank 0; again is harmless)."""
        if self.monitors is not None:
            self.monitors.stop()

    # -- the loop -----------------------------------------------------------------------

    def _loop(self) -> int:
        """The steps, until max_steps, a stop the ranks agreed on or a run directory that no
        longer takes writes; then the run's end (`_finish`)."""
        cfg, tr, world = self.cfg, self.trainer, self.world
        max_steps, n_micro = cfg.train.max_steps, cfg.train.grad_accum
        mine = my_micro_batches(world.rank, n_micro, n_micro * world.size)
        self._exchange(np.zeros(0), 0.0)  # a stop asked for while starting up: all see it
        # step_ms is the loop's whole time per step: from the end of the previous step (its
        # ranks' exchange) to the end of this step's optimizer update and exchange, so it
        # counts the data, the staging and the host's share too; checkpoint writes, validation
        # and text samples (restarting the clock) are not counted.
        # With one micro-batch the device is kept busy and the host works meanwhile: the step
        # after the one running is queued behind it (`queue`: two in flight, while nothing is
        # due between them and the bandit's phase goes on), the previous step's records are
        # written while they run (`self._pending`), and where the next step may not be queued yet,
        # its batch is at least drawn and staged (`self._drawn`).
        self._pending = None
        queue: collections.deque[Queued] = collections.deque()
        t0 = time.perf_counter()
        while queue or (tr.step_count < max_steps and not self._stop
                        and self.out.failed is None):
            if n_micro == 1:  # the fused step where the backend has one (the all-reduce in it)
                srcs, weights, phase, done = self._queued_step(queue, mine)
            else:
                srcs, weights, phase, done = self._accumulated_step(mine)
            self.steps_run += 1
            record, change = self._step_record(done, srcs, weights, phase, t0)
            t0 = time.perf_counter()  # the next step's clock starts here ...
            if queue or (n_micro == 1 and not self._due_between_steps(record.step)):
                self._pending = (record, change)  # written while the next step runs
                continue
            self._after_step(record, change)
            self._between_steps(record.step)
            t0 = time.perf_counter()  # ... or after validation, a text sample or a checkpoint
        if self._pending is not None:
            self._after_step(*self._pending)
            self._pending = None
        if self.channel is not None:
            self.channel.finish()  # no collective after this: the others may end now
        self._stop_monitors()  # a stop or final checkpoint is expected work, not a stall
        return self._finish(max_steps)

    def _queued_step(self, queue: collections.deque[Queued],
                     mine: range) -> tuple[list[np.ndarray], np.ndarray, Phase, Any]:
        """One step of one micro-batch: begun now unless queued already, the step after it
        queued behind it where it may be (or its batch drawn), the previous step's records
        written meanwhile; ends it and returns its (sources, mixture, phase, result)."""
        tr = self.trainer
        if not queue:
            weights = self.bandit.weights.copy()
            srcs, self._drawn = self._drawn or self._draw(weights, mine), None
            tr.begin_step()
            queue.append((srcs, weights, (self.bandit.phase, self.bandit.phase_step + 1,
                                          self.bandit.phase_len)))
        if self._pending is not None:
            self._after_step(*self._pending)
            self._pending = None
        weights = queue[0][1]
        if self._may_queue_next(len(queue)):
            srcs, self._drawn = self._drawn or self._draw(weights, mine), None
            tr.begin_step()
            queue.append((srcs, weights, (self.bandit.phase, self.bandit.phase_step + 2,
                                          self.bandit.phase_len)))
        elif self._drawn is None and self._next_mixture_known(len(queue)):
            self._drawn = self._draw(weights, mine)
        done = tr.end_step()
        srcs, weights, phase = queue.popleft()
        return srcs, weights, phase, done

    def _accumulated_step(self, mine: range) -> tuple[list[np.ndarray], np.ndarray, Phase, Any]:
        """One step of several micro-batches (gradient accumulation), run to its end; returns
        its (sources, mixture, phase, result)."""
        tr, B = self.trainer, self.cfg.train.batch_size
        weights = self.bandit.weights.copy()
        phase = (self.bandit.phase, self.bandit.phase_step + 1, self.bandit.phase_len)
        srcs = []
        tr.zero_grads()
        # The whole job's micro-batches in one order (every rank draws them all and
        # trains its own share): the sampler and the bandit stay the same everywhere.
        for m in range(self.cfg.train.grad_accum * self.world.size):
            tokens, src = self.sampler.sample(B, weights)
            if m in mine:
                tr.forward_backward(tokens)
            srcs.append(src)
        return srcs, weights, phase, tr.step()

    def _step_record(self, done: Any, srcs: list[np.ndarray], weights: np.ndarray,
                     phase: Phase, t0: float) -> tuple[rec.StepRecord, Any]:
        """A finished step's record (after the ranks' exchange) and the bandit's change of
        phase, if its per-source losses end one."""
        rows, rank_ms = self._exchange(self.trainer.row_losses, time.perf_counter() - t0)
        step_s = time.perf_counter() - t0
        src_loss = self._src_loss(rows, np.concatenate(srcs))
        change = self.bandit.observe(src_loss)
        record = rec.StepRecord(
            step=done.step, loss=float(np.mean(rows)), grad_norm=done.grad_norm,
            clip_scale=done.clip_scale, lr=done.lr, tokens=done.tokens,
            tok_s=self.cfg.tokens_per_step * self.world.size / step_s, step_ms=step_s * 1e3,
            phase=phase[0], phase_step=phase[1], phase_len=phase[2],
            weights=self._by_source(weights), src_loss=src_loss, skipped=done.skipped,
            t=time.time(), rank_ms=rank_ms)
        return record, change

    def _between_steps(self, step: int) -> None:
        """What runs on the state after `step` before the next step: validation, a text sample,
        a checkpoint (periodic, or a snapshot asked for)."""
        cfg, world = self.cfg, self.world
        if self.evaluator is not None and self.evaluator.due(step):
            self._evaluate(step)
        if cfg.samples.every_steps and step % cfg.samples.every_steps == 0 and world.main:
            self._sample(step)  # text only rank 0 writes: the others would throw it away
        if self.monitors is not None:
            self.monitors.beat(step)  # validation and samples are expected work
        if world.main and self.write_error is None:  # rank 0 writes the checkpoints
            periodic_due = step % cfg.checkpoint.every == 0 and step != cfg.train.max_steps
            if not self._handle_snapshot_requests(periodic_due) and periodic_due:
                self._checkpoint("periodic", wait=False)
        else:
            self._snapshots = 0  # taken here by rank 0 too: the ranks go on deciding alike

    def _exchange(self, rows: np.ndarray, step_s: float) -> tuple[np.ndarray, list[float]]:
        """What the ranks tell each other after a step, in one exchange: every rank's row
        losses (global micro-batch order) and step time, and the stop and snapshot requests,
        which all ranks then act on at this same step boundary (`_stop`, `_snapshots`).
        Returns (rows, each rank's step ms)."""
        stop, snaps = self.flags.stop_requested, self.flags.take_snapshot_requests()
        stop = stop or self.write_error is not None  # rank 0's checkpoint failed: all stop
        # a rank that wants the steps taken one at a time for now: a snapshot waiting for the
        # writer, or a run directory it can no longer write
        hold = self.snapshot_pending or self.out.failed is not None
        if self.channel is None:
            self._stop, self._snapshots, self._hold = stop, self._snapshots + snaps, hold
            return rows, []
        head = struct.Struct(">qqqd")
        rows = np.asarray(rows, dtype=np.float64)
        parts = self.channel.allgather(head.pack(stop, snaps, hold, step_s * 1e3)
                                       + rows.tobytes())
        heads = [head.unpack(p[: head.size]) for p in parts]
        self._stop = any(h[0] for h in heads)
        self._snapshots += max(h[1] for h in heads)
        self._hold = any(h[2] for h in heads)
        every = np.concatenate([np.frombuffer(p[head.size :], dtype=np.float64) for p in parts])
        return every, [h[3] for h in heads]

    def _draw(self, weights: np.ndarray, mine: range) -> list[np.ndarray]:
        """The next step's batch: every rank draws the whole job's micro-batches (the sampler
        and the bandit stay the same everywhere) and hands its own to the trainer. The
        sampler's state before the draw is what a checkpoint between the steps keeps."""
        self._sampler_state = self.sampler.state_dict()
        srcs = []
        for m in range(self.world.size):
            tokens, src = self.sampler.sample(self.cfg.train.batch_size, weights)
            if m in mine:
                self.trainer.prepare(tokens)
            srcs.append(src)
        return srcs

    def _next_mixture_known(self, queued: int) -> bool:
        """Whether the batch of the step after the `queued` ones can be drawn now: it exists,
        no stop is asked for, and the bandit's mixture will not change before it (its phase
        goes on past the oldest queued step: the others were queued under the same rule)."""
        return (self.trainer.step_count + queued + 1 <= self.cfg.train.max_steps
                and not self._stop and self.bandit.phase_step + 1 < self.bandit.phase_len)

    def _may_queue_next(self, queued: int) -> bool:
        """Whether the step after the one queued may be queued behind it: the trainer takes
        two, its batch can be drawn, and nothing must see the state between the two steps.
        Every rank of a job decides alike, from what they share (the config, the step, the
        bandit, the requests and holds agreed in `_exchange`): a rank that queued a step the
        others did not would wait in that step's all-reduce while they stop."""
        return (queued == 1 and self.trainer.queue_depth > 1 and self._next_mixture_known(1)
                and not self._hold and not self._due_between_steps(self.trainer.step_count + 1))

    def _due_between_steps(self, step: int) -> bool:
        """Whether anything must run on the state after `step` before the next step starts:
        validation, a text sample, a checkpoint (periodic, or a snapshot asked for), the end.
        From the config and the agreed requests, so every rank answers alike (rank 0 alone
        validates, samples and writes, but the others must not run ahead meanwhile)."""
        cfg = self.cfg
        if step >= cfg.train.max_steps or self._stop or self._snapshots > 0 or self._hold:
            return True
        if cfg.eval is not None and step % cfg.eval.every_steps == 0:
            return True
        if cfg.samples.every_steps and step % cfg.samples.every_steps == 0:
            return True
        return step % cfg.checkpoint.every == 0
