"""The shipped larger models' widths (ANDREA-312M: d 1024, 16 heads; ANDREA-1.2B: d 2048, 32
heads) at 2 layers, against the numpy backend in float64: a full step's loss and every
gradient tensor, on the path the configs run (cuDNN attention with, at the full sequence
length of the micro-batch, the flex backward where it is built; fusions) and on the engine's
own attention; the FP8 step against the bf16 one; the same bits twice at full length; and the
full-depth 312M model's memory plan against the sum of its parts and the device."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cudabk import cuda_backend
from devarrays import check_close, rel_err

from engine.backends.numpy import NumpyBackend
from engine.config import load_config
from engine.model.layout import ModelShapes, init_params, n_params, tensor_table
from tests.conftest import ROOT

pytestmark = pytest.mark.gpu

SIZES = ("312M", "1.2B")
# bf16 bounds of test_backend's full step (‖gpu − numpy(float64)‖/‖numpy‖, per tensor)
BOUND = {"loss": 1e-2, "grad": 5e-2}
HP = {"loss_scale": 1.0, "grad_mult": 1.0, "lr": 1e-3, "beta1": 0.9, "beta2": 0.95,
      "eps": 1e-8, "weight_decay": 0.1, "max_norm": 1.0}


def shipped(size: str) -> ModelShapes:
    return load_config(ROOT / "experiments" / f"ANDREA-{size}-TRAIN.json").model


def two_layers(size: str) -> ModelShapes:
    """The shipped model's widths and heads at 2 layers."""
    return dataclasses.replace(shipped(size), n_layer=2)


def tokens(rng: np.random.Generator, s: ModelShapes, B: int, T: int):
    tok = rng.integers(0, s.vocab_size, (B, T + 1)).astype(np.int32)
    return tok[:, :-1], tok[:, 1:]


@pytest.mark.parametrize("attention", ["auto", "classic"])
@pytest.mark.parametrize("size", SIZES)
def test_full_step_matches_numpy_at_the_larger_widths(size: str, attention: str, rng) -> None:
    s = two_layers(size)
    B, T = 2, s.seq_len  # the full length: the flex backward runs only there
    params = init_params(s, seed=int(rng.integers(1 << 30)))
    ref = NumpyBackend(s, B, dtype=np.float64)
    ref.load_params(params.astype(np.float64))
    gpu = cuda_backend(s, B, "bf16", attention=attention)
    gpu.load_params(params)
    x, y = tokens(rng, s, B, T)
    want = ref.forward_backward(x, y, loss_scale=3.0)
    gpu.zero_grads()
    got = gpu.forward_backward(x, y, loss_scale=3.0)
    what = f"{size} widths, 2 layers, {attention} attention"
    check_close(got, want, BOUND["loss"], f"{what}: row losses", "bf16")
    g, wg = gpu.read_grads(), ref.read_grads()
    worst = max(tensor_table(s), key=lambda t: rel_err(g[t.offset:t.offset + t.size],
                                                       wg[t.offset:t.offset + t.size]))
    sl = slice(worst.offset, worst.offset + worst.size)
    check_close(g[sl], wg[sl], BOUND["grad"], f"{what}: worst grad ({worst.name})", "bf16")
    gpu.close()


@pytest.mark.parametrize("size", SIZES)
def test_fp8_step_against_the_bf16_step_at_the_larger_widths(size: str, rng) -> None:
    """Every linear map's GEMMs in FP8 at these widths; the loss within 1% of the bf16 step's and
    the gradient's direction within a cosine of 0.99."""
    s = two_layers(size)
    params = init_params(s, seed=11)
    x, y = tokens(rng, s, 2, 1024)
    out = {}
    for precision in ("bf16", "fp8"):
        bk = cuda_backend(s, 2, precision)
        bk.load_params(params)
        bk.zero_grads()
        rows = bk.forward_backward(x, y)
        out[precision] = (float(np.mean(rows)), bk.read_grads().astype(np.float64))
        if precision == "fp8":
            assert len(bk.fp8_gemms) == (12 if bk.build.qkv_rows else 9), bk.build.fp8_ops.notes
        bk.close()
    (l16, g16), (l8, g8) = out["bf16"], out["fp8"]
    cos = float(g8 @ g16 / (np.linalg.norm(g8) * np.linalg.norm(g16)))
    assert abs(l8 - l16) <= 1e-2 * abs(l16), (l8, l16)
    assert cos >= 0.99, cos


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_two_runs_give_the_same_bits_at_d_2048(precision: str) -> None:
    s = two_layers("1.2B")
    params = init_params(s, seed=3)
    tok = np.random.default_rng(1).integers(0, s.vocab_size, (3, 2, s.seq_len + 1))
    tok = tok.astype(np.int32)
    runs = []
    for _ in range(2):
        bk = cuda_backend(s, 2, precision)
        bk.load_params(params)
        rows = [bk.train_step(t[:, :-1], t[:, 1:], t=i + 1, **HP) for i, t in enumerate(tok)]
        runs.append((rows, bk.read_params(), *bk.read_optimizer()))
        bk.close()
    for (ra, na, ca), (rb, nb, cb) in zip(runs[0][0], runs[1][0], strict=True):
        assert np.array_equal(ra, rb) and (na, ca) == (nb, cb)
    for a, b in zip(runs[0][1:], runs[1][1:], strict=True):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_the_312m_memory_plan_adds_up_and_is_what_the_device_gives() -> None:
    """The full-depth 312M model at its config's micro-batch: weights, gradients and Adam's
    moments as the parameter count says, the total the sum of the groups, and the device
    memory the backend takes (the driver's free memory before and after) the plan's total and
    at most 2 GiB more (the libraries' handles and workspaces, the graphs)."""
    import gc

    import pycuda.driver as drv

    s = shipped("312M")
    cfg = load_config(ROOT / "experiments" / "ANDREA-312M-TRAIN.json")
    # the context, the kernels' modules and the libraries first (a small backend, closed)
    cuda_backend(two_layers("312M"), 1, "bf16").close()
    gc.collect()
    drv.Context.synchronize()
    free_before = drv.mem_get_info()[0]
    gpu = cuda_backend(s, cfg.train.batch_size, "bf16")
    try:
        drv.Context.synchronize()
        taken = free_before - drv.mem_get_info()[0]
        plan, n = gpu.memory_plan(), n_params(s)
        assert plan["total"] <= taken <= plan["total"] + 2 * 2**30, (taken, plan)
        assert plan["adam_m"] == plan["adam_v"] >= 4 * n
        assert plan["weights"] >= 6 * n
        assert plan["total"] == sum(v for k, v in plan.items() if k != "total")
    finally:
        gpu.close()
