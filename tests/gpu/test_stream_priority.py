"""Stream priorities (graphs.set_stream_priority, CudaBuild._set_stream_priorities): a kernel
node captured from a stream keeps the stream's priority, a k_fill node that replaced a memset
takes its neighbour kernel's, and the fused step's graph holds the main stream's kernels at the
greatest priority and the weight-gradient stream's at the least, with the very bits of a step
whose streams are equal (both at the greatest)."""

from __future__ import annotations

import numpy as np
import pytest
from cudabk import cuda_backend

from engine.model.layout import ModelShapes, init_params

pytestmark = pytest.mark.gpu


def test_captured_nodes_keep_their_streams_priority(gpu) -> None:
    from engine.backends.cuda import graphs

    k = gpu.kernels("bf16")["k_residual_add"]
    fill = graphs.FillKernel.of(str(gpu.cubin("bf16", "fill")))
    least, greatest = graphs.stream_priority_range()
    assert greatest < least and gpu.stream_priorities == (least, greatest)
    n = 4096
    buf = gpu.drv.mem_alloc(3 * 2 * n)
    a, b, out = int(buf), int(buf) + 2 * n, int(buf) + 4 * n
    stream = gpu.drv.Stream(flags=1)  # its own: the process's main stream keeps its priority

    def issue() -> None:  # a memset (its fill's neighbour is the kernel after it), a kernel
        gpu.drv.memset_d16_async(b, 0, n, stream)
        k.prepared_async_call((n // 256, 1, 1), (256, 1, 1), stream, out, a, b, n)

    got = {}
    try:
        for prio in (greatest, least):
            graphs.set_stream_priority(stream.handle, prio)
            g = graphs.capture(stream.handle, issue, fill)
            got[prio] = (g.kernel_priorities(), len(g.fills))
            g.launch()
            stream.synchronize()
            g.close()
    finally:
        buf.free()
    assert got[greatest] == ({greatest: 2}, 1), got
    assert got[least] == ({least: 2}, 1), got


def test_the_step_graph_puts_the_main_stream_first_with_the_same_bits(monkeypatch) -> None:
    """Two live backends, one as built (its weight-gradient stream below the main one) and one
    whose weight-gradient stream the test raises to the main stream's priority before anything
    is captured, take steps in turn on the process's one main stream: each step graph holds its
    own backend's priorities, and both give the same bits."""
    from engine import env
    from engine.backends.cuda import graphs

    for v in (env.CUDA_GRAPHS, env.CUDA_SYNC):
        monkeypatch.delenv(v.name, raising=False)  # the defaults: graphs
    shapes = ModelShapes(n_layer=2, d_model=128, n_head=2, d_ff=512, vocab_size=8449,
                         seq_len=128)
    hp = {"loss_scale": 1.0, "lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
          "weight_decay": 0.1, "max_norm": 1.0}
    tok = np.random.default_rng(7).integers(0, 8449, (3, 4, 129)).astype(np.int32)
    bks = []
    try:
        for equal in (False, True):
            bk = cuda_backend(shapes, 4, "bf16")
            if equal:
                graphs.set_stream_priority(bk.build.side.handle, bk.build.gpu.stream_priorities[1])
            bk.load_params(init_params(shapes, seed=4))
            bks.append(bk)
        rows: list[list] = [[], []]
        for i, t in enumerate(tok):  # in turn, on the process's one main stream
            for k, bk in enumerate(bks):
                rows[k].append(bk.train_step(t[:, :-1], t[:, 1:], grad_mult=1.0, t=i + 1, **hp))
        prios = [{k: g.kernel_priorities() for k, g in bk.graphs.graphs.items() if k[0] == "step"}
                 for bk in bks]
        states = [(bk.read_params(), *bk.read_optimizer()) for bk in bks]
    finally:
        for bk in bks:
            bk.close()
    least, greatest = graphs.stream_priority_range()
    assert prios[0] and prios[1], prios
    for key, counts in prios[0].items():  # main's kernels and the side's, in every graph
        assert set(counts) == {least, greatest}, (key, counts)
    for key, counts in prios[1].items():  # both streams at the main stream's
        assert set(counts) == {greatest}, (key, counts)
    for (la, na, ca), (lb, nb, cb) in zip(rows[0], rows[1], strict=True):
        assert np.array_equal(la, lb) and (na, ca) == (nb, cb), ((na, ca), (nb, cb))
    for x, y in zip(*states, strict=True):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))
