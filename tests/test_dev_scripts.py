"""dev/'s benchmarks and probes keep up with the code they measure, and CI compiles their CUDA.

The scripts need GPUs, PyTorch or minutes to run, so on the CPU: every name a script imports from
the project or from dev/'s own modules (at its top or inside a function, and in the inline Python
of scripts/gpu-check and its kin, which run dev/'s benchmarks) still exists, the ones with a command line answer --help,
dev/README.md names every file there, and scripts/nvcc-check hands every .cu file of the
repository to nvcc (through a stand-in nvcc that records its arguments).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEV = ROOT / "dev"
PROJECT = ("engine", "andrea_tui", "tests")
# dev/ is no package: its scripts import each other by name (bench_gpu.py its modules)
DEV_MODULES = frozenset(p.stem for p in DEV.glob("*.py"))


def python_scripts() -> list[Path]:
    return sorted(p for p in DEV.iterdir() if p.is_file() and (
        p.suffix == ".py" or p.read_bytes().startswith(b"#!/usr/bin/env python")))


def ours(module: str) -> bool:
    return module.split(".")[0] in PROJECT or module in DEV_MODULES


def project_imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) of every import from the project or from dev/'s own modules in the script;
    name None for `import m`."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and ours(node.module):
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if ours(a.name)]
    return found


def test_the_scripts_are_found() -> None:
    names = {p.name for p in python_scripts()}
    assert {"bench_gpu.py", "gpu_diag.py", "flex-variants"} <= names, names


def test_the_gpu_benchmarks_modules_are_checked_as_well() -> None:
    """bench_gpu.py's imports of its modules are among those checked, and so are theirs."""
    imported = {module for module, _ in project_imports(DEV / "bench_gpu.py")}
    assert {"bench_groups", "bench_models", "gpu_profile", "gpu_timing", "torch_peer"} <= imported
    assert {"bench_groups.py", "bench_models.py", "gpu_profile.py"} <= \
        {p.name for p in python_scripts()}


@pytest.mark.parametrize("script", python_scripts(), ids=lambda p: p.name)
def test_every_project_name_a_script_imports_exists(script: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(DEV))
    missing = []
    for module, name in project_imports(script):
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{module}: {e}")
            continue
        if name is not None and not hasattr(mod, name) \
                and importlib.util.find_spec(f"{module}.{name}") is None:
            missing.append(f"{module}.{name}")
    assert not missing, f"{script.name} imports what the project no longer has: {missing}"


SHELL_SCRIPTS = ("scripts/gpu-check", "scripts/gpu-health", "scripts/flex-pack")
INLINE_IMPORT = re.compile(r"(?:^|;)\s*from ((?:engine|andrea_tui)[\w.]*) import ([\w, ]+)",
                           re.M)


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_every_project_name_the_gpu_scripts_inline_python_imports_exists(script: str) -> None:
    found = INLINE_IMPORT.findall((ROOT / script).read_text())
    assert found, f"{script}: no inline import from the project found (the pattern is stale)"
    missing = []
    for module, names in found:
        mod = importlib.import_module(module)
        missing += [f"{module}.{n}" for n in (x.strip() for x in names.split(","))
                    if n and not hasattr(mod, n)
                    and importlib.util.find_spec(f"{module}.{n}") is None]
    assert not missing, f"{script} imports what the project no longer has: {missing}"


@pytest.mark.parametrize("script", [p for p in python_scripts() if "argparse" in p.read_text()],
                         ids=lambda p: p.name)
def test_a_script_with_a_command_line_answers_help(script: Path) -> None:
    r = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and r.stdout.startswith("usage:"), r.stderr[-2000:]


def test_the_readme_names_every_file_and_only_files_that_exist() -> None:
    readme = (DEV / "README.md").read_text()
    named = set(re.findall(r"`([\w./-]+)`", readme))
    files = {p.name for p in DEV.iterdir() if p.is_file() and p.name != "README.md"}
    assert files - named == set(), "dev/README.md does not name these"
    sources = {n for n in named if n.endswith((".py", ".cu"))}
    assert {n for n in sources if not (DEV / n).exists() and not (ROOT / n).exists()} == set()


def test_nvcc_check_compiles_every_cu_file(tmp_path: Path) -> None:
    log = tmp_path / "nvcc.log"
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    nvcc.chmod(0o755)
    cutlass = tmp_path / "cutlass"
    for sub in ("include/cutlass", "tools/util/include/cutlass"):
        (cutlass / sub).mkdir(parents=True)
    r = subprocess.run([str(ROOT / "scripts" / "nvcc-check")], cwd=ROOT, capture_output=True,
                       text=True, timeout=120,
                       env={**os.environ, "NVCC": str(nvcc), "CUTLASS_DIR": str(cutlass),
                            "CI": "true"})
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    known = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                            "*.cu"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60).stdout.split()
    every = sorted(f for f in known if (ROOT / f).is_file())
    assert every and any(f.startswith("dev/") for f in every)
    for f in every:
        assert any(c.endswith(" " + f) for c in calls), f"{f} is not compiled"
    cutlass_call = next(c for c in calls if c.endswith("dev/bench_mlp_gemm.cu"))
    assert f"-I{cutlass}/include" in cutlass_call and "-arch=sm_90a" in cutlass_call
