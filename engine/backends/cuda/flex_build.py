"""Ahead-of-time build of the flex attention backward into a shared library (no GPU, no torch).

`build_library(cache_dir)` returns the path of a `.so` whose C entry point `ENTRY_SYMBOL` runs
the frontend's SM90 deterministic attention backward (preprocess, main kernel, dQ postprocess;
arguments in flex_build_main.py's docstring, in the order `ARG_NAMES`). It:
1. asks the build interpreter (`python`, default this one; it needs nvidia-cutlass-dsl with the
   libs-cu13 wheel, apache-tvm-ffi and nvidia-cudnn-frontend, all cp312 today) for the packages'
   versions and the run-time libraries' paths, without importing them;
2. on a cache miss, compiles in that interpreter (a subprocess: the build may install a
   stand-in for torch in its `sys.modules`) for sm_90a with symbolic B, T, H and strides, and
   writes an object with `export_to_c`;
3. links it with `g++ -shared` against libcute_dsl_runtime.so and libtvm_ffi.so (with an rpath
   to where they were found), then renames it into place (atomic). g++ is needed only on a miss:
   a cached library (built elsewhere and carried) is returned without it.
The package versions must be TESTED_VERSIONS (the recipe reads the frontend's private modules;
another version is a RunError saying which). The cache key (`cache_key`) is the recipe
(`RECIPE_SHA256`, the sha256 of flex_build_main.py: argument order, constructor arguments
(BWD_CONFIG), fake-tensor specs), the frontend, CuTe DSL,
libs-cu13 and TVM FFI versions, head_dim and dtype. Next to each library a JSON manifest records
them, the argument names, the run-time libraries' paths, the kernels' config (`bwd_config`,
`postprocess`) and the plan's mask words for it (`plan_mask_words`) (`read_manifest`);
flex_call.py refuses a library whose manifest's recipe, argument names or versions differ from
this checkout's. Everything that can fail (an interpreter, a package, g++, the cache directory) is a
RunError saying what.

`build_variant(out_dir, name, overrides)` builds the same library with overrides of the main
kernel's BWD_CONFIG (not cached; its manifest records them) for dev/flex-variants and
dev/bench_flex_configs.py; the engine loads only build_library's.
"""

from __future__ import annotations

import ast
import hashlib
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
LINK_TIMEOUT_S = 300


def _script_constant(name: str) -> object:
    """The literal value of the build script's module-level `name = ...` (read, not imported:
    the script installs stand-ins in sys.modules and must not run in the engine's process)."""
    tree = ast.parse(BUILD_SCRIPT.read_text(), str(BUILD_SCRIPT))
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == name):
            return ast.literal_eval(node.value)
    raise LookupError(f"{BUILD_SCRIPT} has no literal {name}")


# The entry point's parameter names in order, defined once in flex_build_main.py.
ARG_NAMES: tuple[str, ...] = tuple(_script_constant("ARG_NAMES"))  # type: ignore[arg-type]
# The main kernel's constructor arguments the library is built with (overrides: build_variant).
BWD_CONFIG: dict = dict(_script_constant("BWD_CONFIG"))  # type: ignore[call-overload]
# The package versions the recipe was written against and run with on the H200: the build
# script reads the frontend's private kernel modules and the plan (flex_plan.py) follows its
# planner, so any other version is refused (pyproject's `flex` extra pins the same).
TESTED_VERSIONS = {"frontend_version": "1.32.0", "dsl_version": "4.8.1",
                   "tvm_ffi_version": "0.1.15.post2"}


# The build recipe: a changed script is a different library. The file's bytes, not its syntax
# tree: ast.dump differs between Python versions (3.12 added fields), and a library built by
# one interpreter is loaded by another (a pack built here, run by a GPU machine's 3.12).
RECIPE_SHA256 = hashlib.sha256(BUILD_SCRIPT.read_bytes()).hexdigest()


def untested_versions(info: dict) -> str:
    """"" where probe()'s (or a manifest's) package versions are TESTED_VERSIONS; else which
    differ, e.g. "nvidia-cudnn-frontend 1.33.0 (tested: 1.32.0)"."""
    names = {"frontend_version": "nvidia-cudnn-frontend", "dsl_version": "nvidia-cutlass-dsl",
             "tvm_ffi_version": "apache-tvm-ffi"}
    return ", ".join(f"{names[k]} {info.get(k)} (tested: {v})"
                     for k, v in TESTED_VERSIONS.items() if info.get(k) != v)


def _run_build_script(python: str, args: list[str], timeout: float) -> dict:
    """Run the build script's `args` in `python`; its last JSON line as a dict. RunError unless
    the interpreter starts, exits 0 within `timeout` seconds and printed a JSON line without
    an "error" key."""
    try:
        r = subprocess.run([python, str(BUILD_SCRIPT), *args], capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
    except OSError as e:  # missing, not executable, not an executable format
        raise RunError(f"flex attention build: cannot run the interpreter {python!r} "
                       f"({type(e).__name__}: {e.strerror or e})") from None
    except subprocess.TimeoutExpired:
        raise RunError(f"flex attention build: {args[0]} ran past {timeout:.0f} s") from None
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    out: dict | None = None
    if lines:
        try:
            parsed = json.loads(lines[-1])
            out = parsed if isinstance(parsed, dict) else None
        except json.JSONDecodeError:
            out = None
    if out is not None and "error" in out:
        raise RunError(f"flex attention build ({python}): {out['error']}")
    if out is None or r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise RunError(f"flex attention build: {args[0]} with {python} failed "
                       f"(exit {r.returncode}): {' | '.join(tail) or 'no output'}")
    return out


def probe(python: str | None = None) -> dict:
    """Versions of the frontend, CuTe DSL, libs-cu13 and TVM FFI and the run-time libraries'
    paths, as the build interpreter sees them. RunError when one is missing."""
    return _run_build_script(python or sys.executable, ["probe"], timeout=120)


def cache_key(info: dict, head_dim: int, dtype: str) -> str:
    """The file stem of the cached library for the probed `info` (package versions), head_dim
    and dtype: it changes with any of them and with the recipe (RECIPE_SHA256's first 16 hex
    digits). Only [A-Za-z0-9._-]."""
    key = (f"{ENTRY_NAME}-{dtype}-hd{head_dim}-fe{info['frontend_version']}"
           f"-dsl{info['dsl_version']}-cu13{info.get('libs_cu13_version')}"
           f"-tvmffi{info['tvm_ffi_version']}-r{RECIPE_SHA256[:16]}")
    return re.sub(r"[^A-Za-z0-9._-]", "_", key)


def read_manifest(library: Path) -> dict:
    """The manifest written next to a built library (versions, recipe, argument names, run-time
    library paths). RunError when it is missing or not a JSON object."""
    path = Path(library).with_suffix(".json")
    try:
        m = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RunError(f"flex attention: no readable manifest {path} ({e})") from None
    if not isinstance(m, dict):
        raise RunError(f"flex attention: the manifest {path} is not a JSON object")
    return m


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _link(obj: Path, so: Path, info: dict) -> None:
    """g++ -shared `obj` into `so` against the run-time libraries; RunError on any failure."""
    gxx = shutil.which("g++")
    if gxx is None:
        raise RunError("flex attention build: g++ not found on PATH (it links the kernels' object "
                       "into a shared library; install g++)")
    libdirs = sorted({str(Path(info["runtime_lib"]).parent), str(Path(info["tvm_ffi_lib"]).parent)})
    cmd = [gxx, "-shared", "-o", str(so), str(obj)]
    cmd += [f"-L{d}" for d in libdirs] + ["-lcute_dsl_runtime", "-ltvm_ffi"]
    cmd += [f"-Wl,-rpath,{d}" for d in libdirs]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=LINK_TIMEOUT_S,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RunError(f"flex attention build: linking ran past {LINK_TIMEOUT_S} s") from None
    except OSError as e:
        raise RunError(f"flex attention build: cannot run {gxx} ({e})") from None
    if r.returncode != 0:
        raise RunError(f"flex attention build: linking failed: {r.stderr.strip()[-500:]}")


def build_library(cache_dir: Path | str, *, python: str | None = None, head_dim: int = 64,
                  dtype: str = "bf16") -> Path:
    """The cached `.so` for (recipe, package versions, head_dim, dtype); built on a miss (which
    needs g++). RunError for anything that fails, including a cache directory that cannot be
    created. `build` also says whether it compiled."""
    return build(cache_dir, python=python, head_dim=head_dim, dtype=dtype)[0]


def _prepare(out_dir: Path | str, python: str | None, info: dict | None, head_dim: int,
             dtype: str) -> tuple[str, dict, Path]:
    """What every build starts with: head_dim and dtype checked, the interpreter probed (unless
    `info` is its answer) for TESTED_VERSIONS, `out_dir` created. (python, info, out_dir);
    RunError for any of them."""
    if head_dim != 64 or dtype not in ("bf16", "fp16"):
        raise RunError(f"flex attention build: only head_dim 64 in bf16 or fp16, got "
                       f"head_dim={head_dim}, dtype={dtype!r}")
    python = python or sys.executable
    info = info or probe(python)
    untested = untested_versions(info)
    if untested:
        raise RunError(f"flex attention build ({python}): {untested}: pip install the tested "
                       f"versions (pip install 'andrea[flex]')")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunError(f"flex attention build: cannot create the directory {out} ({e})") from None
    return python, info, out


def build(cache_dir: Path | str, *, python: str | None = None, head_dim: int = 64,
          dtype: str = "bf16") -> tuple[Path, bool]:
    """build_library's library, and whether this call compiled it (False: a cache hit)."""
    python, info, cache = _prepare(cache_dir, python, None, head_dim, dtype)
    key = cache_key(info, head_dim, dtype)
    lib, manifest = cache / f"{key}.so", cache / f"{key}.json"
    if lib.is_file() and manifest.is_file():
        return lib, False
    try:
        out = _compile_and_link(python, info, lib, head_dim, dtype)
        _write_atomic(manifest, (json.dumps(_record(info, out, head_dim, dtype), indent=1)
                                 + "\n").encode())
    except OSError as e:  # a read-only or full cache directory
        raise RunError(f"flex attention build: cannot write into {cache} ({e})") from None
    return lib, True


def _compile_and_link(python: str, info: dict, lib: Path, head_dim: int, dtype: str,
                      overrides: dict | None = None) -> dict:
    """Compile in `python` (with `overrides` of BWD_CONFIG, passed as the script's sixth
    argument, when given) and link into `lib` (built in a temporary directory beside it, then
    renamed into place); the build script's output. RunError for any failure."""
    with tempfile.TemporaryDirectory(dir=lib.parent, prefix=f".{lib.stem}.") as tmp:
        obj, so = Path(tmp) / "flex_bwd.o", Path(tmp) / "flex_bwd.so"
        args = ["compile", str(obj), ENTRY_NAME, str(head_dim), dtype]
        if overrides is not None:
            args.append(json.dumps(overrides))
        out = _run_build_script(python, args, timeout=BUILD_TIMEOUT_S)
        if out.get("arg_names") != list(ARG_NAMES):
            raise RunError(f"flex attention build: the script compiled the arguments "
                           f"{out.get('arg_names')}, expected {list(ARG_NAMES)}")
        _link(obj, so, info)
        os.replace(so, lib)
    return out


def _record(info: dict, out: dict, head_dim: int, dtype: str) -> dict:
    """The manifest of a library built with `out` (the build script's output)."""
    return {**info, "head_dim": head_dim, "dtype": dtype, "entry_symbol": ENTRY_SYMBOL,
            "recipe_sha256": RECIPE_SHA256, "arg_names": list(ARG_NAMES),
            "torch": out.get("torch"), "compile_s": out.get("compile_s"),
            "bwd_config": out.get("bwd_config"), "postprocess": out.get("postprocess"),
            "plan_mask_words": out.get("plan_mask_words")}


VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def build_variant(out_dir: Path | str, name: str, overrides: dict, *, python: str | None = None,
                  info: dict | None = None, head_dim: int = 64, dtype: str = "bf16") -> Path:
    """Build the library with `overrides` of BWD_CONFIG into `out_dir/<name>.so`, its manifest
    `<name>.json` beside it (build_library's keys, plus `variant` and `overrides`; the recipe
    is this checkout's, so FlexBackward loads it). Not cached: always compiled (g++ needed).
    `info`: probe()'s answer, when the caller has it. For dev/bench_flex_configs.py, never
    for the engine: the plan (flex_plan.py) fits BWD_CONFIG as it is (flex_build_main.py says
    which entries change it). RunError for a bad name, a refused override (the build script's
    error: an unknown key, a wrong type, tile_m or tile_n, a kernel's assert) or any failure."""
    if not isinstance(name, str) or not VARIANT_NAME.fullmatch(name):
        raise RunError(f"flex attention variant: the name {name!r} is not [A-Za-z0-9._-] "
                       f"(at most 64, not starting with . - _)")
    if not isinstance(overrides, dict):
        raise RunError(f"flex attention variant {name}: overrides must be a dict, got "
                       f"{type(overrides).__name__}")
    python, info, out_dir = _prepare(out_dir, python, info, head_dim, dtype)
    lib, manifest = out_dir / f"{name}.so", out_dir / f"{name}.json"
    try:
        for stale in (lib, manifest):  # a failed build leaves neither behind
            stale.unlink(missing_ok=True)
        out = _compile_and_link(python, info, lib, head_dim, dtype, overrides)
        record = {**_record(info, out, head_dim, dtype), "variant": name,
                  "overrides": out.get("overrides", overrides)}
        _write_atomic(manifest, (json.dumps(record, indent=1) + "\n").encode())
    except OSError as e:
        raise RunError(f"flex attention variant {name}: cannot write into {out_dir} ({e})") from None
    return lib
