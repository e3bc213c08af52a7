"""Every CUDA kernel source compiles standalone for sm_90 (skipped where nvcc is absent), and
every kernel the backend launches exists with the argument count its launch format says."""

from __future__ import annotations

import re
import subprocess

import pytest

from engine.backends.cuda import KERNEL_DIR
from engine.backends.cuda.runtime import SIGNATURES, nvcc_path

SOURCES = sorted(KERNEL_DIR.glob("*.cu"))


def test_there_are_kernel_sources():
    assert {p.stem for p in SOURCES} >= {"embed", "layernorm", "attention", "mlp", "loss"}


def _kernel_params() -> dict[str, list[str]]:
    """kernel name -> parameter list, parsed from the extern "C" definitions."""
    out = {}
    for src in SOURCES:
        text = src.read_text()
        for m in re.finditer(r'extern "C" __global__ void (?:[A-Z_]+ )?(\w+)\(([^)]*)\)', text):
            out[m.group(1)] = [p.strip() for p in m.group(2).split(",")]
    return out


def test_launch_formats_match_kernel_parameters():
    params = _kernel_params()
    assert set(SIGNATURES) == set(params)
    codes = {"P": "*", "i": "int", "q": "long", "f": "float"}
    for name, fmt in SIGNATURES.items():
        assert len(fmt) == len(params[name]), name
        for code, decl in zip(fmt, params[name], strict=True):
            kind = codes[code]
            if kind == "*":
                assert "*" in decl, (name, decl)
            else:
                assert "*" not in decl and decl.split()[-2] == kind, (name, decl)


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_compiles_for_sm90(src, tmp_path):
    """The default build (bf16 activations), exactly as CI's scripts/nvcc-check runs nvcc."""
    cmd = [nvcc_path(), "-arch=sm_90", "-std=c++17", "-O3", "--cubin",
           "-o", str(tmp_path / f"{src.stem}.cubin"), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_loss_row_held_in_registers_is_the_one_ops_knows():
    """ops.LOSS_ROW_MAX (where dlogits may overwrite the logits) is kernels/loss.cu's LOSS_OCTETS
    octets (8 columns) a thread of an Ops block: a row past it is streamed, and streamed rows must not be
    overwritten while they are read."""
    from engine.backends.cuda.ops import LOSS_ROW_MAX, THREADS

    text = (KERNEL_DIR / "loss.cu").read_text()
    octets = int(re.search(r"^#define LOSS_OCTETS (\d+)", text, re.M).group(1))
    bounds = re.search(r"^#define LOSS_BOUNDS __launch_bounds__\((\d+), \d+\)", text, re.M)
    assert LOSS_ROW_MAX == octets * 8 * THREADS
    assert int(bounds.group(1)) == THREADS
