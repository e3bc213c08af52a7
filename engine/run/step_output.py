"""What a training run writes as it steps (DESIGN §7): each step's record in `loss.jsonl`, the
events it brings (a skipped update, alerts, a moved data mixture, a new bandit phase), the log's
progress line and the status; the validation losses and text samples between steps.

`StepOutput` is a part of `TrainingRun` (engine.run.loop), which sets the attributes declared
below; the loop calls `_after_step` for each step, while the next one runs where it can, and
`_after_step` collects the checkpoints written meanwhile (engine.run.checkpointing).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from engine import records as rec
from engine.config import Config
from engine.records import Status

if TYPE_CHECKING:
    from engine.data.tokenizer import Tokenizer
    from engine.run.evaluate import Evaluator
    from engine.run.mixture import MixtureWatch
    from engine.run.monitors import RunMonitors
    from engine.run.writer import RunWriter
    from engine.train.trainer import Trainer

PROGRESS_EVERY_S = 1.0  # the log's progress line, at most this often (and at the last step)


class StepOutput:
    """The records, events and log lines of each step; validation and text samples."""

    cfg: Config
    out: RunWriter
    trainer: Trainer
    source_names: list[str]
    tokenizer: Tokenizer
    evaluator: Evaluator | None
    monitors: RunMonitors | None
    mixture: MixtureWatch
    _last_print: float  # when the last progress line went to the log
    _notes_logged: int  # the backend's notes written to the log so far

    def _after_step(self, record: rec.StepRecord, change: Any) -> None:
        """A step's records: loss.jsonl, its events and alerts, the log line, the status; and
        the checkpoints the writer finished meanwhile. `change`: the bandit's new phase, if the
        step ended one."""
        step = record.step
        self.out.step(record)
        if record.skipped:
            self.out.event(rec.SkippedEvent(step=step, grad_norm=record.grad_norm))
            self.out.log(f"step {step}: non-finite gradient norm, update skipped")
        if self.monitors is not None:
            self.monitors.observe(record)
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
        if now - self._last_print >= PROGRESS_EVERY_S or step == self.cfg.train.max_steps:
            self._last_print = now
            self.out.log(f"step {step}/{self.cfg.train.max_steps} loss {record.loss:.4f} "
                         f"gnorm {record.grad_norm:.3f} clip {record.clip_scale:.3f} "
                         f"lr {record.lr:.2e} tok/s {record.tok_s:,.0f} "
                         f"phase {record.phase} ({record.phase_step}/{record.phase_len})")
        self.out.set_status(durable=False, status=Status.RUNNING, step=step)
        self._log_backend_notes()
        self._collect_writes()

    def _log_backend_notes(self) -> None:
        """The backend's notes not logged yet: its start-up's, then any it adds later (a graph
        captured at the first step of its kind, e.g. CudaGraph.fill_note)."""
        be = self.trainer.backend
        for note in be.notes[self._notes_logged:]:
            self.out.log(f"{be.name}: {note}")
        self._notes_logged = len(be.notes)

    def _by_source(self, values: Any) -> dict[str, float]:
        return {n: float(x) for n, x in zip(self.source_names, values, strict=True)}

    def _src_loss(self, rows: np.ndarray, src: np.ndarray) -> dict[str, float | None]:
        """Each source's mean row loss this step (None: no row of it)."""
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
        """A text generated from the next of the config's prompts."""
        from engine.model.sampling import generate

        prompts = self.cfg.samples.prompts
        prompt = prompts[(step // self.cfg.samples.every_steps) % len(prompts)]
        text = generate(self.trainer.backend, self.tokenizer, prompt, self.cfg,
                        self.cfg.train.seed, step)
        self.out.sample(rec.Sample(step=step, t=time.time(), prompt=prompt, text=text))
