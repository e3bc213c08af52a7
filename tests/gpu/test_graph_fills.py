"""A captured graph's memset nodes as k_fill kernel nodes (graphs.memsets_as_kernels): the graph
writes the same bytes as with its memsets, nothing outside them, and a training step so built
gives the same bits as one with cuDNN's and cuBLASLt's memset nodes left in."""

from __future__ import annotations

import ctypes as C
import os

import numpy as np
import pytest

from engine.model.layout import ModelShapes, init_params

pytestmark = pytest.mark.gpu

SIZE = 1 << 16  # bytes of the test buffer


def _memsets(drv, stream, base: int) -> None:
    """1-D memsets of each element size at odd offsets and lengths, and two 2-D ones."""
    drv.memset_d8_async(base + 3, 0xA5, 1001, stream)
    drv.memset_d8_async(base + 5000, 0x00, 17, stream)
    drv.memset_d16_async(base + 2 * 3001, 0xBEEF, 4097, stream)
    drv.memset_d32_async(base + 4 * 4001, 0xDEADBEEF, 1, stream)
    drv.memset_d32_async(base + 4 * 5003, 0x01020304, 2000, stream)
    drv.memset_d32_async(base + 4 * 8192, 0, 4096, stream)  # 16-byte aligned: the vector body
    lib = C.CDLL("libcuda.so.1")
    vp, sz = C.c_void_p, C.c_size_t
    lib.cuMemsetD2D32Async.argtypes = [C.c_uint64, sz, C.c_uint, sz, sz, vp]
    lib.cuMemsetD2D8Async.argtypes = [C.c_uint64, sz, C.c_ubyte, sz, sz, vp]
    assert lib.cuMemsetD2D32Async(base + 50000, 400, 0x7F7F0001, 37, 9, stream.handle) == 0
    assert lib.cuMemsetD2D8Async(base + 60001, 129, 0x3C, 100, 7, stream.handle) == 0


@pytest.mark.parametrize("fill", [False, True], ids=["memset nodes", "k_fill nodes"])
def test_the_graph_writes_what_its_memsets_write(gpu, rng, fill: bool) -> None:
    from engine.backends.cuda import graphs

    drv = gpu.drv
    start = rng.integers(0, 256, SIZE, dtype=np.uint8)
    buf = drv.mem_alloc(SIZE)
    drv.memcpy_htod(buf, start)
    _memsets(drv, gpu.stream, int(buf))
    gpu.stream.synchronize()
    want = np.empty(SIZE, np.uint8)
    drv.memcpy_dtoh(want, buf)
    assert not np.array_equal(want, start)

    drv.memcpy_htod(buf, start)
    kernel = graphs.FillKernel(str(gpu.cubin("bf16", "fill"))) if fill else None
    g = graphs.capture(gpu.stream.handle, lambda: _memsets(drv, gpu.stream, int(buf)), kernel)
    counts = g.node_counts()
    assert counts.get("memset", 0) == (0 if fill else 8), counts
    assert counts.get("kernel", 0) == (8 if fill else 0), counts
    g.launch()
    gpu.stream.synchronize()
    got = np.empty(SIZE, np.uint8)
    drv.memcpy_dtoh(got, buf)
    g.close()
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:20]


def test_the_fill_grid_covers_a_row() -> None:
    from engine.backends.cuda.graphs import FILL_BLOCK, FILL_MAX_BLOCKS, FillKernel

    assert FillKernel.grid(1, 4, 1) == (1, 1)
    assert FillKernel.grid(FILL_BLOCK * 4, 4, 3) == (1, 3)
    assert FillKernel.grid(FILL_BLOCK * 4 + 1, 4, 1) == (2, 1)
    assert FillKernel.grid(1 << 30, 1, 70000) == (FILL_MAX_BLOCKS, 65535)


def test_a_step_with_fill_kernels_gives_the_bits_of_one_with_memsets() -> None:
    """cuDNN's attention and cuBLASLt's GEMMs bring memset nodes into the step graph; as k_fill
    nodes the step computes the same bits (the other GPU tests run with them by default)."""
    from engine.backends.cuda import CudaBackend

    shapes = ModelShapes(n_layer=2, d_model=128, n_head=2, d_ff=512, vocab_size=8449,
                         seq_len=128)
    hp = {"loss_scale": 1.0, "lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
          "weight_decay": 0.1, "max_norm": 1.0}
    tok = np.random.default_rng(5).integers(0, 8449, (3, 4, 129)).astype(np.int32)
    out, nodes = [], []
    saved = os.environ.get("ANDREA_MEMSET_KERNELS")
    try:
        for fills in ("0", "1"):
            os.environ["ANDREA_MEMSET_KERNELS"] = fills
            bk = CudaBackend(shapes, 4, "bf16", tune=False)
            bk.load_params(init_params(shapes, seed=4))
            rows = [bk.train_step(t[:, :-1], t[:, 1:], grad_mult=1.0, t=i + 1, **hp)
                    for i, t in enumerate(tok)]
            nodes.append(bk.graph_nodes("step"))
            m, v = bk.read_optimizer()
            out.append((rows, bk.read_params(), m, v))
            bk.close()
    finally:
        if saved is None:
            os.environ.pop("ANDREA_MEMSET_KERNELS", None)
        else:
            os.environ["ANDREA_MEMSET_KERNELS"] = saved
    if not nodes[0].get("memset"):
        pytest.skip(f"this step graph has no memset nodes to replace: {nodes[0]}")
    assert not nodes[1].get("memset"), nodes[1]
    assert nodes[1]["kernel"] == nodes[0]["kernel"] + nodes[0]["memset"], nodes
    (rows_a, pa, ma, va), (rows_b, pb, mb, vb) = out
    for (la, na, ca), (lb, nb, cb) in zip(rows_a, rows_b, strict=True):  # row losses, norm, clip
        assert np.array_equal(la, lb) and (na, ca) == (nb, cb), ((na, ca), (nb, cb))
    for a, b in ((pa, pb), (ma, mb), (va, vb)):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
