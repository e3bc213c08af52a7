"""cuDNN's fused attention (engine/backends/cuda/cudnn_attn.py) against the numpy op twin, its
determinism, the full-length graph on shorter sequences, and the fallback when cuDNN is absent.

Skipped (with the reason) where the cuDNN frontend is not installed; the fallback test runs
everywhere the GPU tests run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cudabk import cuda_backend
from devarrays import DevArrays, check_close, rounded

from engine.backends.numpy import ops as npo
from engine.model.layout import ModelShapes, init_params
from tests.conftest import micro_config_dict, run_engine

pytestmark = pytest.mark.gpu


def _cudnn_or_skip() -> None:
    from engine.backends.cuda.cudnn_attn import cudnn_available

    ok, why = cudnn_available()
    if not ok:
        pytest.skip(why)


@pytest.fixture
def att(gpu):
    _cudnn_or_skip()
    return gpu


def tm(a: np.ndarray) -> np.ndarray:
    return np.swapaxes(a, 0, 1)


@pytest.mark.parametrize(("B", "T", "H", "hd"), [(3, 37, 2, 64), (2, 128, 4, 32), (1, 64, 12, 64)])
def test_cudnn_attention_matches_numpy(att, rng, B, T, H, hd):
    """Forward (out) and deterministic backward (dQ, dK, dV) against ops.attn_fwd / attn_bwd in
    float64 on the same bf16 inputs; time-major slabs read through strides, as in the backend
    (the Q, K, V slabs `slab` elements apart, more than R·d: the backend's R_max·d); then the
    graphs built for rows (CudnnAttention(rows=True): Q, K, V read from, and dQ, dK, dV written
    to, one [R,3d] matrix, d apart in each row) against the same numpy answers, bound 1e-2."""
    gpu = att
    precision, d = "bf16", H * hd
    R = B * T
    slab = R * d + 8 * d  # slabs farther apart than the rows: the strides must be honoured
    from engine.backends.cuda.cudnn_attn import CudnnAttention

    a = CudnnAttention(precision, H, hd, gpu.stream.handle)
    a.build(B, T, backward=True)
    dev = DevArrays(gpu.drv, precision)
    rows_att = None
    try:
        qkv = rounded(rng.normal(0, 1, (3, B, T, d)), precision)
        probs, want = np.empty((B, H, T, T)), np.empty((B, T, d))
        npo.attn_fwd(qkv, H, probs, want)
        buf = np.zeros((3, slab))
        for j in range(3):
            buf[j, : R * d] = tm(qkv[j]).reshape(-1)
        dqkv_in = dev.put(buf)
        ws = dev.empty((max(1, a.workspace_bytes(B, T)) // 4 + 1,), "f32")
        out, stats = dev.empty((T, B, d)), dev.empty((B, H, T), "f32")
        es = 2
        q, k, v = (dqkv_in + j * slab * es for j in range(3))
        a.fwd(q, k, v, out, stats, B, T, ws)
        check_close(tm(dev.get(out)), want, 1e-2, "cudnn attn_fwd out", precision)

        dout = rounded(rng.normal(0, 1, (B, T, d)), precision)
        w_dqkv = np.empty((3, B, T, d))
        npo.attn_bwd(dout, qkv, probs, H, w_dqkv, np.empty((B, H, T, T)))
        grads = []
        for _ in range(2):  # twice: the deterministic backward gives the same bits
            g = dev.empty((3, slab))
            dq, dk, dv = (g + j * slab * es for j in range(3))
            a.bwd(q, k, v, out, dev.put(tm(dout)), stats, dq, dk, dv, B, T, ws)
            grads.append(dev.get(g))
        assert np.array_equal(grads[0], grads[1], equal_nan=True), \
            "cuDNN's backward is not repeatable"
        for j, name in enumerate("QKV"):
            got = tm(grads[0][j, : R * d].reshape(T, B, d))
            check_close(got, w_dqkv[j], 1e-2, f"cudnn attn_bwd d{name}", precision)

        # rows: Q, K, V and dQ, dK, dV side by side in each row, [R, 3d] (gpu.qkv_rows); O
        # and dO stay [R, d]
        rows_att = ar = CudnnAttention(precision, H, hd, gpu.stream.handle, rows=True)
        ar.build(B, T, backward=True)
        ws2 = dev.empty((max(1, ar.workspace_bytes(B, T)) // 4 + 1,), "f32")
        qkv_rows = dev.put(np.concatenate([tm(qkv[j]) for j in range(3)], axis=2))  # [T,B,3d]
        qr, kr, vr = (qkv_rows + j * d * es for j in range(3))
        out_r, stats_r = dev.empty((T, B, d)), dev.empty((B, H, T), "f32")
        ar.fwd(qr, kr, vr, out_r, stats_r, B, T, ws2)
        check_close(tm(dev.get(out_r)), want, 1e-2, "cudnn attn_fwd out (rows)", precision)
        grads = []
        for _ in range(2):
            g = dev.empty((R, 3 * d))
            ar.bwd(qr, kr, vr, out_r, dev.put(tm(dout)), stats_r,
                   *(g + j * d * es for j in range(3)), B, T, ws2)
            grads.append(dev.get(g))
        assert np.array_equal(grads[0], grads[1]), "cuDNN's backward in rows is not repeatable"
        rows = grads[0].reshape(T, B, 3 * d)
        for j, name in enumerate("QKV"):
            check_close(tm(rows[:, :, j * d : (j + 1) * d]), w_dqkv[j], 1e-2,
                        f"cudnn attn_bwd d{name} (rows)", precision)
    finally:
        gpu.stream.synchronize()
        a.close()
        if rows_att is not None:
            rows_att.close()
        dev.free()


@pytest.mark.parametrize(("B", "T", "H", "hd"), [(3, 37, 2, 64), (1, 64, 12, 64)])
def test_q_k_v_in_rows_through_the_ops_match_numpy(att, rng, B, T, H, hd):
    """The backend's rows path op by op, on the GPU: attn_qkv_fwd_rows (one GEMM, [R,3d] =
    ln1 @ W_QKV, W_QKV read as layer 1's 3d² range of a GEMM copy laid out by lp_positions,
    as FlatBuffers.w("h.1.attn.W_Q") points), attn_fwd_cudnn on CudnnAttention(rows=True),
    attn_bwd_cudnn, then attn_qkv_bwd_rows from the same W_QKV, against numpy's attn_qkv_fwd,
    attn_fwd, attn_bwd and attn_qkv_bwd in float64 on the same bf16 inputs (B = 1: the
    sampling forward's batch). Bounds: Q, K, V and out 1e-2 (test_ops' bf16 bound); dQ, dK, dV,
    dx and dW 2e-2 (cuDNN's backward on top of the forward's roundings)."""
    from engine.backends.cuda.buffers import lp_positions, qkv_seg_table
    from engine.backends.cuda.cublas import WORKSPACE_BYTES
    from engine.backends.cuda.cudnn_attn import CudnnAttention
    from engine.backends.cuda.gemm import LtGemm
    from engine.backends.cuda.ops import Ops
    from engine.model.layout import n_params, tensor_table, views

    gpu, precision, d, R = att, "bf16", H * hd, B * T
    s = ModelShapes(n_layer=2, d_model=d, n_head=H, d_ff=64, vocab_size=64, seq_len=T)
    table = tensor_table(s)
    seg = np.array([t.offset for t in table] + [n_params(s)], np.int64)
    # weights of std 1/sqrt(d): scores of about unit size (with 0.1 at d = 768 they were about 8,
    # a peaked softmax that amplifies the bf16 rounding of Q and K close to the bounds)
    flat = rounded(rng.normal(0, 1 / np.sqrt(d), n_params(s)), precision)
    lp = np.empty_like(flat)
    lp[lp_positions(seg, qkv_seg_table(s), d)] = flat
    w = np.stack([views(flat, s)[f"h.1.attn.{n}"] for n in ("W_Q", "W_K", "W_V")])
    x = rounded(rng.normal(0, 1, (B, T, d)), precision)
    dout = rounded(rng.normal(0, 1, (B, T, d)), precision)
    # numpy, batch-major
    qkv = np.empty((3, R, d))
    npo.attn_qkv_fwd(x.reshape(R, d), w, qkv)
    qkv = qkv.reshape(3, B, T, d)
    probs, want = np.empty((B, H, T, T)), np.empty((B, T, d))
    npo.attn_fwd(qkv, H, probs, want)
    w_dqkv = np.empty((3, B, T, d))
    npo.attn_bwd(dout, qkv, probs, H, w_dqkv, np.empty((B, H, T, T)))
    w_dx, w_dw = np.empty((R, d)), np.zeros((3, d, d))
    npo.attn_qkv_bwd(w_dqkv.reshape(3, R, d), x.reshape(R, d), w, w_dx, w_dw, np.empty((R, d)),
                     np.empty(3 * d * d))

    ar = CudnnAttention(precision, H, hd, gpu.stream.handle, rows=True)
    ar.build(B, T, backward=True)
    dev = DevArrays(gpu.drv, precision)
    g = LtGemm(WORKSPACE_BYTES, "test")
    try:
        ws = dev.empty((WORKSPACE_BYTES // 4,), "f32")
        cws = dev.empty((max(1, ar.workspace_bytes(B, T)) // 4 + 1,), "f32")
        o = Ops(gpu.kernels(precision), None, gpu.stream, precision, gemm=g, ws=ws, cudnn=ar,
                cudnn_ws=cws)
        w_qkv = dev.put(lp) + next(t.offset for t in table if t.name == "h.1.attn.W_Q") * 2
        xp, qkvp = dev.put(tm(x)), dev.empty((T, B, 3 * d))
        o.attn_qkv_fwd_rows(xp, w_qkv, qkvp, R, d)
        got = dev.get(qkvp)
        for j, name in enumerate("QKV"):
            check_close(tm(got[:, :, j * d : (j + 1) * d]), qkv[j], 1e-2,
                        f"attn_qkv_fwd_rows {name}", precision)
        out, stats = dev.empty((T, B, d)), dev.empty((B, H, T), "f32")
        o.attn_fwd_cudnn(qkvp, out, stats, B, T, d, R * d)
        check_close(tm(dev.get(out)), want, 1e-2, "cudnn attn_fwd out (rows, ops)", precision)
        dqkvp = dev.empty((T, B, 3 * d))
        o.attn_bwd_cudnn(dev.put(tm(dout)), qkvp, out, stats, dqkvp, B, T, d, R * d)
        got = dev.get(dqkvp)
        for j, name in enumerate("QKV"):
            check_close(tm(got[:, :, j * d : (j + 1) * d]), w_dqkv[j], 2e-2,
                        f"cudnn attn_bwd d{name} (rows, ops)", precision)
        dxp, dwp = dev.empty((T, B, d)), dev.put(np.zeros((3, d, d)), "f32")
        o.attn_qkv_bwd_rows(dqkvp, xp, w_qkv, dxp, dwp, R, d)
        check_close(tm(dev.get(dxp)).reshape(R, d), w_dx, 2e-2, "attn_qkv_bwd_rows dx (ops)",
                    precision)
        check_close(dev.get(dwp), w_dw, 2e-2, "attn_qkv_bwd_rows dW (ops)", precision)
    finally:
        gpu.stream.synchronize()
        g.close()
        ar.close()
        dev.free()


TINY = ModelShapes(n_layer=2, d_model=128, n_head=2, d_ff=512, vocab_size=8449, seq_len=128)


def test_short_sequences_through_the_full_length_graph(att):
    """The backend builds cuDNN's graphs for seq_len; a shorter T runs them at full length
    (causal: rows < T never see the rest; the backward zeroes dO past T). Against the classic
    attention on the same weights and tokens: the same function, to bf16 rounding."""

    params = init_params(TINY, seed=2)
    rng = np.random.default_rng(4)
    x = rng.integers(0, 8449, (4, 77)).astype(np.int32)
    y = rng.integers(0, 8449, (4, 77)).astype(np.int32)
    res = {}
    for attention in ("cudnn", "classic"):
        bk = cuda_backend(TINY, 4, "bf16", attention=attention)
        assert bk.attention == attention
        bk.load_params(params)
        bk.zero_grads()
        # a full-length step first, so the rows past 77 hold another batch's values
        full = rng.integers(0, 8449, (4, 129)).astype(np.int32)
        bk.forward_backward(full[:, :-1], full[:, 1:])
        bk.zero_grads()
        res[attention] = (bk.forward_backward(x, y), bk.read_grads())
        bk.close()
    check_close(res["cudnn"][0], res["classic"][0], 1e-2, "short T: losses cudnn vs classic",
                "bf16")
    check_close(res["cudnn"][1], res["classic"][1], 5e-2, "short T: grads cudnn vs classic",
                "bf16")


@pytest.mark.parametrize("refused", ["training", "sampling"])
def test_a_refused_rows_graph_falls_back_to_the_slabs(att, monkeypatch, refused):
    """Where cuDNN refuses Q, K, V side by side in rows (for the training graphs, or only the
    sampling forward, B = 1, built after them), the backend keeps cuDNN's attention with the
    slabs and three GEMMs (not the classic attention), says so in its notes, keeps the GEMM copy
    in the flat layout (it is decided before the copy is first written), and trains."""
    from engine.backends.cuda import cudnn_attn
    from engine.errors import RunError

    build = cudnn_attn.CudnnAttention.build

    def refuse_rows(self, B, T, backward):
        if self.rows and (backward if refused == "training" else B == 1):
            raise RunError("cuDNN refuses attention (this test refuses the rows layout)")
        return build(self, B, T, backward)

    monkeypatch.setattr(cudnn_attn.CudnnAttention, "build", refuse_rows)
    bk = cuda_backend(TINY, 4, "bf16", attention="cudnn", qkv_rows=True)
    try:
        assert bk.attention == "cudnn" and not bk.qkv_rows and not bk.build.cudnn.rows
        assert any("cuDNN refuses Q, K, V in rows" in n for n in bk.notes), bk.notes
        assert "Q, K, V in rows" not in bk.describe()
        params = init_params(TINY, seed=3)
        bk.load_params(params)
        assert np.array_equal(bk.read_params_lp(), rounded(params, "bf16")), "GEMM copy"
        tok = np.random.default_rng(1).integers(0, 8449, (4, 129)).astype(np.int32)
        assert np.all(np.isfinite(bk.forward_backward(tok[:, :-1], tok[:, 1:])))
        assert np.all(np.isfinite(bk.logits_last(tok[:1, :50])))
    finally:
        bk.close()


def test_memory_plan_shrinks_without_probabilities(att):

    plans = {}
    for attention in ("classic", "cudnn"):
        bk = cuda_backend(TINY, 8, "bf16", attention=attention, fusions=False)
        plans[attention] = bk.memory_plan()
        bk.close()
    B, H, S, L = 8, TINY.n_head, TINY.seq_len, TINY.n_layer
    probs = L * B * H * S * S * 2
    assert plans["cudnn"]["activations"] < plans["classic"]["activations"] - probs // 2
    assert plans["cudnn"]["total"] < plans["classic"]["total"]


def test_without_cudnn_the_engine_falls_back_and_says_so(tmp_path: Path, prepared_data: Path):
    """ANDREA_CUDNN=0 stands for a machine without the cuDNN frontend: the run trains with the
    classic attention, and engine.log and the ready event say which attention ran and why."""
    from engine.records import ReadyEvent
    from engine.runfiles import read_events

    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(micro_config_dict(max_steps=3, precision="bf16")))
    run = tmp_path / "run"
    r = run_engine(cfg, run, "--backend", "cuda", env={"ANDREA_CUDNN": "0"})
    assert r.returncode == 0, r.stdout + r.stderr
    ready = [e for e in read_events(run / "events.jsonl")[0] if isinstance(e, ReadyEvent)]
    assert ready and ready[-1].attention.startswith("classic (ANDREA_CUDNN=0"), ready
    assert "attention classic (ANDREA_CUDNN=0" in (run / "engine.log").read_text()
