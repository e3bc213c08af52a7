"""scripts/bench-mlp-gemm on the CPU: what it says and returns when it cannot build or run (its
benchmark, scripts/bench_mlp_gemm.cu, needs CUTLASS's headers to build and an SM90 GPU to run;
NOTES.md has its figures). Each test runs a copy of the script in a folder of its own, so a build
in this checkout does not change what it sees."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

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


def _fake_cutlass(tmp_path: Path) -> Path:
    root = tmp_path / "cutlass"
    (root / "include" / "cutlass").mkdir(parents=True)
    (root / "tools" / "util" / "include" / "cutlass").mkdir(parents=True)
    return root


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_a_failed_compile_is_one_line_and_its_log(tmp_path: Path) -> None:
    nvcc = _executable(tmp_path / "fake-nvcc", "#!/bin/sh\necho 'bench_mlp_gemm.cu(1): error: boom' >&2\nexit 3\n")
    r = _run(tmp_path, "build", NVCC=str(nvcc), CUTLASS_DIR=str(_fake_cutlass(tmp_path)))
    assert r.returncode == 1
    assert "error: boom" in r.stderr
    assert r.stderr.strip().endswith("nvcc failed (the whole log: .bench-mlp-gemm/nvcc.log)")
    assert "error: boom" in (tmp_path / ".bench-mlp-gemm" / "nvcc.log").read_text()


def test_build_passes_the_headers_to_nvcc(tmp_path: Path) -> None:
    root = _fake_cutlass(tmp_path)
    nvcc = _executable(tmp_path / "fake-nvcc", '#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\n')
    r = _run(tmp_path, "build", NVCC=str(nvcc), CUTLASS_DIR=str(root))
    assert r.returncode == 0, r.stderr
    args = (tmp_path / "args").read_text().split()
    assert f"-I{root}/include" in args and f"-I{root}/tools/util/include" in args
    assert "-arch=sm_90a" in args and "scripts/bench_mlp_gemm.cu" in args


def test_run_hands_the_binary_the_cublaslt_path(tmp_path: Path) -> None:
    _executable(tmp_path / ".bench-mlp-gemm" / "bench_mlp_gemm", '#!/bin/sh\necho "ran with $1"\n')
    r = _run(tmp_path, "run", CUBLASLT="/some/libcublasLt.so.13")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ran with /some/libcublasLt.so.13"


def test_run_without_cublaslt_says_so(tmp_path: Path) -> None:
    """Nothing found (the standard library folders hold no cuBLASLt on a machine without CUDA's
    math libraries, and the search covers an empty folder and one that does not exist): one line,
    exit 2, where a failing `find` under pipefail used to end the script silently."""
    if any(Path(d, "libcublasLt.so.13").exists() or Path(d, "libcublasLt.so.12").exists()
           for d in ("/usr/local/cuda/lib64", "/usr/local/cuda-13.0/targets/x86_64-linux/lib",
                     "/usr/lib/x86_64-linux-gnu")):
        pytest.skip("this machine has cuBLASLt in a standard folder")
    _executable(tmp_path / ".bench-mlp-gemm" / "bench_mlp_gemm", "#!/bin/sh\necho ran\n")
    env = {k: v for k, v in os.environ.items() if k != "CUBLASLT"}
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "scripts").mkdir(exist_ok=True)
    script = tmp_path / "scripts" / SCRIPT.name
    shutil.copy2(SCRIPT, script)
    r = subprocess.run([str(script), "run"], capture_output=True, text=True, timeout=60,
                       env={**env, "CUBLASLT_SEARCH": f"{empty} {tmp_path / 'missing'}",
                            "PYTHONPATH": "", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2
    assert r.stderr.strip() == "bench-mlp-gemm: libcublasLt not found (set CUBLASLT to its path)"
    assert "ran" not in r.stdout
