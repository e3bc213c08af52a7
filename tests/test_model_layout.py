"""Model layout: parameter count, tensor order and offsets, init statistics, decay mask."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.config import ModelConfig
from engine.errors import UserError
from engine.model.layout import (
    ModelShapes,
    decay_mask,
    init_params,
    n_params,
    tensor_table,
    views,
)

M120 = ModelShapes(n_layer=12, d_model=768, n_head=12, d_ff=3072, vocab_size=8449, seq_len=1024)
TINY = ModelShapes(n_layer=4, d_model=128, n_head=4, d_ff=512, vocab_size=8449, seq_len=128)


def test_120m_parameter_count_matches_design() -> None:
    # DESIGN §2 states the exact figure; also recomputed here from the shapes by hand
    d, f, v, t, L = 768, 3072, 8449, 1024, 12
    by_hand = v * d + t * d + L * (4 * d + 4 * d * d + 2 * d * f) + 2 * d
    assert by_hand == 92_248_320
    assert n_params(M120) == 92_248_320


def test_tensor_table_order_names_and_contiguous_offsets() -> None:
    s = ModelShapes(n_layer=2, d_model=8, n_head=2, d_ff=16, vocab_size=11, seq_len=6)
    table = tensor_table(s)
    per_layer = ["ln1.gamma", "ln1.beta", "attn.W_Q", "attn.W_K", "attn.W_V", "attn.W_O",
                 "ln2.gamma", "ln2.beta", "mlp.W_1", "mlp.W_2"]
    expected = ["wte", "wpe"] + [f"h.{i}.{n}" for i in range(2) for n in per_layer]
    expected += ["lnf.gamma", "lnf.beta"]
    assert [t.name for t in table] == expected
    shapes = {t.name: t.shape for t in table}
    assert shapes["wte"] == (11, 8) and shapes["wpe"] == (6, 8)
    assert shapes["h.1.mlp.W_1"] == (8, 16) and shapes["h.1.mlp.W_2"] == (16, 8)
    offset = 0
    for t in table:
        assert t.offset == offset
        offset += math.prod(t.shape)
    assert offset == n_params(s)


def test_init_statistics_and_determinism() -> None:
    p = init_params(TINY, 1337)
    assert p.dtype == np.float32 and p.size == n_params(TINY)
    assert np.array_equal(p, init_params(TINY, 1337))
    assert not np.array_equal(p, init_params(TINY, 1338))
    w = views(p, TINY)
    scaled = 0.02 / math.sqrt(2 * TINY.n_layer)
    # std of n normal samples is within a few % of sigma for n >= 16K (rel. s.e. ~ 1/sqrt(2n))
    assert abs(w["wte"].std() - 0.02) / 0.02 < 0.01
    assert abs(w["wte"].mean()) < 1e-3
    assert abs(w["h.0.attn.W_Q"].std() - 0.02) / 0.02 < 0.03
    assert abs(w["h.0.mlp.W_1"].std() - 0.02) / 0.02 < 0.02
    for i in range(TINY.n_layer):
        assert abs(w[f"h.{i}.attn.W_O"].std() - scaled) / scaled < 0.03
        assert abs(w[f"h.{i}.mlp.W_2"].std() - scaled) / scaled < 0.02
        assert np.all(w[f"h.{i}.ln1.gamma"] == 1) and np.all(w[f"h.{i}.ln2.beta"] == 0)
    assert np.all(w["lnf.gamma"] == 1) and np.all(w["lnf.beta"] == 0)


def test_decay_mask_is_true_exactly_on_2d_tensors() -> None:
    mask = decay_mask(TINY)
    assert mask.dtype == bool and mask.size == n_params(TINY)
    for t in tensor_table(TINY):
        region = mask[t.offset : t.offset + math.prod(t.shape)]
        assert region.all() if len(t.shape) == 2 else not region.any(), t.name


def test_from_config_and_bad_shapes() -> None:
    cfg = {"n_layer": 4, "d_model": 128, "n_head": 4, "d_ff": 512, "vocab_size": 8449,
           "seq_len": 128}
    assert ModelShapes.from_config(ModelConfig(**cfg)) == TINY
    with pytest.raises(UserError, match=r"model\.n_head"):
        ModelShapes(**cfg | {"n_head": 3})
    with pytest.raises(UserError, match=r"model\.d_ff"):
        ModelShapes(**cfg | {"d_ff": 0})
