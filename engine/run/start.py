"""A training run's start-up, after the quick refusals (engine.run.loop `run`): the run announced
(config.json, the start event), its data prepared and checked, the trainer built on the chosen
backend (one GEMM plan for all ranks of a data-parallel job, its gradients summed over them), the
sampler, the bandit and the validation set up, a resume's state loaded, and the run declared
ready (the memory plan, the ready event) with its monitors started.

`RunStartup` is a part of `TrainingRun` (engine.run.loop), which sets the attributes declared
below; the resume itself (which checkpoint, which config) is engine.run.resume.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine import env
from engine import records as rec
from engine.backends import BackendChoice
from engine.backends.base import Backend
from engine.config import Config
from engine.records import Status
from engine.run.checkpointing import format_bytes
from engine.run.comm import Channel
from engine.run.ddp import check_same_collectives, collective_settings, make_reducer

if TYPE_CHECKING:
    from engine.data.bandit import Bandit
    from engine.data.prep import Prepared
    from engine.data.sampler import Sampler
    from engine.data.tokenizer import Tokenizer
    from engine.run.checkpoint import Checkpoint
    from engine.run.checkpoint_write import CheckpointWriter
    from engine.run.evaluate import Evaluator
    from engine.run.loop import RunOptions
    from engine.run.monitors import RunMonitors
    from engine.run.signals import SignalFlags
    from engine.run.world import World
    from engine.run.writer import RunWriter
    from engine.train.trainer import Trainer


class RunStartup:
    """The start-up of a TrainingRun: `_join` meets the other ranks, `_start` builds the rest."""

    cfg: Config
    args: RunOptions
    run_dir: Path
    ckpt_root: Path
    argv: list[str]
    run_id: str
    world: World
    flags: SignalFlags
    out: RunWriter
    channel: Channel | None  # the other ranks, when there are any
    _ranks: list[rec.RankInfo]
    data: Prepared
    tokenizer: Tokenizer
    source_names: list[str]
    data_identity: dict[str, Any]
    trainer: Trainer
    sampler: Sampler
    bandit: Bandit
    evaluator: Evaluator | None
    snap: dict[str, np.ndarray]
    writer: CheckpointWriter | None
    monitors: RunMonitors | None

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

    def _start(self, resume: Checkpoint | None, choice: BackendChoice) -> None:
        """Everything the loop needs, in the order the run's files tell it: started, data
        prepared, trainer built, state loaded (a resume), ready."""
        from engine.run.checkpoint_write import CheckpointWriter

        self._announce_start(resume, choice)
        self._load_data(resume)
        self.out.log(f"building the {choice.name} trainer")
        with self.flags.interrupting():
            # building allocates and initialises everything (seconds for a large model): a stop
            # meanwhile ends the start at once (KeyboardInterrupt: status stopped, nothing
            # trained)
            self.trainer = self._build_trainer(choice, resume)
        topology = self._join_reducer(choice) if self.channel is not None else {}
        attention = self._report_backend(self.trainer.backend)
        if resume is not None:
            for line in gpu_differences(rec.gpu_ran_of(resume.state),
                                        self.trainer.backend.resolved):
                self.out.log(f"resume: {line}")
        self._make_sampling()
        with self.flags.interrupting():
            self._load_state(resume)
        self.writer = CheckpointWriter(self.ckpt_root) if self.world.main else None
        self._announce_ready(topology, attention)
        if self.world.main:
            self._start_monitors(choice)

    def _announce_start(self, resume: Checkpoint | None, choice: BackendChoice) -> None:
        """The host memory checked, then config.json, the first log line, the status and the
        start event."""
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

    def _load_data(self, resume: Checkpoint | None) -> None:
        """The data prepared (rank 0; its lines in the log and the events) and loaded; a
        resume's checked to be the very data the run trained on."""
        from engine.data.prep import load_prepared, prepare

        def progress(event: rec.PrepEvent) -> None:
            self.out.log(f"prep: {event.message}")
            self.out.event(event)

        cfg = self.cfg
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

    def _make_sampling(self) -> None:
        """The sampler of the training windows, the validation (rank 0) and the bandit."""
        from engine.data.bandit import Bandit
        from engine.data.sampler import Sampler

        cfg = self.cfg
        self.sampler = Sampler(self.data.shards, cfg.model.seq_len, cfg.train.seed,
                               holdout=cfg.eval.holdout if cfg.eval else 0.0)
        if cfg.eval is not None and self.world.main:
            from engine.run.evaluate import Evaluator

            self.evaluator = Evaluator(cfg, self.data.shards)
        b = cfg.bandit
        self.bandit = Bandit(self.source_names, list(b.phase_lengths), b.eta, b.floor, b.seed,
                             score=b.score)

    def _load_state(self, resume: Checkpoint | None) -> None:
        """A resume's state into the trainer, the sampler and the bandit; the host buffers a
        checkpoint is copied into."""
        n = self.trainer.n_params
        if resume is not None:
            st = resume.state
            self.trainer.load_state(resume.params, resume.m, resume.v, st["trainer"])
            self.sampler.load_state_dict(st["sampler"])
            self.bandit.load_state_dict(st["bandit"])
            self.mixture.load_state_dict(st.get(rec.STATE_MIXTURE))
        self._load_fp8_history(resume)
        # Host buffers for checkpoint copies, allocated once: the loop stalls only to fill
        # them. On a resume the checkpoint's arrays, read already and copied into the
        # trainer now, are those buffers (no second 12 bytes a parameter).
        own = resume is not None and all(
            a.dtype == np.float32 and a.size == n and a.flags.c_contiguous
            and a.flags.writeable for a in (resume.params, resume.m, resume.v))
        self.snap = ({"params": resume.params, "m": resume.m, "v": resume.v} if own else
                     {k: np.empty(n, dtype=np.float32) for k in ("params", "m", "v")})

    def _load_fp8_history(self, resume: Checkpoint | None) -> None:
        """train/precision fp8 on a resume: the delayed FP8 scales go on from the checkpoint's
        amax history. A checkpoint without one (written in another precision, or by an engine
        without delayed scaling), or with one that does not fit, starts the history afresh; one
        naming fewer tensors (written while fewer GEMMs ran in FP8, or the weights were scaled
        by their own amax) goes on with the rows it has. The log says either: the first steps
        then scale differently than the run would have."""
        from engine.model.fp8 import AmaxHistory

        be = self.trainer.backend
        if resume is None or self.cfg.train.precision != "fp8":
            return
        raw = resume.state.get(rec.STATE_FP8_HISTORY)
        why = "the checkpoint has none (written in another precision or by an older engine)"
        if raw is not None:
            try:
                got = AmaxHistory.from_json(raw, self.cfg.model.n_layer)
                be.load_fp8_history(got.history)
            except ValueError as e:
                why = f"the checkpoint's does not fit: {e}"
            else:
                if got.without:
                    self.out.log(
                        f"resume: the checkpoint's FP8 amax history has no rows for "
                        f"{', '.join(got.without)} (written by an engine that ran fewer GEMMs "
                        f"in FP8 or scaled the weights by their own amax each pass): each is "
                        f"scaled by its own amax until it has one, so these steps' bits differ "
                        f"from the run's had it gone on")
                return
        be.load_fp8_history(None)
        self.out.log(f"resume: FP8 amax history starts afresh: {why}; until each tensor has "
                     f"one, it is scaled by its own amax, so these steps' bits differ from "
                     f"the run's had it gone on")

    def _announce_ready(self, topology: dict[str, Any], attention: str) -> None:
        """The model and its memory plan in the log, the status running, the ready event."""
        cfg, be, n = self.cfg, self.trainer.backend, self.trainer.n_params
        plan = dict(be.memory_plan())
        plan["host_checkpoint_copy"] = 3 * 4 * n
        self.out.log(f"model {cfg.name}: {n:,} parameters; backend {be.name} on {be.device}")
        self.out.log("memory plan: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in plan.items()))
        if self.world.main:
            self._log_checkpoint_room()
        self.out.set_status(status=Status.RUNNING, step=self.trainer.step_count,
                            device=be.device, health=rec.Health.HEALTHY, health_reason="")
        self.out.event(rec.ReadyEvent(memory_plan=plan, n_params=n, backend=be.name,
                                      device=be.device, step=self.trainer.step_count,
                                      max_steps=cfg.train.max_steps,
                                      tokens_per_step=cfg.tokens_per_step * self.world.size,
                                      world_size=self.world.size, attention=attention,
                                      topology=topology, precision=cfg.train.precision,
                                      fp8_gemms=list(be.fp8_gemms)))

    def _log_checkpoint_room(self) -> None:
        """The disk the periodic checkpoints need, in the log at start (a 1.2B model's
        checkpoint is about 13.7 GiB), with a warning when the file system has less free than
        the run will need: a checkpoint that cannot be written stops the run at its step."""
        from engine.run.checkpoint_store import list_checkpoints
        from engine.run.checkpoint_write import checkpoint_room

        try:
            existing = sum(e.reason == "periodic" and e.valid
                           for e in list_checkpoints(self.ckpt_root, check_hash=False))
        except OSError:
            existing = 0
        ck, step = self.cfg.checkpoint, self.trainer.step_count
        # the periodic checkpoints still to come, and the final one
        writes = (self.cfg.train.max_steps // ck.every - step // ck.every) + 1
        room = checkpoint_room(self.ckpt_root, self.trainer.n_params, ck.keep, existing, writes)
        free = "unknown free space" if room.free is None else f"{format_bytes(room.free)} free"
        self.out.log(f"checkpoints: {format_bytes(room.each)} each; checkpoint.keep {room.keep}:"
                     f" up to {format_bytes(room.peak)} of periodic ones while the next is "
                     f"written (snapshots and stop checkpoints besides); {free} at "
                     f"{self.ckpt_root}")
        if room.short:
            self.out.log(f"warning: checkpoints need {format_bytes(room.more)} more than the "
                         f"{existing} periodic one(s) there, and the file system has "
                         f"{format_bytes(room.free or 0)} free: the run stops at the first "
                         f"checkpoint that does not fit. Free space, lower checkpoint.keep, or "
                         f"give --run-dir on a larger disk.")

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
                             f"{len(got.choices)} choices: GELU in the epilogue or not, FP8 or bf16)")
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
        """Alerts, health, the stall watchdog and telemetry (engine.run.monitors): rank 0 only."""
        from engine.run.monitors import RunMonitors, gpus_on_this_host

        gpus = gpus_on_this_host(self._ranks) if choice.on_gpu else []
        self.monitors = RunMonitors(self.cfg, self.out, lambda: self.trainer.step_count, gpus)
        self.monitors.start()


def gpu_differences(ran: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """What a resumed backend resolved otherwise than the run before its checkpoint did (a
    config of `auto` attention where cuDNN was missing then and is here, a flex backward that
    could not load then): one line each, saying that the bits differ."""
    return [f"gpu.{k} ran as {json.dumps(ran[k])} before the checkpoint and runs as "
            f"{json.dumps(now[k])} now (where the GPU could not honour the config, or can now): "
            f"the bits differ from an uninterrupted run"
            for k in sorted(set(ran) & set(now)) if ran[k] != now[k]]
