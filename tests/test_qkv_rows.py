"""Q, K, V's input gradient as one GEMM (ANDREA_QKV_ROWS), checked on the CPU: no GPU, no pycuda.

What the CUDA ops hand to cuBLASLt is checked by running it: `EmuGemm` (tests/emugemm.py)
carries out `LtGemm.matmul`'s row-major contract (gemm.py: out[M,N] = alpha·op(a)@op(b) +
beta·out, ld* row strides and s* batch strides in elements) in numpy over a fake device memory,
and the results of `Ops.attn_qkv_bwd_rows` and of the slab path's `Ops.attn_qkv_bwd` are
compared with numpy's `attn_qkv_bwd` in float64. cuDNN's strides for dQ, dK, dV (`sdpa_strides`) are checked to address
the very elements the GEMMs read. The kernel that puts W_Q, W_K, W_V side by side and the GEMMs
themselves run in tests/gpu (test_ops, test_cudnn, test_fusions, test_train_resume); here a
stand-in for the cuDNN frontend records the strides CudnnAttention.build gives each tensor."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from engine.backends.cuda.buffers import plan_memory, qkv_layer_stride
from engine.backends.cuda.cudnn_attn import sdpa_strides
from engine.backends.cuda.ops import Ops
from engine.backends.numpy import ops as npo
from engine.model.layout import ModelShapes
from tests.emugemm import emulated_ops


@pytest.fixture(autouse=True)
def _no_device_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANDREA_CUDA_SYNC", raising=False)  # Ops would wait on the fake stream


@pytest.fixture
def case(request: pytest.FixtureRequest):
    """x [R,d], W_Q, W_K, W_V [3,d,d], dQ, dK, dV [3,R,d], a gradient to add to, and numpy's
    answer (float64)."""
    rng = np.random.default_rng(7)
    R, d = 3 * 37, 48
    x = rng.normal(0, 1, (R, d))
    w = rng.normal(0, 0.1, (3, d, d))
    dqkv = rng.normal(0, 1, (3, R, d))
    g0 = rng.normal(0, 1, (3, d, d))
    dx, dw = np.empty((R, d)), g0.copy()
    npo.attn_qkv_bwd(dqkv, x, w, dx, dw, np.empty((R, d)), np.empty(3 * d * d))
    return SimpleNamespace(R=R, d=d, x=x, w=w, dqkv=dqkv, g0=g0, dx=dx, dw=dw)


@pytest.mark.parametrize("overwrite", [False, True])
def test_one_gemm_over_rows_is_numpys_attn_qkv_bwd(case, overwrite):
    """dQ, dK, dV side by side in rows [R,3d], W_Q, W_K, W_V side by side [d,3d]: dx in one GEMM
    over K = 3d, dW batched over the three column blocks into the flat gradient as it lies
    (added to, or written when the fused step writes its gradients)."""
    c = case
    o, emu = emulated_ops()
    o.overwrite_grads = overwrite
    dqkv = emu.put(np.concatenate(list(c.dqkv), axis=1))
    w_rows = emu.put(np.concatenate(list(c.w), axis=1))
    x, dx, dw = emu.put(c.x), emu.alloc(c.R * c.d), emu.put(c.g0)
    o.attn_qkv_bwd_rows(dqkv, x, w_rows, dx, dw, c.R, c.d)
    np.testing.assert_allclose(emu.get(dx, (c.R, c.d)), c.dx, rtol=1e-12, atol=1e-12)
    want_dw = c.dw - c.g0 if overwrite else c.dw
    np.testing.assert_allclose(emu.get(dw, (3, c.d, c.d)), want_dw, rtol=1e-12, atol=1e-12)
    assert sorted(emu.calls) == sorted([(c.d, c.d, c.R, 3), (c.R, c.d, 3 * c.d, 1)])


def test_the_slabs_take_three_gemms_for_the_same_answer(case):
    """The slab path (attn_qkv_bwd) through the same emulation, the slabs farther apart than
    R·d as in the backend: the emulation's own check, and the reference the rows replace."""
    c = case
    o, emu = emulated_ops()
    slab = c.R * c.d + 5 * c.d
    buf = np.full((3, slab), np.nan)
    buf[:, : c.R * c.d] = c.dqkv.reshape(3, -1)
    dqkv = emu.put(buf)
    x, w, dx, dw = emu.put(c.x), emu.put(c.w), emu.alloc(c.R * c.d), emu.put(c.g0)
    o.attn_qkv_bwd(dqkv, x, w, dx, dw, c.R, c.d, slab)
    np.testing.assert_allclose(emu.get(dx, (c.R, c.d)), c.dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(emu.get(dw, (3, c.d, c.d)), c.dw, rtol=1e-12, atol=1e-12)
    assert len(emu.calls) == 4  # dW batched, dx in three


@pytest.mark.parametrize(("B", "T", "H", "hd"), [(3, 37, 4, 12), (8, 16, 12, 64)])
def test_cudnn_strides_address_the_rows_the_gemm_reads(B, T, H, hd):
    """cuDNN's dims [B,H,T,hd] with sdpa_strides(row = 3d), based at dQ, dK, dV = d·j elements
    into the buffer, land on element (t·B + b, j·d + h·hd + e) of the [R,3d] matrix that
    attn_qkv_bwd_rows reads; with row = d, on the slabs' (t·B + b, h·hd + e)."""
    d, R = H * hd, B * T
    cells = np.arange(R * 3 * d)
    for j in range(3):
        got = as_strided(cells[j * d :], (B, H, T, hd),
                         tuple(s * cells.itemsize for s in sdpa_strides(B, hd, 3 * d)))
        mat = cells.reshape(T, B, 3 * d)[:, :, j * d : (j + 1) * d]  # [T, B, d]
        want = mat.reshape(T, B, H, hd).transpose(1, 2, 0, 3)
        assert np.array_equal(got, want)
    slab = as_strided(cells, (B, H, T, hd),
                      tuple(s * cells.itemsize for s in sdpa_strides(B, hd, d)))
    assert np.array_equal(slab, cells[: R * d].reshape(T, B, H, hd).transpose(1, 2, 0, 3))


@pytest.mark.parametrize("n_layer", [1, 2, 12])
def test_the_layout_keeps_each_layers_qkv_weights_together(n_layer):
    """What k_qkv_rows reads: W_Q, W_K, W_V one after the other, every layer's the same distance
    after the one before (the layer's parameter count: 4d² + 2dF + 4d)."""
    s = ModelShapes(n_layer=n_layer, d_model=48, n_head=4, d_ff=80, vocab_size=97, seq_len=16)
    want = 4 * 48 * 48 + 2 * 48 * 80 + 4 * 48 if n_layer > 1 else 0
    assert qkv_layer_stride(s) == want


def test_the_memory_plan_adds_one_copy_of_the_attention_weights():
    """qkv_rows adds [L,d,3d] in the GEMM precision to the weights (ANDREA-120M bf16: 42.5 MB)
    and changes nothing else."""
    s = ModelShapes(n_layer=12, d_model=768, n_head=12, d_ff=3072, vocab_size=8449, seq_len=1024)
    base = plan_memory(s, 8, "bf16", "cudnn", True, 1 << 20)[0].totals()
    rows = plan_memory(s, 8, "bf16", "cudnn", True, 1 << 20, qkv_rows=True)[0].totals()
    extra = 12 * 3 * 768 * 768 * 2
    assert rows["weights"] - base["weights"] == extra
    assert {k: v for k, v in rows.items() if k not in ("weights", "total")} == \
        {k: v for k, v in base.items() if k not in ("weights", "total")}
    assert rows["total"] - base["total"] == extra


@pytest.mark.parametrize("grad_rows", [False, True])
def test_cudnn_backward_gets_the_pointers_of_its_layout(grad_rows):
    """Ops.attn_bwd_cudnn hands cuDNN dK and dV d elements after dQ where its graphs were built
    for rows, a slab apart otherwise; Q, K, V are slabs either way."""
    calls = []
    fake = SimpleNamespace(grad_rows=grad_rows, bwd=lambda *a: calls.append(a))
    o = Ops({}, None, SimpleNamespace(handle=0), "bf16", cudnn=fake, cudnn_ws=4096)
    d, slab, qkv, dqkv = 64, 1000 * 64, 1 << 20, 1 << 24
    o.attn_bwd_cudnn(7, qkv, 8, 9, dqkv, 2, 16, d, slab)
    (q, k, v, out, dout, stats, dq, dk, dv, B, T, ws), = calls
    assert (q, k, v) == (qkv, qkv + 2 * slab, qkv + 4 * slab)
    apart = 2 * (d if grad_rows else slab)
    assert (dq, dk, dv) == (dqkv, dqkv + apart, dqkv + 2 * apart)
    assert (out, dout, stats, B, T, ws) == (8, 7, 9, 2, 16, 4096)


class _FakeTensor:
    def __init__(self, name: str, dim=None, stride=None) -> None:
        self.name, self.dim, self.stride = name, dim, stride

    def set_output(self, _on: bool) -> _FakeTensor:
        return self

    def set_dim(self, dim: list[int]) -> _FakeTensor:
        self.dim = dim
        return self

    def set_stride(self, stride: list[int]) -> _FakeTensor:
        self.stride = stride
        return self

    def set_data_type(self, _t: object) -> _FakeTensor:
        return self


class _FakeGraph:
    """What CudnnAttention.build asks of a cuDNN frontend graph, recording every tensor."""

    def __init__(self, made: list[dict[str, _FakeTensor]]) -> None:
        self.tensors: dict[str, _FakeTensor] = {}
        made.append(self.tensors)

    def tensor(self, name: str, dim: list[int], stride: list[int], data_type: object):
        self.tensors[name] = _FakeTensor(name, dim, stride)
        return self.tensors[name]

    def _out(self, *names: str) -> tuple[_FakeTensor, ...]:
        for n in names:
            self.tensors[n] = _FakeTensor(n)
        return tuple(self.tensors[n] for n in names)

    def sdpa(self, **_kw: object) -> tuple[_FakeTensor, ...]:
        return self._out("o", "stats_out")

    def sdpa_backward(self, **_kw: object) -> tuple[_FakeTensor, ...]:
        return self._out("dq", "dk", "dv")

    def validate(self) -> None: ...
    def build_operation_graph(self) -> None: ...
    def create_execution_plans(self, _modes: object) -> None: ...
    def check_support(self) -> None: ...
    def build_plans(self) -> None: ...

    def get_workspace_size(self) -> int:
        return 0


@pytest.mark.parametrize("grad_rows", [False, True])
def test_cudnn_graphs_give_the_rows_strides_to_dq_dk_dv_only(monkeypatch, grad_rows):
    """CudnnAttention.build on a stand-in for the cuDNN frontend: with grad_rows, dQ, dK, dV are
    described with rows 3d apart; Q, K, V, O, dO and the forward's O stay slabs (rows d apart)."""
    import sys

    from engine.backends.cuda.cudnn_attn import CudnnAttention

    made: list[dict[str, _FakeTensor]] = []
    names = SimpleNamespace(BFLOAT16="bf16", HALF="f16", FLOAT="f32")
    fake = SimpleNamespace(
        data_type=names, diagonal_alignment=SimpleNamespace(TOP_LEFT=0),
        heur_mode=SimpleNamespace(A=0, FALLBACK=1), create_handle=lambda: object(),
        set_stream=lambda h, s: None, destroy_handle=lambda h: None, backend_version=lambda: 0,
        __version__="fake", pygraph=lambda **kw: _FakeGraph(made))
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    B, T, H, hd = 3, 37, 4, 16
    d = H * hd
    att = CudnnAttention("bf16", H, hd, 0, grad_rows=grad_rows)
    att.build(B, T, backward=True)
    fwd, bwd = made
    slab, rows = [d, hd, B * d, 1], [3 * d, hd, B * 3 * d, 1]
    for name in ("q", "k", "v", "o"):
        assert fwd[name].stride == slab, name
    for name in ("q", "k", "v", "o", "do"):
        assert bwd[name].stride == slab, name
    for name in ("dq", "dk", "dv"):
        assert bwd[name].dim == [B, H, T, hd]
        assert bwd[name].stride == (rows if grad_rows else slab), name
