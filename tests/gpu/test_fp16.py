"""fp16 compute with dynamic loss scaling (DESIGN §4) and the backend's limits, on the GPU."""

from __future__ import annotations

import numpy as np
import pytest
from cudabk import cuda_backend

import engine
from engine.config import parse_config
from engine.errors import UserError
from engine.model.layout import ModelShapes
from tests.conftest import ROOT, micro_config_dict

pytestmark = pytest.mark.gpu


def tokens(cfg: dict, seed: int) -> np.ndarray:
    B, T = cfg.train.batch_size, cfg.model.seq_len
    return np.random.default_rng(seed).integers(0, 8449, (B, T + 1), dtype=np.int32)


def one_step(tr: engine.Trainer, seed: int) -> dict:
    tr.zero_grads()
    tr.forward_backward(tokens(tr.config, seed))
    return tr.step()


def test_fp16_step_tracks_numpy_and_overflow_halves_the_scale() -> None:
    cfg = parse_config(micro_config_dict(max_steps=20, precision="fp16"), "micro", ROOT)
    gpu = engine.Trainer(cfg, backend="cuda")
    ref = engine.Trainer(cfg, backend="numpy")  # computes in fp32
    assert gpu.scaler.enabled and gpu.scaler.scale == 2.0**16
    a, b = one_step(gpu, 0), one_step(ref, 0)
    assert a.skipped is False
    assert abs(a.loss - b.loss) / b.loss < 1e-2  # fp16 activations: ~1e-3 measured
    assert abs(a.grad_norm - b.grad_norm) / b.grad_norm < 5e-2

    m, v = gpu.backend.read_optimizer()
    before = gpu.params.copy(), m.copy(), v.copy()
    gpu.scaler.scale = 2.0**40  # the scaled loss gradient overflows fp16
    rec = one_step(gpu, 1)
    assert rec.skipped is True and not np.isfinite(rec.grad_norm)
    assert gpu.scaler.scale == 2.0**39 and gpu.skipped_steps == 1
    m, v = gpu.backend.read_optimizer()
    for x, y in zip(before, (gpu.params, m, v), strict=True):
        assert np.array_equal(x, y)  # the skipped step changed nothing
    gpu.scaler.scale = 2.0**16
    rec = one_step(gpu, 2)
    assert rec.skipped is False and np.isfinite(rec.grad_norm)
    assert not np.array_equal(before[0], gpu.params)


def test_too_many_tensors_for_adamw_is_a_clear_refusal() -> None:

    shapes = ModelShapes(n_layer=103, d_model=64, n_head=2, d_ff=128, vocab_size=8449, seq_len=32)
    with pytest.raises(UserError, match="at most 102 layers, got 103"):
        cuda_backend(shapes, 1, "bf16")
