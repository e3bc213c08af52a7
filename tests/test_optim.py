"""LR schedule, clipping, grad norm and AdamW against direct float64 implementations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.backends.numpy import NumpyBackend, ops
from engine.model.layout import ModelShapes, decay_mask, init_params, n_params, tensor_table
from engine.model.optim import clip_scale, lr_at

S = ModelShapes(n_layer=2, d_model=16, n_head=2, d_ff=32, vocab_size=37, seq_len=8)


def test_lr_schedule_120m_step_one_is_exact() -> None:
    assert lr_at(1, 3e-4, 2000, 50000, 0.1) == 1.5e-7


def test_lr_schedule_against_direct_formula() -> None:
    lr, warm, total, frac = 1e-3, 50, 2000, 0.1
    for step in (1, 2, 25, 50, 51, 500, 1025, 1999, 2000, 2500):
        if step <= warm:
            want = lr * step / warm
        else:
            prog = min(1.0, (step - warm) / (total - warm))
            want = frac * lr + (lr - frac * lr) * (1 + math.cos(math.pi * prog)) / 2
        assert lr_at(step, lr, warm, total, frac) == pytest.approx(want, rel=1e-12), step
    assert lr_at(warm, lr, warm, total, frac) == pytest.approx(lr, rel=1e-12)
    assert lr_at(total, lr, warm, total, frac) == pytest.approx(frac * lr, rel=1e-12)
    with pytest.raises(ValueError):
        lr_at(0, lr, warm, total, frac)


def test_clip_scale() -> None:
    assert clip_scale(0.5, 1.0) == 1.0
    assert clip_scale(1.0, 1.0) == 1.0  # at the threshold: no scaling
    assert clip_scale(4.0, 1.0) == 0.25


def trained_backend() -> NumpyBackend:
    be = NumpyBackend(S, 2)
    be.load_params(init_params(S, 3))
    seq = np.random.default_rng(4).integers(0, S.vocab_size, (2, 9)).astype(np.int32)
    be.zero_grads()
    be.forward_backward(seq[:, :-1], seq[:, 1:], loss_scale=50.0)  # norm well above 1
    return be


def test_grad_norm_and_clipping() -> None:
    # bound: fp32 sums vs a float64 reference, rtol 1e-5
    be = trained_backend()
    g64 = be.read_grads().astype(np.float64)
    ref = np.sqrt(np.sum(g64**2))
    norm = be.grad_norm()
    assert norm == pytest.approx(ref, rel=1e-5)
    assert norm > 1.0
    be.grad_scale(clip_scale(norm, 1.0))
    assert np.sqrt(np.sum(be.read_grads().astype(np.float64) ** 2)) == pytest.approx(1.0, rel=1e-5)
    # at or below max_norm nothing changes
    before = be.read_grads().copy()
    s = clip_scale(be.grad_norm(), 2.0)
    assert s == 1.0
    np.testing.assert_array_equal(be.read_grads(), before)


def test_grad_norm_partials_and_non_finite() -> None:
    g = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    partials = ops.grad_norm_partial(g, block=64)
    assert partials.shape == (16,)  # ceil(1000/64): the last block is partial
    ref = (g.astype(np.float64) ** 2)[: 15 * 64].reshape(15, 64).sum(1)
    np.testing.assert_allclose(partials[:15], ref, rtol=1e-5)
    assert ops.grad_norm_final(partials) == pytest.approx(np.linalg.norm(g.astype(float)), 1e-6)
    g[10] = np.inf
    assert math.isinf(ops.grad_norm_final(ops.grad_norm_partial(g, 64)))
    g[10] = np.nan
    assert math.isnan(ops.grad_norm_final(ops.grad_norm_partial(g, 64)))


def reference_adamw(p, g, m, v, mask, lr, b1, b2, eps, wd, t):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    mhat = m / (1 - b1**t)
    vhat = v / (1 - b2**t)
    p = p - lr * (mhat / (np.sqrt(vhat) + eps) + wd * p * mask)
    return p, m, v


def test_adamw_matches_float64_reference_over_several_steps() -> None:
    # bound: fp32 vs float64 after 5 steps: rtol 1e-5, plus atol 1e-6 of each array's largest
    # value for elements near zero (fp32 cancellation in m = β1·m + (1-β1)·g)
    rng = np.random.default_rng(1)
    n = n_params(S)
    be = NumpyBackend(S, 2)
    p = init_params(S, 9)
    be.load_params(p)
    mask = decay_mask(S).astype(np.float64)
    p64, m64, v64 = p.astype(np.float64), np.zeros(n), np.zeros(n)
    hp = dict(b1=0.9, b2=0.95, eps=1e-8, wd=0.1)
    for t in range(1, 6):
        g = (rng.standard_normal(n) * 0.01).astype(np.float32)
        be.zero_grads()
        be._grads[:] = g  # the gradient source is not under test here
        lr = lr_at(t, 1e-2, 3, 10, 0.1)
        be.adamw(lr, hp["b1"], hp["b2"], hp["eps"], hp["wd"], t)
        p64, m64, v64 = reference_adamw(p64, g.astype(np.float64), m64, v64, mask, lr,
                                        hp["b1"], hp["b2"], hp["eps"], hp["wd"], t)
    got_p = be.read_params()
    got_m, got_v = be.read_optimizer()
    for got, ref in ((got_p, p64), (got_m, m64), (got_v, v64)):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_adamw_decays_only_2d_tensors() -> None:
    be = NumpyBackend(S, 2)
    p = init_params(S, 9)
    p += 0.5  # make gammas/betas non-zero so decay on them would show
    be.load_params(p)
    be.zero_grads()  # zero gradient: only the decay can move a parameter
    be.adamw(lr=0.1, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.5, t=1)
    got = be.read_params()
    for t in tensor_table(S):
        sl = slice(t.offset, t.offset + int(np.prod(t.shape)))
        if len(t.shape) == 2:
            np.testing.assert_allclose(got[sl], p[sl] * (1 - 0.1 * 0.5), rtol=1e-6)
        else:
            np.testing.assert_array_equal(got[sl], p[sl])


def test_adamw_op_across_chunk_boundaries() -> None:
    n = 2 * ops.ADAMW_CHUNK + 123  # several chunks and a ragged tail
    rng = np.random.default_rng(2)
    p, g = rng.standard_normal(n), rng.standard_normal(n)
    m, v = rng.standard_normal(n) * 0.1, rng.random(n) * 0.1
    mask = (rng.random(n) < 0.5).astype(np.float64)
    want = reference_adamw(p, g, m, v, mask, 1e-3, 0.9, 0.95, 1e-8, 0.1, 7)
    ops.adamw(p, g, m, v, mask, 1e-3, 0.9, 0.95, 1e-8, 0.1, 7, np.empty((2, ops.ADAMW_CHUNK)))
    for got, ref in zip((p, m, v), want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-12)
