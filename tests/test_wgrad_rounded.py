"""The QKV weight gradient in the compute precision by way of float32 (Ops.wgrad_rounded,
Launcher._wgrad's `via`) without a GPU: the real Ops on the stand-in kernels and GEMMs of
test_fp8_launches, which check every launch against its kernel's declaration and record it."""

from __future__ import annotations

from typing import Any

import pytest

from engine.backends.cuda.cublas import R_32F
from engine.backends.cuda.ops import Ops
from engine.backends.cuda.runtime import SIGNATURES
from engine.errors import RunError
from tests.test_fp8_launches import Gemm, Kernel, Stream

R, d = 256, 128
SCRATCH = 0x7000_0000
DQKV, X, W_ROWS, DX, DW = 0x1000_0000, 0x2000_0000, 0x3000_0000, 0x4000_0000, 0x5000_0000


def make(lp: bool = True) -> tuple[Ops, list[tuple[str, tuple[int, ...]]], Gemm]:
    calls: list[tuple[str, tuple[int, ...]]] = []
    gemm = Gemm()
    ops = Ops({name: Kernel(name, calls) for name in SIGNATURES}, None, Stream(), "bf16",
              gemm=gemm, ws=1 << 20)
    ops.overwrite_grads = ops.wgrad_lp = lp
    ops.wgrad_f32 = SCRATCH
    return ops, calls, gemm


def qkv_bwd(ops: Ops) -> None:
    ops.attn_qkv_bwd_rows(DQKV, X, W_ROWS, DX, DW, R, d)


def wgrad_of(gemm: Gemm) -> dict[str, Any]:
    [m] = [m for m in gemm.matmuls if m["b"] == DQKV and m["M"] == d]
    return m


@pytest.mark.parametrize(("direct_ms", "rounded_ms", "use"), [(0.44, 0.29, "rounded"),
                                                              (0.20, 0.29, "direct")])
def test_the_faster_way_is_timed_at_start_and_kept(direct_ms: float, rounded_ms: float,
                                                   use: str) -> None:
    ops, calls, gemm = make()

    def timer(fn: Any) -> float:
        gemm.matmuls.clear()
        fn()
        return rounded_ms if wgrad_of(gemm)["out"] == SCRATCH else direct_ms

    gemm.tuning, gemm.timer = True, timer
    qkv_bwd(ops)
    key = f"qkv_wgrad R={R} d={d}"
    assert gemm.choices[key] == use and gemm.choice_ms[key] == (direct_ms, rounded_ms)
    gemm.tuning, gemm.timer = False, None
    gemm.matmuls.clear()
    calls.clear()
    qkv_bwd(ops)  # as chosen, untimed
    m = wgrad_of(gemm)
    rounds = [a for n, a in calls if n == "k_params_to_lp"]
    if use == "rounded":
        # float32 into the scratch (written: beta 0), then rounded into the gradient, all three
        # [d,d] blocks one after another, no table: every element in its place
        assert m["out"] == SCRATCH and m["types"][2] == R_32F and m["beta"] == 0.0
        assert rounds == [(DW, SCRATCH, 3 * d * d, 0, 0, 0, 0)]
    else:
        assert m["out"] == DW and m["types"][2] == ops.act and not rounds
    assert (m["batch"], m["ldb"], m["sa"], m["sb"], m["sc"]) == (3, 3 * d, 0, d, d * d)


def test_untimed_the_gemm_writes_the_compute_precision_itself() -> None:
    ops, calls, gemm = make()
    qkv_bwd(ops)
    assert wgrad_of(gemm)["out"] == DW and not gemm.choices
    assert "k_params_to_lp" not in [n for n, _ in calls]


def test_float32_gradients_take_no_rounding() -> None:
    """A step that keeps the gradients in float32 (accumulating: wgrad_lp off) adds into them,
    whatever the choice."""
    ops, calls, gemm = make(lp=False)
    gemm.choices[f"qkv_wgrad R={R} d={d}"] = "rounded"
    qkv_bwd(ops)
    m = wgrad_of(gemm)
    assert m["out"] == DW and m["types"][2] == R_32F and m["beta"] == 1.0
    assert "k_params_to_lp" not in [n for n, _ in calls]


def test_a_recorded_plan_without_the_choice_keeps_the_gemms_own() -> None:
    """A GEMM plan written before this choice existed: its run computed the gradient by the
    GEMM itself, so a resume does too, untimed (its bits must not depend on a new timing)."""
    ops, calls, gemm = make()
    gemm.plan_imported = True
    gemm.tuning, gemm.timer = True, lambda fn: pytest.fail("timed a choice the plan implies")
    qkv_bwd(ops)
    assert gemm.choices[f"qkv_wgrad R={R} d={d}"] == "direct" and not gemm.choice_ms
    assert wgrad_of(gemm)["out"] == DW and "k_params_to_lp" not in [n for n, _ in calls]


def test_a_float32_output_the_library_refuses_leaves_the_gemms_own() -> None:
    ops, _, gemm = make()
    real = gemm.matmul

    def matmul(out: int, *args: Any, **kw: Any) -> None:
        if out == SCRATCH:
            raise RunError("no algorithm for the float32-output problem")
        real(out, *args, **kw)

    gemm.matmul = matmul
    gemm.tuning, gemm.timer = True, lambda fn: (fn(), 0.3)[1]
    qkv_bwd(ops)
    key = f"qkv_wgrad R={R} d={d}"
    assert gemm.choices[key] == "direct" and gemm.choice_ms[key][1] == float("inf")
    gemm.tuning, gemm.timer = False, None
    gemm.matmuls.clear()
    qkv_bwd(ops)
    assert wgrad_of(gemm)["out"] == DW
