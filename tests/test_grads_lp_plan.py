"""The fused bf16 step's weight gradients in the compute precision (buffers.GRAD_LP_TENSORS,
CudaBackend.grads_lp), checked on the CPU: the norm's table of ranges and kinds, the memory plan,
and what Ops refuses before any launch. The kernels themselves run in tests/gpu/test_grads_lp.py."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cuda.buffers import (
    GRAD_LP_TENSORS,
    grads_lp_table,
    layer_ranges,
    norm_ranges,
    plan_memory,
)
from engine.backends.cuda.ops import Ops
from engine.backends.cuda.optim_ops import NORM_RANGE_BLOCKS
from engine.model.layout import ModelShapes, n_params, tensor_table
from tests.test_cuda_buffers import M120, ODD, _FakeDrv

TINY = ModelShapes(n_layer=3, d_model=128, n_head=4, d_ff=512, vocab_size=8449, seq_len=64)
ODD_D = ModelShapes(n_layer=2, d_model=3, n_head=3, d_ff=5, vocab_size=11, seq_len=5)


def kind_of_each_element(s: ModelShapes) -> np.ndarray:
    """1 for every element of a layer's weight matrix, 0 elsewhere, from the tensor names (not
    through buffers.grads_lp_table: the tests' own reading of GRAD_LP_TENSORS)."""
    out = np.zeros(n_params(s), np.int32)
    for t in tensor_table(s):
        h, _, rest = t.name.partition(".")
        if h == "h" and rest.split(".", 1)[1] in GRAD_LP_TENSORS:
            out[t.offset : t.offset + t.size] = 1
    return out


def test_the_table_names_the_layers_weight_matrices_and_nothing_else():
    lp = grads_lp_table(TINY)
    names = [t.name for t, k in zip(tensor_table(TINY), lp, strict=True) if k]
    assert names == [f"h.{l}.{n}" for l in range(TINY.n_layer) for n in GRAD_LP_TENSORS]
    d, F = TINY.d_model, TINY.d_ff
    assert sum(t.size for t, k in zip(tensor_table(TINY), lp, strict=True) if k) == \
        TINY.n_layer * (4 * d * d + 2 * d * F)


@pytest.mark.parametrize("shapes", [M120, TINY, ODD], ids=["120M", "tiny", "odd"])
@pytest.mark.parametrize("lp", [False, True])
def test_the_norm_ranges_partition_the_buffer_by_layer_and_kind(shapes, lp):
    r = norm_ranges(shapes, lp)
    n = n_params(shapes)
    assert r.cuts[0] == 0 and r.cuts[-1] == n and np.all(np.diff(r.cuts) > 0)
    assert len(r.cuts) == len(r.kinds) + 1 == len(r) + 1
    # each layer range (the update's) is exactly its group's ranges, in order
    layers = layer_ranges(shapes)
    assert len(r.groups) == len(layers)
    at = 0
    for (first, count), (begin, end) in zip(r.groups, layers, strict=True):
        assert first == at and count >= 1
        assert r.cuts[first] == begin and r.cuts[first + count] == end
        at += count
    assert at == len(r)
    # every element of a range has the range's kind
    want = kind_of_each_element(shapes) if lp else np.zeros(n, np.int32)
    for k in range(len(r)):
        assert np.all(want[r.cuts[k] : r.cuts[k + 1]] == r.kinds[k])
    if not lp:  # one range a layer: the partials as before the grads_lp table
        assert [c for c, _ in layers] + [n] == list(r.cuts)
    else:  # [ln1][W_Q..W_O][ln2][W_1, W_2] a layer, the last with the final LayerNorm too
        assert all(c % 4 == 0 for c in r.cuts)
        assert [c for _, c in r.groups] == [1] + [4] * (shapes.n_layer - 1) + [5]
        assert list(r.kinds[1:5]) == [0, 1, 0, 1]


def test_grads_lp_wants_cuts_of_whole_groups_of_four():
    with pytest.raises(ValueError, match="multiple of 4"):
        norm_ranges(ODD_D, True)
    assert len(norm_ranges(ODD_D, False)) == ODD_D.n_layer + 1


def test_the_plan_holds_the_bf16_gradients_and_the_norm_partials_of_every_range():
    n = n_params(M120)
    base, _, _ = plan_memory(M120, 8, "bf16", "cudnn", fused=True, cudnn_workspace=1)
    plan, _, _ = plan_memory(M120, 8, "bf16", "cudnn", fused=True, cudnn_workspace=1,
                             grads_lp=True)
    assert plan.totals()["grads"] - base.totals()["grads"] >= 2 * n
    assert plan.totals()["grads"] - base.totals()["grads"] < 2 * n + 256
    plan.allocate(_FakeDrv())
    assert plan["grads_lp"] - plan["grads"] >= 4 * n  # its own n bf16 after the float32 ones
    ranges = len(norm_ranges(M120, True))
    assert ranges == 1 + 4 * M120.n_layer + 1
    # the partials of every range (norm follows them), a kind for each (clip follows)
    assert plan["norm"] - plan["norm_partials"] >= 4 * NORM_RANGE_BLOCKS * ranges
    assert plan["clip"] - plan["norm_kinds"] >= 4 * ranges
    assert plan["seg_glp"]
    for precision, fused in (("fp16", True), ("fp32", True), ("bf16", False)):
        with pytest.raises(ValueError, match="grads_lp needs the fused path in bf16"):
            plan_memory(TINY, 2, precision, fused=fused, grads_lp=True)


def _ops(precision: str = "bf16") -> tuple[Ops, list[tuple[str, tuple]]]:
    o = Ops({}, None, None, precision)
    launched: list[tuple[str, tuple]] = []
    o._go = lambda name, *a, **k: launched.append((name, a))
    return o, launched


def test_ops_refuse_the_bf16_gradients_where_they_cannot_be_read_or_written():
    o, launched = _ops()
    base = 1 << 20
    # AdamW: grads_lp with its table, beside a low-precision copy, aligned for four
    o.adamw_step(1, base, 2, 3, 4, 5, 6, 1, 0, 64, 7, grads_lp=base + 64, seg_glp=9)
    assert launched[-1][0] == "k_adamw_step"
    assert launched[-1][1][4] == base + 64  # after the grid: p, p_lp, g, then g_lp
    for bad in ({"grads_lp": base + 64}, {"seg_glp": 9}, {"grads_lp": base + 2, "seg_glp": 9}):
        with pytest.raises(ValueError, match=r"grads_lp|seg_glp"):
            o.adamw_step(1, base, 2, 3, 4, 5, 6, 1, 0, 64, 7, **bad)
        with pytest.raises(ValueError, match=r"grads_lp|seg_glp"):
            o.adamw(1, base, 2, 3, 4, 5, 6, 1, 64, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1, **bad)
    with pytest.raises(ValueError, match="params_lp"):
        o.adamw_step(1, 0, 2, 3, 4, 5, 6, 1, 0, 64, 7, grads_lp=base, seg_glp=9)
    # the norm: grads_lp and kinds together
    n = len(launched)
    with pytest.raises(ValueError, match="together"):
        o.grad_norm_ranges(1, 2, 0, 3, 4, grads_lp=base)
    with pytest.raises(ValueError, match="together"):
        o.grad_norm_ranges(1, 2, 0, 3, 4, kinds=8)
    assert len(launched) == n
    o.grad_norm_ranges(1, 2, 0, 3, 4, grads_lp=base, kinds=8)
    assert launched[-1][0] == "k_grad_norm_ranges"
    assert launched[-1][1][0] == (NORM_RANGE_BLOCKS, 3)


def test_a_weight_gradient_gemm_writes_bf16_only_where_the_step_writes_its_gradients():
    """Ops._wgrad: with wgrad_lp a layer matrix's GEMM writes the compute precision with beta 0;
    the tied embedding's (layer=False) stays float32 and adds where it adds; wgrad_lp without
    overwrite_grads is refused (bf16 gradients are written, never accumulated)."""
    o, _ = _ops()
    calls: list[dict] = []
    o._mm = lambda out, a, b, M, N, K, **kw: calls.append(kw)
    o.wgrad_lp = True
    with pytest.raises(ValueError, match="overwrite_grads"):
        o._wgrad(1, 2, 3, 4, 4, 4, ())
    o.overwrite_grads = True
    o._wgrad(1, 2, 3, 4, 4, 4, ())
    o._wgrad(1, 2, 3, 4, 4, 4, (), layer=False)
    assert [(c["out32"], c["beta"]) for c in calls] == [(False, 0.0), (True, 0.0)]
    o.wgrad_lp = o.overwrite_grads = False
    o._wgrad(1, 2, 3, 4, 4, 4, ())
    assert (calls[-1]["out32"], calls[-1]["beta"]) == (True, 1.0)


def test_the_norm_is_cut_by_kind_wherever_the_setting_is_on():
    """Gradient accumulation keeps float32 gradients (no grads_lp buffer) but, with the setting
    on, sums the norm over the same ranges as a run with bf16 ones: one GPU of two micro-batches
    and two GPUs of one then add the norm's partials in one order."""
    n = n_params(TINY)
    by_kind, _, _ = plan_memory(TINY, 2, "bf16", fused=True, norm_by_kind=True)
    by_layer, _, _ = plan_memory(TINY, 2, "bf16", fused=True)
    lp, _, _ = plan_memory(TINY, 2, "bf16", fused=True, grads_lp=True)
    for plan in (by_kind, by_layer, lp):
        plan.allocate(_FakeDrv())
    ranges = len(norm_ranges(TINY, True))
    assert ranges > len(norm_ranges(TINY, False))
    assert by_kind["norm"] - by_kind["norm_partials"] >= 4 * NORM_RANGE_BLOCKS * ranges
    assert by_kind.totals()["grads"] == by_layer.totals()["grads"] < lp.totals()["grads"]
    assert lp.totals()["grads"] - by_kind.totals()["grads"] >= 2 * n
    with pytest.raises(ValueError, match="by kind"):
        plan_memory(TINY, 2, "bf16", fused=True, grads_lp=True, norm_by_kind=False)
