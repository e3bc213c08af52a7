"""Each op twin's backward against float64 central finite differences of its forward.

Error bound for every check: max |analytic - numeric| <= 1e-6 · max |numeric| (relative to the
gradient's scale). With h = 1e-5 in float64, central differences carry truncation error ~h²·f'''
(~1e-10 here) and rounding error ~1e-16·|f|/h (~1e-11), so 1e-6 has wide margin while any
missing term (a wrong factor, a dropped sum) is off by O(1).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.backends.numpy import ops

H = 1e-5
REL_TOL = 1e-6


def numeric_grad(f: Callable[[], float], x: np.ndarray) -> np.ndarray:
    """Central differences of scalar f() with respect to every element of x (perturbed in place)."""
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + H
        fp = f()
        flat[i] = old - H
        fm = f()
        flat[i] = old
        gflat[i] = (fp - fm) / (2 * H)
    return g


def assert_close(analytic: np.ndarray, numeric: np.ndarray) -> None:
    scale = max(float(np.abs(numeric).max()), 1e-12)
    err = float(np.abs(analytic - numeric).max())
    assert err <= REL_TOL * scale, f"max abs error {err:.3e} vs gradient scale {scale:.3e}"


def rnd(rng: np.random.Generator, *shape: int, std: float = 1.0) -> np.ndarray:
    return rng.standard_normal(shape) * std


def test_embed_bwd() -> None:
    rng = np.random.default_rng(1)
    B, T, V, S, d = 2, 5, 6, 7, 4
    tokens = np.array([[1, 3, 3, 0, 5], [3, 1, 2, 2, 4]], dtype=np.int32)  # repeats on purpose
    wte, wpe, r = rnd(rng, V, d), rnd(rng, S, d), rnd(rng, B, T, d)
    out = np.empty((B, T, d))

    def f() -> float:
        ops.embed_fwd(tokens, wte, wpe, out)
        return float(np.sum(r * out))

    dwte, dwpe = np.zeros_like(wte), np.zeros_like(wpe)
    ops.embed_bwd(r, tokens, dwte, dwpe)
    assert_close(dwte, numeric_grad(f, wte))
    assert_close(dwpe, numeric_grad(f, wpe))
    assert np.all(dwpe[T:] == 0)


def test_layernorm_bwd() -> None:
    rng = np.random.default_rng(2)
    N, d = 5, 7
    x = rnd(rng, N, d, std=3.0) + 1.5
    gamma, beta, r = 1 + rnd(rng, d, std=0.3), rnd(rng, d), rnd(rng, N, d)
    out, mean, rstd = np.empty((N, d)), np.empty(N), np.empty(N)

    def f() -> float:
        ops.layernorm_fwd(x, gamma, beta, out, mean, rstd)
        return float(np.sum(r * out))

    f()
    # forward against the textbook formula
    ref = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5) * gamma + beta
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    dx, dgamma, dbeta = np.empty((N, d)), np.zeros(d), np.zeros(d)
    ops.layernorm_bwd(r, x, gamma, mean, rstd, dx, dgamma, dbeta, np.empty((N, d)))
    assert_close(dx, numeric_grad(f, x))
    assert_close(dgamma, numeric_grad(f, gamma))
    assert_close(dbeta, numeric_grad(f, beta))


def test_attn_qkv_bwd() -> None:
    rng = np.random.default_rng(3)
    N, d = 5, 4
    x, w, r = rnd(rng, N, d), rnd(rng, 3, d, d), rnd(rng, 3, N, d)
    out = np.empty((3, N, d))

    def f() -> float:
        ops.attn_qkv_fwd(x, w, out)
        return float(np.sum(r * out))

    dx, dw = np.empty((N, d)), np.zeros_like(w)
    ops.attn_qkv_bwd(r, x, w, dx, dw, np.empty((N, d)), np.empty(3 * d * d))
    assert_close(dx, numeric_grad(f, x))
    assert_close(dw, numeric_grad(f, w))


def reference_attention(qkv: np.ndarray, n_head: int) -> np.ndarray:
    """Direct per-(b, h) loops: an independent check of attn_fwd's values."""
    _, B, T, d = qkv.shape
    hd = d // n_head
    out = np.zeros((B, T, d))
    for b in range(B):
        for h in range(n_head):
            cols = slice(h * hd, (h + 1) * hd)
            q, k, v = (qkv[j, b, :, cols] for j in range(3))
            for i in range(T):
                s = q[i] @ k[: i + 1].T / np.sqrt(hd)
                p = np.exp(s - s.max())
                out[b, i, cols] = (p / p.sum()) @ v[: i + 1]
    return out


def test_attn_fwd_values_and_bwd_with_odd_length() -> None:
    rng = np.random.default_rng(4)
    B, T, d, n_head = 2, 5, 8, 2  # T = 5: not a power of two
    qkv, r = rnd(rng, 3, B, T, d), rnd(rng, B, T, d)
    probs, out = np.empty((B, n_head, T, T)), np.empty((B, T, d))

    def f() -> float:
        ops.attn_fwd(qkv, n_head, probs, out)
        return float(np.sum(r * out))

    f()
    np.testing.assert_allclose(out, reference_attention(qkv, n_head), rtol=1e-12, atol=1e-12)
    assert np.all(np.triu(probs, k=1) == 0)  # causal: no weight on future positions
    dqkv = np.empty_like(qkv)
    ops.attn_bwd(r, qkv, probs, n_head, dqkv, np.empty_like(probs))
    assert_close(dqkv, numeric_grad(f, qkv))


def test_attn_out_bwd() -> None:
    rng = np.random.default_rng(5)
    N, d = 5, 4
    y, w, r = rnd(rng, N, d), rnd(rng, d, d), rnd(rng, N, d)
    out = np.empty((N, d))

    def f() -> float:
        ops.attn_out_fwd(y, w, out)
        return float(np.sum(r * out))

    dy, dw = np.empty((N, d)), np.zeros_like(w)
    ops.attn_out_bwd(r, y, w, dy, dw, np.empty(d * d))
    assert_close(dy, numeric_grad(f, y))
    assert_close(dw, numeric_grad(f, w))


def test_mlp_fwd_values_and_bwd() -> None:
    rng = np.random.default_rng(6)
    N, d, F = 5, 4, 6
    # std 1 inputs and weights put pre-activations across GELU's curved range (|u| up to ~5)
    x, w1, w2, r = rnd(rng, N, d), rnd(rng, d, F), rnd(rng, F, d), rnd(rng, N, d)
    pre, act, out = np.empty((N, F)), np.empty((N, F)), np.empty((N, d))

    def f() -> float:
        ops.mlp_fwd(x, w1, w2, pre, act, out)
        return float(np.sum(r * out))

    f()
    u = x @ w1
    gelu = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3)))
    np.testing.assert_allclose(out, gelu @ w2, rtol=1e-12, atol=1e-12)
    dx, dw1, dw2 = np.empty((N, d)), np.zeros_like(w1), np.zeros_like(w2)
    scratch = [np.empty((N, F)) for _ in range(3)]
    ops.mlp_bwd(r, x, w1, w2, pre, act, dx, dw1, dw2, *scratch, np.empty(d * F))
    assert_close(dx, numeric_grad(f, x))
    assert_close(dw1, numeric_grad(f, w1))
    assert_close(dw2, numeric_grad(f, w2))


def test_residual_add_and_bwd() -> None:
    rng = np.random.default_rng(7)
    x, y, r = rnd(rng, 3, 4), rnd(rng, 3, 4), rnd(rng, 3, 4)
    out = np.empty((3, 4))

    def f() -> float:
        ops.residual_add(x, y, out)
        return float(np.sum(r * out))

    branch = rnd(rng, 3, 4)  # what the branch's backward already put into dx
    dx = branch.copy()
    ops.residual_add_bwd(r, dx)
    assert_close(dx - branch, numeric_grad(f, x))
    assert_close(r, numeric_grad(f, y))  # the branch output's gradient is dout itself


def test_loss_fwd_values_and_bwd() -> None:
    rng = np.random.default_rng(8)
    N, d, V = 6, 4, 7
    x, wte = rnd(rng, N, d, std=2.0), rnd(rng, V, d)
    targets = np.array([0, 6, 3, 3, 1, 5], dtype=np.int32)
    scale = 0.37
    logits, row_sum, losses = np.empty((N, V)), np.empty(N), np.empty(N)

    def f() -> float:
        ops.loss_fwd(x, wte, targets, logits, row_sum, losses)
        return scale * float(losses.sum())

    f()
    z = x @ wte.T
    logp = z - z.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    np.testing.assert_allclose(losses, -logp[np.arange(N), targets], rtol=1e-12)
    dx, dwte = np.empty((N, d)), np.zeros_like(wte)
    ops.loss_bwd(x, wte, targets, logits, row_sum, scale, dx, dwte, np.empty((N, d)),
                 np.empty(V * d))
    assert_close(dx, numeric_grad(f, x))
    assert_close(dwte, numeric_grad(f, wte))


def test_loss_fwd_is_stable_for_large_logits() -> None:
    # logits of ~±1000 overflow a naive exp; the max-shifted form must stay finite and exact
    x = np.array([[1000.0, 0.0], [-1000.0, 0.0]], dtype=np.float32)
    wte = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], dtype=np.float32)
    targets = np.array([0, 2], dtype=np.int32)
    logits, row_sum, losses = (np.empty((2, 3), np.float32), np.empty(2, np.float32),
                               np.empty(2, np.float32))
    ops.loss_fwd(x, wte, targets, logits, row_sum, losses)
    np.testing.assert_allclose(losses, [0.0, 0.0], atol=1e-6)


def test_backward_ops_accumulate_parameter_grads() -> None:
    # a second call adds the same amount again (micro-batches add up until zero_grads)
    rng = np.random.default_rng(9)
    N, d, F = 4, 4, 6
    x, w1, w2, r = rnd(rng, N, d), rnd(rng, d, F), rnd(rng, F, d), rnd(rng, N, d)
    pre, act, out = np.empty((N, F)), np.empty((N, F)), np.empty((N, d))
    ops.mlp_fwd(x, w1, w2, pre, act, out)
    dx, dw1, dw2 = np.empty((N, d)), np.zeros_like(w1), np.zeros_like(w2)
    scratch = [np.empty((N, F)) for _ in range(3)]
    ops.mlp_bwd(r, x, w1, w2, pre, act, dx, dw1, dw2, *scratch, np.empty(d * F))
    once, dx_once = (dw1.copy(), dw2.copy()), dx.copy()
    ops.mlp_bwd(r, x, w1, w2, pre, act, dx, dw1, dw2, *scratch, np.empty(d * F))
    np.testing.assert_allclose(dw1, 2 * once[0], rtol=1e-14)
    np.testing.assert_allclose(dw2, 2 * once[1], rtol=1e-14)
    np.testing.assert_array_equal(dx, dx_once)  # activation gradients are overwritten
