"""Validation is on in every shipped config (experiments/*.json), at a cost under 2% of the
training time, and its holdout fits the built-in data every config but the seed-sources
template trains on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import parse_config
from tests.conftest import DATA_DIR, ROOT

CONFIGS = sorted((ROOT / "experiments").glob("*.json"))
# A forward pass costs a third of a training step's forward and backward (the backward does
# twice the forward's matrix products); measured on the CPU for ANDREA-tiny: 79 ms a batch
# against 237 ms a step (0.33).
FORWARD_SHARE = 1 / 3


def eval_share(cfg) -> float:
    """What evaluation adds to training time: every `every_steps` steps, `batches` forward
    batches of each source."""
    e = cfg.eval
    return len(cfg.data.sources) * e.batches * FORWARD_SHARE / e.every_steps


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_validates_at_under_2_percent(path: Path) -> None:
    cfg = parse_config(json.loads(path.read_text()), str(path), path.parent, check_paths=False)
    assert cfg.eval is not None, f"{path.name}: no eval section"
    assert eval_share(cfg) < 0.02, (path.name, eval_share(cfg))
    assert cfg.eval.every_steps < cfg.train.max_steps // 10  # at least ten points on a chart


@pytest.mark.parametrize("name", ["tiny", "12M", "120M"])
def test_the_holdout_fits_the_built_in_sources(name: str, prepared_data: Path) -> None:
    from engine.data.shards import open_shard
    from engine.data.validation import check_split, validation_windows

    path = ROOT / "experiments" / f"ANDREA-{name}-TRAIN.json"
    cfg = parse_config(json.loads(path.read_text()), str(path), path.parent, check_paths=False)
    for source in cfg.data.source_names:
        shard = open_shard(DATA_DIR / "shards" / f"{source}.bin")
        check_split(shard, cfg.model.seq_len, cfg.eval.holdout)  # raises when it does not fit
        rows = cfg.eval.batches * cfg.train.batch_size
        w = validation_windows(shard, cfg.model.seq_len, cfg.eval.holdout, rows)
        assert w.shape == (rows, cfg.model.seq_len + 1)
