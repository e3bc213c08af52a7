"""Q, K, V in rows (gpu.qkv_rows), checked on the CPU: no GPU, no pycuda.

With cuDNN the backend keeps Q, K, V side by side in each row of `qkv` ([R,3d]) and keeps each
layer's W_Q, W_K, W_V side by side in the GEMM copy of the weights (W_QKV [d,3d] in that
layer's 3d² range), so the forward is one GEMM with N = 3d and the input gradient one over
K = 3d. What the CUDA ops hand to cuBLASLt is checked by running it: `EmuGemm`
(tests/emugemm.py) carries out `LtGemm.matmul`'s row-major contract in numpy over a fake
device memory, and `Ops.attn_qkv_fwd_rows` / `attn_qkv_bwd_rows`, reading W_QKV where the
permuted GEMM copy holds it, are compared with numpy's `attn_qkv_fwd` / `attn_qkv_bwd` in
float64. The permutation itself: `buffers.lp_positions` against np.concatenate, and the very
index functions of kernels/optim.cu (compiled for the host with nvcc, where it is installed)
against `lp_positions`, as k_params_to_lp and adamw_body walk the elements. cuDNN's strides
(`sdpa_strides`) are checked to address the elements the GEMMs read and write, and a
stand-in for the cuDNN frontend records the strides CudnnAttention.build gives each tensor.
The kernels and cuDNN themselves run in tests/gpu (test_ops, test_fusions, test_cudnn,
test_train_resume)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from engine.backends.cuda import KERNEL_DIR
from engine.backends.cuda.buffers import lp_positions, plan_memory, qkv_seg_table
from engine.backends.cuda.cudnn_attn import sdpa_strides
from engine.backends.cuda.ops import Ops
from engine.backends.cuda.runtime import nvcc_path
from engine.backends.numpy import ops as npo
from engine.model.layout import ModelShapes, n_params, tensor_table, views
from tests.emugemm import ES, emulated_ops


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


def test_one_gemm_computes_q_k_v_side_by_side(case):
    """attn_qkv_fwd_rows: [R,3d] = x @ [W_Q | W_K | W_V], one GEMM with N = 3d; row r holds
    numpy's Q[r], K[r], V[r] one after the other."""
    c = case
    o, emu = emulated_ops()
    want = np.empty((3, c.R, c.d))
    npo.attn_qkv_fwd(c.x, c.w, want)
    out = emu.alloc(c.R * 3 * c.d)
    o.attn_qkv_fwd_rows(emu.put(c.x), emu.put(np.concatenate(list(c.w), axis=1)), out, c.R, c.d)
    got = emu.get(out, (c.R, 3 * c.d))
    for j in range(3):
        np.testing.assert_allclose(got[:, j * c.d : (j + 1) * c.d], want[j], rtol=1e-12,
                                   atol=1e-12)
    assert emu.calls == [(c.R, 3 * c.d, c.d, 1)]


@pytest.mark.parametrize(("B", "T", "H", "hd"), [(3, 37, 4, 12), (8, 16, 12, 64)])
def test_cudnn_strides_address_the_rows_the_gemm_reads(B, T, H, hd):
    """cuDNN's dims [B,H,T,hd] with sdpa_strides(row = 3d), based at Q, K, V (dQ, dK, dV) = d·j
    elements into the buffer, land on element (t·B + b, j·d + h·hd + e) of the [R,3d] matrix
    that attn_qkv_fwd_rows writes and attn_qkv_bwd_rows reads; with row = d, on the slabs'
    (t·B + b, h·hd + e)."""
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


# --- the GEMM copy in rows --------------------------------------------------------------------

SHAPES = {
    "aligned": ModelShapes(n_layer=3, d_model=48, n_head=4, d_ff=80, vocab_size=97, seq_len=16),
    "one layer": ModelShapes(n_layer=1, d_model=32, n_head=2, d_ff=64, vocab_size=64,
                             seq_len=8),
    # d odd: every tensor boundary after wte falls inside a float4 group of adamw_body
    "odd": ModelShapes(n_layer=2, d_model=37, n_head=1, d_ff=50, vocab_size=97, seq_len=13),
}


def _table(s: ModelShapes) -> tuple[np.ndarray, np.ndarray]:
    """(seg_start [nseg + 1], seg_qkv [nseg]) as the backend uploads them."""
    seg_start = np.array([t.offset for t in tensor_table(s)] + [n_params(s)], np.int64)
    return seg_start, qkv_seg_table(s)


@pytest.mark.parametrize("key", SHAPES)
def test_qkv_seg_table_marks_each_layers_w_q_w_k_w_v(key):
    s = SHAPES[key]
    names = {t.name: k for k, t in enumerate(tensor_table(s))}
    seg_qkv = qkv_seg_table(s)
    want = np.zeros(len(names), np.int32)
    for layer in range(s.n_layer):
        for j, w in enumerate(("W_Q", "W_K", "W_V")):
            want[names[f"h.{layer}.attn.{w}"]] = j + 1
    assert seg_qkv.dtype == np.int32 and np.array_equal(seg_qkv, want)


@pytest.mark.parametrize("key", SHAPES)
def test_lp_positions_is_np_concatenate_of_each_layers_blocks(key):
    """The GEMM copy laid out by lp_positions against an independent construction: the flat
    layout, with each layer's 3d² range replaced by np.concatenate([W_Q, W_K, W_V], axis=1)
    ([d,3d], row-major); and the map is a permutation of the flat indices."""
    s = SHAPES[key]
    d, n = s.d_model, n_params(s)
    flat = np.random.default_rng(3).normal(size=n)
    pos = lp_positions(*_table(s), d)
    assert pos.dtype == np.int64 and np.array_equal(np.sort(pos), np.arange(n))
    lp = np.empty(n)
    lp[pos] = flat
    want = flat.copy()
    w = views(flat, s)
    for layer in range(s.n_layer):
        h = f"h.{layer}.attn."
        base = next(t.offset for t in tensor_table(s) if t.name == h + "W_Q")
        want[base : base + 3 * d * d] = np.concatenate([w[h + "W_Q"], w[h + "W_K"],
                                                        w[h + "W_V"]], axis=1).ravel()
    assert np.array_equal(lp, want)


def test_lp_positions_leave_everything_in_place_without_qkv():
    seg_start = np.array([0, 5, 41, 77, 113, 120], np.int64)
    assert np.array_equal(lp_positions(seg_start, np.zeros(5, np.int32), 6), np.arange(120))


@pytest.mark.parametrize("layer", [0, 1])
def test_the_rows_ops_read_w_qkv_from_the_permuted_gemm_copy(layer):
    """The backend's pointer for layer l's W_QKV is the GEMM copy at W_Q's offset
    (FlatBuffers.w("h.l.attn.W_Q")): with the whole copy laid out by lp_positions in the
    emulated memory, attn_qkv_fwd_rows and attn_qkv_bwd_rows from there are numpy's
    attn_qkv_fwd / attn_qkv_bwd on the flat masters' W_Q, W_K, W_V."""
    s = SHAPES["aligned"]
    d, n, R = s.d_model, n_params(s), 2 * 29
    rng = np.random.default_rng(11)
    flat = rng.normal(0, 0.1, n)
    lp = np.empty(n)
    lp[lp_positions(*_table(s), d)] = flat
    o, emu = emulated_ops()
    plp = emu.put(lp)
    h = f"h.{layer}.attn."
    w_ptr = plp + next(t.offset for t in tensor_table(s) if t.name == h + "W_Q") * ES
    v = views(flat, s)
    w = np.stack([v[h + "W_Q"], v[h + "W_K"], v[h + "W_V"]])
    x = rng.normal(0, 1, (R, d))
    want = np.empty((3, R, d))
    npo.attn_qkv_fwd(x, w, want)
    xp, out = emu.put(x), emu.alloc(R * 3 * d)
    o.attn_qkv_fwd_rows(xp, w_ptr, out, R, d)
    got = emu.get(out, (R, 3 * d))
    np.testing.assert_allclose(got, np.concatenate(list(want), axis=1), rtol=1e-12, atol=1e-12)
    dqkv = rng.normal(0, 1, (3, R, d))
    want_dx, want_dw = np.empty((R, d)), np.zeros((3, d, d))
    npo.attn_qkv_bwd(dqkv, x, w, want_dx, want_dw, np.empty((R, d)), np.empty(3 * d * d))
    dx, dw = emu.alloc(R * d), emu.put(np.zeros((3, d, d)))
    o.attn_qkv_bwd_rows(emu.put(np.concatenate(list(dqkv), axis=1)), xp, w_ptr, dx, dw, R, d)
    np.testing.assert_allclose(emu.get(dx, (R, d)), want_dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(emu.get(dw, (3, d, d)), want_dw, rtol=1e-12, atol=1e-12)


# kernels/optim.cu's index functions, compiled for the host: stdin gives nseg, d, seg_start,
# seg_qkv and ranges [begin, end); it prints where k_params_to_lp puts each element (one a line),
# then, per range, "i at" for each element as adamw_body walks it (its float4 groups in order,
# the tail one by one), with the very calls and loop control of the kernels.
HOST_MAIN = r"""
#include "optim.cu"
#include <cstdio>
#include <vector>

int main() {
    int nseg, d, nr;
    if (scanf("%d %d", &nseg, &d) != 2) return 1;
    std::vector<long> starts(nseg + 1);
    std::vector<int> qkv(nseg), flags(nseg);
    for (auto& s : starts) if (scanf("%ld", &s) != 1) return 1;
    for (auto& q : qkv) if (scanf("%d", &q) != 1) return 1;
    // every tensor flagged as having its gradient in g_lp too: the walk must not change
    const std::vector<int> glp(nseg, 1);
    for (int s = 0; s < nseg; s++) flags[s] = seg_flag(nullptr, qkv.data(), glp.data(), s);
    for (long i = 0; i < starts[nseg]; i++) {  // k_params_to_lp
        const int s = seg_of(starts.data(), nseg, i);
        int col;
        printf("%ld\n", lp_index(i, starts[s], qkv[s], d, &col));
    }
    if (scanf("%d", &nr) != 1) return 1;
    for (int r = 0; r < nr; r++) {  // adamw_body
        long begin, end;
        if (scanf("%ld %ld", &begin, &end) != 2) return 1;
        const long n = end - begin, nq = n / 4;
        for (long q = 0; q < nq + (n & 3); q++) {
            const bool vec = q < nq;
            const long i0 = begin + (vec ? q * 4 : nq * 4 + (q - nq));
            int lo = seg_of(starts.data(), nseg, i0);
            long at = 0;
            int seg = -1, col = 0;
            for (int k = 0; k < 4; k++) {
                if (k > 0 && !vec) break;
                while (i0 + k >= starts[lo + 1]) lo++;
                at = lp_walk(i0 + k, lo, starts.data(), flags.data(), d, at, &seg, &col);
                printf("%ld %ld\n", i0 + k, at);
            }
        }
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def lp_host(tmp_path_factory: pytest.TempPathFactory):
    """The host build of HOST_MAIN (skipped where nvcc is absent, as test_cuda_sources is)."""
    import subprocess

    nvcc = nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not installed")
    tmp = tmp_path_factory.mktemp("lp_host")
    (tmp / "main.cu").write_text(HOST_MAIN)
    exe = tmp / "lp_host"
    r = subprocess.run([nvcc, "-std=c++17", "-O2", "-DANDREA_ACT=1", f"-I{KERNEL_DIR}", "-o",
                        str(exe), str(tmp / "main.cu")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr

    def run(seg_start: np.ndarray, seg_qkv: np.ndarray, d: int,
            ranges: list[tuple[int, int]]) -> tuple[np.ndarray, list[np.ndarray]]:
        words = [len(seg_qkv), d, *seg_start.tolist(), *seg_qkv.tolist(), len(ranges)]
        words += [x for r in ranges for x in r]
        out = subprocess.run([str(exe)], input=" ".join(map(str, words)), capture_output=True,
                             text=True, check=True).stdout.split("\n")
        n = int(seg_start[-1])
        whole = np.array(out[:n], np.int64)
        pairs = np.array([line.split() for line in out[n:] if line], np.int64).reshape(-1, 2)
        walks, at = [], 0
        for begin, end in ranges:
            walks.append(pairs[at : at + end - begin])
            at += end - begin
        assert at == len(pairs)
        return whole, walks

    return run


def _cuts(s: ModelShapes) -> list[tuple[int, int]]:
    """Three ranges as k_adamw_step may get them (begins multiples of 4): cut inside layer 0's
    W_Q and inside the last layer's W_K, not at a row's start."""
    off = {t.name: t.offset for t in tensor_table(s)}
    d, last = s.d_model, s.n_layer - 1
    a = (off["h.0.attn.W_Q"] + 5 * d + 3) // 4 * 4
    b = (off[f"h.{last}.attn.W_K"] + 2 * d + 11) // 4 * 4
    return [(0, a), (a, b), (b, n_params(s))]


SYNTHETIC = (np.array([0, 5, 41, 77, 113, 120], np.int64), np.array([0, 1, 2, 3, 0], np.int32), 6)


@pytest.mark.parametrize("key", [*SHAPES, "synthetic"])
def test_the_kernels_index_functions_are_lp_positions(lp_host, key):
    """k_params_to_lp's and adamw_body's index math (seg_of, lp_index, lp_walk from
    kernels/optim.cu, built for the host) put every element where lp_positions says: element by
    element, and walking float4 groups over the whole buffer or over ranges that start and end
    inside a layer's W_Q, W_K, W_V (where groups straddle tensors: d odd, the synthetic table
    with a 5-element tensor before the three and d = 6)."""
    if key == "synthetic":
        seg_start, seg_qkv, d = SYNTHETIC
        n = int(seg_start[-1])
        splits = [[(0, n)], [(0, 8), (8, 44), (44, 80), (80, n)]]
    else:
        s = SHAPES[key]
        (seg_start, seg_qkv), d, n = _table(s), s.d_model, n_params(s)
        splits = [[(0, n)], _cuts(s)]
    want = lp_positions(seg_start, seg_qkv, d)
    for ranges in splits:
        whole, walks = lp_host(seg_start, seg_qkv, d, ranges)
        assert np.array_equal(whole, want), "k_params_to_lp"
        for (begin, end), walk in zip(ranges, walks, strict=True):
            assert np.array_equal(np.sort(walk[:, 0]), np.arange(begin, end)), (begin, end)
            assert np.array_equal(walk[:, 1], want[walk[:, 0]]), f"adamw_body [{begin}, {end})"


def test_the_memory_plan_adds_only_the_kernels_table():
    """qkv_rows keeps every buffer's size (qkv and dqkv hold [R,3d] where they held [3,R,d]; the
    GEMM copy is permuted in place) and adds the int32 seg_qkv table to the scratch."""
    s = ModelShapes(n_layer=12, d_model=768, n_head=12, d_ff=3072, vocab_size=8449, seq_len=1024)
    base = plan_memory(s, 8, "bf16", "cudnn", True, 1 << 20)[0].totals()
    rows = plan_memory(s, 8, "bf16", "cudnn", True, 1 << 20, qkv_rows=True)[0].totals()
    table = -(-len(tensor_table(s)) * 4 // 256) * 256
    assert rows["scratch"] - base["scratch"] == table
    assert {k: v for k, v in rows.items() if k not in ("scratch", "total")} == \
        {k: v for k, v in base.items() if k not in ("scratch", "total")}
    assert rows["total"] - base["total"] == table


@pytest.mark.parametrize("rows", [False, True])
def test_cudnn_gets_the_pointers_of_its_layout(rows):
    """Ops.attn_fwd_cudnn and attn_bwd_cudnn hand cuDNN Q, K, V (and dQ, dK, dV) d elements
    apart where its graphs were built for rows, a slab apart otherwise."""
    calls = {"fwd": [], "bwd": []}
    fake = SimpleNamespace(rows=rows, fwd=lambda *a: calls["fwd"].append(a),
                           bwd=lambda *a: calls["bwd"].append(a))
    o = Ops({}, None, SimpleNamespace(handle=0), "bf16", cudnn=fake, cudnn_ws=4096)
    d, slab, qkv, dqkv = 64, 1000 * 64, 1 << 20, 1 << 24
    apart = 2 * (d if rows else slab)  # bytes: bf16
    o.attn_fwd_cudnn(qkv, 8, 9, 2, 16, d, slab)
    (q, k, v, out, stats, B, T, ws), = calls["fwd"]
    assert (q, k, v) == (qkv, qkv + apart, qkv + 2 * apart)
    assert (out, stats, B, T, ws) == (8, 9, 2, 16, 4096)
    o.attn_bwd_cudnn(7, qkv, 8, 9, dqkv, 2, 16, d, slab)
    (q, k, v, out, dout, stats, dq, dk, dv, B, T, ws), = calls["bwd"]
    assert (q, k, v) == (qkv, qkv + apart, qkv + 2 * apart)
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


@pytest.mark.parametrize("rows", [False, True])
def test_cudnn_graphs_give_the_rows_strides_to_q_k_v_and_their_gradients(monkeypatch, rows):
    """CudnnAttention.build on a stand-in for the cuDNN frontend: with rows, Q, K, V (forward
    and backward) and dQ, dK, dV are described with rows 3d apart; O and dO stay slabs (rows d
    apart); without, everything is a slab."""
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
    att = CudnnAttention("bf16", H, hd, 0, rows=rows)
    att.build(B, T, backward=True)
    fwd, bwd = made
    slab, in_rows = [d, hd, B * d, 1], [3 * d, hd, B * 3 * d, 1]
    for name in ("q", "k", "v"):
        assert fwd[name].stride == (in_rows if rows else slab), name
        assert bwd[name].stride == (in_rows if rows else slab), name
    assert fwd["o"].stride == slab
    for name in ("o", "do"):
        assert bwd[name].stride == slab, name
    for name in ("dq", "dk", "dv"):
        assert bwd[name].dim == [B, H, T, hd]
        assert bwd[name].stride == (in_rows if rows else slab), name
