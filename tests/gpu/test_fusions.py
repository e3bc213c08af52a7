"""Each fused kernel against the unfused kernels it replaces (the reference stays reachable:
Ops' unfused methods, and cuda_backend(fusions=False)), on fresh random inputs: the fused ones are
written to give the same bits, and these tests hold them to that. Then the fused step of the
backend (one graph: zero, forward, backward, norm, clip, AdamW) against the step the trainer
drives from the host; and the choices of the config's gpu section that change the bits (Q, K,
V in rows, the logits in the compute precision) against the path without them, within stated
bounds instead of bits."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from cudabk import cuda_backend
from devarrays import DevArrays, check_close, rounded

from engine.model.layout import ModelShapes, init_params, n_params, tensor_table

pytestmark = pytest.mark.gpu

B, T, H = 3, 37, 4
R = B * T


@pytest.fixture(params=["fp32", "bf16"])
def env(request, gpu):
    from engine.backends.cuda.cublas import WORKSPACE_BYTES, Cublas
    from engine.backends.cuda.ops import Ops

    precision = request.param
    dev = DevArrays(gpu.drv, precision)
    ws = dev.empty((WORKSPACE_BYTES // 4,), "f32")
    blas = Cublas(gpu.stream.handle, ws, WORKSPACE_BYTES)
    o = Ops(gpu.kernels(precision), blas, gpu.stream, precision)
    yield precision, o, dev
    gpu.stream.synchronize()
    blas.close()
    dev.free()


def same(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert np.all(np.isfinite(a)), f"{what}: unwritten (NaN) elements"
    assert np.array_equal(a, b), f"{what}: fused and unfused differ (max |diff| " \
                                 f"{np.max(np.abs(a - b)):.3g})"


@pytest.mark.parametrize("D", [64, 384, 36, 1024, 2048])
def test_residual_layernorm_is_residual_add_then_layernorm(env, rng, D):
    """D = 64, 384: the vector path; 36 (bf16: not whole 16-byte vectors): the scalar path;
    1024 (fp32) and 2048 (bf16, fp16): the _wide kernels'."""
    precision, o, dev = env
    a, b = (dev.put(rounded(rng.normal(0.2, 1.5, (R, D)), precision)) for _ in range(2))
    gamma, beta = dev.put(rng.normal(1, 0.2, D), "f32"), dev.put(rng.normal(0, 0.2, D), "f32")
    outs = []
    for fused in (True, False):
        xsum, out = dev.empty((R, D)), dev.empty((R, D))
        mean, rstd = dev.empty((R,), "f32"), dev.empty((R,), "f32")
        if fused:
            o.residual_layernorm_fwd(a, b, xsum, gamma, beta, out, mean, rstd, R, D)
        else:
            o.residual_add(a, b, xsum, R * D)
            o.layernorm_fwd(xsum, gamma, beta, out, mean, rstd, R, D)
        outs.append([dev.get(p) for p in (xsum, out, mean, rstd)])
    for name, f, u in zip(("xsum", "out", "mean", "rstd"), *outs, strict=True):
        same(f, u, f"residual_layernorm_fwd {name} D={D}")


@pytest.mark.parametrize("D", [64, 384, 768])
@pytest.mark.parametrize("rows", [37 * 3, 1000])
def test_layernorm_bwd_params_vector_path_is_the_scalar_path(env, rng, D, rows):
    """k_layernorm_bwd_params on 16-byte aligned rows (vector loads) and on the same values one
    element off alignment (scalar loads): the same partial sums, bit for bit (chunks that end
    inside a warp's rows included); and against float64 sums of the same terms."""
    from engine.backends.cuda.ops import LN_ROWS_PER_CHUNK

    precision, o, dev = env
    xs = rounded(rng.normal(0.3, 2.0, (rows, D)), precision)
    gs = rounded(rng.normal(0, 1, (rows, D)), precision)
    mu, rs = rng.normal(0.3, 0.1, rows), rng.uniform(0.4, 0.6, rows)
    mean, rstd = dev.put(mu, "f32"), dev.put(rs, "f32")
    nchunk = -(-rows // LN_ROWS_PER_CHUNK)
    parts = []
    for shift in (0, 1):  # a leading element moves every row off 16-byte alignment
        pad = np.zeros(shift)
        x = dev.put(np.concatenate([pad, xs.reshape(-1)])) + shift * o.esize
        dout = dev.put(np.concatenate([pad, gs.reshape(-1)])) + shift * o.esize
        part = dev.empty((nchunk, 2 * D), "f32")
        o._go("k_layernorm_bwd_params", (-(-D // (32 * 16 // o.esize)), nchunk), part, dout, x,
              mean, rstd, rows, D, LN_ROWS_PER_CHUNK)
        parts.append(dev.get(part))
    same(parts[0], parts[1], f"layernorm_bwd_params vector/scalar D={D} rows={rows}")
    xh = (xs - np.float32(mu)[:, None].astype(np.float64)) * np.float32(rs)[:, None]
    want = np.concatenate([(gs * xh).sum(0), gs.sum(0)])
    check_close(parts[0].sum(0), want, 1e-5, "layernorm_bwd_params sums", "fp32")


@pytest.mark.parametrize("V", [301, 13001])
def test_loss_fwd_bwd_is_loss_fwd_then_loss_bwd(env, rng, V):
    """V = 301: the row kept in registers; 13001 (past LOSS_OCTETS octets a thread, ops.LOSS_ROW_MAX
    columns): the row streamed from memory on each pass."""
    precision, o, dev = env
    D = 64
    ldv = -(-V // 64) * 64
    x = dev.put(rounded(rng.normal(0, 1, (T, B, D)), precision))
    wte = dev.put(rounded(rng.normal(0, 0.3, (ldv + 5, D)), precision))
    targets = dev.put(rng.integers(0, V, (B, T)), "i32")
    scale = dev.put(np.array([2.5 / R]), "f32")
    outs = []
    for fused in (True, False):
        logits, lse, losses = (dev.empty((R, ldv), "f32"), dev.empty((R,), "f32"),
                               dev.empty((R,), "f32"))
        dlogits = dev.empty((R, ldv))
        if fused:
            o.loss_fwd_bwd(x, wte, targets, logits, lse, losses, scale, dlogits, B, T, V, ldv, D,
                           ldv + 5)
        else:
            o.loss_fwd(x, wte, targets, logits, lse, losses, B, T, V, ldv, D, ldv + 5)
            o._go("k_loss_bwd", R, dlogits, logits, lse, targets, scale, B, T, V, ldv)
        outs.append([dev.get(p) for p in (losses, lse, dlogits)])
    for name, f, u in zip(("losses", "lse", "dlogits"), *outs, strict=True):
        same(f, u, f"loss_fwd_bwd {name}")


@pytest.mark.parametrize("env", ["fp32", "bf16", "fp16"], indirect=True)
@pytest.mark.parametrize("V", [301, 13001])
def test_loss_kernels_on_logits_in_the_compute_precision_give_the_float_kernels_bits(env, rng, V):
    """k_loss_fwd_lp and k_loss_fwd_bwd_lp (CudaBackend.logits_lp) on z stored as act_t against
    k_loss_fwd and k_loss_fwd_bwd on the same values stored as float: the same losses, lse and
    dlogits, with dlogits written over the logits where a row fits the registers (V = 301) and
    apart where it is streamed (13001). Then ops.loss_fwd(lp=True): the GEMM's output, rounded
    to act_t, is what the loss kernel read."""
    from engine.backends.cuda.ops import LOSS_ROW_MAX

    precision, o, dev = env
    D = 64
    ldv = -(-V // 64) * 64
    z = rounded(rng.normal(0, 3, (R, ldv)), precision)
    targets = dev.put(rng.integers(0, V, (B, T)), "i32")
    scale = dev.put(np.array([2.5 / R]), "f32")
    outs = []
    for lp in (False, True):
        logits = dev.put(z, "act" if lp else "f32")
        lse, losses = dev.empty((R,), "f32"), dev.empty((R,), "f32")
        o._go("k_loss_fwd_lp" if lp else "k_loss_fwd", R, losses, lse, logits, targets, B, T, V,
              ldv)
        fwd = [dev.get(p) for p in (losses, lse)]
        in_place = lp and ldv <= LOSS_ROW_MAX
        dlogits = logits if in_place else dev.empty((R, ldv))
        o._go("k_loss_fwd_bwd_lp" if lp else "k_loss_fwd_bwd", R, losses, lse, dlogits, logits,
              targets, scale, B, T, V, ldv)
        outs.append([*fwd, *(dev.get(p) for p in (losses, lse, dlogits))])
    for name, f, u in zip(("losses", "lse", "fused losses", "fused lse", "dlogits"), *outs,
                          strict=True):
        same(f, u, f"loss kernels on act_t logits, {name} (V={V})")
    assert (V == 301) == (ldv <= LOSS_ROW_MAX)
    x = dev.put(rounded(rng.normal(0, 1, (T, B, D)), precision))
    wte = dev.put(rounded(rng.normal(0, 0.3, (ldv + 5, D)), precision))
    logits, lse, losses = dev.empty((R, ldv)), dev.empty((R,), "f32"), dev.empty((R,), "f32")
    o.loss_fwd(x, wte, targets, logits, lse, losses, B, T, V, ldv, D, ldv + 5, lp=True)
    got = dev.get(losses)
    z32 = dev.put(dev.get(logits), "f32")  # the act_t values, exactly, as float
    o._go("k_loss_fwd", R, losses, lse, z32, targets, B, T, V, ldv)
    same(got, dev.get(losses), f"ops.loss_fwd(lp=True) (V={V})")


def test_grad_norm_ranges_launched_apart_are_the_ranges_launched_together(env, rng):
    """k_grad_norm_ranges: each range's partials are the same bits whether its range is launched
    alone (as the one-graph step's backward completes it) or with every other (the host-driven
    grad_norm), with the scale given or read from the device; the norm within float rounding
    of numpy's float64 one; a one-group range, and a tail past the last float4 group, counted."""
    from engine.backends.cuda.optim_ops import NORM_RANGE_BLOCKS

    _precision, o, dev = env
    cuts = np.array([0, 4, 100_004, 612_345], dtype=np.int64)  # begins: multiples of 4
    n, nr = int(cuts[-1]), len(cuts) - 1
    g_host = rng.normal(0, 1, n).astype(np.float32)
    g = dev.put(g_host, "f32")
    table = dev.put(cuts.view(np.int32), "i32")
    gs = dev.put(np.array([0.37]), "f32")
    got = []
    for apart, on_device in ((False, False), (True, False), (True, True)):
        parts, norm = dev.empty((NORM_RANGE_BLOCKS * nr,), "f32"), dev.empty((1,), "f32")
        kw = {"gs_dev": gs} if on_device else {"gs": 0.37}
        for first, count in ([(r, 1) for r in reversed(range(nr))] if apart else [(0, nr)]):
            o.grad_norm_ranges(g, table, first, count, parts, **kw)
        o.grad_norm_final(parts, norm, NORM_RANGE_BLOCKS * nr)
        got.append((dev.get(parts), dev.get(norm)))
    for parts, norm in got[1:]:
        same(parts, got[0][0], "grad_norm_ranges partials, apart against together")
        same(norm, got[0][1], "grad_norm_ranges norm, apart against together")
    scaled = g_host.astype(np.float64) * np.float32(0.37)
    want = float(np.sqrt(np.dot(scaled, scaled)))
    assert abs(float(got[0][1][0]) - want) <= 1e-5 * want
    per_range = got[0][0].reshape(nr, NORM_RANGE_BLOCKS).astype(np.float64).sum(axis=1)
    for r in range(nr):
        x = scaled[cuts[r]:cuts[r + 1]]
        assert abs(per_range[r] - np.dot(x, x)) <= 1e-5 * max(np.dot(x, x), 1e-30), f"range {r}"


@pytest.mark.parametrize("case", ["clip", "no clip", "non-finite"])
def test_adamw_step_is_the_host_driven_step(env, rng, case):
    """k_step_clip (clip and skip decided on the device) then k_adamw_step, in three ranges cut
    inside tensors as a deferred update is cut by layer, against k_adamw given the clip the
    host would compute; a non-finite norm changes nothing."""
    from engine.backends.cuda.buffers import HP_FIELDS, UPD_WORDS

    _precision, o, dev = env
    n = 100_003
    seg = np.array([0, 60_000, 60_100, n], dtype=np.int64)
    decay = np.array([1, 0, 1], dtype=np.int32)
    p, g = rng.normal(0, 1, n), rng.normal(0, 1, n)
    m, v = rng.normal(0, 0.1, n), rng.uniform(0, 0.1, n)
    norm = {"clip": 3.7, "no clip": 0.6, "non-finite": np.inf}[case]
    t, max_norm, gm = 7, 1.0, 0.5
    b1, b2 = 0.9, 0.95
    from engine.backends.cuda.optimizer import hyper_parameters

    hp = hyper_parameters(gm, 1e-2, b1, b2, 1e-8, 0.1, t, max_norm)
    outs = []
    for fused in (True, False):
        dp, dg, dm, dv = (dev.put(a, "f32") for a in (p, g, m, v))
        plp = dev.put(np.zeros(n))
        dseg, ddec = dev.put(seg.view(np.int32), "i32"), dev.put(decay, "i32")
        if fused:
            dhp = dev.put(np.array([hp[k] for k in HP_FIELDS]), "f32")
            clip = dev.put(np.array([7.0]), "f32")
            skipped = dev.put(np.array([7]), "i32")
            upd = dev.put(np.zeros(UPD_WORDS), "f32")
            o.step_clip(upd, dhp, dev.put(np.array([norm]), "f32"), clip, skipped)
            for begin, end in ((0, 4_000), (4_000, 60_052), (60_052, n)):
                o.adamw_step(dp, plp, dg, dm, dv, dseg, ddec, 3, begin, end, upd)
            assert dev.get(skipped)[0] == (0 if np.isfinite(norm) else 1)
            finite_clip = norm > max_norm and np.isfinite(norm)
            want = np.float32(max_norm) / np.float32(norm) if finite_clip else np.float32(1)
            assert dev.get(clip)[0] == want
        elif np.isfinite(norm):
            c = np.float32(max_norm) / np.float32(norm) if norm > max_norm else np.float32(1)
            o.grad_scale(dg, n, gm)  # g·gm stored, then the clip folded into k_adamw
            o.adamw(dp, plp, dg, dm, dv, dseg, ddec, 3, n, 1e-2, b1, b2, 1e-8, 0.1, t, float(c))
        outs.append([dev.get(a) for a in (dp, dm, dv, plp)])
    for name, f, u in zip(("params", "m", "v", "params_lp"), *outs, strict=True):
        same(f, u, f"adamw_step {name} ({case})")
    if not np.isfinite(norm):
        assert np.array_equal(outs[0][0], p.astype(np.float32).astype(np.float64))


def _lp_table(s: ModelShapes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seg_start, seg_decay, seg_qkv) as CudaBuild uploads them."""
    from engine.backends.cuda.buffers import qkv_seg_table

    table = tensor_table(s)
    seg = np.array([t.offset for t in table] + [n_params(s)], np.int64)
    return seg, np.array([len(t.shape) == 2 for t in table], np.int32), qkv_seg_table(s)


@pytest.mark.parametrize("d", [37, 64])
def test_the_gemm_copy_keeps_w_q_w_k_w_v_in_rows(env, rng, d):
    """The optimizer kernels with the seg_qkv table (CudaBackend with Q, K, V in rows):
    k_params_to_lp, then k_adamw, then k_step_clip + k_adamw_step in three ranges cut inside
    layer 0's W_Q and layer 1's W_K (not at a row's start). After each, the GEMM copy (NaN
    before, so every element must be written) is the masters rounded to the precision (numpy's
    round to nearest even, devarrays.rounded), bit for bit, each layer's W_Q, W_K, W_V at
    buffers.lp_positions (= np.concatenate of the three along axis 1, test_qkv_rows) and every
    other element in place; the masters, m and v are those of the same launches without the
    table, bit for bit (the table changes where the copy goes, nothing else: decay included).
    d = 37: tensor boundaries and W_j's rows inside float4 groups; 64: aligned."""
    from engine.backends.cuda.buffers import HP_FIELDS, UPD_WORDS, lp_positions
    from engine.backends.cuda.optimizer import hyper_parameters

    precision, o, dev = env
    s = ModelShapes(n_layer=2, d_model=d, n_head=1, d_ff=40, vocab_size=53, seq_len=7)
    n, (seg, decay, seg_qkv) = n_params(s), _lp_table(s)
    nseg = len(decay)
    pos = lp_positions(seg, seg_qkv, d)
    dseg, ddec = dev.put(seg.view(np.int32), "i32"), dev.put(decay, "i32")
    dqkv = dev.put(seg_qkv, "i32")
    off = {t.name: t.offset for t in tensor_table(s)}
    cut1 = (off["h.0.attn.W_Q"] + 5 * d + 3) // 4 * 4
    cut2 = (off["h.1.attn.W_K"] + 2 * d + 11) // 4 * 4
    p, g = rng.normal(0, 1, n), rng.normal(0, 1, n)
    m, v = rng.normal(0, 0.1, n), rng.uniform(0, 0.1, n)
    hp = hyper_parameters(0.5, 1e-2, 0.9, 0.95, 1e-8, 0.1, 3, 1.0)
    outs = []
    for table in (True, False):
        rows = {"seg_qkv": dqkv, "d": d} if table else {}
        dp, dg, dm, dv = (dev.put(a, "f32") for a in (p, g, m, v))
        stages = []  # (kernel, the GEMM copy it wrote, the masters then)
        plp = dev.empty((n,))
        o.params_to_lp(plp, dp, n, seg_start=dseg, nseg=nseg, **rows)
        stages.append(("k_params_to_lp", dev.get(plp), dev.get(dp)))
        plp = dev.empty((n,))
        o.adamw(dp, plp, dg, dm, dv, dseg, ddec, nseg, n, 1e-2, 0.9, 0.95, 1e-8, 0.1, 2, 0.7,
                **rows)
        stages.append(("k_adamw", dev.get(plp), dev.get(dp)))
        upd = dev.put(np.zeros(UPD_WORDS), "f32")
        o.step_clip(upd, dev.put(np.array([hp[k] for k in HP_FIELDS]), "f32"),
                    dev.put(np.array([3.7]), "f32"), dev.put(np.array([1.0]), "f32"),
                    dev.put(np.array([0]), "i32"))
        plp = dev.empty((n,))
        for begin, end in ((0, cut1), (cut1, cut2), (cut2, n)):
            o.adamw_step(dp, plp, dg, dm, dv, dseg, ddec, nseg, begin, end, upd, **rows)
        stages.append(("k_adamw_step", dev.get(plp), dev.get(dp)))
        for name, lp, master in stages:
            want = np.empty(n)  # flat element i at pos[i] (each layer's W_Q, W_K, W_V side by
            want[pos if table else np.arange(n)] = rounded(master, precision)  # side), or at i
            assert np.array_equal(lp, want), \
                f"{name}: the GEMM copy ({precision}, {'rows' if table else 'flat'})"
        outs.append([dev.get(a) for a in (dp, dm, dv)])
    for name, a, b in zip(("params", "m", "v"), *outs, strict=True):
        same(a, b, f"optimizer with and without seg_qkv: {name}")


# --- the backend: fused step against the unfused one ------------------------------------------

SHAPES = ModelShapes(n_layer=2, d_model=384, n_head=6, d_ff=1536, vocab_size=8449, seq_len=256)


def _steps(bk, params, steps: int, T: int, fused_step: bool, max_norm: float):
    from engine.model.optim import clip_scale

    bk.load_params(params)
    rng = np.random.default_rng(3)
    out = []
    for t in range(1, steps + 1):
        tok = rng.integers(0, 64, (4, T + 1)).astype(np.int32)
        x, y = tok[:, :-1], tok[:, 1:]
        if fused_step:
            rows, norm, clip = bk.train_step(x, y, loss_scale=1.0, grad_mult=1.0, lr=1e-3,
                                             beta1=0.9, beta2=0.95, eps=1e-8,
                                             weight_decay=0.1, t=t, max_norm=max_norm)
        else:
            bk.zero_grads()
            rows = bk.forward_backward(x, y)
            norm = bk.grad_norm()
            clip = clip_scale(norm, max_norm)
            if clip < 1.0:
                bk.grad_scale(clip)
            bk.adamw(1e-3, 0.9, 0.95, 1e-8, 0.1, t)
        out.append((rows, norm, clip))
    return out, bk.read_params()


@pytest.mark.parametrize("attention", ["cudnn", "classic"])
def test_train_step_is_the_host_driven_step(attention):
    """The one-graph step against zero_grads/forward_backward/grad_norm/adamw on the same fused
    backend: the same bits when no clipping happens (max_norm large); within float rounding of
    the clip factor (float32 division on the device, float64 on the host) when it does (cuDNN,
    Q, K, V's input gradient in one GEMM: 1.06e-5 measured on the H200)."""

    params = init_params(SHAPES, seed=5)
    for max_norm in (1e9, 0.05):
        res, plan = [], None
        for fused_step in (True, False):
            # the second backend runs the first one's GEMM algorithms, so that the bits hold
            # with the GEMMs timed at start too (gpu.gemm_tune: each start chooses its own)
            bk = cuda_backend(SHAPES, 4, "bf16", attention=attention, fusions=True,
                             gemm_plan=plan)
            plan = bk.gemm_plan
            res.append(_steps(bk, params, 3, 255, fused_step, max_norm))
            bk.close()
        (a, pa), (b, pb) = res
        if max_norm > 1e6:
            for (ra, na, ca), (rb, nb, cb) in zip(a, b, strict=True):
                assert np.array_equal(ra, rb) and na == nb and ca == cb == 1.0
            assert np.array_equal(pa, pb)
        else:
            assert all(x[2] < 1.0 for x in a), "the test means to clip"
            bound = 2e-5 if attention == "cudnn" else 1e-5
            check_close(pa, pb, bound, f"train_step vs host step, clipping ({attention})",
                        "bf16")


@pytest.mark.parametrize("max_norm", [1e9, 0.05])
def test_optimizer_step_is_the_end_of_train_step(max_norm):
    """forward_backward + optimizer_step (the path of several micro-batches, or of an all-reduce
    outside the step) against the one-graph train_step with float32 gradients
    (gpu.grads_low_precision false: the others' kind; tests/gpu/test_grads_lp.py compares the
    bf16 ones): the same bits, clipped or not; and the gradient buckets of a data-parallel step
    tile the flat gradient in backward order."""

    params = init_params(SHAPES, seed=6)
    rng = np.random.default_rng(4)
    toks = [rng.integers(0, 64, (4, 257)).astype(np.int32) for _ in range(3)]
    got, plan = [], None
    for fused in (True, False):
        bk = cuda_backend(SHAPES, 4, "bf16", fusions=True, gemm_plan=plan,  # the same GEMMs
                          grads_low_precision=False)
        plan = bk.gemm_plan
        bk.load_params(params)
        hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_norm=max_norm)
        out = []
        for t, tok in enumerate(toks, 1):
            x, y = tok[:, :-1], tok[:, 1:]
            if fused:
                rows, norm, clip = bk.train_step(x, y, loss_scale=1.0, grad_mult=1.0, t=t, **hp)
            else:
                bk.zero_grads()
                rows = bk.forward_backward(x, y)
                norm, clip = bk.optimizer_step(grad_mult=1.0, t=t, **hp)
            out.append((rows, norm, clip))
        got.append((out, bk.read_params(), bk.read_optimizer()))
        buckets = bk.grad_buckets()
        bk.close()
    (a, pa, (ma, va)), (b, pb, (mb, vb)) = got
    for (ra, na, ca), (rb, nb, cb) in zip(a, b, strict=True):
        assert np.array_equal(ra, rb) and na == nb and ca == cb
    assert (max_norm < 1) == all(x[2] < 1.0 for x in a), "clipped exactly when meant to"
    assert np.array_equal(pa, pb) and np.array_equal(ma, mb) and np.array_equal(va, vb)
    spans = sorted(buckets)
    assert spans[0][0] == 0 and all(f + c == g for (f, c), (g, _) in itertools.pairwise(spans))
    assert sum(c for _, c in buckets) == pa.size and len(buckets) == SHAPES.n_layer + 1
    assert buckets[-1][0] == 0 and buckets[0][0] > buckets[1][0]  # wte last; last layer first


@pytest.mark.parametrize("attention", ["cudnn", "classic"])
def test_fused_backend_tracks_the_unfused_one(attention):
    """fusions on (cuBLASLt GEMMs, second stream, fused kernels, one-graph step) against
    fusions off (the unfused reference) from the same weights: losses and weights after three
    steps agree to bf16 rounding (other GEMM algorithms sum in other orders)."""

    params = init_params(SHAPES, seed=8)
    res = []
    for fusions in (True, False):
        bk = cuda_backend(SHAPES, 4, "bf16", attention=attention, fusions=fusions)
        res.append(_steps(bk, params, 3, 256, fusions, 1.0))
        bk.close()
    (a, pa), (b, pb) = res
    for (ra, na, _), (rb, nb, _) in zip(a, b, strict=True):
        check_close(ra, rb, 1e-2, f"fused vs unfused losses ({attention})", "bf16")
        check_close(np.array([na]), np.array([nb]), 5e-2, f"fused vs unfused norm ({attention})",
                    "bf16")
    check_close(pa - params, pb - params, 5e-2, f"fused vs unfused updates ({attention})",
                "bf16")


def test_kernels_per_step_fall():
    """The fused step's graph holds far fewer kernels than the unfused forward/backward graph
    plus the optimizer's launches (the benchmark prints these counts less the k_fill nodes that
    stand for memsets, graph_fills)."""

    counts = {}
    tok = np.random.default_rng(0).integers(0, 64, (4, 257)).astype(np.int32)
    for fusions, attention in ((False, "classic"), (True, "cudnn")):
        bk = cuda_backend(SHAPES, 4, "bf16", attention=attention, fusions=fusions)
        if fusions:  # two steps: the second's graph holds the first's deferred update too
            for t in (1, 2):
                bk.train_step(tok[:, :-1], tok[:, 1:], loss_scale=1.0, grad_mult=1.0, lr=1e-3,
                              beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, t=t,
                              max_norm=1.0)
            counts[fusions] = bk.graph_nodes("step").get("kernel", 0)
        else:
            bk.forward_backward(tok[:, :-1], tok[:, 1:])
            counts[fusions] = bk.graph_nodes("fb").get("kernel", 0) + 3  # norm x2, adamw
        bk.close()
    print(f"kernels per step (2 layers): unfused {counts[False]}, fused {counts[True]}")
    # (the fused LayerNorm backward is off by default: the count is that of the default path)
    assert 0 < counts[True] < counts[False], counts


@pytest.mark.parametrize("fusions", [True, False])
def test_adamw_decays_exactly_the_2d_tensors(fusions):
    """The optimizer's tensor table on the device is the layout's (it was once zeroed by the
    start-up memset of the scratch group: k_adamw then searched a table of zeros, read past its
    shared arrays and decayed tensors at random). With zero gradients an AdamW step changes only
    the 2-D tensors, by p·(1 - lr·wd); 1-D tensors keep their bits."""

    params = init_params(SHAPES, seed=4)
    bk = cuda_backend(SHAPES, 4, "fp32", fusions=fusions)
    flat = bk.build.flat
    try:
        starts = np.empty(flat.nseg + 1, np.int64)
        bk.drv.memcpy_dtoh(starts, bk.build.plan["seg_start"])
        assert np.array_equal(starts, flat.seg_start) and starts[-1] == flat.n
        bk.load_params(params)
        bk.zero_grads()
        bk.adamw(1e-2, 0.9, 0.95, 1e-8, 0.1, 1)
        p = bk.read_params()
    finally:
        bk.close()
    for t in flat.table:
        a, b = params[t.offset : t.offset + t.size], p[t.offset : t.offset + t.size]
        if len(t.shape) == 2:
            check_close(b, a * np.float32(1 - 1e-3), 1e-6, f"decayed {t.name}", "fp32")
        else:
            assert np.array_equal(a, b), f"{t.name} is 1-D and must not decay"


def test_qkv_rows_track_the_slabs():
    """Q, K, V in rows (the default: one GEMM with N = 3d forward, cuDNN reading Q, K, V and
    writing dQ, dK, dV in rows, one input-gradient GEMM over K = 3d, the GEMM copy's W_Q, W_K,
    W_V side by side) against the slabs and their three GEMMs each way (gpu.qkv_rows false),
    from the same weights: the sampling forward's logits (B = 1, T = 1, 77, 256) agree to 1e-2;
    losses, norms and the updates of three one-graph steps (deferred AdamW included) agree to
    bf16 rounding (the one GEMM rounds the sum once, the three after each addend); then, from
    the same weights again (Adam's moments carried on), one step of a short sequence (T = 131)
    through the full-length graph. Each backend's GEMM copy is its masters rounded (bits). Two
    backends with rows give the same bits."""
    from engine.backends.cuda.cudnn_attn import cudnn_available

    if not cudnn_available()[0]:
        pytest.skip(cudnn_available()[1])
    params = init_params(SHAPES, seed=9)
    prompt = np.random.default_rng(6).integers(0, 8449, 256)
    res, logits = {}, {}
    for rows in ("0", "1", "1 again"):
        bk = cuda_backend(SHAPES, 4, "bf16", attention="cudnn", qkv_rows=rows != "0")
        assert bk.qkv_rows == (rows != "0")
        assert ("Q, K, V in rows" in bk.describe()) == bk.qkv_rows
        bk.load_params(params)
        logits[rows] = [bk.logits_last(prompt[:t]) for t in (1, 77, 256)]
        res[rows] = (_steps(bk, params, 3, 256, True, 1.0), _steps(bk, params, 1, 131, True, 1.0))
        assert np.array_equal(bk.read_params_lp(), rounded(bk.read_params(), "bf16")), rows
        bk.close()
    for t, la, lb, lc in zip((1, 77, 256), logits["0"], logits["1"], logits["1 again"],
                             strict=True):
        check_close(lb, la, 1e-2, f"qkv rows vs slabs: logits_last (T = {t})", "bf16")
        assert np.array_equal(lb, lc), f"logits_last (T = {t}): rows twice"
    ((a, pa), (sa, psa)), ((b, pb), (sb, psb)) = res["0"], res["1"]
    for (ra, na, _), (rb, nb, _) in zip(a + sa, b + sb, strict=True):
        check_close(rb, ra, 1e-2, "qkv rows vs slabs: losses", "bf16")
        check_close(np.array([nb]), np.array([na]), 2e-2, "qkv rows vs slabs: norm", "bf16")
    check_close(pb - params, pa - params, 5e-2, "qkv rows vs slabs: updates", "bf16")
    check_close(psb - params, psa - params, 5e-2, "qkv rows vs slabs: short-T update", "bf16")
    (c, pc), (sc, psc) = res["1 again"]
    for (rb, nb, cb), (rc, nc, cc) in zip(b + sb, c + sc, strict=True):
        assert np.array_equal(rb, rc) and nb == nc and cb == cc
    assert np.array_equal(pb, pc) and np.array_equal(psb, psc)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("rows", ["1", "0"])
def test_the_backends_gemm_copy_is_its_masters_rounded(precision, rows):
    """CudaBackend.read_params_lp (the GEMM copy, taken back to the flat layout through
    buffers.lp_positions where Q, K, V run in rows) equals read_params() rounded to the
    precision, bit for bit: after load_params, after two one-graph steps (the first's AdamW
    deferred into the second's graph, applied layer by layer beside its forward; the second's
    left pending, applied by the read), after a shorter sequence's step and after the
    host-driven adamw; and a backend given the stepped masters (a resume) rebuilds the same
    copy. With the rows (the copy permuted by k_params_to_lp and the AdamW kernels) and
    without (gpu.qkv_rows false, in place)."""
    params = init_params(SHAPES, seed=12)
    bk = cuda_backend(SHAPES, 4, precision, qkv_rows=rows == "1")
    other = None
    try:
        if bk.attention == "cudnn":
            assert bk.qkv_rows == (rows == "1")

        def check(when: str) -> np.ndarray:
            lp, p = bk.read_params_lp(), bk.read_params()
            assert np.array_equal(lp, rounded(p, precision)), f"GEMM copy {when} ({precision})"
            return lp

        bk.load_params(params)
        check("after load_params")
        _steps(bk, params, 2, 256, True, 1.0)
        check("after deferred one-graph steps")
        _steps(bk, params, 1, 131, True, 1.0)
        check("after a short sequence's step")
        _steps(bk, params, 1, 256, False, 1.0)
        lp = check("after the host-driven adamw")
        other = cuda_backend(SHAPES, 4, precision, qkv_rows=rows == "1")
        other.load_params(bk.read_params())
        assert np.array_equal(other.read_params_lp(), lp), "the GEMM copy rebuilt on a resume"
    finally:
        bk.close()
        if other is not None:
            other.close()


def test_logits_in_the_compute_precision_track_float32_logits():
    """gpu.logits_low_precision (default on: bf16 logits, dlogits over them) against float32
    logits from the same weights: the row losses within 1e-2 and the gradient within 5e-2 (both
    sides carry bf16 rounding, as the other bf16 layout change does: test_qkv_rows_track_the_
    slabs; the logits' own is 2^-9 of z)."""

    params = init_params(SHAPES, seed=11)
    tok = np.random.default_rng(6).integers(0, 64, (4, 257)).astype(np.int32)
    res = {}
    for on in (False, True):
        bk = cuda_backend(SHAPES, 4, "bf16", logits_low_precision=on)
        assert bk.logits_lp == on and bk.resolved["logits_low_precision"] == on
        assert (bk.build.train.at("dlogits") == bk.build.train.at("logits")) == bk.logits_lp
        bk.load_params(params)
        bk.zero_grads()
        rows = bk.forward_backward(tok[:, :-1], tok[:, 1:])
        res[on] = (rows, bk.read_grads())
        bk.close()
    (r0, g0), (r1, g1) = res[False], res[True]
    check_close(r1, r0, 1e-2, "bf16 logits vs float32: row losses", "bf16")
    check_close(g1, g0, 5e-2, "bf16 logits vs float32: gradient", "bf16")
    assert not np.array_equal(g1, g0), "the setting did not change the path"
