"""Config validation: one test per kind of bad input; each checks the message and exit status 2."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import ConfigError, load_config, parse_config
from engine.model.layout import n_params

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "experiments" / "ANDREA-tiny-TRAIN.json"


def base() -> dict:
    return json.loads(TINY.read_text())


def write(tmp_path: Path, obj: dict | str) -> Path:
    p = tmp_path / "x.json"
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj, indent=2))
    return p


def bad(tmp_path: Path, obj: dict | str) -> str:
    p = write(tmp_path, obj)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: "), msg
    return msg


@pytest.mark.parametrize("name", ["tiny", "12M", "120M", "312M", "1.2B"])
def test_shipped_configs_load(name: str) -> None:
    cfg = load_config(ROOT / "experiments" / f"ANDREA-{name}-TRAIN.json")
    assert cfg.model.vocab_size == 8449
    assert cfg.bandit.phase_lengths == (7, 14, 21, 28, 42)
    assert Path(cfg.data.dir).is_absolute()
    assert cfg.optim.max_grad_norm == 1.0
    # what config.json and checkpoints hold loads back into the same config
    assert parse_config(cfg.to_json(), "again", ROOT) == cfg


@pytest.mark.parametrize("name", ["120M", "312M", "1.2B"])
def test_seed_sources_template(name: str) -> None:
    """A template for a user who has the seed's data: valid but for its paths, which do not exist
    here (data/ is not in the repository), and a missing path is one clear line."""
    path = ROOT / "experiments" / f"ANDREA-{name}-SEED-SOURCES.json"
    raw = json.loads(path.read_text())
    cfg = parse_config(raw, str(path), path.parent, check_paths=False)
    assert [(s.name, s.format) for s in cfg.data.sources] == [
        ("repo-docs", "docs"), ("gutenberg", "gutenberg"), ("hermes3-general", "jsonl")]
    train = load_config(ROOT / "experiments" / f"ANDREA-{name}-TRAIN.json")
    assert (cfg.model, cfg.train.batch_size, cfg.train.grad_accum, cfg.optim, cfg.checkpoint) \
        == (train.model, train.train.batch_size, train.train.grad_accum, train.optim,
            train.checkpoint)
    assert cfg.train.max_steps * cfg.tokens_per_step > 1.6e9  # the seed's 1.6 B tokens
    missing = [s.paths[0] for s in cfg.data.sources if not (path.parent / s.paths[0]).exists()]
    if not missing:
        load_config(path)  # this checkout has the seed's data linked in: it loads
        return
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path}: data.sources[")
    assert "matches no file (looked for " in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name, shape, lr", [
    ("312M", (24, 1024, 16, 4096), 3e-4), ("1.2B", (24, 2048, 32, 8192), 2e-4)])
def test_larger_configs_say_what_they_are_and_what_they_need(name: str, shape, lr) -> None:
    """The larger configs: GPT-2-medium shapes and a d-2048 one, named by their parameter
    count, whose descriptions state the parameters, the tokens a step and a checkpoint's size
    truly; the bf16 plan fits an 80 GB GPU with room for cuDNN and cuBLAS."""
    from engine.backends.cuda.buffers import plan_memory

    cfg = load_config(ROOT / "experiments" / f"ANDREA-{name}-TRAIN.json")
    m, n = cfg.model, n_params(cfg.model)
    assert (m.n_layer, m.d_model, m.n_head, m.d_ff) == shape and cfg.optim.lr == lr
    unit, scale = (1e9, "B") if n >= 1e9 else (1e6, "M")
    assert cfg.name == f"ANDREA-{n / unit:.{1 if scale == 'B' else 0}f}{scale}"
    desc = cfg.description
    assert f"{n:,} parameters" in desc
    assert f"{cfg.tokens_per_step:,} tokens a step" in desc
    assert f"about {n * 12 / 2**30:.1f} GiB" in desc  # fp32 weights, m and v, as engine.log
    keep = cfg.checkpoint.keep
    assert f"up to {n * 12 / 2**30 * (keep + 1):.0f} GiB of disk" in desc
    assert f"keep {cfg.checkpoint.keep} periodic" in desc
    plan, _, _ = plan_memory(m, cfg.train.batch_size, "bf16", attention="cudnn", fused=True,
                             qkv_rows=True, logits_lp=True, grads_lp=True)
    said = re.search(r"memory plan about (\d+) GiB", desc)
    assert said and abs(int(said[1]) - plan.totals()["total"] / 2**30) < 1, plan.totals()
    assert plan.totals()["total"] < 60 * 2**30  # room on an 80 GB GPU for cuDNN and cuBLAS


def test_120m_recipe() -> None:
    cfg = load_config(ROOT / "experiments" / "ANDREA-120M-TRAIN.json")
    assert cfg.optim.lr == 3e-4 and cfg.optim.warmup_steps == 2000
    m = cfg.model
    assert (m.n_layer, m.d_model, m.n_head, m.d_ff) == (12, 768, 12, 3072)


def test_negative_lr(tmp_path: Path) -> None:
    c = base()
    c["optim"]["lr"] = -1
    assert bad(tmp_path, c).endswith("optim.lr: must be > 0, got -1")


def test_unknown_key_is_an_error_with_a_hint(tmp_path: Path) -> None:
    c = base()
    c["optim"]["lerning_rate"] = 0.1
    msg = bad(tmp_path, c)
    assert "optim.lerning_rate: unknown key" in msg
    c = base()
    c["optim"]["warmup_step"] = 5
    assert "did you mean 'warmup_steps'" in bad(tmp_path, c)


def test_unknown_top_level_key(tmp_path: Path) -> None:
    c = base()
    c["modle"] = {}
    assert "modle: unknown key (did you mean 'model'?)" in bad(tmp_path, c)


def test_missing_key(tmp_path: Path) -> None:
    c = base()
    del c["train"]["seed"]
    assert bad(tmp_path, c).endswith("train.seed: missing (required)")


def test_wrong_type(tmp_path: Path) -> None:
    c = base()
    c["model"]["n_layer"] = "4"
    assert bad(tmp_path, c).endswith("model.n_layer: must be an integer, got '4'")
    c = base()
    c["model"]["n_layer"] = True
    assert "model.n_layer: must be an integer" in bad(tmp_path, c)
    c = base()
    c["optim"]["betas"] = [0.9]
    assert "optim.betas: must have at least 2 item(s), got 1" in bad(tmp_path, c)


def test_out_of_range(tmp_path: Path) -> None:
    c = base()
    c["optim"]["betas"] = [0.9, 1.0]
    assert bad(tmp_path, c).endswith("optim.betas[1]: must be < 1, got 1.0")
    c = base()
    c["train"]["precision"] = "fp4"
    assert "train.precision: must be one of fp32, bf16, fp16, fp8; got 'fp4'" in bad(tmp_path, c)


def test_head_must_divide_width(tmp_path: Path) -> None:
    c = base()
    c["model"]["n_head"] = 3
    assert bad(tmp_path, c).endswith("model.n_head: must divide d_model (128), got 3")


def test_vocab_must_match_tokenizer(tmp_path: Path) -> None:
    c = base()
    c["model"]["vocab_size"] = 8000
    assert "model.vocab_size: must equal data.tokenizer.vocab_size (8449), got 8000" in bad(tmp_path, c)


def test_tokenizer_file_of_another_size(tmp_path: Path) -> None:
    c = base()
    c["data"]["dir"] = str(tmp_path)
    vocab = {chr(65 + i): i for i in range(10)}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))
    assert "tokenizer at" in bad(tmp_path, c) and "has 10 ids, config says 8449" in bad(tmp_path, c)


def test_source_path_that_does_not_exist(tmp_path: Path) -> None:
    c = base()
    c["data"]["sources"].append({"name": "mine", "paths": ["nowhere/*.txt"]})
    assert "data.sources[3].paths[0]: 'nowhere/*.txt' matches no file" in bad(tmp_path, c)


def test_source_path_that_exists_is_resolved(tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("hello")
    c = base()
    c["data"]["sources"].append({"name": "mine", "paths": ["corpus"], "format": "text"})
    cfg = load_config(write(tmp_path, c))
    assert cfg.data.sources[3].paths == (str(tmp_path / "corpus"),)


def test_unknown_builtin_and_duplicate_names(tmp_path: Path) -> None:
    c = base()
    c["data"]["sources"][0]["builtin"] = "wikipedia"
    assert "data.sources[0].builtin: must be one of" in bad(tmp_path, c)
    c = base()
    c["data"]["sources"][1]["name"] = c["data"]["sources"][0]["name"]
    assert "data.sources[1].name: duplicate source name" in bad(tmp_path, c)
    c = base()
    c["data"]["sources"][0]["paths"] = ["x"]
    assert "data.sources[0]: needs exactly one of 'builtin' or 'paths'" in bad(tmp_path, c)


def test_bandit_floor_must_leave_room(tmp_path: Path) -> None:
    c = base()
    c["bandit"]["floor"] = 0.4
    assert "bandit.floor: times the number of sources (3) must be < 1, got 0.4" in bad(tmp_path, c)


def test_malformed_json_names_line_and_column(tmp_path: Path) -> None:
    text = json.dumps(base(), indent=2).replace('"n_head": 4,', '"n_head": 4,,')
    msg = bad(tmp_path, text)
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if ",," in ln)
    assert f"line {line} column" in msg and "invalid JSON" in msg


def test_duplicate_json_key(tmp_path: Path) -> None:
    text = json.dumps(base(), indent=2).replace('"n_head": 4,', '"n_head": 4, "n_head": 8,')
    assert "duplicate key 'n_head'" in bad(tmp_path, text)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_top_level_not_an_object(tmp_path: Path) -> None:
    assert bad(tmp_path, "[1, 2]").endswith("must be an object, got list")


def test_loaded_config_is_immutable(tmp_path: Path) -> None:
    a = load_config(TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.optim.lr = 5.0  # type: ignore[misc]
    assert a.with_max_steps(7).train.max_steps == 7 and a.train.max_steps != 7
    assert load_config(TINY) == a


@pytest.mark.parametrize(
    "mutate, expect",
    [
        (lambda c: c["optim"].__setitem__("lr", -1), "optim.lr: must be > 0, got -1"),
        (lambda c: c["optim"].__setitem__("lerning_rate", 1), "optim.lerning_rate: unknown key"),
        (lambda c: c["model"].__setitem__("n_head", 5), "model.n_head: must divide d_model"),
    ],
)
def test_cli_exit_status_2_and_no_traceback(tmp_path: Path, mutate, expect: str) -> None:
    c = base()
    mutate(c)
    p = write(tmp_path, c)
    r = subprocess.run([sys.executable, "-m", "engine.run.cli", str(p)], capture_output=True,
                       text=True, cwd=tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    assert expect in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists()  # nothing was created for a bad config


def test_cli_malformed_json_exit_2(tmp_path: Path) -> None:
    p = write(tmp_path, '{"name": "x",\n  "model": }')
    r = subprocess.run([sys.executable, "-m", "engine.run.cli", str(p)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert f"{p}: line 2 column 12: invalid JSON" in r.stderr
    assert "Traceback" not in r.stderr
