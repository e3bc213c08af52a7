"""Ahead-of-time build of the flex attention backward into a shared library (no GPU, no torch).

`build_library(cache_dir)` returns the path of a `.so` whose C entry point `ENTRY_SYMBOL` runs
the frontend's SM90 deterministic attention backward (preprocess, main kernel, dQ postprocess;
arguments in flex_build_main.py's docstring). It:
1. asks the build interpreter (`python`, default this one; it needs nvidia-cutlass-dsl with the
   libs-cu13 wheel, apache-tvm-ffi and nvidia-cudnn-frontend, all cp312 today) for the packages'
   versions and the run-time libraries' paths, without importing them;
2. on a cache miss, compiles in that interpreter (a subprocess: the build installs a stand-in
   for torch in its `sys.modules`) for sm_90a with symbolic B, T, H and strides, and writes an
   object with `export_to_c`;
3. links it with `g++ -shared` against libcute_dsl_runtime.so and libtvm_ffi.so (with an rpath
   to where they were found), then renames it into place (atomic).
The cache key is (frontend, CuTe DSL and TVM FFI versions, head_dim, dtype); next to each
library a JSON manifest records the versions and the run-time libraries' paths
(`read_manifest`). Everything that can be missing (an interpreter, a package, g++) is a
RunError that says what to install.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.errors import RunError

ENTRY_NAME = "flex_bwd_sm90_d64"
ENTRY_SYMBOL = "__tvm_ffi_" + ENTRY_NAME
BUILD_SCRIPT = Path(__file__).resolve().parent / "flex_build_main.py"
BUILD_TIMEOUT_S = 900


def _run_build_script(python: str, args: list[str], timeout: float) -> dict:
    try:
        r = subprocess.run([python, str(BUILD_SCRIPT), *args], capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise RunError(f"flex attention build: no interpreter {python!r}") from None
    except subprocess.TimeoutExpired:
        raise RunError(f"flex attention build: {args[0]} ran past {timeout:.0f} s") from None
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    try:
        out = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise RunError(f"flex attention build: {args[0]} with {python} failed "
                       f"(exit {r.returncode}): {' | '.join(tail) or 'no output'}") from None
    if "error" in out:
        raise RunError(f"flex attention build ({python}): {out['error']}")
    return out


def probe(python: str | None = None) -> dict:
    """Versions of the frontend, CuTe DSL and TVM FFI and the run-time libraries' paths, as the
    build interpreter sees them. RunError when one is missing."""
    return _run_build_script(python or sys.executable, ["probe"], timeout=120)


def cache_key(info: dict, head_dim: int, dtype: str) -> str:
    key = (f"{ENTRY_NAME}-{dtype}-hd{head_dim}-fe{info['frontend_version']}"
           f"-dsl{info['dsl_version']}-tvmffi{info['tvm_ffi_version']}")
    return re.sub(r"[^A-Za-z0-9._-]", "_", key)


def read_manifest(library: Path) -> dict:
    """The manifest written next to a built library (versions, run-time library paths)."""
    path = Path(library).with_suffix(".json")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RunError(f"flex attention: no readable manifest {path} ({e})") from None


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def build_library(cache_dir: Path | str, *, python: str | None = None, head_dim: int = 64,
                  dtype: str = "bf16") -> Path:
    """The cached `.so` for (head_dim, dtype) and the installed package versions; built on a miss."""
    if head_dim != 64 or dtype not in ("bf16", "fp16"):
        raise RunError(f"flex attention build: only head_dim 64 in bf16 or fp16, got "
                       f"head_dim={head_dim}, dtype={dtype!r}")
    python = python or sys.executable
    gxx = shutil.which("g++")
    if gxx is None:
        raise RunError("flex attention build: g++ not found on PATH (it links the kernels' object "
                       "into a shared library; install g++)")
    info = probe(python)
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    key = cache_key(info, head_dim, dtype)
    lib, manifest = cache / f"{key}.so", cache / f"{key}.json"
    if lib.is_file() and manifest.is_file():
        return lib
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".{key}.") as tmp:
        obj, so = Path(tmp) / "flex_bwd.o", Path(tmp) / "flex_bwd.so"
        out = _run_build_script(python, ["compile", str(obj), ENTRY_NAME, str(head_dim), dtype],
                                timeout=BUILD_TIMEOUT_S)
        libdirs = sorted({str(Path(info["runtime_lib"]).parent), str(Path(info["tvm_ffi_lib"]).parent)})
        cmd = [gxx, "-shared", "-o", str(so), str(obj)]
        cmd += [f"-L{d}" for d in libdirs] + ["-lcute_dsl_runtime", "-ltvm_ffi"]
        cmd += [f"-Wl,-rpath,{d}" for d in libdirs]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                           stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise RunError(f"flex attention build: linking failed: {r.stderr.strip()[-500:]}")
        os.replace(so, lib)
    record = {**info, "head_dim": head_dim, "dtype": dtype, "entry_symbol": ENTRY_SYMBOL,
              "compile_s": out.get("compile_s")}
    _write_atomic(manifest, (json.dumps(record, indent=1) + "\n").encode())
    return lib
