"""Stream priorities (graphs.set_stream_priority, CudaBackend._set_stream_priorities): a kernel
node captured from a stream keeps the stream's priority, a k_fill node that replaced a memset
takes its neighbour kernel's, and the fused step's graph holds the main stream's kernels at the
greatest priority and the weight-gradient stream's at the least, with the very bits of a step
whose streams are equal (ANDREA_STREAM_PRIORITY=0)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from engine.model.layout import ModelShapes, init_params

pytestmark = pytest.mark.gpu


def test_captured_nodes_keep_their_streams_priority(gpu) -> None:
    from engine.backends.cuda import graphs

    k = gpu.kernels("bf16")["k_residual_add"]
    fill = graphs.FillKernel.of(str(gpu.cubin("bf16", "fill")))
    least, greatest = graphs.stream_priority_range()
    assert greatest < least, (least, greatest)
    n = 4096
    buf = gpu.drv.mem_alloc(3 * 2 * n)
    a, b, out = int(buf), int(buf) + 2 * n, int(buf) + 4 * n

    def issue() -> None:  # a memset (its fill's neighbour is the kernel after it), a kernel
        gpu.drv.memset_d16_async(b, 0, n, gpu.stream)
        k.prepared_async_call((n // 256, 1, 1), (256, 1, 1), gpu.stream, out, a, b, n)

    try:
        got = {}
        for prio in (greatest, least):
            graphs.set_stream_priority(gpu.stream.handle, prio)
            g = graphs.capture(gpu.stream.handle, issue, fill)
            got[prio] = (g.kernel_priorities(), len(g.fills))
            g.launch()
            gpu.stream.synchronize()
            g.close()
    finally:
        graphs.set_stream_priority(gpu.stream.handle, least)
        gpu.stream_priority = least
        buf.free()
    assert got[greatest] == ({greatest: 2}, 1), got
    assert got[least] == ({least: 2}, 1), got


def test_the_step_graph_puts_the_main_stream_first_with_the_same_bits() -> None:
    from engine.backends.cuda import CudaBackend, graphs

    shapes = ModelShapes(n_layer=2, d_model=128, n_head=2, d_ff=512, vocab_size=8449,
                         seq_len=128)
    hp = {"loss_scale": 1.0, "lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
          "weight_decay": 0.1, "max_norm": 1.0}
    tok = np.random.default_rng(7).integers(0, 8449, (3, 4, 129)).astype(np.int32)
    out, prios, described = [], [], []
    saved = os.environ.get("ANDREA_STREAM_PRIORITY")
    try:
        for on in ("1", "0"):
            os.environ["ANDREA_STREAM_PRIORITY"] = on
            bk = CudaBackend(shapes, 4, "bf16", tune=False)
            bk.load_params(init_params(shapes, seed=4))
            rows = [bk.train_step(t[:, :-1], t[:, 1:], grad_mult=1.0, t=i + 1, **hp)
                    for i, t in enumerate(tok)]
            step = max(k for k in bk._graphs if k[0] == "step")
            prios.append(bk._graphs[step].kernel_priorities())
            described.append("ANDREA_STREAM_PRIORITY" in bk.describe())
            m, v = bk.read_optimizer()
            out.append((rows, bk.read_params(), m, v))
            bk.close()
    finally:
        if saved is None:
            os.environ.pop("ANDREA_STREAM_PRIORITY", None)
        else:
            os.environ["ANDREA_STREAM_PRIORITY"] = saved
    least, greatest = graphs.stream_priority_range()
    assert set(prios[0]) == {least, greatest}, prios  # main's kernels and the side's
    assert prios[0][greatest] > 0 and prios[0][least] > 0, prios
    assert set(prios[1]) == {least}, prios
    assert described == [True, False]
    (rows_a, pa, ma, va), (rows_b, pb, mb, vb) = out
    for (la, na, ca), (lb, nb, cb) in zip(rows_a, rows_b, strict=True):
        assert np.array_equal(la, lb) and (na, ca) == (nb, cb), ((na, ca), (nb, cb))
    for x, y in ((pa, pb), (ma, mb), (va, vb)):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))
