"""Two fused steps queued at once (the training loop queues the next step behind the running
one): the same bits as the steps run one after the other, also when the first is skipped (its
norm not finite), which the second's Adam step count learns on the device (k_step_hp)."""

from __future__ import annotations

import numpy as np
import pytest
from cudabk import cuda_backend

from engine.model.layout import ModelShapes, init_params

pytestmark = pytest.mark.gpu

SHAPES = ModelShapes(n_layer=2, d_model=128, n_head=2, d_ff=512, vocab_size=8449, seq_len=64)
HP = {"loss_scale": 1.0, "lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
      "weight_decay": 0.1, "max_norm": 1.0}


@pytest.mark.parametrize("first", ["applied", "skipped"])
def test_a_queued_step_gives_the_bits_of_steps_run_in_turn(first: str) -> None:

    tok = np.random.default_rng(3).integers(0, 8449, (3, 4, 65)).astype(np.int32)
    gm0 = float("nan") if first == "skipped" else 1.0  # a NaN gradient scale: a skipped step
    out = []
    for queued in (False, True):
        bk = cuda_backend(SHAPES, 4, "bf16", gemm_tune=False)
        bk.load_params(init_params(SHAPES, seed=9))
        rows = []
        x = [(t[:, :-1], t[:, 1:]) for t in tok]
        # step 1 (t = 1), then step 2 whose Adam t is 2 if step 1 applied, else 1
        if queued:
            bk.launch_step(*x[0], grad_mult=gm0, t=1, **HP)
            bk.launch_step(*x[1], grad_mult=1.0, t=2, **HP)  # guesses step 1 applied
            assert bk.queued_steps == 2
            rows += [bk.step_result(), bk.step_result()]
        else:
            rows.append(bk.train_step(*x[0], grad_mult=gm0, t=1, **HP))
            t2 = 1 if first == "skipped" else 2
            rows.append(bk.train_step(*x[1], grad_mult=1.0, t=t2, **HP))
        # step 3, run alone after them: Adam's t counts the updates applied
        rows.append(bk.train_step(*x[2], grad_mult=1.0, t=2 if first == "skipped" else 3, **HP))
        m, v = bk.read_optimizer()
        out.append((rows, bk.read_params(), m.copy(), v.copy()))
        bk.close()
    (ra, pa, ma, va), (rb, pb, mb, vb) = out
    assert (ra[0][1] != ra[0][1]) == (first == "skipped")  # the norm: NaN when skipped
    for a, b in zip(ra, rb, strict=True):
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1:], b[1:], equal_nan=True)
    assert np.array_equal(pa, pb) and np.array_equal(ma, mb) and np.array_equal(va, vb)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("first", ["applied", "skipped"])
def test_the_update_beside_the_next_forward_gives_the_bits_of_the_update_in_its_step(
        monkeypatch: pytest.MonkeyPatch, first: str, precision: str) -> None:
    """Each step's AdamW left to the next step's graph (on the weight-gradient stream, layer by
    layer beside the forward): the same bits as the update in its own step (`defer_update`
    turned off on a second backend before its first step), through two-deep queues, a validation forward
    between steps (which applies the pending update first), a shorter sequence (its pending
    update applied before its gradients are zeroed), a skipped step and the state read at the
    end. In fp8 each layer's FP8 weight copies are made from masters its range has updated."""

    tok = np.random.default_rng(5).integers(0, 8449, (7, 4, 65)).astype(np.int32)
    x = [(t[:, :-1], t[:, 1:]) for t in tok]
    gm0 = float("nan") if first == "skipped" else 1.0
    out = []
    for defer in (False, True):
        bk = cuda_backend(SHAPES, 4, precision)
        assert bk.defer_update
        bk.defer_update = defer
        bk.load_params(init_params(SHAPES, seed=9))
        t = 1
        rows = [bk.train_step(*x[0], grad_mult=gm0, t=t, **HP)]
        t += first == "applied"
        rows.append(bk.train_step(*x[1], grad_mult=1.0, t=t, **HP))
        t += 1
        rows.append((bk.forward_loss(*x[2]),))  # validation: sees step 2's update
        bk.launch_step(*x[3], grad_mult=1.0, t=t, **HP)
        bk.launch_step(*x[4], grad_mult=1.0, t=t + 1, **HP)
        rows += [bk.step_result(), bk.step_result()]
        t += 2
        short = tok[5][:, :33]
        rows.append(bk.train_step(short[:, :-1], short[:, 1:], grad_mult=1.0, t=t, **HP))
        rows.append(bk.train_step(*x[6], grad_mult=1.0, t=t + 1, **HP))
        m, v = bk.read_optimizer()
        out.append((rows, bk.read_params(), m.copy(), v.copy()))
        bk.close()
    (ra, pa, ma, va), (rb, pb, mb, vb) = out
    for a, b in zip(ra, rb, strict=True):
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1:], b[1:], equal_nan=True)
    assert np.array_equal(pa, pb) and np.array_equal(ma, mb) and np.array_equal(va, vb)
