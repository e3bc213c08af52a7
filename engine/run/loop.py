"""The training run: one process bound to one run directory (`andrea-train`, engine.run.cli).

The loop: data → trainer step → records → alerts → bandit → validation → samples → checkpoints,
with the signals of DESIGN §8 acted on between steps. Beside it, on rank 0, two daemon threads:
the telemetry sampler (system.jsonl) and the stall watchdog (engine.run.alerts); the run's
health (engine.run.health) follows the alerts. Everything the loop writes goes to the run
directory (DESIGN §7); everything it needs to continue goes into each checkpoint (DESIGN §6).
"""

from __future__ import annotations

import collections
import json
import os
import platform
import socket
import struct
import sys
import time
import traceback
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine import env
from engine import records as rec
from engine.backends import BackendChoice
from engine.backends.base import Backend
from engine.config import Config, config_diff, gpu_section_of_checkpoint, parse_config
from engine.errors import UserError
from engine.records import Status
from engine.run.checkpoint_write import cleanup_tmp
from engine.run.comm import Channel, JoinInterrupted
from engine.run.ddp import (
    check_same_collectives,
    collective_settings,
    make_reducer,
    my_micro_batches,
)
from engine.run.mixture import MixtureWatch
from engine.run.signals import SignalFlags
from engine.run.world import world_from_env
from engine.run.writer import QuietWriter
from engine.runfiles import has_checkpoints

CRASH_WRITE_WAIT_S = 120.0  # a crash waits this long for a checkpoint being written to end


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


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


class TrainingRun:
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
        self.writer: Any = None
        self.steps_run = 0  # optimizer steps taken by this process
        self.inflight: list[str] = []  # reasons of checkpoints submitted, not yet collected
        self.snapshot_pending = False
        # the first checkpoint that could not be written (engine.run.checkpoint.WriteResult): the
        # run stops at once, at the next step boundary, and says where a resume continues
        self.write_error: Any = None
        self._stop = False  # the job agreed to stop at this step boundary
        self._snapshots = 0  # snapshot requests the job agreed on, not acted on yet
        self._hold = False  # a rank asked for one step at a time (agreed in _exchange)
        # a completed step's (record, bandit change), written while the next step runs
        self._pending: tuple[rec.StepRecord, Any] | None = None
        self._last_print = 0.0  # when the last progress line went to the log
        self._notes_logged = 0  # the backend's notes written to the log so far
        self._drawn: list[np.ndarray] | None = None  # sources of a batch drawn ahead (_draw)
        self._sampler_state: dict[str, Any] = {}  # the sampler's state before that draw
        self.world_size_was: int | None = None
        self._ranks: list[rec.RankInfo] = []
        self.monitor: Any = None  # engine.run.alerts.AlertMonitor, on rank 0
        self.health: Any = None  # engine.run.health.HealthMonitor, on rank 0
        self._alerted: collections.deque[str] = collections.deque(maxlen=8)  # alerts' messages
        self.mixture = MixtureWatch()
        self.sink: Any = None
        self.watchdog: Any = None
        self.telemetry: Any = None
        self.evaluator: Any = None
        self.trainer: Any = None  # engine.train.trainer.Trainer, once built

    # -- start-up -----------------------------------------------------------------------

    def run(self) -> int:
        from engine.backends import resolve_backend
        from engine.data.prep import PrepInterrupted
        from engine.run.identity import engine_info

        try:
            try:
                cleanup_tmp(self.ckpt_root)  # half-written dirs of writers that died
                resume = self._pick_resume()
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

    def _join(self, backend: BackendChoice) -> list[rec.RankInfo]:
        """Meet the job's other ranks; every rank's pid, host and device, in rank order."""
        w = self.world
        if backend.on_gpu and w.distributed and not env.CUDA_DEVICE.is_set():
            os.environ[env.CUDA_DEVICE.name] = str(w.local_rank)  # one GPU a rank
        me = rec.RankInfo(w.rank, os.getpid(), socket.gethostname(),
                          f"cuda:{env.CUDA_DEVICE.read()}" if backend.on_gpu else "cpu")
        if not w.distributed:
            return []
        self.channel = Channel.join(w, self.run_dir,
                                    should_stop=lambda: self.flags.stop_requested)
        self.out.log(f"data parallel: {w.describe()}, {w.size} ranks joined")
        return [rec.RankInfo.from_json(json.loads(b))  # type: ignore[misc]
                for b in self.channel.allgather(json.dumps(me.to_json()).encode())]

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

    def _pick_resume(self) -> Any:
        from engine.run.checkpoint import load_checkpoint
        from engine.run.checkpoint_store import find_resume_checkpoint

        if not (self.args.resume and has_checkpoints(self.run_dir)):
            if self.args.resume:
                self.out.log(f"--resume: no checkpoint in {self.ckpt_root}, starting fresh")
            return None
        path, skipped = find_resume_checkpoint(self.ckpt_root)
        for p, why in skipped:
            self.out.log(f"resume: skipping {p}: {why}")
        if path is None:
            why = "; ".join(f"{Path(p).name}: {w}" for p, w in skipped)
            raise UserError(f"{self.ckpt_root}: no checkpoint verifies, nothing to resume from "
                            f"({why})")
        ck = load_checkpoint(path)
        saved = parse_config(self._checkpoint_config(ck.state), f"{path / 'state.json'}: config",
                             path)
        # what the command line set on purpose; a train.max_steps of the given config that
        # differs from the run's is kept as the run's and said (--max-steps changes it)
        overridden = ({"train.max_steps"} if self.args.max_steps is not None else set()) | \
            ({"train.precision"} if self.args.precision else set()) | \
            ({"gpu.attention"} if self.args.attention else set())
        ignored = [rec.IgnoredSetting(k, kept, given)
                   for k, kept, given in config_diff(saved, self.cfg) if k not in overridden]
        if ignored:
            self._warn_ignored(ignored)
        self.cfg = saved
        if self.args.max_steps is not None and self.args.max_steps < ck.step:
            raise UserError(f"--max-steps {self.args.max_steps}: the run is already at step "
                            f"{ck.step} ({path.name}); give a larger number")
        if self.args.max_steps is not None and self.args.max_steps != saved.train.max_steps:
            self.out.log(f"resume: --max-steps {self.args.max_steps} replaces the run's "
                         f"{saved.train.max_steps} (the lr schedule changes with it)")
            self.cfg = saved.with_max_steps(self.args.max_steps)
        if self.args.precision is not None and self.args.precision != saved.train.precision:
            self.out.log(f"resume: --precision {self.args.precision} replaces the run's "
                         f"{saved.train.precision} (the checkpoint's fp32 masters and Adam "
                         f"moments go on as they are)")
            self.cfg = self.cfg.with_precision(self.args.precision)
        if self.args.attention is not None and self.args.attention != saved.gpu.attention:
            self.out.log(f"resume: --attention {self.args.attention} replaces the run's "
                         f"{saved.gpu.attention} (the bits may differ from an uninterrupted run)")
            self.cfg = self.cfg.with_attention(self.args.attention)
        self.out.log(f"resume: from {path} (step {ck.step})")
        was = ck.state.get("world_size", 1)
        self.world_size_was = was if was != self.world.size else None
        if self.world_size_was is not None:
            self.out.log(f"resume: the checkpoint was written by {was} rank(s), this job has "
                         f"{self.world.size}: the global batch is drawn anew (not bit-exact "
                         "with a run that kept its world size)")
        self.out.set_status(step=ck.step, last_checkpoint=rec.CheckpointRef(
            str(path), ck.step, str(ck.state.get("reason"))))
        self.out.event(rec.ResumeEvent(step=ck.step, path=str(path), skipped=[
            rec.SkippedCheckpoint(str(p), str(w)) for p, w in skipped], ignored=ignored,
            world_size_was=self.world_size_was))
        return ck

    def _checkpoint_config(self, state: Mapping[str, Any]) -> Any:
        """The config a checkpoint's state.json holds; one written before the config had a gpu
        section gets the section its run computed with (engine.config.
        gpu_section_of_checkpoint), so that the resume computes as the run did."""
        raw = state.get("config")
        if not isinstance(raw, dict) or "gpu" in raw:
            return raw
        gpu, notes = gpu_section_of_checkpoint(state)
        said = ", ".join(f"{k} {json.dumps(v)}" for k, v in gpu.items()) or "the defaults"
        self.out.log(f"resume: the checkpoint's config has no gpu section (written before it "
                     f"existed): its run's settings go on as gpu: {said}")
        for note in notes:
            self.out.log(f"resume: {note}")
        return {**raw, "gpu": gpu}

    def _warn_ignored(self, ignored: list[rec.IgnoredSetting]) -> None:
        """A resume trains on with the checkpoint's config: say loudly what the given config
        would have changed, and how to train with it instead."""
        lines = [f"  {i.key}: {json.dumps(i.kept)} (kept) -- given {json.dumps(i.given)}"
                 for i in ignored]
        lines += [f"  {a}" for a in rec.ignored_advice(ignored)]
        msg = (f"warning: --resume continues {self.run_dir} with its checkpoint's config; "
               f"{len(ignored)} setting(s) of the given config are NOT used:\n"
               + "\n".join(lines))
        print(msg, file=sys.stderr, flush=True)
        for line in msg.splitlines():
            self.out.log(line, echo=False)

    def _start(self, resume: Any, choice: BackendChoice) -> None:
        from engine.data.bandit import Bandit
        from engine.data.prep import load_prepared, prepare
        from engine.data.sampler import Sampler
        from engine.run.memcheck import require_host_memory

        cfg = self.cfg
        backend = choice.name
        # Before the data's preparation and the trainer's buffers: a model this host cannot
        # hold is refused now with the figures (exit 2), not killed by the kernel later.
        require_host_memory(cfg, backend, resumed=resume is not None)
        self.out.write_json(self.out.paths.config, cfg.to_json())
        self.out.log(f"andrea-train {cfg.name} pid {os.getpid()} run {self.run_id}: "
                     f"{choice.why}")
        self.out.set_status(status=Status.STARTING, step=resume.step if resume else 0,
                            max_steps=cfg.train.max_steps, backend=backend, device="",
                            pid=os.getpid(), run_id=self.run_id)
        self.out.event(rec.StartEvent(pid=os.getpid(), argv=self.argv, name=cfg.name,
                                      backend=backend, device="", run_id=self.run_id,
                                      resumed=resume is not None))

        def progress(event: rec.PrepEvent) -> None:
            self.out.log(f"prep: {event.message}")
            self.out.event(event)

        if self.world.main:
            prepare(cfg, progress=progress, should_stop=lambda: self.flags.stop_requested)
        if self.channel is not None:
            self.channel.broadcast(b"prepared")  # the others read what rank 0 prepared
        self.data = load_prepared(cfg)
        self.tokenizer = self.data.tokenizer
        self.source_names = cfg.data.source_names
        self.data_identity = {
            "tokenizer_sha256": self.tokenizer.sha256,
            "tokens": {n: len(sh) for n, sh in zip(self.source_names, self.data.shards, strict=True)},
        }
        if resume is not None and "data" in resume.state:
            self._check_same_data(resume.state["data"])

        self.out.log(f"building the {backend} trainer")
        with self.flags.interrupting():
            # building allocates and initialises everything (seconds for a large model): a stop
            # meanwhile ends the start at once (KeyboardInterrupt: status stopped, nothing
            # trained)
            self.trainer = self._build_trainer(choice, resume)
        topology = self._join_reducer(choice) if self.channel is not None else {}
        be = self.trainer.backend
        attention = self._report_backend(be)
        self.sampler = Sampler(self.data.shards, cfg.model.seq_len, cfg.train.seed,
                               holdout=cfg.eval.holdout if cfg.eval else 0.0)
        if cfg.eval is not None and self.world.main:
            from engine.run.evaluate import Evaluator

            self.evaluator = Evaluator(cfg, self.data.shards)
        b = cfg.bandit
        self.bandit = Bandit(self.source_names, list(b.phase_lengths), b.eta, b.floor, b.seed,
                             score=b.score)
        n = self.trainer.n_params
        with self.flags.interrupting():
            if resume is not None:
                st = resume.state
                self.trainer.load_state(resume.params, resume.m, resume.v, st["trainer"])
                self.sampler.load_state_dict(st["sampler"])
                self.bandit.load_state_dict(st["bandit"])
            # Host buffers for checkpoint copies, allocated once: the loop stalls only to fill
            # them. On a resume the checkpoint's arrays, read already and copied into the
            # trainer now, are those buffers (no second 12 bytes a parameter).
            own = resume is not None and all(
                a.dtype == np.float32 and a.size == n and a.flags.c_contiguous
                and a.flags.writeable for a in (resume.params, resume.m, resume.v))
            self.snap = ({"params": resume.params, "m": resume.m, "v": resume.v} if own else
                         {k: np.empty(n, dtype=np.float32) for k in ("params", "m", "v")})
        from engine.run.checkpoint_write import CheckpointWriter

        self.writer = CheckpointWriter(self.ckpt_root) if self.world.main else None
        plan = dict(be.memory_plan())
        plan["host_checkpoint_copy"] = 3 * 4 * n
        self.out.log(f"model {cfg.name}: {n:,} parameters; backend {be.name} on {be.device}")
        self.out.log("memory plan: " + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in plan.items()))
        self.out.set_status(status=Status.RUNNING, step=self.trainer.step_count,
                            device=be.device, health=rec.Health.HEALTHY, health_reason="")
        self.out.event(rec.ReadyEvent(memory_plan=plan, n_params=n, backend=be.name,
                                      device=be.device, step=self.trainer.step_count,
                                      max_steps=cfg.train.max_steps,
                                      tokens_per_step=cfg.tokens_per_step * self.world.size,
                                      world_size=self.world.size, attention=attention,
                                      topology=topology, precision=cfg.train.precision,
                                      fp8_gemms=list(be.fp8_gemms)))
        if self.world.main:
            self._start_monitors(choice)

    def _build_trainer(self, choice: BackendChoice, resume: Any) -> Any:
        """The trainer on the chosen backend. A data-parallel job on GPUs computes with one set
        of GEMM algorithms: rank 0 times them (or reads the run's plan) and the others take its
        choice, so every rank computes the same bits (a rank that resolves its config otherwise,
        a cuDNN that does not start, say, is refused by `_join_reducer`)."""
        from engine.train.trainer import Trainer

        cfg = self.cfg
        plan = self._gemm_plan(resume) if choice.on_gpu else None
        if self.channel is None or not choice.on_gpu:
            return Trainer(cfg, choice.name, gemm_plan=plan)
        if self.world.main:
            trainer = Trainer(cfg, choice.name, gemm_plan=plan)
            self.channel.broadcast(json.dumps({"plan": trainer.backend.gemm_plan}).encode())
            return trainer
        got = json.loads(self.channel.broadcast(b""))
        return Trainer(cfg, choice.name, gemm_plan=got["plan"])

    def _join_reducer(self, choice: BackendChoice) -> dict[str, Any]:
        """One rank of a data-parallel job: the trainer's gradients summed over the ranks (NCCL
        on GPUs), every rank checked to make the same collective calls with the same choices;
        returns the GPUs' topology for the ready event ({} on the CPU)."""
        assert self.channel is not None
        reducer = make_reducer(self.channel, choice.on_gpu, self.cfg.gpu.ddp_overlap)
        self.trainer.join(reducer)
        if not choice.on_gpu:
            return {}
        from engine.run.topology import describe

        topology = describe(reducer.nccl.version)  # type: ignore[union-attr]
        self.out.log(f"data parallel over NCCL {topology['nccl_version']}: GPU links "
                     f"{topology['links'] or 'unknown'}, settings "
                     f"{topology['nccl'] or 'NCCL defaults'}")
        be = self.trainer.backend
        mine = collective_settings(reducer, be)
        check_same_collectives([json.loads(p) for p in
                                self.channel.allgather(json.dumps(mine).encode())])
        if self.cfg.train.grad_accum == 1 and reducer.in_step and be.device_step() is not None:
            self.out.log(f"gradients summed inside the one-graph step: "
                         f"{len(be.grad_buckets())} buckets, each all-reduced as the "
                         f"backward completes it")
        return topology

    def _gemm_plan(self, resume: Any) -> dict[str, Any] | None:
        """The run directory's GEMM plan (gemm_plan.json) when it has one, so a resumed run (or
        a new run given that plan) runs the very same GEMM algorithms: the same bits
        (--retune times them again)."""
        from engine.backends.cuda.gemm_plan import GemmPlan, read_gemm_plan

        plan = None
        path = self.out.paths.gemm_plan
        if self.args.retune:
            self.out.log("--retune: timing the GEMMs again" + (
                " (the bits may differ from the run before the checkpoint)" if resume else ""))
        elif path.exists():
            got = read_gemm_plan(self.run_dir)
            if isinstance(got, GemmPlan):
                plan = got.to_json()
                self.out.log(f"GEMM algorithms from {path.name} ({len(got.gemms)} problems, "
                             f"{len(got.choices)} epilogue choices)")
            else:
                self.out.log(f"{path.name} is not usable ({got}); timing the GEMMs again"
                             + (" (the bits may differ from the run before the checkpoint)"
                                if resume else ""))
        elif resume is not None:
            self.out.log(f"resume: no {path.name}; timing the GEMMs")
        return plan

    def _report_backend(self, be: Backend) -> str:
        """Log what the backend runs (for the CUDA one: attention, GEMMs, fusions) and keep its
        GEMM plan, where it has one, in the run directory; returns the attention line for the
        ready event."""
        self.out.log(f"{be.name}: {be.describe()}")
        self._log_backend_notes()
        if be.gemm_plan is not None:
            from engine.backends.cuda.gemm_plan import GemmPlan

            record = GemmPlan.from_json(be.gemm_plan)
            if isinstance(record, GemmPlan):
                self.out.write_json(self.out.paths.gemm_plan, record.to_json())
        return be.attention_info

    def _start_monitors(self, choice: BackendChoice) -> None:
        """Alerts (engine.run.alerts) and telemetry (engine.run.telemetry): rank 0 only."""
        from engine.config import AlertsConfig
        from engine.run.alerts import AlertMonitor, AlertSink, CommandRunner, Watchdog
        from engine.run.health import HealthMonitor
        from engine.run.telemetry import SystemSampler

        a = self.cfg.alerts or AlertsConfig()
        runner = CommandRunner(list(a.command), a.timeout_s, self.out.log) if a.command else None
        self.sink = sink = AlertSink(self.out.event, self.out.log, runner)
        self.monitor = AlertMonitor(a, vocab_size=self.cfg.model.vocab_size, optim=self.cfg.optim)
        self.health = health = HealthMonitor(self._report_health, a.quiet_steps)

        def stall(alert: rec.AlertEvent) -> None:  # the watchdog's thread, or a late beat()
            sink.emit(alert)
            self._alerted.append(alert.message)
            health.stalled(alert)

        self.watchdog = Watchdog(stall, a.stall_factor, a.stall_min_s)
        self.watchdog.start()
        gpus = self._my_gpus() if choice.on_gpu else []
        self.telemetry = SystemSampler(self.out.system, lambda: self.trainer.step_count, gpus)
        self.telemetry.start()

    def _report_health(self, event: rec.HealthEvent, changed: bool) -> None:
        """The health changed (engine.run.health): into state.json and events.jsonl
        (RunWriter.set_health), and a line in the log when its state did."""
        if self.out.set_health(event, changed) and changed:
            told = event.reason in self._alerted  # its alert's line is in the log already
            self.out.log(f"health {event.state} at step {event.step}"
                         + (f": {event.reason}" if event.reason and not told else ""))

    def _my_gpus(self) -> list[int]:
        """CUDA ordinals of this job's GPUs on this host (rank 0 samples them all)."""
        host = socket.gethostname()
        ranks = self._ranks or []
        ords = sorted({int(r.device.split(":")[1]) for r in ranks
                       if r.host == host and r.device.startswith("cuda:")
                       and r.device.split(":")[1].isdigit()})
        return ords or [env.CUDA_DEVICE.read()]

    def _stop_monitors(self) -> None:
        for part in (self.watchdog, self.telemetry, self.sink):
            if part is not None:
                part.stop()
        self.watchdog = self.telemetry = self.sink = None

    def _check_same_data(self, saved: dict[str, Any]) -> None:
        """Bit-exact resume needs the very tokens the run trained on: refuse when they changed."""
        now = self.data_identity
        problems = []
        if saved.get("tokenizer_sha256") != now["tokenizer_sha256"]:
            problems.append(f"tokenizer sha256 {str(saved.get('tokenizer_sha256'))[:12]} -> "
                            f"{now['tokenizer_sha256'][:12]}")
        for name, n in saved.get("tokens", {}).items():
            if now["tokens"].get(name) != n:
                problems.append(f"source {name}: {n} tokens -> {now['tokens'].get(name)}")
        if problems:
            raise UserError(f"{self.cfg.data.dir}: the data changed since the checkpoint "
                            f"({'; '.join(problems)}); restore it, or start a new run")

    # -- the loop -----------------------------------------------------------------------

    def _loop(self) -> int:
        cfg, tr = self.cfg, self.trainer
        max_steps = cfg.train.max_steps
        n_micro, B = cfg.train.grad_accum, cfg.train.batch_size
        world = self.world
        mine = my_micro_batches(world.rank, n_micro, n_micro * world.size)
        tokens_per_step = cfg.tokens_per_step * world.size
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
        queue: collections.deque[tuple[list[np.ndarray], np.ndarray, tuple[int, int, int]]] = \
            collections.deque()
        t0 = time.perf_counter()
        while queue or (tr.step_count < max_steps and not self._stop
                        and self.out.failed is None):
            if n_micro == 1:  # the fused step where the backend has one (the all-reduce in it)
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
            else:
                weights = self.bandit.weights.copy()
                phase = (self.bandit.phase, self.bandit.phase_step + 1, self.bandit.phase_len)
                srcs = []
                tr.zero_grads()
                # The whole job's micro-batches in one order (every rank draws them all and
                # trains its own share): the sampler and the bandit stay the same everywhere.
                for m in range(n_micro * world.size):
                    tokens, src = self.sampler.sample(B, weights)
                    if m in mine:
                        tr.forward_backward(tokens)
                    srcs.append(src)
                done = tr.step()
            self.steps_run += 1
            rows, rank_ms = self._exchange(tr.row_losses, time.perf_counter() - t0)
            step_s = time.perf_counter() - t0
            src_loss = self._src_loss(rows, np.concatenate(srcs))
            change = self.bandit.observe(src_loss)
            record = rec.StepRecord(
                step=done.step, loss=float(np.mean(rows)), grad_norm=done.grad_norm,
                clip_scale=done.clip_scale, lr=done.lr, tokens=done.tokens,
                tok_s=tokens_per_step / step_s, step_ms=step_s * 1e3, phase=phase[0],
                phase_step=phase[1], phase_len=phase[2], weights=self._by_source(weights),
                src_loss=src_loss, skipped=done.skipped, t=time.time(), rank_ms=rank_ms)
            t0 = time.perf_counter()  # the next step's clock starts here ...
            if queue or (n_micro == 1 and not self._due_between_steps(record.step)):
                self._pending = (record, change)  # written while the next step runs
                continue
            self._after_step(record, change)
            step = record.step
            if self.evaluator is not None and self.evaluator.due(step):
                self._evaluate(step)
            if cfg.samples.every_steps and step % cfg.samples.every_steps == 0 and world.main:
                self._sample(step)  # text only rank 0 writes: the others would throw it away
            if self.watchdog is not None:
                self.watchdog.beat(step)  # validation and samples are expected work
            if world.main and self.write_error is None:  # rank 0 writes the checkpoints
                periodic_due = step % cfg.checkpoint.every == 0 and step != max_steps
                if not self._handle_snapshot_requests(periodic_due) and periodic_due:
                    self._checkpoint("periodic", wait=False)
            else:
                self._snapshots = 0  # taken here by rank 0 too: the ranks go on deciding alike
            t0 = time.perf_counter()  # ... or after validation, a text sample or a checkpoint
        if self._pending is not None:
            self._after_step(*self._pending)
            self._pending = None
        if self.channel is not None:
            self.channel.finish()  # no collective after this: the others may end now
        self._stop_monitors()  # a stop or final checkpoint is expected work, not a stall
        return self._finish(max_steps)

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

    def _log_backend_notes(self) -> None:
        """The backend's notes not logged yet: its start-up's, then any it adds later (a graph
        captured at the first step of its kind, e.g. CudaGraph.fill_note)."""
        be = self.trainer.backend
        for note in be.notes[self._notes_logged:]:
            self.out.log(f"{be.name}: {note}")
        self._notes_logged = len(be.notes)

    def _after_step(self, record: rec.StepRecord, change: Any) -> None:
        """A step's records: loss.jsonl, its events and alerts, the log line, the status; and
        the checkpoints the writer finished meanwhile."""
        step = record.step
        self.out.step(record)
        if record.skipped:
            self.out.event(rec.SkippedEvent(step=step, grad_norm=record.grad_norm))
            self.out.log(f"step {step}: non-finite gradient norm, update skipped")
        if self.monitor is not None:
            alerts = self.monitor.observe(record)
            for alert in alerts:
                self.sink.emit(alert)
                self._alerted.append(alert.message)
            self.watchdog.beat(step, record.step_ms / 1e3)  # may tell a stall it could not see
            self.health.observe(record, alerts, self.monitor.diverging, self.monitor.recovered)
        moved = self.mixture.observe(step, record.weights)
        if moved is not None:
            self.out.event(moved)
            self.out.log(f"step {step}: the data mixture moved: " + ", ".join(
                f"{n} {a:.2f} -> {b:.2f}" for n, a, b in moved.moves()))
        if change is not None:
            self.out.event(rec.PhaseEvent(
                step=step, phase=change.new_phase, phase_len=change.new_length,
                weights=self._by_source(change.new_weights),
                scores=self._by_source(change.scores)))
        now = time.time()
        if now - self._last_print >= 1.0 or step == self.cfg.train.max_steps:
            self._last_print = now
            self.out.log(f"step {step}/{self.cfg.train.max_steps} loss {record.loss:.4f} "
                         f"gnorm {record.grad_norm:.3f} clip {record.clip_scale:.3f} "
                         f"lr {record.lr:.2e} tok/s {record.tok_s:,.0f} "
                         f"phase {record.phase} ({record.phase_step}/{record.phase_len})")
        self.out.set_status(durable=False, status=Status.RUNNING, step=step)
        self._log_backend_notes()
        self._collect_writes()

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

    def _by_source(self, values: Any) -> dict[str, float]:
        return {n: float(x) for n, x in zip(self.source_names, values, strict=True)}

    def _src_loss(self, rows: np.ndarray, src: np.ndarray) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for i, name in enumerate(self.source_names):
            sel = rows[src == i]
            out[name] = float(sel.mean()) if sel.size else None
        return out

    def _evaluate(self, step: int) -> None:
        """The validation loss now (forward passes on the held-out windows; the training state
        and its random streams are left as they were)."""
        t0 = time.perf_counter()
        r = self.evaluator.evaluate(self.trainer, step)
        self.out.eval_record(r)
        self.out.log(f"eval step {step}: val loss {r.val_loss:.4f} "
                     f"({time.perf_counter() - t0:.2f} s)", echo=False)

    def _sample(self, step: int) -> None:
        from engine.model.sampling import generate

        prompts = self.cfg.samples.prompts
        prompt = prompts[(step // self.cfg.samples.every_steps) % len(prompts)]
        text = generate(self.trainer.backend, self.tokenizer, prompt, self.cfg,
                        self.cfg.train.seed, step)
        self.out.sample(rec.Sample(step=step, t=time.time(), prompt=prompt, text=text))

    # -- checkpoints and signals -------------------------------------------------------------

    def _state(self, reason: str) -> dict[str, Any]:
        tr = self.trainer
        return {
            "config": self.cfg.to_json(),
            "data": self.data_identity,
            "trainer": tr.state_dict(),
            # the state before a batch drawn ahead for the next step (a resume draws it again)
            "sampler": self._sampler_state if self._drawn else self.sampler.state_dict(),
            "bandit": self.bandit.state_dict(),
            "schedule": {"step": tr.step_count, "lr": tr.lr_at(max(tr.step_count, 1)),
                         "warmup_steps": self.cfg.optim.warmup_steps,
                         "max_steps": self.cfg.train.max_steps},
            "tokens": tr.tokens,
            "run_id": self.run_id,
            "backend": tr.backend.name,
            "world_size": self.world.size,
            "versions": {"python": platform.python_version(), "numpy": np.__version__},
            # train/precision "fp8": the GEMMs that ran in FP8 (only then: the key says so)
            **({rec.STATE_FP8_GEMMS: list(tr.backend.fp8_gemms)} if tr.backend.fp8_gemms
               else {}),
        }

    def _copy_state(self) -> None:
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
                           self.snap["v"], self._state(reason), reason, self.trainer.tensor_table)
        if wait:
            self.writer.wait()
            self._collect_writes()

    def _collect_writes(self) -> None:
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
                         f"({_fmt_bytes(info.bytes)} in {info.seconds:.2f} s)")
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

    def _write_failed(self, res: Any) -> None:
        """A checkpoint was not written (`res`: engine.run.checkpoint.WriteResult). Training on
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
        from engine.run.checkpoint_store import list_checkpoints

        return any(e.step == step and e.reason in ("final", "stop") and e.valid
                   for e in list_checkpoints(self.ckpt_root, check_hash=False))
