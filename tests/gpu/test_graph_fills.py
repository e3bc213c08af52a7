"""A captured graph's memset nodes as k_fill kernel nodes (graphs.memsets_as_kernels): the graph
writes the same bytes as with its memsets, nothing outside them, in the same order (the edges
in and out of each memset are kept), and a training step so built gives the same bits as one
with cuDNN's and cuBLASLt's memset nodes left in."""

from __future__ import annotations

import ctypes as C

import numpy as np
import pytest
from cudabk import cuda_backend

from engine.model.layout import ModelShapes, init_params

pytestmark = pytest.mark.gpu

SIZE = 24 << 20  # bytes of the test buffer
TALL = 16 << 20  # where the 2-D memset with more rows than a grid's y dimension starts
WIDE = 8 << 20  # where the 1-D memset longer than one grid's reach starts (4 MiB: 1024 x 256 x 16)


def _lib() -> C.CDLL:
    lib = C.CDLL("libcuda.so.1")
    sz = C.c_size_t
    lib.cuMemsetD2D32Async.argtypes = [C.c_uint64, sz, C.c_uint, sz, sz, C.c_void_p]
    lib.cuMemsetD2D16Async.argtypes = [C.c_uint64, sz, C.c_ushort, sz, sz, C.c_void_p]
    lib.cuMemsetD2D8Async.argtypes = [C.c_uint64, sz, C.c_ubyte, sz, sz, C.c_void_p]
    return lib


class Fork:
    """A second stream and the two events of a fork and a join, made before any capture (the
    backend too makes its events outside captures: ops.reserve_events)."""

    def __init__(self, drv) -> None:
        self.side = drv.Stream(flags=1)
        self.fork, self.join = drv.Event(), drv.Event()


def _memsets(gpu, base: int, fork: Fork) -> None:
    """Memsets of each element size at odd offsets and lengths, 2-D ones, two that overlap (the
    later one decides), a kernel between memsets that copies a filled range (it must see the
    first fill and not the second), and a fork onto a second stream and back."""
    drv, s, lib = gpu.drv, gpu.stream, _lib()
    drv.memset_d8_async(base + 3, 0xA5, 1001, s)
    drv.memset_d8_async(base + 5000, 0x00, 17, s)
    drv.memset_d16_async(base + 2 * 3001, 0xBEEF, 4097, s)
    drv.memset_d32_async(base + 4 * 4001, 0xDEADBEEF, 1, s)
    drv.memset_d32_async(base + 4 * 5003, 0x01020304, 2000, s)
    drv.memset_d32_async(base + 4 * 8192, 0, 4096, s)  # 16-byte aligned: the vector body
    assert lib.cuMemsetD2D32Async(base + 50000, 400, 0x7F7F0001, 37, 9, s.handle) == 0
    assert lib.cuMemsetD2D8Async(base + 60001, 129, 0x3C, 100, 7, s.handle) == 0
    assert lib.cuMemsetD2D16Async(base + 70002, 130, 0x1234, 50, 11, s.handle) == 0
    # overlapping: the second wins where they meet
    drv.memset_d32_async(base + 80000, 0x11111111, 1000, s)
    drv.memset_d16_async(base + 81000, 0x2222, 1000, s)
    # a kernel reads the first fill of [90000, 94000) (k_residual_add: out = a + b with b = 0)
    drv.memset_d16_async(base + 90000, 0x3F80, 2000, s)  # bf16 1.0
    drv.memset_d16_async(base + 100000, 0, 2000, s)
    gpu.kernels("bf16")["k_residual_add"].prepared_async_call(
        (8, 1, 1), (256, 1, 1), s, base + 110000, base + 90000, base + 100000, 2000)
    drv.memset_d16_async(base + 90000, 0x4000, 2000, s)  # bf16 2.0, after the kernel read 1.0
    # a fork: the side stream fills, the main stream waits for it, then overwrites part of it
    fork.fork.record(s)
    fork.side.wait_for_event(fork.fork)
    drv.memset_d8_async(base + 120000, 0x77, 5000, fork.side)
    fork.join.record(fork.side)
    s.wait_for_event(fork.join)
    drv.memset_d8_async(base + 122000, 0x88, 100, s)
    # beyond one grid: a row longer than 4 MiB, and more rows than 65535
    drv.memset_d32_async(base + WIDE, 0x5A5A5A5A, (5 << 20) // 4 + 3, s)
    assert lib.cuMemsetD2D32Async(base + TALL, 8, 0x0BADF00D, 1, 70000, s.handle) == 0


N_MEMSETS = 18


def _loaded(gpu):
    """k_fill and the bf16 kernels (_memsets launches one), loaded before any capture: a module
    load while a stream captures is not permitted."""
    from engine.backends.cuda import graphs

    gpu.kernels("bf16")
    return graphs.FillKernel.of(str(gpu.cubin("bf16", "fill")))


@pytest.mark.parametrize("fill", [False, True], ids=["memset nodes", "k_fill nodes"])
def test_the_graph_writes_what_its_memsets_write(gpu, rng, fill: bool) -> None:
    from engine.backends.cuda import graphs

    drv = gpu.drv
    kernel = _loaded(gpu) if fill else None
    fork = Fork(drv)
    start = rng.integers(0, 256, SIZE, dtype=np.uint8)
    buf = drv.mem_alloc(SIZE)
    drv.memcpy_htod(buf, start)
    _memsets(gpu, int(buf), fork)
    gpu.stream.synchronize()
    want = np.empty(SIZE, np.uint8)
    drv.memcpy_dtoh(want, buf)
    assert not np.array_equal(want, start)
    copied = want[110000:114000].view(np.uint16)
    assert (copied == 0x3F80).all()  # eagerly, the kernel saw the first fill

    drv.memcpy_htod(buf, start)
    g = graphs.capture(gpu.stream.handle, lambda: _memsets(gpu, int(buf), fork), kernel)
    counts = g.node_counts()
    assert counts.get("memset", 0) == (0 if fill else N_MEMSETS), counts
    assert counts.get("kernel", 0) == 1 + (N_MEMSETS if fill else 0), counts
    if fill:
        assert not g.fill_note
        assert {f.elem for f in g.fills} == {1, 2, 4}
        assert len(g.fills) == N_MEMSETS and any(f.height == 70000 for f in g.fills)
    g.launch()
    gpu.stream.synchronize()
    got = np.empty(SIZE, np.uint8)
    drv.memcpy_dtoh(got, buf)
    g.close()
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:20]


def _labelled_edges(graph) -> tuple[list[str], set[tuple[str, str]]]:
    """The graph's nodes named by what they write (a memset and the k_fill that stands for it
    alike: destination and value) and its edges by those names."""
    from engine.backends.cuda import graphs

    lib = graphs._driver()
    fills = {f.node: f for f in graph.fills}
    names = {}
    for node, kind in graphs._nodes(graph._graph):
        if kind == "memset":
            m = graphs._MemsetParams()
            assert lib.cuGraphMemsetNodeGetParams(node, C.byref(m)) == 0
            names[node.value] = f"fill {m.dst:#x}={m.value:#x}"
        elif node.value in fills:
            f = fills[node.value]
            names[node.value] = f"fill {f.dst:#x}={f.value:#x}"
        else:
            names[node.value] = kind
    vp = C.c_void_p
    get = C.CDLL("libcuda.so.1").cuGraphGetEdges_v2
    get.argtypes = [vp, C.POINTER(vp), C.POINTER(vp), vp, C.POINTER(C.c_size_t)]
    n = C.c_size_t(0)
    assert get(graph._graph, None, None, None, C.byref(n)) == 0
    a, b = (vp * max(1, n.value))(), (vp * max(1, n.value))()
    assert get(graph._graph, a, b, None, C.byref(n)) == 0
    return sorted(names.values()), {(names[a[i]], names[b[i]]) for i in range(n.value)}


def test_the_edges_stay_where_they_were(gpu) -> None:
    """Each memset's edges become its k_fill's: the same nodes by what they write (all
    distinct), joined by the same edges."""
    from engine.backends.cuda import graphs

    kernel, fork = _loaded(gpu), Fork(gpu.drv)
    buf = gpu.drv.mem_alloc(SIZE)
    plain = graphs.capture(gpu.stream.handle, lambda: _memsets(gpu, int(buf), fork))
    filled = graphs.capture(gpu.stream.handle, lambda: _memsets(gpu, int(buf), fork), kernel)
    before, after = _labelled_edges(plain), _labelled_edges(filled)
    plain.close()
    filled.close()
    assert len(filled.fills) == N_MEMSETS and len(set(before[0])) == N_MEMSETS + 1
    assert len(before[1]) >= N_MEMSETS  # the capture chains them (and forks once)
    assert after == before


def test_a_step_with_fill_kernels_gives_the_bits_of_one_with_memsets() -> None:
    """cuDNN's attention and cuBLASLt's GEMMs bring memset nodes into the step graph; as k_fill
    nodes, with the very same parameters, the step computes the same bits (the other GPU tests
    run with them by default; the memset nodes are what runs where the fill kernel does not
    load). Both backends take cuBLASLt's first choices (no GEMM timing), so that they run the
    same GEMM algorithms. This shows that the fills corrupt
    nothing and race with nothing; that they write the right bytes is the first test's (the
    counters may hold zeros already)."""

    shapes = ModelShapes(n_layer=2, d_model=128, n_head=2, d_ff=512, vocab_size=8449,
                         seq_len=128)
    hp = {"loss_scale": 1.0, "lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
          "weight_decay": 0.1, "max_norm": 1.0}
    tok = np.random.default_rng(5).integers(0, 8449, (3, 4, 129)).astype(np.int32)
    out, nodes, fills = [], [], []
    for fill_kernels in (False, True):
        bk = cuda_backend(shapes, 4, "bf16")
        bk.graphs.memset_kernels = fill_kernels  # before any graph is captured
        bk.load_params(init_params(shapes, seed=4))
        rows = [bk.train_step(t[:, :-1], t[:, 1:], grad_mult=1.0, t=i + 1, **hp)
                for i, t in enumerate(tok)]
        nodes.append(bk.graph_nodes("step"))
        step = max((k for k in bk.graphs.graphs if k[0] == "step"), default=None)
        fills.append(bk.graphs.graphs[step].fills if step else [])
        m, v = bk.read_optimizer()
        out.append((rows, bk.read_params(), m, v))
        bk.close()
    if not nodes[0].get("memset"):
        pytest.skip(f"this step graph has no memset nodes to replace: {nodes[0]}")
    assert not nodes[1].get("memset"), nodes[1]
    assert nodes[1]["kernel"] == nodes[0]["kernel"] + nodes[0]["memset"], nodes
    assert not fills[0] and len(fills[1]) == nodes[0]["memset"]
    (rows_a, pa, ma, va), (rows_b, pb, mb, vb) = out
    for (la, na, ca), (lb, nb, cb) in zip(rows_a, rows_b, strict=True):  # row losses, norm, clip
        assert np.array_equal(la, lb) and (na, ca) == (nb, cb), ((na, ca), (nb, cb))
    for a, b in ((pa, pb), (ma, mb), (va, vb)):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
