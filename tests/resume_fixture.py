"""A run directory written by the engine before the config had a gpu section, put in place for
a resume: tests/fixtures/resume-before-gpu-config/ (numpy) and, where the GPU's is there,
tests/fixtures/resume-before-gpu-config-cuda/ (same layout, plus the run's gemm_plan.json).

The fixture keeps the data paths of its checkpoint's config relative to its own folder (no path
of the machine that wrote it); `install` copies it and writes them back absolute, with the
state digest that follows them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# what a resume must reproduce of each step record
COMPARED = ("step", "loss", "grad_norm", "clip_scale", "lr", "tokens", "phase", "phase_step",
            "phase_len", "weights", "src_loss", "skipped")


def install(fixture: Path, dest: Path) -> tuple[Path, Path]:
    """Copy `fixture` to `dest` and make its checkpoints' data paths absolute there: (the
    config to resume with, the run directory)."""
    from engine.run.checkpoint import state_digest

    shutil.copytree(fixture, dest)
    for state_path in (dest / "run" / "checkpoints").glob("step_*/state.json"):
        doc = json.loads(state_path.read_text())
        data = doc["config"]["data"]
        data["dir"] = str(dest / data["dir"])
        data["tokenizer"]["path"] = str(Path(data["dir"]) / data["tokenizer"]["path"])
        for source in data["sources"]:
            source["paths"] = [str(dest / p) for p in source["paths"]]
        doc["state_sha256"] = state_digest(doc)
        state_path.write_text(json.dumps(doc, indent=1))
    return dest / "config.json", dest / "run"


def step_records(path: Path) -> list[dict[str, Any]]:
    """The COMPARED fields of each record of a loss.jsonl, in order."""
    return [{k: r[k] for k in COMPARED}
            for r in (json.loads(line) for line in path.read_text().splitlines())]
