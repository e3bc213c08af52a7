"""Every CUDA kernel names its numpy twin and quotes it truly (kernels/common.cuh states the rule).

The comment right above each `k_` kernel opens with `// numpy twin: ops.NAME` (or `model.NAME`,
engine/backends/numpy/; or `fp8.NAME`, the FP8 recipe in engine/model/fp8.py) followed by the
numpy lines it implements, each marked `// >`, and each quote must be found in that function's
source; or it opens with `// numpy twin: none — ` and says what the kernel is for. No GPU and no nvcc needed."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import pytest

from engine.backends.cuda import KERNEL_DIR
from engine.backends.numpy import model as np_model
from engine.backends.numpy import ops as np_ops
from engine.model import fp8 as fp8_recipe

KERNEL = re.compile(r'^extern "C" __global__ void (?:[A-Z_]+ )?(k_\w+)\(')
TWIN = re.compile(r"^// numpy twin: (?:none — (?P<why>\S.*)|(?P<ref>(?:ops|model|fp8)\.[\w.]+)\b.*)$")
QUOTE = re.compile(r"^// >\s+(?P<code>\S.*)$")
MODULES = {"ops": np_ops, "model": np_model, "fp8": fp8_recipe}


@dataclass
class Kernel:
    name: str
    source: str  # file name
    comment: list[str]  # the `//` lines right above the definition, top to bottom


def kernels() -> list[Kernel]:
    out = []
    for src in sorted(KERNEL_DIR.glob("*.cu")):
        lines = src.read_text().splitlines()
        for i, line in enumerate(lines):
            m = KERNEL.match(line)
            if m:
                j = i
                while j > 0 and lines[j - 1].startswith("//"):
                    j -= 1
                out.append(Kernel(m.group(1), src.name, lines[j:i]))
    return out


def resolve(ref: str) -> object:
    module, *path = ref.split(".")
    obj: object = MODULES[module]
    for part in path:
        obj = getattr(obj, part)
    return obj


def parse(k: Kernel) -> tuple[str | None, str | None, list[str]]:
    """(twin reference or None, reason when none, quoted lines)."""
    assert k.comment, f"{k.source}: {k.name} has no comment above it"
    m = TWIN.match(k.comment[0])
    assert m, f"{k.source}: {k.name}'s comment does not open with `// numpy twin: ...`"
    twins = [line for line in k.comment if line.startswith("// numpy twin:")]
    assert len(twins) == 1, f"{k.source}: {k.name} names {len(twins)} twins"
    quotes = [q.group("code").strip() for q in map(QUOTE.match, k.comment) if q]
    return m.group("ref"), m.group("why"), quotes


def test_the_kernels_are_found():
    names = {k.name for k in kernels()}
    assert {"k_layernorm_fwd", "k_adamw", "k_residual_add_bwd", "k_params_to_lp"} <= names
    from engine.backends.cuda.runtime import SIGNATURES

    assert names == set(SIGNATURES)


@pytest.mark.parametrize("k", kernels(), ids=lambda k: k.name)
def test_kernel_quotes_its_numpy_twin(k):
    ref, why, quotes = parse(k)
    if ref is None:
        assert len(why) > 20 and not quotes, f"{k.name}: say what a kernel with no twin is for"
        return
    obj = resolve(ref)
    assert inspect.isfunction(obj), f"{k.name}: {ref} is not a numpy function"
    assert quotes, f"{k.name}: quote the numpy lines of {ref} it implements (`// > ...`)"
    source = [line.strip() for line in inspect.getsource(obj).splitlines()]
    for q in quotes:
        assert any(q in line for line in source), f"{k.name}: `{q}` is not in {ref}"


def test_the_checks_can_fail():
    """A made-up twin, a wrong quote and a missing header are each caught."""
    bad = [
        Kernel("k_x", "x.cu", ["// numpy twin: ops.no_such_op", "// >   x = 1"]),
        Kernel("k_x", "x.cu", ["// numpy twin: ops.residual_add_bwd", "// >   dx += 2 * dout"]),
        Kernel("k_x", "x.cu", ["// numpy: dx += dout"]),
        Kernel("k_x", "x.cu", ["// numpy twin: none — short"]),
    ]
    for k in bad:
        with pytest.raises((AssertionError, AttributeError)):
            test_kernel_quotes_its_numpy_twin(k)
