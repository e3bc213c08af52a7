"""scripts/bench-mlp-gemm on the CPU: what it says and returns when it cannot build or run (its
benchmark, scripts/bench_mlp_gemm.cu, needs CUTLASS's headers to build and an SM90 GPU to run;
NOTES.md has its figures). Each test runs a copy of the script in a folder of its own, so a build
in this checkout does not change what it sees."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench-mlp-gemm"


def _run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "scripts").mkdir(exist_ok=True)
    script = tmp_path / "scripts" / SCRIPT.name
    shutil.copy2(SCRIPT, script)
    return subprocess.run([str(script), *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=60)


def test_usage(tmp_path: Path) -> None:
    r = _run(tmp_path)
    assert r.returncode == 2
    assert "usage: scripts/bench-mlp-gemm build|run" in r.stderr
    assert _run(tmp_path, "bench").returncode == 2


def test_run_before_build_says_so(tmp_path: Path) -> None:
    r = _run(tmp_path, "run")
    assert r.returncode == 2
    assert ".bench-mlp-gemm/bench_mlp_gemm not built: scripts/bench-mlp-gemm build" in r.stderr


def test_build_names_a_cutlass_dir_without_headers(tmp_path: Path) -> None:
    empty = tmp_path / "not-cutlass"
    empty.mkdir()
    r = _run(tmp_path, "build", NVCC=shutil.which("true") or "/bin/true", CUTLASS_DIR=str(empty))
    assert r.returncode == 2
    assert f"{empty} has no include/cutlass and tools/util/include/cutlass" in r.stderr
    assert not (tmp_path / ".bench-mlp-gemm").exists()  # nothing written


def test_build_without_nvcc(tmp_path: Path) -> None:
    r = _run(tmp_path, "build", NVCC=str(tmp_path / "no-nvcc"), CUTLASS_DIR=str(tmp_path))
    assert r.returncode == 2
    assert "nvcc not found (set NVCC)" in r.stderr
