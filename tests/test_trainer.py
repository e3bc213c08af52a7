"""The optimizer step of DESIGN §4 through the `engine.Trainer` API (numpy backend)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import engine
from engine.config import parse_config
from tests.conftest import ROOT, micro_config_dict


@pytest.fixture
def trainer() -> engine.Trainer:
    cfg = parse_config(micro_config_dict(max_steps=50), "micro", ROOT)
    return engine.Trainer(cfg, backend="numpy")


def batch(tr: engine.Trainer, seed: int = 0) -> np.ndarray:
    B, T = tr.config.train.batch_size, tr.config.model.seq_len
    return np.random.default_rng(seed).integers(0, 8449, size=(B, T + 1), dtype=np.int32)


def snapshot(tr: engine.Trainer) -> tuple[np.ndarray, ...]:
    m, v = tr.backend.read_optimizer()
    return tr.params.copy(), m.copy(), v.copy()


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_gradient_skips_the_update(trainer: engine.Trainer, poison: float) -> None:
    tr = trainer
    tr.zero_grads()
    tr.forward_backward(batch(tr))
    first = tr.step()
    assert first.skipped is False and math.isfinite(first.grad_norm)
    before = snapshot(tr)
    tr.zero_grads()
    tr.forward_backward(batch(tr, 1))
    tr.backend.scale_grads(poison)  # every gradient becomes non-finite
    rec = tr.step()
    assert rec.skipped is True and not math.isfinite(rec.grad_norm)
    assert rec.step == 2 and tr.skipped_steps == 1 and tr.adam_t == 1
    for a, b in zip(before, snapshot(tr), strict=True):
        assert np.array_equal(a, b)  # params, m and v untouched, bit for bit
    tr.zero_grads()
    tr.forward_backward(batch(tr, 2))
    third = tr.step()
    assert third.skipped is False and tr.adam_t == 2
    assert not np.array_equal(before[0], tr.params)


def test_step_record_and_counters(trainer: engine.Trainer) -> None:
    tr = trainer
    tr.zero_grads()
    losses = [tr.forward_backward(batch(tr, s)) for s in range(2)]  # two micro-batches
    rec = tr.step()
    B, T = tr.config.train.batch_size, tr.config.model.seq_len
    assert rec.tokens == 2 * B * T == tr.tokens
    assert rec.loss == pytest.approx(np.mean(losses), rel=1e-12)
    assert rec.lr == pytest.approx(tr.config.optim.lr / tr.config.optim.warmup_steps)
    assert 0 < rec.clip_scale <= 1.0
    if rec.grad_norm > tr.config.optim.max_grad_norm:
        assert rec.clip_scale == pytest.approx(tr.config.optim.max_grad_norm / rec.grad_norm)
    with pytest.raises(RuntimeError):
        tr.zero_grads()
        tr.step()  # no micro-batch since zero_grads


def test_copy_state_into_gives_the_checkpoint_arrays(trainer: engine.Trainer) -> None:
    tr = trainer
    tr.zero_grads()
    tr.forward_backward(batch(tr))
    tr.step()
    out = [np.full(tr.n_params, np.nan, dtype=np.float32) for _ in range(3)]
    tr.backend.copy_state_into(*out)
    m, v = tr.backend.read_optimizer()
    for got, want in zip(out, (tr.params, m, v), strict=True):
        assert np.array_equal(got, want)
    assert np.any(out[1] != 0)  # after a step Adam's m is not all zeros


def test_train_step_is_zero_forward_backward_step(tmp_path) -> None:
    """Trainer.train_step on a backend without a fused step is the three calls, bit for bit."""
    cfg = parse_config(micro_config_dict(max_steps=5), "micro", ROOT)
    a, b = engine.Trainer(cfg, backend="numpy"), engine.Trainer(cfg, backend="numpy")
    for s in range(3):
        ra = a.train_step(batch(a, s))
        b.zero_grads()
        b.forward_backward(batch(b, s))
        rb = b.step()
        assert ra == rb
    assert np.array_equal(a.params, b.params)
    assert np.array_equal(a.row_losses, b.row_losses)


def test_prepared_steps_are_train_steps_and_misuse_is_refused() -> None:
    """prepare(tokens) → begin_step() → end_step(), with the tokens handed over before the step
    before ended (as the training loop does), gives train_step's results, bit for bit; a call
    out of order is refused, not silently mixed up."""
    cfg = parse_config(micro_config_dict(max_steps=50), "micro", ROOT)
    a, b = engine.Trainer(cfg, backend="numpy"), engine.Trainer(cfg, backend="numpy")
    plain = [a.train_step(batch(a, s)) for s in range(3)]
    b.prepare(batch(b, 0))
    b.begin_step()
    piped = []
    for s in range(3):  # as the loop runs them: the next step begun before this one ends
        if s + 1 < 3:
            b.prepare(batch(b, s + 1))
            b.begin_step()
        piped.append(b.end_step())
    assert piped == plain
    assert np.array_equal(a.params, b.params)
    with pytest.raises(RuntimeError, match="without begin_step"):
        b.end_step()
    with pytest.raises(RuntimeError, match="without tokens or prepare"):
        b.begin_step()
    b.prepare(batch(b, 7))
    with pytest.raises(RuntimeError, match="twice"):
        b.prepare(batch(b, 8))
    with pytest.raises(RuntimeError, match="tokens twice"):
        b.begin_step(batch(b, 8))
    b.begin_step()
    assert b.queue_depth == 2 and b.queued == 1
    b.begin_step(batch(b, 9))  # a second step queued behind the first
    with pytest.raises(RuntimeError, match="2 step"):
        b.begin_step(batch(b, 10))
    assert [b.end_step().step, b.end_step().step] == [4, 5] and b.queued == 0
