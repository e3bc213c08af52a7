"""How a training run resumes (`--resume`): the checkpoint it continues from, the config it goes
on with (the checkpoint's, with what the command line overrides on purpose) and the checks that
keep a resume bit-exact (the very data the run trained on).

`RunResume` is a part of `TrainingRun` (engine.run.loop), which sets the attributes declared
below; the checkpoint's arrays and state are loaded into the trainer at start-up
(engine.run.start).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import records as rec
from engine.config import (
    Config,
    GpuConfig,
    config_diff,
    gpu_section_of_checkpoint,
    parse_config,
)
from engine.errors import UserError
from engine.runfiles import has_checkpoints

if TYPE_CHECKING:
    from engine.run.checkpoint import Checkpoint
    from engine.run.loop import RunOptions
    from engine.run.world import World
    from engine.run.writer import RunWriter


class RunResume:
    """The resume of a TrainingRun: `_pick_resume` at start-up, `_check_same_data` once the
    data is loaded."""

    cfg: Config
    args: RunOptions
    run_dir: Path
    ckpt_root: Path
    world: World
    out: RunWriter
    world_size_was: int | None
    data_identity: dict[str, Any]

    def _pick_resume(self) -> Checkpoint | None:
        """The checkpoint a `--resume` continues from, its config now the run's (`cfg`); None
        for a fresh start. Refuses (UserError) when the run has checkpoints and none verifies."""
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
        ignored = self._take_checkpoint_config(ck, path)
        self._announce_resume(ck, path, skipped, ignored)
        return ck

    def _take_checkpoint_config(self, ck: Checkpoint, path: Path) -> list[rec.IgnoredSetting]:
        """The run goes on with the checkpoint's config (`cfg`), with the command line's
        --max-steps, --precision and --attention applied; returns the given config's settings
        that are not used (said loudly: `_warn_ignored`)."""
        saved = parse_config(self._checkpoint_config(ck.state), f"{path / 'state.json'}: config",
                             path)
        # what the command line set on purpose; a train.max_steps of the given config that
        # differs from the run's is kept as the run's and said (--max-steps changes it)
        overridden = ({"train.max_steps"} if self.args.max_steps is not None else set()) | \
            ({"train.precision"} if self.args.precision else set()) | \
            ({"gpu.attention"} if self.args.attention else set())
        if not _has_gpu_section(ck.state) and self.cfg.gpu == GpuConfig():
            # a checkpoint from before the gpu section, resumed with a config that sets none of
            # it: the section's defaults were not given against the run's translated one
            overridden |= {f"gpu.{f.name}" for f in fields(GpuConfig)}
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
        return ignored

    def _announce_resume(self, ck: Checkpoint, path: Path, skipped: list[tuple[Path, str]],
                         ignored: list[rec.IgnoredSetting]) -> None:
        """The log lines, the status and the resume event of a resume from `ck`."""
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


def _has_gpu_section(state: Mapping[str, Any]) -> bool:
    raw = state.get("config")
    return isinstance(raw, dict) and "gpu" in raw
