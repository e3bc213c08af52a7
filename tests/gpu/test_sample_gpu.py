"""`andrea-sample` on the CUDA backend: from an fp32 checkpoint, the same prompt and seed give the
same text as the numpy backend (the logits agree to float32 rounding, and top-k sampling with one
generator draws the same tokens unless two probabilities tie within that rounding)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import micro_config_dict, run_engine

pytestmark = [pytest.mark.gpu]


def sample(target: Path, backend: str, seed: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine.run.sample_cli", str(target),
                           "--prompt", "def main(", "--tokens", "40", "--seed", str(seed),
                           "--backend", backend], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def test_fp32_text_is_the_same_on_both_backends(tmp_path: Path, prepared_data: Path) -> None:
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(micro_config_dict(max_steps=20, precision="fp32")))
    run = tmp_path / "run"
    r = run_engine(cfg, run)
    assert r.returncode == 0, r.stdout + r.stderr
    for seed in (0, 1, 2):
        cpu, gpu = sample(run, "numpy", seed), sample(run, "cuda", seed)
        assert cpu.returncode == 0 and gpu.returncode == 0, cpu.stderr + gpu.stderr
        assert "on cuda" in gpu.stderr, gpu.stderr
        assert gpu.stdout == cpu.stdout, (seed, cpu.stdout, gpu.stdout)
