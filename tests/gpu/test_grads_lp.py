"""The fused bf16 step's weight gradients in bf16 (gpu.grads_low_precision, CudaBackend.grads_lp):
the layers' weight-gradient GEMMs write bf16 into grads_lp, the norm and AdamW read them there, and
anything else that reads or adds to the gradients gets them back as float32 first. Checked
against the same backend with float32 gradients (the setting false) on the same weights and
tokens, and against itself (the step's norm equals the host's norm of what read_grads returns)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from cudabk import cuda_backend
from devarrays import DevArrays, rounded

from engine.model.layout import ModelShapes, init_params
from tests.test_grads_lp_plan import kind_of_each_element

pytestmark = pytest.mark.gpu

SHAPES = ModelShapes(n_layer=2, d_model=128, n_head=2, d_ff=512, vocab_size=8449, seq_len=64)
HP = {"loss_scale": 1.0, "lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
      "weight_decay": 0.1, "max_norm": 1.0}


def _backend(monkeypatch: pytest.MonkeyPatch, on: bool, precision: str = "bf16"):
    bk = cuda_backend(SHAPES, 4, precision, grads_low_precision=on)
    assert bk.grads_lp == on
    assert ("weight gradients in bf16" in bk.describe()) == on
    bk.load_params(init_params(SHAPES, seed=11))
    return bk


def _tokens(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    tok = np.random.default_rng(7).integers(0, SHAPES.vocab_size, (steps, 4, 65)).astype(np.int32)
    return [(t[:, :-1], t[:, 1:]) for t in tok]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_step_reads_the_bf16_gradients_it_wrote(monkeypatch: pytest.MonkeyPatch,
                                                    precision: str) -> None:
    """One step each way on the same weights and tokens. The gradients: the layers' matrices
    bf16 values within bf16's rounding of the float32 ones, everything else the same bits. The
    norm: the step's equals the host's over read_grads (so the norm read grads_lp where the
    matrices are and nothing else), and is within bf16's rounding of the float32 step's. The
    update: Adam's first step is about lr·sign(g), so the weights after it agree closely (AdamW
    read each gradient at its own place). In fp8 the FP8 weight-gradient GEMMs write bf16
    too."""
    x = _tokens(1)[0]
    mask = kind_of_each_element(SHAPES).astype(bool)
    out = {}
    for on in (True, False):
        bk = _backend(monkeypatch, on, precision)
        if precision == "fp8":  # the FP8 weight-gradient GEMMs ran (none fell back to bf16)
            assert {"fc1 wgrad", "fc2 wgrad", "proj wgrad"} <= set(bk.fp8_gemms), \
                bk.build.fp8_ops.notes
        p0 = bk.read_params()
        rows, norm, clip = bk.train_step(*x, grad_mult=1.0, t=1, **HP)
        g = bk.read_grads()
        p = bk.read_params()
        # the GEMM copy is the masters rounded, each element in its place (AdamW's walk)
        assert np.array_equal(bk.read_params_lp(), rounded(p.astype(np.float64), "bf16"))
        out[on] = (rows, norm, clip, g, p, p0, bk.grad_norm())
        bk.close()
    rows, norm, clip, g, p, p0, host_norm = out[True]
    rows_f, norm_f, clip_f, g_f, p_f, p0_f, _ = out[False]
    assert np.array_equal(p0, p0_f)
    assert np.array_equal(rows, rows_f)  # the forward does not depend on where dW goes
    # the matrices' gradients are bf16 values (the low 16 bits of their float32 zero)
    assert not np.any(g[mask].view(np.uint32) & 0xFFFF)
    assert np.any(g_f[mask].view(np.uint32) & 0xFFFF)  # the float32 ones are not
    # bf16's rounding (2^-9), and the float32 sums of GEMM algorithms that may differ
    np.testing.assert_allclose(g[mask], g_f[mask], rtol=2**-7, atol=1e-7)
    assert np.array_equal(g[~mask], g_f[~mask])
    assert float(np.abs(g_f[mask]).max()) > 1e-4  # the comparison is not vacuous
    assert norm == host_norm  # the same partials, read from bf16 or from their float32 copy
    assert norm == pytest.approx(norm_f, rel=1e-3) and clip == pytest.approx(clip_f, rel=1e-3)
    step, step_f = p - p0, p_f - p0
    assert float(np.abs(step).max()) > 0.5 * HP["lr"]
    big = np.abs(g_f) > 1e-6  # where eps does not decide the step's size
    np.testing.assert_allclose(step[big], step_f[big], rtol=1e-3, atol=1e-7)


def test_steps_then_accumulation_agree_with_float32_gradients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two queued steps (the second's graph applies the first's update beside its forward,
    reading grads_lp), a validation forward, a shorter sequence (float32 gradients zeroed and
    added), a step, then a forward_backward onto the step's gradients (written back to float32
    first), a gradient scale, the host-driven norm and AdamW: losses, norms and weights within
    bf16's rounding of the same calls with float32 gradients throughout, and the GEMM copy the
    masters rounded."""
    xs = _tokens(6)
    res = {}
    for on in (True, False):
        bk = _backend(monkeypatch, on)
        got = []
        for t in (1, 2):
            bk.launch_step(*xs[t - 1], grad_mult=1.0, t=t, **HP)
        got += [bk.step_result(), bk.step_result()]
        got.append((bk.forward_loss(*xs[2]),))
        short = (xs[3][0][:, :40], xs[3][1][:, :40])
        got.append(bk.train_step(*short, grad_mult=1.0, t=3, **HP))
        got.append(bk.train_step(*xs[4], grad_mult=1.0, t=4, **HP))
        got.append((bk.forward_backward(*xs[5]),))  # onto step 4's gradients
        bk.grad_scale(0.5)
        got.append((np.array([bk.grad_norm()]),))
        bk.adamw(HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"], 5)
        res[on] = (got, bk.read_params(), bk.read_grads())
        assert np.array_equal(bk.read_params_lp(), rounded(res[on][1].astype(np.float64),
                                                           "bf16"))
        bk.close()
    (got, p, g), (got_f, p_f, g_f) = res[True], res[False]
    for a, b in zip(got, got_f, strict=True):
        np.testing.assert_allclose(a[0], b[0], rtol=2e-3)  # the rows' losses
        for u, v in zip(a[1:], b[1:], strict=True):  # norm, clip
            assert u == pytest.approx(v, rel=5e-3)
    # Adam moves every element about lr a step whatever its gradient's size, so where a
    # gradient is near zero the two trajectories may step apart: compared as a whole, against
    # how far the weights moved (a gradient read from the wrong place moves them ~100% apart)
    moved = p_f - init_params(SHAPES, seed=11)
    assert float(np.abs(moved).max()) > 1e-3  # it trained
    assert np.linalg.norm(p - p_f) < 0.1 * np.linalg.norm(moved)
    assert np.linalg.norm(g - g_f) < 2e-2 * np.linalg.norm(g_f)


def test_two_runs_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    xs = _tokens(3)
    out = []
    for _ in range(2):
        bk = _backend(monkeypatch, True)
        rows = [bk.train_step(*x, grad_mult=1.0, t=t, **HP) for t, x in enumerate(xs, 1)]
        out.append((rows, bk.read_params(), bk.read_grads(), *bk.read_optimizer()))
        bk.close()
    (ra, *sa), (rb, *sb) = out
    for a, b in zip(ra, rb, strict=True):
        assert np.array_equal(a[0], b[0]) and a[1:] == b[1:]
    assert all(np.array_equal(u, v) for u, v in zip(sa, sb, strict=True))


# --- the kernels, on tables with tensors and ranges of every alignment ----------------------------

# five tensors, three of them (1, 3, 4) with bf16 gradients; sizes not multiples of 4, so that
# groups of four straddle tensors of both kinds (1000..1003, 70000.., 70008..) and two bf16 ones
# (130000..130003), and the last element (130332) is a bf16 tensor's lone tail
SEG = np.array([0, 1_001, 70_003, 70_010, 130_001, 130_333], np.int64)
GLP = np.array([0, 1, 0, 1, 1], np.int32)


@pytest.fixture
def ops(gpu):
    from engine.backends.cuda.ops import Ops

    dev = DevArrays(gpu.drv, "bf16")
    yield Ops(gpu.kernels("bf16"), None, gpu.stream, "bf16"), dev
    gpu.stream.synchronize()
    dev.free()


def _split(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(g: float32 gradients whose bf16 tensors hold bf16 values, mask of those tensors)."""
    n = int(SEG[-1])
    mask = np.zeros(n, bool)
    for k in np.flatnonzero(GLP):
        mask[SEG[k] : SEG[k + 1]] = True
    g = rng.normal(0, 1, n)
    g[mask] = rounded(g[mask], "bf16")
    return g, mask


def _lp_buffer(dev: DevArrays, g: np.ndarray, mask: np.ndarray) -> int:
    """grads_lp: the bf16 values where mask, NaN elsewhere (never to be read)."""
    return dev.put(np.where(mask, g, np.nan))


@pytest.mark.parametrize("case", ["clip", "no clip"])
def test_adamw_reads_a_tensors_gradient_from_grads_lp_where_seg_glp_says(ops, rng, case):
    """k_adamw_step (in ranges cut inside tensors) and k_adamw, with the bf16 tensors' gradients
    in grads_lp and NaN in their float32 places, against the same kernel given every gradient
    in float32: the same bits, and no NaN read."""
    from engine.backends.cuda.buffers import HP_FIELDS, UPD_WORDS
    from engine.backends.cuda.optimizer import hyper_parameters

    o, dev = ops
    n = int(SEG[-1])
    g, mask = _split(rng)
    p, m, v = rng.normal(0, 1, n), rng.normal(0, 0.1, n), rng.uniform(0, 0.1, n)
    hp = hyper_parameters(0.5, 1e-2, 0.9, 0.95, 1e-8, 0.1, 7, 1.0)
    norm = {"clip": 3.7, "no clip": 0.6}[case]
    decay = np.array([1, 1, 0, 1, 0], np.int32)
    dseg, ddec = dev.put(SEG.view(np.int32), "i32"), dev.put(decay, "i32")
    out = {}
    for fused, lp in itertools.product((True, False), (True, False)):
        dg = dev.put(np.where(mask, np.nan, g) if lp else g, "f32")
        glp = ({"grads_lp": _lp_buffer(dev, g, mask), "seg_glp": dev.put(GLP, "i32")} if lp
               else {})
        dp, dm, dv = (dev.put(a, "f32") for a in (p, m, v))
        plp = dev.put(np.zeros(n))
        if fused:
            upd = dev.put(np.zeros(UPD_WORDS), "f32")
            o.step_clip(upd, dev.put(np.array([hp[k] for k in HP_FIELDS]), "f32"),
                        dev.put(np.array([norm]), "f32"), dev.put(np.array([0.0]), "f32"),
                        dev.put(np.array([0]), "i32"))
            for begin, end in ((0, 1_000), (1_000, 70_004), (70_004, n)):
                o.adamw_step(dp, plp, dg, dm, dv, dseg, ddec, 5, begin, end, upd, **glp)
        else:  # the host-driven AdamW, its gradient scale the clip
            o.adamw(dp, plp, dg, dm, dv, dseg, ddec, 5, n, 1e-2, 0.9, 0.95, 1e-8, 0.1, 7,
                    min(1.0, 1.0 / norm), **glp)
        out[fused, lp] = [dev.get(a) for a in (dp, dm, dv, plp)]
    for fused in (True, False):
        for name, a, b in zip(("params", "m", "v", "params_lp"), out[fused, True],
                              out[fused, False], strict=True):
            assert np.all(np.isfinite(a)), f"{name} (fused {fused}): a NaN place was read"
            assert np.array_equal(a, b), f"{name} (fused {fused}): grads_lp against float32"
    assert not np.array_equal(out[True, True][0], p.astype(np.float32))  # it stepped


def test_the_norm_and_the_write_back_read_grads_lp_where_the_kinds_say(ops, rng):
    """k_grad_norm_ranges with kinds (the bf16 ranges read from grads_lp, NaN in their float32
    places) gives the bits of the same values all in float32; k_grads_from_lp writes exactly
    those values into the float32 places of the bf16 ranges and nothing else."""
    from engine.backends.cuda.optim_ops import NORM_RANGE_BLOCKS

    o, dev = ops
    # ranges cut at multiples of 4 (as buffers.norm_ranges makes them), kinds alternating
    # (the last, a bf16 one, ends off a group of four: its tail element by element)
    cuts = np.array([0, 1_000, 70_004, 70_008, 130_000, 130_333], np.int64)
    kinds = np.array([0, 1, 0, 1, 1], np.int32)
    n, nr = int(cuts[-1]), len(kinds)
    mask = np.repeat(kinds.astype(bool), np.diff(cuts))
    g = rng.normal(0, 1, n)
    g[mask] = rounded(g[mask], "bf16")
    table, dk = dev.put(cuts.view(np.int32), "i32"), dev.put(kinds, "i32")
    got = []
    for lp in (True, False):
        dg = dev.put(np.where(mask, np.nan, g) if lp else g, "f32")
        glp = _lp_buffer(dev, g, mask)
        parts, norm = dev.empty((NORM_RANGE_BLOCKS * nr,), "f32"), dev.empty((1,), "f32")
        kw = {"grads_lp": glp, "kinds": dk} if lp else {}
        for first, count in ((0, 2), (2, 3)):
            o.grad_norm_ranges(dg, table, first, count, parts, gs=0.37, **kw)
        o.grad_norm_final(parts, norm, NORM_RANGE_BLOCKS * nr)
        got.append((dev.get(parts), dev.get(norm)))
        if lp:
            o.grads_from_lp(dg, glp, table, dk, nr)
            back = dev.get(dg)
            assert np.array_equal(back[mask], g[mask].astype(np.float32))
            assert np.array_equal(back[~mask], g[~mask].astype(np.float32))  # untouched
    assert np.array_equal(got[0][0], got[1][0]) and np.array_equal(got[0][1], got[1][1])
    assert np.isfinite(got[0][1][0])
