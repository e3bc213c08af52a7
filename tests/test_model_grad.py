"""The whole numpy model: forward against an independent reference, gradient against finite
differences, micro-batch accumulation, forward_loss, logits_last, memory plan, backend choice."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends import get_backend, resolve_backend
from engine.backends.base import Backend
from engine.backends.numpy import NumpyBackend
from engine.errors import UserError
from engine.model.layout import ModelShapes, init_params, n_params, tensor_table, views

SMALL = ModelShapes(n_layer=2, d_model=8, n_head=2, d_ff=16, vocab_size=11, seq_len=6)


def reference_logits(w: dict[str, np.ndarray], tokens: np.ndarray, s: ModelShapes) -> np.ndarray:
    """DESIGN §2 written out directly in float64, one sequence at a time: [B,T,V] logits."""

    def ln(x: np.ndarray, g: np.ndarray, b: np.ndarray) -> np.ndarray:
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b

    hd = s.d_model // s.n_head
    out = []
    for seq in tokens:
        T = len(seq)
        x = w["wte"][seq] + w["wpe"][:T]
        for i in range(s.n_layer):
            p = f"h.{i}."
            a = ln(x, w[p + "ln1.gamma"], w[p + "ln1.beta"])
            q, k, v = (a @ w[p + f"attn.W_{n}"] for n in "QKV")
            y = np.zeros_like(x)
            for h in range(s.n_head):
                c = slice(h * hd, (h + 1) * hd)
                sc = q[:, c] @ k[:, c].T / np.sqrt(hd)
                sc[np.triu_indices(T, 1)] = -np.inf
                pr = np.exp(sc - sc.max(1, keepdims=True))
                y[:, c] = pr / pr.sum(1, keepdims=True) @ v[:, c]
            x = x + y @ w[p + "attn.W_O"]
            u = ln(x, w[p + "ln2.gamma"], w[p + "ln2.beta"]) @ w[p + "mlp.W_1"]
            x = x + 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3))) @ w[
                p + "mlp.W_2"]
        out.append(ln(x, w["lnf.gamma"], w["lnf.beta"]) @ w["wte"].T)
    return np.stack(out)


def reference_row_losses(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return -picked.mean(axis=1)


def random_params(s: ModelShapes, seed: int) -> np.ndarray:
    # larger than init (std 0.02) and with non-trivial LN params so every term matters
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n_params(s)) * 0.5
    w = views(p, s)
    for name, t in w.items():
        if name.endswith("gamma"):
            t += 1.0
    return p


def batch(s: ModelShapes, B: int, T: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    seq = np.random.default_rng(seed).integers(0, s.vocab_size, (B, T + 1)).astype(np.int32)
    return seq[:, :-1], seq[:, 1:]


def test_forward_matches_independent_reference_float64() -> None:
    # bound: 1e-10 relative (float64, same math in a different order)
    be = NumpyBackend(SMALL, 3, dtype=np.float64)
    p = random_params(SMALL, 0)
    be.load_params(p)
    x, y = batch(SMALL, 3, 5, 1)  # T = 5 < seq_len = 6
    ref = reference_row_losses(reference_logits(views(p, SMALL), x, SMALL), y)
    np.testing.assert_allclose(be.forward_loss(x, y), ref, rtol=1e-10)


def test_model_gradient_matches_finite_differences_float64() -> None:
    # bound: |analytic - numeric| <= 1e-6 · max|numeric| per tensor; central differences with
    # h = 1e-5 in float64 are accurate to ~1e-9 relative here, a wrong term is off by O(1)
    s, B, T = SMALL, 2, 5
    be = NumpyBackend(s, B, dtype=np.float64)
    p = random_params(s, 3)
    be.load_params(p)
    x, y = batch(s, B, T, 4)
    loss_scale = 1.7
    be.zero_grads()
    be.forward_backward(x, y, loss_scale=loss_scale)
    grads = be.read_grads().copy()

    def loss() -> float:
        return loss_scale * float(be.forward_loss(x, y).mean())  # rows have equal T

    rng = np.random.default_rng(5)
    h = 1e-5
    for t in tensor_table(s):
        size = int(np.prod(t.shape))
        idx = t.offset + rng.choice(size, size=min(size, 4), replace=False)
        if t.name == "wpe":  # positions >= T get no gradient; test used ones
            idx = t.offset + rng.choice(T * s.d_model, size=4, replace=False)
        numeric = np.empty(len(idx))
        for j, i in enumerate(idx):
            q = p.copy()
            q[i] += h
            be.load_params(q)
            fp = loss()
            q[i] -= 2 * h
            be.load_params(q)
            fm = loss()
            numeric[j] = (fp - fm) / (2 * h)
        scale = max(np.abs(numeric).max(), 1e-8)
        err = np.abs(grads[idx] - numeric).max()
        assert err <= 1e-6 * scale, f"{t.name}: error {err:.2e}, scale {scale:.2e}"
    # forward_loss never touched the gradients
    np.testing.assert_array_equal(be.read_grads(), grads)


def test_two_half_batches_equal_one_full_batch_fp32() -> None:
    # bound: fp32 rounding of different summation orders, rtol 1e-4 / atol 1e-6 of grads ~1e-2
    s = ModelShapes(n_layer=2, d_model=32, n_head=4, d_ff=64, vocab_size=97, seq_len=16)
    p = init_params(s, 7)
    x, y = batch(s, 4, 16, 8)
    full = NumpyBackend(s, 4)
    full.load_params(p)
    full.zero_grads()
    losses_full = full.forward_backward(x, y)
    half = NumpyBackend(s, 2)
    half.load_params(p)
    half.zero_grads()
    losses_a = half.forward_backward(x[:2], y[:2])
    losses_b = half.forward_backward(x[2:], y[2:])
    half.scale_grads(0.5)
    np.testing.assert_allclose(np.concatenate([losses_a, losses_b]), losses_full, rtol=1e-6)
    np.testing.assert_allclose(half.read_grads(), full.read_grads(), rtol=1e-4, atol=1e-6)
    assert float(np.abs(full.read_grads()).max()) > 1e-3  # the comparison is not vacuous


def test_logits_last_matches_full_forward_and_leaves_training_state() -> None:
    # bound: fp32 vs a float64 reference, 1e-4 absolute on logits of size ~1
    s = SMALL
    be = NumpyBackend(s, 2)
    p = random_params(s, 11).astype(np.float32)
    be.load_params(p)
    x, y = batch(s, 2, 6, 12)
    be.zero_grads()
    be.forward_backward(x, y)
    grads, acts = be.read_grads().copy(), be._acts.flat.copy()
    for t in (1, 4, 6):
        tokens = x[1, :t]
        got = be.logits_last(tokens)
        ref = reference_logits(views(p.astype(np.float64), s), tokens[None], s)[0, -1]
        assert got.dtype == np.float32 and got.shape == (s.vocab_size,)
        np.testing.assert_allclose(got, ref, atol=1e-4)
    np.testing.assert_array_equal(be.read_grads(), grads)
    np.testing.assert_array_equal(be._acts.flat, acts)


def test_bad_tokens_are_user_errors() -> None:
    be = NumpyBackend(SMALL, 2)
    x, y = batch(SMALL, 2, 4, 0)
    with pytest.raises(UserError, match="token ids"):
        be.forward_backward(x, np.full_like(y, SMALL.vocab_size))
    with pytest.raises(UserError, match="inputs"):
        be.forward_backward(x[:1], y[:1])  # wrong micro-batch
    with pytest.raises(UserError, match="tokens"):
        be.logits_last(np.zeros(SMALL.seq_len + 1, dtype=np.int32))


def test_memory_plan_adds_up() -> None:
    s = ModelShapes(n_layer=4, d_model=128, n_head=4, d_ff=512, vocab_size=8449, seq_len=128)
    be = NumpyBackend(s, 8)
    plan = be.memory_plan()
    parts = ("weights", "grads", "adam_m", "adam_v", "activations", "scratch")
    assert plan["total"] == sum(plan[k] for k in parts)
    for k in ("weights", "grads", "adam_m", "adam_v"):
        assert plan[k] == 4 * n_params(s)
    # the logits alone (B·T·V fp32) must be counted among the activations
    assert plan["activations"] >= 4 * 8 * 128 * 8449


def test_backend_selection() -> None:
    assert get_backend("numpy") is NumpyBackend
    assert isinstance(NumpyBackend(SMALL, 1), Backend)
    with pytest.raises(UserError):
        get_backend("tpu")
    with pytest.raises(UserError):
        resolve_backend("tpu")
    assert resolve_backend("numpy")[0] == "numpy"
    name, message = resolve_backend("auto")
    assert name in ("numpy", "cuda") and message
    if name == "numpy":  # no usable CUDA here: asking for it explicitly is a clear error
        with pytest.raises(UserError, match="CUDA is not usable"):
            resolve_backend("cuda")
