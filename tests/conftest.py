"""Shared fixtures: a prepared built-in dataset and small experiment configs for engine runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# The suite runs engines side by side (pytest-xdist, `make test`). OpenBLAS's worker threads spin
# while they wait, so on a 2-core machine two engines of 2 threads each spend the CPU waiting on
# each other: one thread per process (set before numpy loads; engine processes inherit it).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "experiments" / "ANDREA-tiny-TRAIN.json"
# The built-in data lives where `make run` puts it, so tests and the demo prepare it once.
DATA_DIR = ROOT / "data" / "builtin"


def dev_module(name: str) -> Any:
    """dev/NAME.py as a module (dev/ is no package: its scripts import each other by name)."""
    import importlib

    if str(ROOT / "dev") not in sys.path:
        sys.path.insert(0, str(ROOT / "dev"))
    return importlib.import_module(name)


def tiny_config_dict() -> dict[str, Any]:
    c = json.loads(TINY.read_text())
    c["data"]["dir"] = str(DATA_DIR)
    return c


def micro_config_dict(**train: Any) -> dict[str, Any]:
    """A model small enough for many real-process runs in CI, on the shared built-in data."""
    c = tiny_config_dict()
    c["name"] = "ANDREA-micro"
    c["model"].update(n_layer=2, d_model=64, n_head=2, d_ff=128, seq_len=32)
    c["train"].update({"batch_size": 4, "max_steps": 40, **train})
    c["optim"].update(warmup_steps=5)
    c["bandit"].update(seed=11)  # phases of 7, 7, 28 steps: two boundaries inside 40 steps
    c["checkpoint"].update(every=10, keep=2)
    c["samples"].update(every_steps=15, length=8)
    # No validation: these runs test the engine's mechanics in a few dozen steps, and tests of
    # validation turn it on themselves (the shipped configs have it on: test_shipped_eval.py).
    c.pop("eval", None)
    return c


def as_source(d: dict[str, Any]) -> Any:
    """A data source written as the config's JSON object, as a typed engine.config.SourceConfig."""
    from engine.config import SourceConfig

    return SourceConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


@pytest.fixture(autouse=True)
def user_config_home(tmp_path_factory, monkeypatch) -> Path:
    """Each test's own user config directory: the dashboard's settings (andrea_tui.settings)
    a test changes never reach the developer's, nor another test."""
    home = tmp_path_factory.mktemp("config")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def prepared_data() -> Path:
    """Prepare the built-in tokenizer and shards once (idempotent: skipped when up to date)."""
    from engine.config import parse_config
    from engine.data.prep import prepare

    cfg = parse_config(tiny_config_dict(), "tiny", ROOT)
    prepare(cfg, progress=lambda m: None)
    return DATA_DIR


@pytest.fixture
def write_config(tmp_path: Path, prepared_data: Path) -> Callable[[dict[str, Any]], Path]:
    def write(cfg: dict[str, Any], name: str = "cfg.json") -> Path:
        p = tmp_path / name
        p.write_text(json.dumps(cfg, indent=2))
        return p

    return write



@pytest.fixture
def finished_run(tmp_path: Path, write_config) -> tuple[Path, Path]:
    """A micro run trained to its end (checkpoints at steps 10 and 20): (config, run dir)."""
    cfg = write_config(micro_config_dict(max_steps=20))
    run = tmp_path / "run"
    r = run_engine(cfg, run)
    assert r.returncode == 0, r.stderr
    return cfg, run

def engine_cmd(config: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "engine.run.cli", str(config), "--run-dir", str(run_dir),
            "--backend", "numpy", *extra]


def run_engine(config: Path, run_dir: Path, *extra: str, timeout: float = 300,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(engine_cmd(config, run_dir, *extra), capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def start_engine(config: Path, run_dir: Path, *extra: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(engine_cmd(config, run_dir, *extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def loss_records(run_dir: Path) -> list[Any]:
    """The run's step records (engine.records.StepRecord), one per step."""
    from engine.runfiles import read_steps

    return read_steps(run_dir / "loss.jsonl")[0]


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen[str] | None = None,
                  timeout: float = 120, poll: float = 0.002) -> None:
    """Block until `loss.jsonl` has a record for `step` (reading only the file's new bytes)."""
    from engine.runfiles import JsonlTail

    tail = JsonlTail(run_dir / "loss.jsonl")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in tail.read_new():
            if r.get("step", 0) >= step:
                return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"engine exited {proc.returncode} before step {step}: "
                                 f"{proc.stdout.read() if proc.stdout else ''}")
        time.sleep(poll)
    raise AssertionError(f"no step {step} in {run_dir} after {timeout} s")
