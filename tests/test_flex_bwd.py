"""The flex attention backward's torch-free path, on the CPU: plan, build, ctypes call.

The plan tests need only numpy and run everywhere. The others need a build interpreter with
nvidia-cutlass-dsl (+ libs-cu13), apache-tvm-ffi and nvidia-cudnn-frontend (cp312 wheels) and
g++: `ANDREA_FLEX_PYTHON`, else this interpreter; without them they skip, saying why (CI's
Python 3.11 has none of them). No GPU is used: the call test passes fake device pointers and
expects the CUDA runtime's no-driver error, so it skips where a GPU is present.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.backends.cuda import flex_build, flex_libs
from engine.backends.cuda.flex_plan import (
    FIELDS,
    causal_plan,
    diagonal_mask_words,
    fragment_coords,
)
from engine.errors import RunError, UserError

SHAPES = [(8, 1024), (2, 384), (3, 128)]


# ---- the plan (numpy only) -------------------------------------------------------------------
def _dense_reference(B: int, T: int) -> tuple[list[list[int]], list[list[int]], dict]:
    """From the element-wise causal mask (key <= query over T x T), independently of the plan's
    formulas: per plan row (b, key block n), its partial query blocks and its full ones
    (ascending), and the dQ rank of each (n, m) with spt: the number of key blocks n' > n that
    also contribute to query block m (the count of earlier contributors, reversed)."""
    nb = T // 128
    visible = np.arange(T)[:, None] <= np.arange(T)[None, :]  # [key, query]
    tiles = visible.reshape(nb, 128, nb, 128).transpose(0, 2, 1, 3)  # [n, m, 128, 128]
    full = tiles.all(axis=(2, 3))
    some = tiles.any(axis=(2, 3))
    partial, fulls = [], []
    for _ in range(B):  # every sequence has the same mask
        for n in range(nb):
            partial.append([m for m in range(nb) if some[n, m] and not full[n, m]])
            fulls.append([m for m in range(nb) if full[n, m]])
    rank = {(n, m): sum(1 for k in range(n + 1, nb) if some[k, m])
            for n in range(nb) for m in range(nb) if some[n, m]}
    return partial, fulls, rank


@pytest.mark.parametrize(("B", "T"), SHAPES)
def test_plan_matches_the_dense_causal_mask(B: int, T: int) -> None:
    p = causal_plan(B, T)
    nb, rows = T // 128, B * (T // 128)
    partial, fulls, rank = _dense_reference(B, T)
    for name, a in p.arrays():
        assert a.flags.c_contiguous, name
        assert a.dtype == (np.uint32 if name == "masks" else np.int32), name
    assert p.cnt.shape == p.fcnt.shape == (1, rows)
    assert list(p.cnt[0]) == [len(x) for x in partial]
    assert list(p.fcnt[0]) == [len(x) for x in fulls]
    # offsets: where each row's entries start (exclusive prefix sums of the counts)
    assert list(p.off) == [sum(len(x) for x in partial[:r]) for r in range(rows + 1)]
    assert list(p.foff) == [sum(len(x) for x in fulls[:r]) for r in range(rows + 1)]
    assert p.masks.shape == (p.idx.size, 1, 256, 2)
    for r in range(rows):
        n = r % nb
        got_partial = list(p.idx[p.off[r]:p.off[r + 1]])
        got_full = list(p.fidx[p.foff[r]:p.foff[r + 1]])
        assert got_partial == partial[r] and got_full == fulls[r], r
        assert list(p.order[p.off[r]:p.off[r + 1]]) == [rank[n, m] for m in got_partial]
        assert list(p.forder[p.foff[r]:p.foff[r + 1]]) == [rank[n, m] for m in got_full]
    # every query block m gets each rank 0..m exactly once (a total order of its dQ adds)
    for b in range(B):
        for m in range(nb):
            ranks = [0] + [int(p.forder[p.foff[b * nb + k] + (m - k - 1)]) for k in range(m)]
            assert sorted(ranks) == list(range(m + 1))


def test_diagonal_mask_is_the_causal_triangle() -> None:
    key, query = fragment_coords()
    # each (key, query) of the 128x128 tile appears exactly once over threads and values
    cells = key * 128 + query
    assert np.unique(cells).size == 128 * 128 and cells.min() == 0 and cells.max() == 128 * 128 - 1
    # decode the plan's words (bit v % 32 of word v // 32) into a dense tile
    words = causal_plan(1, 256).masks[0, 0]  # [256, 2], every diagonal block's
    v = np.arange(64)
    bits = (words[:, v // 32] >> (v % 32).astype(np.uint32)) & 1  # [256, 64]
    dense = np.zeros((128, 128), np.int64)
    dense[key, query] = bits
    assert (dense == np.tril(np.ones((128, 128), np.int64)).T).all()  # key <= query
    assert (causal_plan(2, 384).masks == words).all()  # the same for every diagonal block


@pytest.mark.parametrize("T", [100, 129, 1000, 0])
def test_plan_refuses_t_not_a_multiple_of_128(T: int) -> None:
    with pytest.raises(UserError, match=r"T must be a multiple of 128|must be positive"):
        causal_plan(2, T)


def test_plan_refuses_other_head_dims() -> None:
    with pytest.raises(UserError, match="head_dim must be 64"):
        causal_plan(2, 256, head_dim=128)


# ---- the build's failure paths (no build interpreter) ----------------------------------------
FAKE_INFO = {"frontend_version": "1.32.0", "dsl_version": "4.8.1", "libs_cu13_version": "4.8.1",
             "tvm_ffi_version": "0.1.15.post2", "runtime_lib": "/nowhere/libcute_dsl_runtime.so",
             "tvm_ffi_lib": "/nowhere/libtvm_ffi.so"}


def _fake_interpreter(tmp_path: Path, body: str, mode: int = 0o755) -> str:
    path = tmp_path / "fake-python"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(mode)
    return str(path)


def test_build_script_runs_a_good_interpreter(tmp_path: Path) -> None:
    python = _fake_interpreter(tmp_path, "echo noise; echo '{\"a\": 1}'")
    assert flex_build._run_build_script(python, ["probe"], timeout=10) == {"a": 1}


@pytest.mark.parametrize(("body", "mode", "message"), [
    ("echo '{}'", 0o644, "cannot run the interpreter"),  # not executable: PermissionError
    ("echo '{\"a\": 1}'; exit 1", 0o755, r"failed \(exit 1\)"),  # JSON, but a failing exit
    ("echo '{\"error\": \"LookupError: x\"}'; exit 3", 0o755, "LookupError: x"),
    ("echo oops >&2", 0o755, r"failed \(exit 0\): oops"),  # no JSON line
    ("echo '[1]'", 0o755, r"failed \(exit 0\)"),  # JSON, not an object
])
def test_build_script_failures_are_run_errors(tmp_path: Path, body: str, mode: int,
                                              message: str) -> None:
    with pytest.raises(RunError, match=message):
        flex_build._run_build_script(_fake_interpreter(tmp_path, body, mode), ["probe"], timeout=10)


def test_build_script_without_an_interpreter_is_a_run_error(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="cannot run the interpreter"):
        flex_build._run_build_script(str(tmp_path / "none"), ["probe"], timeout=10)


def test_build_script_past_its_timeout_is_a_run_error(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="ran past 1 s"):
        flex_build._run_build_script(_fake_interpreter(tmp_path, "sleep 5"), ["probe"], timeout=1)


def _fake_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flex_build, "probe", lambda python=None: dict(FAKE_INFO))


def test_a_cache_hit_needs_no_gxx(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_probe(monkeypatch)
    monkeypatch.setattr(flex_build.shutil, "which", lambda name: None)
    key = flex_build.cache_key(FAKE_INFO, 64, "bf16")
    (tmp_path / f"{key}.so").write_bytes(b"carried")
    (tmp_path / f"{key}.json").write_text("{}")
    assert flex_build.build_library(tmp_path) == tmp_path / f"{key}.so"


@pytest.mark.parametrize(("changes", "said"), [
    ({"frontend_version": "1.33.0"}, r"nvidia-cudnn-frontend 1\.33\.0 \(tested: 1\.32\.0\)"),
    ({"dsl_version": "4.9.0", "tvm_ffi_version": "0.2"},
     r"nvidia-cutlass-dsl 4\.9\.0 \(tested: 4\.8\.1\), apache-tvm-ffi 0\.2 "),
])
def test_untested_package_versions_are_refused_before_a_build(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, changes: dict, said: str) -> None:
    """The recipe reads the frontend's private kernel modules and the plan follows its planner:
    another version is refused (even with a library in the cache), never built and run."""
    monkeypatch.setattr(flex_build, "probe", lambda python=None: {**FAKE_INFO, **changes})
    monkeypatch.setattr(flex_build, "_compile_and_link", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(RunError, match=said + r".*andrea\[flex\]"):
        flex_build.build_library(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_cache_that_cannot_be_written_is_a_run_error(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    """A read-only or full cache directory that exists: a RunError (the backend then runs
    cuDNN's backward), not an OSError's traceback at start-up."""
    _fake_probe(monkeypatch)

    def no_space(*a: object, **k: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(flex_build.tempfile, "TemporaryDirectory", no_space)
    with pytest.raises(RunError, match=r"cannot write into .*No space left on device"):
        flex_build.build_library(tmp_path)


def test_a_cache_miss_without_gxx_is_a_run_error(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    _fake_probe(monkeypatch)
    monkeypatch.setattr(flex_build, "_run_build_script",
                        lambda python, args, timeout: {"arg_names": list(flex_build.ARG_NAMES)})
    monkeypatch.setattr(flex_build.shutil, "which", lambda name: None)
    with pytest.raises(RunError, match="g\\+\\+ not found"):
        flex_build.build_library(tmp_path)
    assert list(tmp_path.iterdir()) == []  # its temporary directory removed


def test_a_build_with_other_argument_names_is_a_run_error(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    _fake_probe(monkeypatch)
    swapped = list(flex_build.ARG_NAMES)
    swapped[9], swapped[10] = swapped[10], swapped[9]  # mLSE2 <-> mdPsum
    monkeypatch.setattr(flex_build, "_run_build_script",
                        lambda python, args, timeout: {"arg_names": swapped})
    with pytest.raises(RunError, match="compiled the arguments"):
        flex_build.build_library(tmp_path)


def test_linking_past_its_timeout_is_a_run_error(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    def hang(cmd: list[str], **kw: object) -> None:
        raise subprocess.TimeoutExpired(cmd, 300)

    monkeypatch.setattr(flex_build.shutil, "which", lambda name: "/usr/bin/g++")
    monkeypatch.setattr(flex_build.subprocess, "run", hang)
    with pytest.raises(RunError, match="linking ran past 300 s"):
        flex_build._link(tmp_path / "a.o", tmp_path / "a.so", FAKE_INFO)


def test_an_unusable_cache_dir_is_a_run_error(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    _fake_probe(monkeypatch)
    (tmp_path / "file").write_text("")
    with pytest.raises(RunError, match="cannot create the directory"):
        flex_build.build_library(tmp_path / "file" / "cache")


def test_the_cache_key_follows_the_recipe_and_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    key = flex_build.cache_key(FAKE_INFO, 64, "bf16")
    assert flex_build.cache_key({**FAKE_INFO, "libs_cu13_version": "4.9"}, 64, "bf16") != key
    assert flex_build.cache_key(FAKE_INFO, 64, "fp16") != key
    monkeypatch.setattr(flex_build, "RECIPE_SHA256", "0" * 64)
    assert flex_build.cache_key(FAKE_INFO, 64, "bf16") != key


def test_the_flex_extra_pins_the_tested_versions() -> None:
    """pyproject's `flex` extra installs what TESTED_VERSIONS accepts (one without the other
    would install versions every build then refuses)."""
    import tomllib

    root = Path(flex_build.__file__).parents[3]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["flex"]
    pins = dict(req.split("==") for req in extra if "==" in req)
    names = {"nvidia-cudnn-frontend": "frontend_version", "nvidia-cutlass-dsl[cu13]": "dsl_version",
             "apache-tvm-ffi": "tvm_ffi_version"}
    assert {names[k]: v for k, v in pins.items()} == flex_build.TESTED_VERSIONS


def test_the_recipe_hash_is_the_build_scripts() -> None:
    script = flex_build.BUILD_SCRIPT.read_bytes()
    assert flex_build.RECIPE_SHA256 == hashlib.sha256(script).hexdigest()
    # ARG_NAMES is read from the script's source: every name once, the plan's in FIELDS' order
    names = flex_build.ARG_NAMES
    assert len(set(names)) == len(names) == 24 and names[-2:] == ("scale", "seqlen")
    assert [n for n in names if n in FIELDS] == list(FIELDS)


TORCH_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
import flex_build_main as fb
print(fb.prepare_torch(), getattr(sys.modules["torch"], "MARKER", "none"))
"""


def test_the_build_uses_a_real_torch_and_never_shadows_it(tmp_path: Path) -> None:
    """With a torch importable (here a fake package), the build script's `prepare_torch` leaves
    it in place; without one it installs the stand-in."""
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("MARKER = 'real'\n__version__ = '9.9'\n")
    script = str(flex_build.BUILD_SCRIPT.parent)

    def run(pythonpath: str) -> str:
        env = {**os.environ, "PYTHONPATH": pythonpath}
        r = subprocess.run([sys.executable, "-c", TORCH_PROBE, script], capture_output=True,
                           text=True, env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    assert run(str(tmp_path / "site")) == "torch 9.9 real"
    if importlib.util.find_spec("torch") is None:
        assert run("") == "stand-in none"


# ---- the call's failure paths (no build interpreter) -----------------------------------------
def _manifest(tmp_path: Path, **changes: object) -> Path:
    record = {"entry_symbol": flex_build.ENTRY_SYMBOL, "recipe_sha256": flex_build.RECIPE_SHA256,
              "arg_names": list(flex_build.ARG_NAMES), "dtype": "bf16", "head_dim": 64,
              **flex_build.TESTED_VERSIONS, "tvm_ffi_lib": str(tmp_path / "libtvm_ffi.so"),
              "runtime_lib": str(tmp_path / "libcute_dsl_runtime.so")}
    record.update(changes)
    record = {k: v for k, v in record.items() if v is not None}
    (tmp_path / "flex.json").write_text(json.dumps(record))
    return tmp_path / "flex.so"


@pytest.mark.parametrize(("changes", "message"), [
    ({"recipe_sha256": None, "arg_names": None}, "lacks recipe_sha256, arg_names"),
    ({"runtime_lib": None}, "lacks runtime_lib"),
    ({"recipe_sha256": "f" * 64}, "built from another flex_build_main.py"),
    ({"arg_names": ["mK", "mQ"]}, r"takes the arguments \['mK', 'mQ'\]"),
    ({"dtype": "fp16"}, "is for fp16 head_dim 64, asked for bf16"),
    ({"frontend_version": "1.33.0"}, r"built with nvidia-cudnn-frontend 1\.33\.0 \(tested: "
                                     r"1\.32\.0\): rebuild it"),
    ({"variant": "spt_off", "overrides": {"spt": False}},
     r"is a config variant \(spt_off: \{'spt': False\}\).*its plan may differ"),
])
def test_a_mismatched_manifest_is_refused(tmp_path: Path, changes: dict, message: str) -> None:
    from engine.backends.cuda.flex_call import FlexBackward

    with pytest.raises(RunError, match=message):
        FlexBackward(_manifest(tmp_path, **changes), 2, 256, 6)


def test_a_variant_is_taken_only_where_its_caller_adapts_the_plan(tmp_path: Path) -> None:
    from engine.backends.cuda.flex_call import FlexBackward

    library = _manifest(tmp_path, variant="spt_off", overrides={"spt": False})
    # past the manifest's checks: the next failure is the first library's load
    with pytest.raises(RunError, match=r"cannot load libtvm_ffi\.so"):
        FlexBackward(library, 2, 256, 6, zero_dq_sem=False, variant_ok=True)


def test_call_refuses_bad_shapes_before_loading() -> None:
    from engine.backends.cuda.flex_call import FlexBackward

    with pytest.raises(UserError, match="multiple of 128"):
        FlexBackward("/nonexistent/flex.so", 2, 200, 6)
    with pytest.raises(UserError, match="heads must be positive"):
        FlexBackward("/nonexistent/flex.so", 2, 256, 0)


def test_call_without_its_libraries_is_a_run_error(tmp_path: Path) -> None:
    from engine.backends.cuda.flex_call import FlexBackward

    with pytest.raises(RunError, match="no readable manifest"):
        FlexBackward(tmp_path / "flex.so", 2, 256, 6)
    library = _manifest(tmp_path)
    with pytest.raises(RunError, match=r"cannot load libtvm_ffi\.so from .*libtvm_ffi\.so"):
        FlexBackward(library, 2, 256, 6, zero_dq_sem=False)
    with pytest.raises(RunError, match=r"cannot load the CUDA driver \(libcuda"):
        FlexBackward(library, 2, 256, 6, libcuda=str(tmp_path / "libcuda.so.1"))


def test_a_missing_symbol_is_a_run_error_naming_the_library() -> None:
    libc = flex_libs.load("libc.so.6", "the C library")
    assert flex_libs.symbol(libc, "strlen", "the C library", [ctypes.c_char_p],
                            ctypes.c_size_t)(b"abc") == 3
    with pytest.raises(RunError, match=r"the C library \(libc.so.6\) has no symbol TVMFFIEnvSetStream"):
        flex_libs.symbol(libc, "TVMFFIEnvSetStream", "the C library", [], ctypes.c_int)


def test_a_failed_memset_is_a_run_error() -> None:
    calls: list[tuple] = []
    m = flex_libs.DriverMemset.__new__(flex_libs.DriverMemset)
    m._memset = lambda *a: calls.append(a) or (0 if len(calls) == 1 else 201)
    m._name = lambda rc, out: 0
    m.zero_i32(0x7F0000000000, 96, 0x1234)
    (ptr, value, count, stream), = calls
    assert (ptr, value, count, stream.value) == (0x7F0000000000, 0, 96, 0x1234)
    with pytest.raises(RunError, match=r"zeroing dq_sem \(cuMemsetD32Async\) failed: unknown \(201\)"):
        m.zero_i32(0x7F0000000000, 96, 0x1234)


# ---- with the CuTe DSL (a build interpreter) -------------------------------------------------
def _probe(python: str) -> dict | None:
    try:
        return flex_build.probe(python)
    except RunError:
        return None


def _flex_python() -> tuple[str | None, str]:
    candidates = [p for p in (os.environ.get("ANDREA_FLEX_PYTHON"), sys.executable) if p]
    for python in candidates:
        if _probe(python) is not None:
            return python, ""
    return None, (f"no build interpreter with nvidia-cutlass-dsl, apache-tvm-ffi and "
                  f"nvidia-cudnn-frontend (tried {', '.join(candidates)}; set ANDREA_FLEX_PYTHON)")


@pytest.fixture(scope="module")
def flex_python() -> str:
    python, why = _flex_python()
    if python is None:
        pytest.skip(why)
    return python


@pytest.fixture(scope="module")
def library(flex_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    return flex_build.build_library(tmp_path_factory.mktemp("flexlib"), python=flex_python)


PARTITION_PROBE = r"""
import os, sys
from pathlib import Path
sys.path.insert(0, str(Path(sys.argv[1]).parent))
import flex_build_main as fb
info = fb.probe()
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
import cutlass, cutlass.cute as cute, tvm_ffi
fb.install_stand_ins(Path(info["cudnn_dir"]))
import numpy as np
from cudnn.flex_attention.kernels.sm90.bwd.backward_config import make_sm90_bwd_tiled_mma_sdp
OUT = np.zeros((256, 64, 2), np.int64)
@cute.jit
def probe():
    mma = make_sm90_bwd_tiled_mma_sdp(cutlass.BFloat16, 128, 128, True)  # SdP_swapAB: (k, q)
    cS = cute.make_identity_tensor((128, 128))
    for t in cutlass.range_constexpr(256):
        tScS = mma.get_slice(t).partition_C(cS)
        for i in cutlass.range_constexpr(64):
            c = tScS[i]
            OUT[t, i, 0] = c[0]
            OUT[t, i, 1] = c[1]
cute.compile(probe)
np.save(sys.argv[2], OUT)
"""


@pytest.mark.slow
def test_plan_masks_match_the_dsl_partition_map(flex_python: str, tmp_path: Path) -> None:
    """The kernel's own MMA partition (as the DSL computes it) gives the numpy plan's masks."""
    out, script = tmp_path / "coords.npy", tmp_path / "partition_probe.py"
    script.write_text(PARTITION_PROBE)  # cute.jit reads its function's source: a file, not -c
    r = subprocess.run([flex_python, str(script), str(flex_build.BUILD_SCRIPT), str(out)],
                       capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]
    coords = np.load(out)
    key, query = fragment_coords()
    assert (coords[..., 0] == key).all() and (coords[..., 1] == query).all()
    dsl_words = diagonal_mask_words(coords[..., 0], coords[..., 1])
    for B, T in SHAPES[:2]:
        p = causal_plan(B, T)
        assert (p.masks == dsl_words[None, None]).all(), (B, T)


@pytest.mark.slow
def test_the_build_interpreter_sees_the_same_recipe(flex_python: str) -> None:
    """The library is built (and a pack made) by one Python and loaded by another (the GPU
    machine's): both must compute the same recipe and argument names. An ast.dump digest, tried
    once, differed between 3.11 and 3.12 and every pack was refused on the H200."""
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); "
             "from engine.backends.cuda import flex_build as f; "
             "print(f.RECIPE_SHA256, ','.join(f.ARG_NAMES), sorted(f.BWD_CONFIG.items()))")
    r = subprocess.run([flex_python, "-c", probe, str(Path(flex_build.__file__).parents[3])],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == flex_build.RECIPE_SHA256
    assert r.stdout.split()[1] == ",".join(flex_build.ARG_NAMES)


@pytest.mark.slow
def test_the_dq_accumulator_is_stored_first_not_zeroed(flex_python: str, tmp_path: Path) -> None:
    """flex_build_main.first_dq_stores, read in the PTX the build emits: the preprocess writes
    no zeros into the float32 dQ accumulator, and every bulk add of a dQ
    contribution into the accumulator is the rank-0 contribution's bulk store otherwise."""
    env = {**os.environ, "CUTE_DSL_KEEP": "ptx", "CUTE_DSL_DUMP_DIR": str(tmp_path)}
    r = subprocess.run([flex_python, str(flex_build.BUILD_SCRIPT), "compile", str(tmp_path / "f.o"),
                        "ptxcheck", "64", "bf16"], capture_output=True, text=True, timeout=900,
                       stdin=subprocess.DEVNULL, env=env, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    (ptx,) = tmp_path.glob("*.ptx")
    entries = re.split(r"^\.visible \.entry ", ptx.read_text(), flags=re.M)[1:]
    pre = [e for e in entries if "backward_preprocess" in e.split("(")[0]]
    main = [e for e in entries if "FlexAttentionBackwardSm90" in e.split("(")[0]]
    assert len(pre) == 1 and len(main) == 1
    assert "st.global" in pre[0]  # it still writes dPsum and LSE·log2 e
    assert re.search(r"st\.global\.v\d\.b32\s+\[[^]]+\],\s*\{0f00000000", pre[0]) is None
    adds = re.findall(r"^(.*)cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32 (.*);$",
                      main[0], flags=re.M)
    stores = re.findall(r"^@first cp\.async\.bulk\.global\.shared::cta\.bulk_group (.*);$", main[0],
                        flags=re.M)
    # the partial and the full blocks' loops, each one per dQ warp group: 4 with BWD_CONFIG
    sites = 2 * (1 if flex_build.BWD_CONFIG["dQ_single_wg"] else 2)
    assert len(adds) == sites and all(guard == "@!first " for guard, _ in adds)
    assert sorted(ops for _, ops in adds) == sorted(stores)


def test_build_exports_the_entry_point_and_caches(flex_python: str, library: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert library.is_file() and library.suffix == ".so"
    manifest = flex_build.read_manifest(library)
    assert manifest["entry_symbol"] == flex_build.ENTRY_SYMBOL
    assert manifest["frontend_version"] and manifest["dsl_version"]
    assert manifest["libs_cu13_version"] and manifest["torch"]
    assert manifest["recipe_sha256"] == flex_build.RECIPE_SHA256
    assert manifest["arg_names"] == list(flex_build.ARG_NAMES)
    # the library is built with the recipe's own config, and the DSL's partition of it gives
    # the very mask words the engine's numpy plan uploads
    assert manifest["bwd_config"] == flex_build.BWD_CONFIG
    masks = causal_plan(8, 1024).masks
    assert np.array_equal(np.asarray(manifest["plan_mask_words"], dtype=masks.dtype),
                          masks.reshape(-1, 256, 2)[0])
    nm = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True)
    if nm.returncode == 0:
        assert flex_build.ENTRY_SYMBOL in nm.stdout
    before = library.stat().st_mtime_ns
    monkeypatch.setattr(flex_build.shutil, "which", lambda name: None)  # a hit needs no g++
    again = flex_build.build_library(library.parent, python=flex_python)
    assert again == library and library.stat().st_mtime_ns == before  # a cache hit
    assert [p.name for p in library.parent.iterdir() if p.name.startswith(".")] == []  # no tmp left


def _fake_args() -> dict:
    base = 0x7F0000000000
    return dict(qkv=base, o=base + 2**26, do=base + 2**27, lse=base + 2**25, dqkv=base + 2**28,
                lse2=base + 2**30, dpsum=base + 2**30 + 2**20, dq_accum=base + 2**30 + 2**21,
                dq_sem=base + 2**31, scale=0.125)


def _flex(library: Path, B: int = 8, T: int = 1024, H: int = 12):
    from engine.backends.cuda.flex_call import FlexBackward

    fb = FlexBackward(library, B, T, H, zero_dq_sem=False)  # no libcuda here
    fb.set_plan([0x7F0100000000 + i * 2**20 for i in range(len(FIELDS))])
    return fb


def _no_gpu() -> None:
    if Path("/dev/nvidiactl").exists():
        pytest.skip("a GPU is present: this test passes fake device pointers")


NO_DRIVER = ("cudaErrorInsufficientDriver", "cudaErrorNoDevice", "CUDA_ERROR_NO_DEVICE",
             "CUDA_ERROR_NOT_INITIALIZED", "no CUDA-capable device")


@pytest.mark.slow
def test_call_with_the_engines_strides_reaches_cuda(library: Path) -> None:
    """Every ABI check of the entry point passes (shapes, strides, dtypes, alignment, B/T/H
    agreeing over all tensors), so the call gets as far as the CUDA runtime, which has no
    driver here. With a GPU present fake pointers would fault: skipped there."""
    _no_gpu()
    fb = _flex(library)
    with pytest.raises(RunError) as e:
        fb(stream=0x1234, **_fake_args())
    msg = str(e.value)
    assert msg.startswith("flex attention backward failed: ")
    assert any(s in msg for s in NO_DRIVER), msg
    for name in ("torch", "tvm_ffi", "cutlass", "pycuda"):
        assert name not in sys.modules, name  # pure ctypes
    ptr, nbytes = fb.semaphores(_fake_args()["dq_sem"])
    assert ptr == _fake_args()["dq_sem"] and nbytes == 4 * 8 * 12 * 8
    s = fb.scratch_bytes()
    assert s["dq_accum"] == 4 * 8 * 12 * 1024 * 64 and s["lse2"] == s["dpsum"] == 4 * 8 * 12 * 1024


@pytest.mark.slow
def test_misaligned_pointers_are_refused_before_cuda(library: Path) -> None:
    fb = _flex(library, 2, 256, 6)
    with pytest.raises(RunError, match=r"dqkv pointer 0x[0-9a-f]+ is not 16-byte aligned"):
        fb(stream=0, **{**_fake_args(), "dqkv": _fake_args()["dqkv"] + 2})
    with pytest.raises(RunError, match=r"lse pointer .* not 4-byte aligned"):
        fb(stream=0, **{**_fake_args(), "lse": _fake_args()["lse"] + 1})
    with pytest.raises(RunError, match=r"masks pointer .* not 16-byte aligned"):
        fb.set_plan([0x7F0100000000 + i * 2**20 for i in range(8)] + [0x7F0200000008])
    with pytest.raises(RunError, match="set_plan needs 9 pointers"):
        fb.set_plan([0x7F0100000000])
    # the entry point's own check (past ours): a bf16 view 2 bytes off, TVM FFI's message
    args = fb.make_args(**_fake_args())
    from engine.backends.cuda.flex_call import DLTensor

    dq = ctypes.cast(args.array[6].v, ctypes.POINTER(DLTensor)).contents
    dq.data += 2
    with pytest.raises(RunError, match=r"(?i)misaligned tensor data on argument #6") as e:
        fb.run(args, stream=0)
    assert not any(s in str(e.value) for s in NO_DRIVER)


@pytest.mark.slow
def test_t128_accepts_null_pointers_for_the_empty_plan_arrays(library: Path) -> None:
    """At T = 128 fidx and forder are empty: set_plan takes 0 for them (and only for them) and
    the entry point's checks pass as far as the CUDA runtime."""
    _no_gpu()
    from engine.backends.cuda.flex_call import FlexBackward

    fb = FlexBackward(library, 3, 128, 6, zero_dq_sem=False)
    empty = [name for name, a in fb.plan_arrays() if a.size == 0]
    assert empty == ["fidx", "forder"]
    ptrs = [0 if name in empty else 0x7F0100000000 + i * 2**20 for i, name in enumerate(FIELDS)]
    fb.set_plan(ptrs)
    with pytest.raises(RunError) as e:
        fb(stream=0, **_fake_args())
    assert any(s in str(e.value) for s in NO_DRIVER), str(e.value)
    with pytest.raises(RunError, match=r"idx pointer 0x0 is not 4-byte aligned \(null\)"):
        fb.set_plan([0 if name in ("idx", *empty) else p for name, p in zip(FIELDS, ptrs, strict=True)])


@pytest.mark.slow
def test_the_entry_points_parameters_are_arg_names_in_order(library: Path) -> None:
    """The entry point's own type error lists its parameters in order: they are ARG_NAMES, and
    flex_call placed each argument by that name (mK's DLTensor is the second)."""
    from engine.backends.cuda.flex_call import DLTensor

    fb = _flex(library, 2, 256, 6)
    args = fb.make_args(**_fake_args())
    view = ctypes.cast(args.array[1].v, ctypes.POINTER(DLTensor)).contents
    assert view.data == _fake_args()["qkv"] + 6 * 64 * 2  # K: H·64 bf16 after Q
    view.dtype.code = 2  # float16 against the bf16 library
    with pytest.raises(RunError, match="Mismatched Tensor on argument #1") as e:
        fb.run(args, stream=0)
    signature = re.search(r"`flex_bwd\((.*)\)`", str(e.value))
    assert signature is not None, str(e.value)
    names = re.findall(r"(?:^|, )(\w+): ", signature.group(1))
    assert tuple(names) == flex_build.ARG_NAMES


@pytest.mark.slow
def test_set_stream_is_the_stream_the_entry_point_reads(library: Path) -> None:
    fb = _flex(library, 2, 256, 6)
    get = ctypes.CDLL(flex_build.read_manifest(library)["tvm_ffi_lib"]).TVMFFIEnvGetStream
    get.argtypes, get.restype = [ctypes.c_int32, ctypes.c_int32], ctypes.c_void_p
    for handle in (0x1234, 0x7F00DEAD0000):
        fb.set_stream(handle)
        assert get(2, 0) == handle  # kDLCUDA, device 0: what the entry point launches on
    fb.set_stream(0)
    assert get(2, 0) is None

