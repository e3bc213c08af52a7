"""The flex attention backward's torch-free path, on the CPU: plan, build, ctypes call.

The plan tests need only numpy and run everywhere. The others need a build interpreter with
nvidia-cutlass-dsl (+ libs-cu13), apache-tvm-ffi and nvidia-cudnn-frontend (cp312 wheels) and
g++: `ANDREA_FLEX_PYTHON`, else this interpreter; without them they skip, saying why (CI's
Python 3.11 has none of them). No GPU is used: the call test passes fake device pointers and
expects the CUDA runtime's no-driver error, so it skips where a GPU is present.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.backends.cuda import flex_build
from engine.backends.cuda.flex_plan import (
    FIELDS,
    causal_plan,
    diagonal_mask_words,
    fragment_coords,
)
from engine.errors import RunError, UserError

SHAPES = [(8, 1024), (2, 384), (3, 128)]


# ---- the plan (numpy only) -------------------------------------------------------------------
@pytest.mark.parametrize(("B", "T"), SHAPES)
def test_plan_invariants(B: int, T: int) -> None:
    p = causal_plan(B, T)
    nb, rows = T // 128, B * (T // 128)
    n = np.tile(np.arange(nb), B)  # key block of each row
    for name, a in p.arrays():
        assert a.flags.c_contiguous, name
        assert a.dtype == (np.uint32 if name == "masks" else np.int32), name
    assert p.cnt.shape == (1, rows) and (p.cnt == 1).all()
    assert p.fcnt.shape == (1, rows) and (p.fcnt[0] == nb - 1 - n).all()
    # offsets: exclusive prefix sums of the counts
    assert (p.off == np.concatenate([[0], np.cumsum(p.cnt[0])])).all()
    assert (p.foff == np.concatenate([[0], np.cumsum(p.fcnt[0])])).all()
    assert p.idx.size == p.order.size == p.masks.shape[0] == p.off[-1] == rows
    assert p.fidx.size == p.forder.size == p.foff[-1] == B * nb * (nb - 1) // 2
    for r in range(rows):
        part = p.idx[p.off[r]:p.off[r + 1]]
        full = p.fidx[p.foff[r]:p.foff[r + 1]]
        assert list(part) == [n[r]]  # the diagonal block is the partial one
        assert list(full) == list(range(n[r] + 1, nb))  # every block below it, ascending
        # dQ write rank m - n: 0 for the diagonal, then 1, 2, ... (spt)
        assert list(p.order[p.off[r]:p.off[r + 1]]) == [0]
        assert list(p.forder[p.foff[r]:p.foff[r + 1]]) == list(full - n[r])
    # every query block m gets each rank 0..m exactly once (a total order of its dQ adds)
    for b in range(B):
        for m in range(nb):
            ranks = [0] + [int(p.forder[p.foff[b * nb + k] + (m - k - 1)]) for k in range(m)]
            assert sorted(ranks) == list(range(m + 1))
    assert p.masks.shape == (rows, 1, 256, 2)
    assert (p.masks == p.masks[0]).all()  # one mask for every diagonal block
    assert len(p.tuple12()) == 12 and [i for i, a in enumerate(p.tuple12()) if a is None] == [4, 10, 11]


def test_diagonal_mask_is_causal() -> None:
    key, query = fragment_coords()
    # each (key, query) of the 128x128 tile appears exactly once over threads and values
    cells = key * 128 + query
    assert np.unique(cells).size == 128 * 128 and cells.min() == 0 and cells.max() == 128 * 128 - 1
    words = diagonal_mask_words(key, query)
    bits = (words[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
    assert int(bits.sum()) == 128 * 129 // 2  # the lower triangle with the diagonal


@pytest.mark.parametrize("T", [100, 129, 1000, 0])
def test_plan_refuses_t_not_a_multiple_of_128(T: int) -> None:
    with pytest.raises(UserError, match=r"T must be a multiple of 128|must be positive"):
        causal_plan(2, T)


def test_plan_refuses_other_head_dims() -> None:
    with pytest.raises(UserError, match="head_dim must be 64"):
        causal_plan(2, 256, head_dim=128)


def test_build_without_gxx_is_a_run_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(flex_build.shutil, "which", lambda name: None)
    with pytest.raises(RunError, match="g\\+\\+ not found"):
        flex_build.build_library(tmp_path)


def test_build_without_the_packages_is_a_run_error(tmp_path: Path) -> None:
    if _probe(sys.executable) is not None:
        pytest.skip("this interpreter has the build packages")
    with pytest.raises(RunError, match=r"is not installed|not found"):
        flex_build.probe(sys.executable)


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
def test_build_exports_the_entry_point_and_caches(flex_python: str, library: Path) -> None:
    assert library.is_file() and library.suffix == ".so"
    manifest = flex_build.read_manifest(library)
    assert manifest["entry_symbol"] == flex_build.ENTRY_SYMBOL
    assert manifest["frontend_version"] and manifest["dsl_version"]
    nm = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True)
    if nm.returncode == 0:
        assert flex_build.ENTRY_SYMBOL in nm.stdout
    before = library.stat().st_mtime_ns
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

    fb = FlexBackward(library, B, T, H)
    fb.set_plan([0x7F0100000000 + i * 2**20 for i in range(len(FIELDS))])
    return fb


NO_DRIVER = ("cudaErrorInsufficientDriver", "cudaErrorNoDevice", "CUDA_ERROR_NO_DEVICE",
             "CUDA_ERROR_NOT_INITIALIZED", "no CUDA-capable device")


@pytest.mark.slow
def test_call_with_the_engines_strides_reaches_cuda(library: Path) -> None:
    """Every ABI check of the entry point passes (shapes, strides, dtypes, alignment, B/T/H
    agreeing over all tensors), so the call gets as far as the CUDA runtime, which has no
    driver here. With a GPU present fake pointers would fault: skipped there."""
    if Path("/dev/nvidiactl").exists():
        pytest.skip("a GPU is present: this test passes fake device pointers")
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


def test_call_refuses_t_not_a_multiple_of_128_before_loading() -> None:
    from engine.backends.cuda.flex_call import FlexBackward

    with pytest.raises(UserError, match="multiple of 128"):
        FlexBackward("/nonexistent/flex.so", 2, 200, 6)


def test_call_without_its_libraries_is_a_run_error(tmp_path: Path) -> None:
    from engine.backends.cuda.flex_call import FlexBackward

    with pytest.raises(RunError, match="no readable manifest"):
        FlexBackward(tmp_path / "flex.so", 2, 256, 6)
    with pytest.raises(RunError, match="cannot load its libraries"):
        FlexBackward(tmp_path / "flex.so", 2, 256, 6, runtime_libs=[tmp_path / "libtvm_ffi.so"])
