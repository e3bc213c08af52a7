"""GEMM algorithms chosen by timing (engine/backends/cuda/gemm.py), recorded and replayed: the
timed GEMMs are still the right products, and a plan handed to a new backend makes it run the
very same algorithms (the same bits), which is what a --resume relies on."""

from __future__ import annotations

import numpy as np
import pytest
from cudabk import cuda_backend
from devarrays import DevArrays, check_close, rounded

from engine.backends.cuda.gemm_plan import GemmPlan
from engine.model.layout import ModelShapes, init_params

pytestmark = pytest.mark.gpu


def _timer(gpu):
    def time_ms(fn):
        e0, e1 = gpu.drv.Event(), gpu.drv.Event()
        e0.record(gpu.stream)
        fn()
        e1.record(gpu.stream)
        e1.synchronize()
        return e1.time_since(e0)

    return time_ms


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_timed_gemms_are_right_and_replay_from_the_plan(gpu, rng, precision):
    from engine.backends.cuda.cublas import DTYPE_OF_PRECISION, R_32F, WORKSPACE_BYTES
    from engine.backends.cuda.gemm import EPILOGUE_GELU_AUX, LtGemm

    dev = DevArrays(gpu.drv, precision)
    ws = dev.empty((WORKSPACE_BYTES // 4,), "f32")
    act = DTYPE_OF_PRECISION[precision]
    M, N, K = 300, 256, 128
    a = rounded(rng.normal(0, 1, (M, K)), precision)
    b = rounded(rng.normal(0, 0.2, (K, N)), precision)
    da, db = dev.put(a), dev.put(b)
    outs, plans, sources = [], [], []
    try:
        for plan in (None, "replay"):
            lt = LtGemm(WORKSPACE_BYTES, "test device")
            if plan is None:
                lt.tuning, lt.timer = True, _timer(gpu)
            else:
                assert lt.import_plan(plans[0]) == ""
            out = dev.empty((M, N))
            lt.matmul(out, da, db, M, N, K, types=(act, act, act), stream=gpu.stream.handle,
                      ws=ws)
            g0 = rng.normal(0, 1, (K, K)) if plan is None else outs[0][2]
            acc = dev.put(g0, "f32")  # += aᵀ·(column half j of a) into float32, batched
            lt.matmul(acc, da, da, K, K // 2, M, types=(act, act, R_32F), ta=True, ldb=K,
                      ldc=K, beta=1.0, batch=2, sa=0, sb=K // 2, sc=K // 2,
                      stream=gpu.stream.handle, ws=ws)
            pre = dev.empty((M, N))
            lt.matmul(dev.empty((M, N)), da, db, M, N, K,
                      types=(act, act, act), epilogue=EPILOGUE_GELU_AUX, aux=pre,
                      stream=gpu.stream.handle, ws=ws)
            outs.append((dev.get(out), dev.get(acc), g0, dev.get(pre)))
            plans.append(lt.export_plan())
            sources.append(sorted(p.source for p in lt._problems.values()))
            lt.close()
        check_close(outs[0][0], a @ b, 1e-2 if precision == "bf16" else 1e-5, "timed GEMM",
                    precision)
        # acc += aᵀ·a[:, half j] per batch j; the timed run added several times while choosing,
        # so the replay (one run) is the one compared
        want = outs[0][2].copy()
        h = K // 2
        for j in range(2):
            want[:, j * h:(j + 1) * h] += a.T @ a[:, j * h:(j + 1) * h]
        check_close(outs[0][3], a @ b, 1e-2 if precision == "bf16" else 1e-5,
                    "timed GELU_AUX pre", precision)
        assert len(plans[0]["gemms"]) == 3
        assert all(e["candidates"] >= 1 and e["ms"] > 0 for e in plans[0]["gemms"].values())
        assert plans[1]["gemms"] == plans[0]["gemms"]  # the replay kept the record...
        assert sources == [["timed"] * 3, ["plan"] * 3], sources  # ...and ran from it
        assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][3], outs[1][3])
        check_close(outs[1][1], want, 1e-2 if precision == "bf16" else 1e-5,
                    "replayed accumulating batched GEMM", precision)
        assert isinstance(GemmPlan.from_json(plans[0]), GemmPlan)
    finally:
        dev.free()


def test_a_recorded_plan_gives_the_same_bits():
    """Backend A times its GEMMs; backend B gets A's plan and times nothing: B's plan is A's,
    and three training steps from the same weights give the same bits on both."""

    shapes = ModelShapes(n_layer=2, d_model=384, n_head=6, d_ff=1536, vocab_size=8449,
                         seq_len=256)
    params = init_params(shapes, seed=4)
    tok = np.random.default_rng(1).integers(0, 64, (3, 4, 257)).astype(np.int32)
    res, plan = [], None
    for given in (None, "A's"):
        bk = cuda_backend(shapes, 4, "bf16", gemm_plan=plan, gemm_tune=given is None)
        if given is None:
            plan = bk.gemm_plan
            assert plan and plan["gemms"] and plan["choices"], plan
        bk.load_params(params)
        rows = [bk.train_step(t[:, :-1], t[:, 1:], loss_scale=1.0, grad_mult=1.0, lr=1e-3,
                              beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, t=i + 1,
                              max_norm=1.0)[0] for i, t in enumerate(tok)]
        res.append((rows, bk.read_params()))
        by = {k: p.source for k, p in bk.gemm._problems.items()}
        if given is None:
            timed = {k for k, s in by.items() if s == "timed"}
            choices = dict(bk.gemm.choices)
        else:
            # every problem A timed that B runs comes from A's record, none was timed again; B
            # runs only its chosen GELU variants' GEMMs (A also timed the variants it dropped)
            assert "timed" not in by.values(), by
            assert all(by[k] == "plan" for k in by.keys() & timed), by
            assert {k for k, s in by.items() if s == "plan"} <= timed
            assert bk.gemm.choices == choices
        bk.close()
    assert all(np.array_equal(x, y) for x, y in zip(res[0][0], res[1][0], strict=True))
    assert np.array_equal(res[0][1], res[1][1])


def test_a_plan_from_elsewhere_is_not_used():

    shapes = ModelShapes(n_layer=1, d_model=128, n_head=2, d_ff=256, vocab_size=8449,
                         seq_len=64)
    foreign = {"version": 1, "library": "cublasLt 1", "device": "another GPU", "gemms": {},
               "choices": {}}
    bk = cuda_backend(shapes, 2, "bf16", gemm_plan=foreign, gemm_tune=False)
    assert any("another GPU" in n for n in bk.notes), bk.notes
    bk.close()
