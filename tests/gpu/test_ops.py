"""Each CUDA op twin, forward and backward, against the numpy twin (engine/backends/numpy/ops.py)
on fresh random inputs. Outputs start as NaN; T = 37 is not a multiple of any block size.

Bounds (‖gpu − numpy‖ / ‖numpy‖, numpy run in float64 on the same rounded inputs):
fp32 1e-5 (summation order and __expf only); bf16 1e-2 (outputs and intermediates rounded to
8 mantissa bits)."""

from __future__ import annotations

import numpy as np
import pytest
from devarrays import DevArrays, check_close, rounded

from engine.backends.numpy import ops as npo

pytestmark = pytest.mark.gpu

BOUND = {"fp32": 1e-5, "bf16": 1e-2}
B, T, S, D, H, F, V = 3, 37, 40, 64, 4, 160, 301
R = B * T


@pytest.fixture(params=[("fp32", "cublas"), ("bf16", "cublas"), ("fp32", "lt"), ("bf16", "lt")],
                ids=lambda p: "-".join(p))
def env(request, gpu):
    """Ops on plain cuBLAS (+ cuBLASLt for the GELU epilogues), or with every GEMM through
    gemm.LtGemm (the fused backend's GEMMs)."""
    from engine.backends.cuda.cublas import WORKSPACE_BYTES, Cublas
    from engine.backends.cuda.cublaslt import CublasLt
    from engine.backends.cuda.gemm import LtGemm
    from engine.backends.cuda.ops import Ops

    precision, gemm = request.param
    dev = DevArrays(gpu.drv, precision)
    ws = dev.empty((WORKSPACE_BYTES // 4,), "f32")
    if gemm == "lt":
        g = LtGemm(WORKSPACE_BYTES, "test")
        yield precision, Ops(gpu.kernels(precision), None, gpu.stream, precision, gemm=g,
                             ws=ws), dev
        gpu.stream.synchronize()
        g.close()
        dev.free()
        return
    blas = Cublas(gpu.stream.handle, ws, WORKSPACE_BYTES)
    lt = CublasLt(gpu.stream.handle, ws, WORKSPACE_BYTES)
    yield precision, Ops(gpu.kernels(precision), blas, gpu.stream, precision, lt), dev
    gpu.stream.synchronize()
    blas.close()
    lt.close()
    dev.free()


def tm(a: np.ndarray) -> np.ndarray:
    """numpy's batch-major [B, T, ...] → the GPU's time-major [T, B, ...]."""
    return np.swapaxes(a, 0, 1)


def bm(a: np.ndarray) -> np.ndarray:
    return np.swapaxes(a, 0, 1)


def check(precision: str, got: np.ndarray, want: np.ndarray, what: str) -> None:
    check_close(got, want, BOUND[precision], what, precision)


def test_embed(env, rng):
    precision, o, dev = env
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    tokens[0, :5] = tokens[1, 3]  # repeated ids: several rows per embedding-gradient bucket
    wte, wpe = rng.normal(0, 1, (V, D)), rng.normal(0, 1, (S, D))
    want = np.zeros((B, T, D))
    npo.embed_fwd(tokens, wte, wpe, want)
    d_tok, d_wte, d_wpe = dev.put(tokens, "i32"), dev.put(wte, "f32"), dev.put(wpe, "f32")
    out = dev.empty((T, B, D))
    o.embed_fwd(d_tok, d_wte, d_wpe, out, B, T, D)
    check(precision, bm(dev.get(out)), want, "embed_fwd")

    dout = rounded(rng.normal(0, 1, (B, T, D)), precision)
    g_wte0, g_wpe0 = rng.normal(0, 1, (V, D)), rng.normal(0, 1, (S, D))
    w_wte, w_wpe = g_wte0.copy(), g_wpe0.copy()
    npo.embed_bwd(dout, tokens, w_wte, w_wpe)
    tok_tm = tokens.T.reshape(-1)
    order = np.argsort(tok_tm, kind="stable")
    srt = tok_tm[order]
    starts = np.flatnonzero(np.r_[True, srt[1:] != srt[:-1]])
    pad = np.zeros(R + 1, np.int32)
    n_u = dev.put(np.array([starts.size]), "i32")
    b_tok = dev.put(np.r_[srt[starts], pad[: R - starts.size]], "i32")
    b_start = dev.put(np.r_[starts, R, pad[: R - starts.size]], "i32")
    rows = dev.put(order, "i32")
    gw, gp = dev.put(g_wte0, "f32"), dev.put(g_wpe0, "f32")
    o.embed_bwd(dev.put(tm(dout)), (n_u, b_tok, b_start, rows), gw, gp, B, T, D)
    check(precision, dev.get(gw) - g_wte0, w_wte - g_wte0, "embed_bwd dwte")
    check(precision, dev.get(gp) - g_wpe0, w_wpe - g_wpe0, "embed_bwd dwpe")


def test_embed_vector_paths_same_bits(env, rng):
    """k_embed_fwd_rows and k_embed_bwd's vector path (rows of whole 16-byte vectors) give the
    bits of the element-a-thread kernels: the forward against k_embed_fwd, the backward
    against its own scalar path, taken on a copy of dout one element off 16-byte alignment.
    One token holds 60 of the rows, so a bucket runs past the batch of loads."""
    from engine.backends.cuda.launch import ROWS_PER_BLOCK, blocks

    precision, o, dev = env
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    flat = tokens.reshape(-1)
    flat[rng.permutation(R)[:60]] = 7
    wte, wpe = rng.normal(0, 1, (V, D)), rng.normal(0, 1, (S, D))
    d_tok, d_wte, d_wpe = dev.put(tokens, "i32"), dev.put(wte, "f32"), dev.put(wpe, "f32")
    vec, scalar, ops = (dev.empty((T, B, D)) for _ in range(3))
    o._go("k_embed_fwd_rows", -(-R // ROWS_PER_BLOCK), vec, d_tok, d_wte, d_wpe, B, T, D)
    o._go("k_embed_fwd", blocks(R * D), scalar, d_tok, d_wte, d_wpe, B, T, D)
    o.embed_fwd(d_tok, d_wte, d_wpe, ops, B, T, D)  # Ops' choice between the two
    assert not np.isnan(dev.get(vec)).any()
    assert np.array_equal(dev.get(vec), dev.get(scalar))
    assert np.array_equal(dev.get(ops), dev.get(scalar))

    dout = rounded(rng.normal(0, 1, (T * B, D)), precision)
    tok_tm = tokens.T.reshape(-1)
    order = np.argsort(tok_tm, kind="stable")
    srt = tok_tm[order]
    starts = np.flatnonzero(np.r_[True, srt[1:] != srt[:-1]])
    pad = np.zeros(R + 1, np.int32)
    buckets = (dev.put(np.array([starts.size]), "i32"),
               dev.put(np.r_[srt[starts], pad[: R - starts.size]], "i32"),
               dev.put(np.r_[starts, R, pad[: R - starts.size]], "i32"), dev.put(order, "i32"))
    aligned = dev.put(dout)
    off = dev.put(np.r_[0.0, dout.reshape(-1)])  # element 1 on: 2 or 4 bytes past alignment
    g0w, g0p = rng.normal(0, 1, (V, D)), rng.normal(0, 1, (S, D))
    got = {}
    for name, dx in (("vector", aligned), ("scalar", off + o.esize)):
        gw, gp = dev.put(g0w, "f32"), dev.put(g0p, "f32")
        o.embed_bwd(dx, buckets, gw, gp, B, T, D)
        got[name] = (dev.get(gw), dev.get(gp))
    assert np.array_equal(got["vector"][0], got["scalar"][0])
    assert np.array_equal(got["vector"][1], got["scalar"][1])
    w_wte, w_wpe = g0w.copy(), g0p.copy()
    npo.embed_bwd(bm(dout.reshape(T, B, D)), tokens, w_wte, w_wpe)
    check(precision, got["vector"][0] - g0w, w_wte - g0w, "embed_bwd dwte")


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("D", [64, 36, 1024, 1036, 2048, 4096])
def test_layernorm(env, rng, accumulate, D):
    """D = 64: the 16-byte-vector path; D = 36 (not a multiple of 8): bf16's general path;
    D = 1024: fp32's _wide kernels (rows of 1024 floats), bf16's narrow ones at their longest
    row; D = 1036: bf16's _wide kernels on their general path (not whole vectors); D = 2048:
    bf16's _wide kernels at their longest row; D = 4096 (and fp32's 2048): the general path of
    a row too long for registers."""
    precision, o, dev = env
    x = rounded(rng.normal(0.3, 2.0, (R, D)), precision)
    gamma, beta = rng.normal(1, 0.2, D), rng.normal(0, 0.2, D)
    want, mean, rstd = np.empty((R, D)), np.empty(R), np.empty(R)
    npo.layernorm_fwd(x, gamma, beta, want, mean, rstd)
    dx_, dg = dev.put(x), dev.put(gamma, "f32")
    dmean, drstd = dev.empty((R,), "f32"), dev.empty((R,), "f32")
    out = dev.empty((R, D))
    o.layernorm_fwd(dx_, dg, dev.put(beta, "f32"), out, dmean, drstd, R, D)
    check(precision, dev.get(out), want, "layernorm_fwd out")
    check("fp32", dev.get(dmean), mean, "layernorm_fwd mean")
    check("fp32", dev.get(drstd), rstd, "layernorm_fwd rstd")

    dout = rounded(rng.normal(0, 1, (R, D)), precision)
    gb0 = rng.normal(0, 1, 2 * D)
    w_dx, w_g, w_b = np.empty((R, D)), gb0[:D].copy(), gb0[D:].copy()
    npo.layernorm_bwd(dout, x, gamma, mean, rstd, w_dx, w_g, w_b, np.empty((R, D)))
    dx0 = rounded(rng.normal(0, 1, (R, D)), precision)
    ddx = dev.put(dx0) if accumulate else dev.empty((R, D))
    dgb = dev.put(gb0, "f32")
    part = dev.empty((-(-R // 64), 2 * D), "f32")
    o.layernorm_bwd(dev.put(dout), dx_, dg, dmean, drstd, ddx, dgb, part, R, D, accumulate)
    check(precision, dev.get(ddx) - (dx0 if accumulate else 0), w_dx, "layernorm_bwd dx")
    got = dev.get(dgb) - gb0
    check(precision, got[:D], w_g - gb0[:D], "layernorm_bwd dgamma")
    check(precision, got[D:], w_b - gb0[D:], "layernorm_bwd dbeta")


def test_attn_qkv(env, rng):
    precision, o, dev = env
    x = rounded(rng.normal(0, 1, (R, D)), precision)
    w = rounded(rng.normal(0, 0.1, (3, D, D)), precision)
    want = np.empty((3, R, D))
    npo.attn_qkv_fwd(x, w, want)
    dxp, dw = dev.put(x), dev.put(w)
    out = dev.empty((3, R, D))
    o.attn_qkv_fwd(dxp, dw, out, R, D)
    check(precision, dev.get(out), want, "attn_qkv_fwd")

    dq = rounded(rng.normal(0, 1, (3, R, D)), precision)
    g0 = rng.normal(0, 1, (3, D, D))
    w_dx, w_dw = np.empty((R, D)), g0.copy()
    npo.attn_qkv_bwd(dq, x, w, w_dx, w_dw, np.empty((R, D)), np.empty(3 * D * D))
    ddx, ddw = dev.empty((R, D)), dev.put(g0, "f32")
    o.attn_qkv_bwd(dev.put(dq), dxp, dw, ddx, ddw, R, D)
    check(precision, dev.get(ddx), w_dx, "attn_qkv_bwd dx")
    check(precision, dev.get(ddw) - g0, w_dw - g0, "attn_qkv_bwd dW")


def test_attn_qkv_fwd_rows(env, rng):
    """Q, K, V in one GEMM with N = 3d: [R,3d] = x @ [W_Q | W_K | W_V] ([d,3d], as the GEMM
    copy keeps them in rows), row r holding numpy's attn_qkv_fwd Q[r], K[r], V[r] side by
    side."""
    precision, o, dev = env
    x = rounded(rng.normal(0, 1, (R, D)), precision)
    w = rounded(rng.normal(0, 0.1, (3, D, D)), precision)
    want = np.empty((3, R, D))
    npo.attn_qkv_fwd(x, w, want)
    out = dev.empty((R, 3 * D))
    o.attn_qkv_fwd_rows(dev.put(x), dev.put(np.concatenate(list(w), axis=1)), out, R, D)
    check(precision, dev.get(out), np.concatenate(list(want), axis=1), "attn_qkv_fwd_rows")


def test_attn_qkv_bwd_rows(env, rng):
    """The one-GEMM input gradient: dQ, dK, dV side by side in rows ([R,3d]) and W_Q, W_K, W_V
    side by side ([d,3d]) against numpy's attn_qkv_bwd on the slabs; dW accumulates into the
    flat [3,d,d] gradient as it lies."""
    precision, o, dev = env
    x = rounded(rng.normal(0, 1, (R, D)), precision)
    w = rounded(rng.normal(0, 0.1, (3, D, D)), precision)
    dq = rounded(rng.normal(0, 1, (3, R, D)), precision)
    g0 = rng.normal(0, 1, (3, D, D))
    w_dx, w_dw = np.empty((R, D)), g0.copy()
    npo.attn_qkv_bwd(dq, x, w, w_dx, w_dw, np.empty((R, D)), np.empty(3 * D * D))
    ddx, ddw = dev.empty((R, D)), dev.put(g0, "f32")
    rows = dev.put(np.concatenate(list(dq), axis=1))  # [R, 3d]
    o.attn_qkv_bwd_rows(rows, dev.put(x), dev.put(np.concatenate(list(w), axis=1)), ddx, ddw,
                        R, D)
    check(precision, dev.get(ddx), w_dx, "attn_qkv_bwd_rows dx")
    check(precision, dev.get(ddw) - g0, w_dw - g0, "attn_qkv_bwd_rows dW")


@pytest.mark.parametrize(("T", "chunk"), [(37, 16), (37, 256), (40, 16)])
def test_attn(env, rng, T, chunk):
    """T = 37, chunk 16: three causal query chunks, the last one partial, scalar softmax path;
    T = 40: rows of whole 16-byte vectors, the vector path."""
    precision, o, dev = env
    o.attn_chunk = chunk
    qkv = rounded(rng.normal(0, 1, (3, B, T, D)), precision)
    probs, want = np.empty((B, H, T, T)), np.empty((B, T, D))
    npo.attn_fwd(qkv, H, probs, want)
    dqkv_in = dev.put(np.swapaxes(qkv, 1, 2))  # [3, T, B, D]
    dprobs, out = dev.empty((B * H, T, T)), dev.empty((T, B, D))
    scores = dev.empty((B * H, T, T))
    o.attn_fwd(dqkv_in, H, dprobs, out, scores, B, T, D)
    check(precision, bm(dev.get(out)), want, "attn_fwd out")
    # only the causal part j <= t is specified (later chunks' columns are never written)
    causal = np.tril(np.ones((T, T), bool))
    got_p = np.where(causal, dev.get(dprobs).reshape(B, H, T, T), 0.0)
    check(precision, got_p, probs, "attn_fwd probs")

    dout = rounded(rng.normal(0, 1, (B, T, D)), precision)
    w_dqkv = np.empty((3, B, T, D))
    npo.attn_bwd(dout, qkv, probs, H, w_dqkv, np.empty((B, H, T, T)))
    # the backward reads the probabilities the GPU forward saved
    ddqkv = dev.empty((3, T, B, D))
    o.attn_bwd(dev.put(tm(dout)), dqkv_in, dprobs, H, ddqkv, scores, B, T, D)
    got = np.swapaxes(dev.get(ddqkv), 1, 2)
    for j, name in enumerate("QKV"):
        check(precision, got[j], w_dqkv[j], f"attn_bwd d{name}")


def test_attn_out(env, rng):
    precision, o, dev = env
    y = rounded(rng.normal(0, 1, (R, D)), precision)
    w = rounded(rng.normal(0, 0.1, (D, D)), precision)
    want = np.empty((R, D))
    npo.attn_out_fwd(y, w, want)
    dy_, dw = dev.put(y), dev.put(w)
    out = dev.empty((R, D))
    o.attn_out_fwd(dy_, dw, out, R, D)
    check(precision, dev.get(out), want, "attn_out_fwd")
    dout = rounded(rng.normal(0, 1, (R, D)), precision)
    g0 = rng.normal(0, 1, (D, D))
    w_dy, w_dw = np.empty((R, D)), g0.copy()
    npo.attn_out_bwd(dout, y, w, w_dy, w_dw, np.empty(D * D))
    ddy, ddw = dev.empty((R, D)), dev.put(g0, "f32")
    o.attn_out_bwd(dev.put(dout), dy_, dw, ddy, ddw, R, D)
    check(precision, dev.get(ddy), w_dy, "attn_out_bwd dy")
    check(precision, dev.get(ddw) - g0, w_dw - g0, "attn_out_bwd dW_O")


@pytest.mark.parametrize("fused", [True, False])
def test_mlp(env, rng, fused):
    """fused: GELU in cuBLASLt's GEMM epilogues; else the k_mlp_gelu kernels."""
    precision, o, dev = env
    if not fused:
        o.lt = None
        if o.gemm is not None:
            o.gemm.choices.update({f"mlp_fwd R={R} d={D} F={F}": "kernel",
                                   f"mlp_bwd R={R} d={D} F={F}": "kernel"})
    x = rounded(rng.normal(0, 1, (R, D)), precision)
    w1 = rounded(rng.normal(0, 0.2, (D, F)), precision)
    w2 = rounded(rng.normal(0, 0.1, (F, D)), precision)
    pre, act, want = np.empty((R, F)), np.empty((R, F)), np.empty((R, D))
    npo.mlp_fwd(x, w1, w2, pre, act, want)
    dx_, d1, d2 = dev.put(x), dev.put(w1), dev.put(w2)
    dpre, dact, out = dev.empty((R, F)), dev.empty((R, F)), dev.empty((R, D))
    o.mlp_fwd(dx_, d1, d2, dpre, dact, out, R, D, F)
    check(precision, dev.get(dpre), pre, "mlp_fwd pre")
    check(precision, dev.get(dact), act, "mlp_fwd act")
    check(precision, dev.get(out), want, "mlp_fwd out")

    dout = rounded(rng.normal(0, 1, (R, D)), precision)
    g1, g2 = rng.normal(0, 1, (D, F)), rng.normal(0, 1, (F, D))
    w_dx, w_g1, w_g2 = np.empty((R, D)), g1.copy(), g2.copy()
    pre_gpu, act_gpu = dev.get(dpre), dev.get(dact)  # what the GPU backward will read
    npo.mlp_bwd(dout, x, w1, w2, pre_gpu, act_gpu, w_dx, w_g1, w_g2, np.empty((R, F)),
                np.empty((R, F)), np.empty((R, F)), np.empty(D * F))
    ddx, dg1, dg2 = dev.empty((R, D)), dev.put(g1, "f32"), dev.put(g2, "f32")
    o.mlp_bwd(dev.put(dout), dx_, d1, d2, dpre, dact, ddx, dg1, dg2, dev.empty((R, F)), R, D, F)
    assert o.fused_gelu_calls == (2 if fused else 0)
    check(precision, dev.get(ddx), w_dx, "mlp_bwd dx")
    check(precision, dev.get(dg1) - g1, w_g1 - g1, "mlp_bwd dW_1")
    check(precision, dev.get(dg2) - g2, w_g2 - g2, "mlp_bwd dW_2")


def test_residual(env, rng):
    precision, o, dev = env
    a, b = (rounded(rng.normal(0, 1, (R, D)), precision) for _ in range(2))
    want = np.empty((R, D))
    npo.residual_add(a, b, want)
    out = dev.empty((R, D))
    o.residual_add(dev.put(a), dev.put(b), out, R * D)
    check(precision, dev.get(out), want, "residual_add")
    dout = rounded(rng.normal(0, 1, (R, D)), precision)
    w_dx = a.copy()
    npo.residual_add_bwd(dout, w_dx)
    ddx = dev.put(a)
    o.residual_add_bwd(dev.put(dout), ddx, R * D)
    check(precision, dev.get(ddx), w_dx, "residual_add_bwd")


@pytest.mark.parametrize("padded", [True, False])
def test_loss(env, rng, padded):
    """padded: wte has readable rows past V (as in the flat buffer), so the GEMMs run over the
    aligned ldv columns; else over exactly V."""
    precision, o, dev = env
    x = rounded(rng.normal(0, 1, (B, T, D)), precision)
    ldv = -(-V // 64) * 64
    wte_rows = ldv + 5 if padded else V
    wte_buf = rounded(rng.normal(0, 0.3, (wte_rows, D)), precision)
    wte = wte_buf[:V]
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    logits, row_sum, losses = np.empty((R, V)), np.empty(R), np.empty(R)
    N = R
    npo.loss_fwd(x.reshape(N, D), wte, targets.reshape(N), logits, row_sum, losses)
    dxp, dw, dt = dev.put(tm(x)), dev.put(wte_buf), dev.put(targets, "i32")
    dlogits, lse, dlosses = dev.empty((R, ldv), "f32"), dev.empty((R,), "f32"), dev.empty(
        (R,), "f32")
    o.loss_fwd(dxp, dw, dt, dlogits, lse, dlosses, B, T, V, ldv, D, wte_rows)
    check("fp32" if precision == "fp32" else "bf16", bm(dev.get(dlosses).reshape(T, B)),
          losses.reshape(B, T), "loss_fwd losses")

    scale = 2.5 / N
    g0 = rng.normal(0, 1, (V, D))
    w_dx, w_dwte = np.empty((N, D)), g0.copy()
    npo.loss_bwd(x.reshape(N, D), wte, targets.reshape(N), logits, row_sum, scale, w_dx, w_dwte,
                 np.empty((N, D)), np.empty(V * D))
    ddx, ddw = dev.empty((T, B, D)), dev.put(g0, "f32")
    o.loss_bwd(dxp, dw, dt, dlogits, lse, dev.put(np.array([scale]), "f32"), ddx, ddw,
               dev.empty((R, ldv)), B, T, V, ldv, D, wte_rows)
    check(precision, bm(dev.get(ddx)).reshape(N, D), w_dx, "loss_bwd dx")
    check(precision, dev.get(ddw) - g0, w_dwte - g0, "loss_bwd dwte")


def test_grad_norm_scale_adamw(env, rng):
    precision, o, dev = env
    from engine.backends.cuda.optim_ops import NORM_BLOCKS

    n = 100_003
    g = rng.normal(0, 1, n).astype(np.float32)
    dg = dev.put(g, "f32")
    parts, norm = dev.empty((NORM_BLOCKS,), "f32"), dev.empty((1,), "f32")
    o.grad_norm_partial(dg, n, parts)
    o.grad_norm_final(parts, norm)
    want = npo.grad_norm_final(npo.grad_norm_partial(g.astype(np.float64)))
    assert abs(dev.get(norm)[0] - want) <= 1e-5 * want
    o.grad_norm_partial(dg, n, parts, 0.5)  # a pending scale, applied while reading
    o.grad_norm_final(parts, norm)
    assert abs(dev.get(norm)[0] - 0.5 * want) <= 1e-5 * want
    o.grad_scale(dg, n, 0.25)
    check("fp32", dev.get(dg), g * 0.25, "grad_scale")
    g[7] = np.inf
    o.grad_norm_partial(dev.put(g, "f32"), n, parts)
    o.grad_norm_final(parts, norm)
    assert not np.isfinite(dev.get(norm)[0])

    # AdamW on three "tensors": 2-D (decay), 1-D (none), 2-D (decay)
    seg = np.array([0, 60_000, 60_100, n], dtype=np.int64)
    decay = np.array([1, 0, 1], dtype=np.int32)
    mask = np.repeat(decay, np.diff(seg)).astype(np.float64)
    p, gg = rng.normal(0, 1, n), rng.normal(0, 1, n)
    m, v = rng.normal(0, 0.1, n), rng.uniform(0, 0.1, n)
    dp, dgg, dm, dv = (dev.put(a, "f32") for a in (p, gg, m, v))
    plp = dev.empty((n,))
    dseg = dev.put(seg.view(np.int32), "i32")  # int64 pairs, uploaded as raw int32 words
    wp, wm, wv = (a.astype(np.float32).astype(np.float64) for a in (p, m, v))
    g64 = gg.astype(np.float32).astype(np.float64)
    for t, gs in ((1, 1.0), (2, 0.5), (3, 1.0)):  # t = 2: a pending clip scale folded in
        npo.adamw(wp, g64 * gs, wm, wv, mask, 1e-2, 0.9, 0.95, 1e-8, 0.1, t,
                  np.empty((2, 16384)))
        o.adamw(dp, plp, dgg, dm, dv, dseg, dev.put(decay, "i32"), 3, n, 1e-2, 0.9, 0.95, 1e-8,
                0.1, t, gs)
    check("fp32", dev.get(dp), wp, "adamw params")
    check("fp32", dev.get(dm), wm, "adamw m")
    check("fp32", dev.get(dv), wv, "adamw v")
    check(precision, dev.get(plp), wp, "adamw low-precision copy")
    assert np.array_equal(dev.get(plp), rounded(dev.get(dp), precision))
