"""graphs.py's graph editing without a GPU: memsets_as_kernels and capture's fallbacks against a
fake driver that keeps a graph as nodes and edges (the real one: tests/gpu/test_graph_fills.py),
and k_fill's grid (graphs.FillKernel.grid)."""

from __future__ import annotations

import ctypes as C
import itertools
from typing import Any

import pytest

from engine.backends.cuda import graphs
from engine.backends.cuda.graphs import FILL_BLOCK, FILL_MAX_BLOCKS, FillKernel
from engine.errors import RunError

FILL_FUNC = 0xF111
TYPES = {name: code for code, name in graphs.NODE_TYPES.items()}


def h(handle: Any) -> int:
    """A handle as the fake gets it: an int, or a c_void_p (its value)."""
    return handle.value if isinstance(handle, C.c_void_p) else int(handle)


class FakeDriver:
    """The driver calls graphs.py makes, on graphs held as {node: (type, params)} and a set of
    edges. `refuse` names calls that fail (CUDA error 1); `issue` builds the captured graph."""

    def __init__(self) -> None:
        self.ids = itertools.count(100)
        self.graphs: dict[int, dict[str, Any]] = {}
        self.destroyed: list[int] = []
        self.refuse: set[str] = set()
        self.captured = 0
        self.clones = 0

    # graphs as the tests write them
    def graph(self, nodes: dict[str, tuple[str, Any]], edges: list[tuple[str, str]]) -> dict:
        gid = next(self.ids)
        names = {name: next(self.ids) for name in nodes}
        self.graphs[gid] = {"nodes": {names[n]: (t, p) for n, (t, p) in nodes.items()},
                            "edges": {(names[a], names[b]) for a, b in edges}}
        self.captured = gid
        return names

    def _graph_of(self, node: int) -> dict[str, Any]:
        return next(g for g in self.graphs.values() if node in g["nodes"])

    def _fail(self, name: str) -> int:
        return 1 if name in self.refuse else 0

    # the calls
    def cuGetErrorString(self, status, msg) -> int:
        msg._obj.value = b"fake refusal"
        return 0

    def cuStreamBeginCapture_v2(self, stream, mode) -> int:
        return 0

    def cuStreamEndCapture(self, stream, graph) -> int:
        graph._obj.value = self.captured
        return 0

    def cuGraphGetNodes(self, graph, nodes, n) -> int:
        ids = sorted(self.graphs[h(graph)]["nodes"])
        if nodes is not None:
            for i, node in enumerate(ids):
                nodes[i] = node
        n._obj.value = len(ids)
        return 0

    def cuGraphNodeGetType(self, node, t) -> int:
        t._obj.value = TYPES[self._graph_of(h(node))["nodes"][h(node)][0]]
        return 0

    def cuGraphMemsetNodeGetParams(self, node, m) -> int:
        for k, v in self._graph_of(h(node))["nodes"][h(node)][1].items():
            setattr(m._obj, k, v)
        return 0

    def _query(self, node, others, data, n, outgoing: bool) -> int:
        g = self._graph_of(h(node))
        found = sorted(b if outgoing else a for a, b in g["edges"]
                       if (a if outgoing else b) == h(node))
        if others is None:
            n._obj.value = len(found)
            return 0
        if not n._obj.value:
            return 1  # as the driver: a query of none with arrays is an invalid argument
        for i, x in enumerate(found):
            others[i] = x
        return 0

    def cuGraphNodeGetDependencies_v2(self, node, others, data, n) -> int:
        return self._query(node, others, data, n, outgoing=False)

    def cuGraphNodeGetDependentNodes_v2(self, node, others, data, n) -> int:
        return self._query(node, others, data, n, outgoing=True)

    def cuGraphAddKernelNode_v2(self, new, graph, deps, n, kp) -> int:
        if self._fail("add"):
            return 1
        p = kp._obj
        types = (C.c_uint64, C.c_int64, C.c_int32, C.c_int32, C.c_int64, C.c_int64)
        args = [C.cast(p.kernelParams[i], C.POINTER(t))[0] for i, t in enumerate(types)]
        node = next(self.ids)
        g = self.graphs[h(graph)]
        g["nodes"][node] = ("kernel", {"func": p.func, "args": args,
                                       "grid": (p.gridDimX, p.gridDimY), "block": p.blockDimX})
        g["edges"] |= {(deps[i], node) for i in range(n)}
        new._obj.value = node
        return 0

    def cuGraphAddDependencies_v2(self, graph, froms, tos, data, n) -> int:
        self.graphs[h(graph)]["edges"] |= {(froms[i], tos[i]) for i in range(n)}
        return 0

    def cuGraphDestroyNode(self, node) -> int:
        if self._fail("destroy_node"):
            return 1
        g = self._graph_of(h(node))
        del g["nodes"][h(node)]
        g["edges"] = {e for e in g["edges"] if h(node) not in e}
        return 0

    def cuGraphClone(self, clone, graph) -> int:
        src = self.graphs[h(graph)]
        if self._fail("clone") or any(t in ("mem_alloc", "conditional")
                                      for t, _ in src["nodes"].values()):
            return 1
        self.clones += 1
        new = {old: next(self.ids) for old in src["nodes"]}
        gid = next(self.ids)
        self.graphs[gid] = {"nodes": {new[k]: v for k, v in src["nodes"].items()},
                            "edges": {(new[a], new[b]) for a, b in src["edges"]}}
        clone._obj.value = gid
        return 0

    def cuGraphKernelNodeGetAttribute(self, node, attr, v) -> int:
        assert attr == graphs.LAUNCH_ATTRIBUTE_PRIORITY
        t, params = self._graph_of(h(node))["nodes"][h(node)]
        assert t == "kernel", t
        v._obj.priority = params.get("priority", 0)
        return 0

    def cuGraphKernelNodeSetAttribute(self, node, attr, v) -> int:
        assert attr == graphs.LAUNCH_ATTRIBUTE_PRIORITY
        self._graph_of(h(node))["nodes"][h(node)][1]["priority"] = v._obj.priority
        return 0

    def cuGraphInstantiateWithFlags(self, exec_, graph, flags) -> int:
        self.instantiate_flags = flags
        edited = any(t == "kernel" and p.get("func") == FILL_FUNC
                     for t, p in self.graphs[h(graph)]["nodes"].values())
        if self._fail("instantiate_edited" if edited else "instantiate"):
            return 1
        exec_._obj.value = h(graph) + 1_000_000
        return 0

    def cuGraphDestroy(self, graph) -> int:
        gid = h(graph)
        assert gid in self.graphs and gid not in self.destroyed, f"graph {gid} destroyed twice"
        self.destroyed.append(gid)
        return 0

    def cuGraphExecDestroy(self, exec_) -> int:
        return 0

    def alive(self) -> set[int]:
        return set(self.graphs) - set(self.destroyed)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    drv = FakeDriver()
    monkeypatch.setattr(graphs, "_lib", drv)
    return drv


@pytest.fixture
def fill() -> FillKernel:
    k = FillKernel.__new__(FillKernel)
    k.func = C.c_void_p(FILL_FUNC)
    return k


def memset(dst: int, value: int, elem: int = 4, width: int = 1, height: int = 1,
           pitch: int = 0) -> tuple[str, dict[str, int]]:
    return ("memset", {"dst": dst, "value": value, "elementSize": elem, "width": width,
                       "height": height, "pitch": pitch})


def sample_graph(drv: FakeDriver, extra: dict[str, tuple[str, Any]] | None = None) -> dict:
    """A root memset, a kernel, a chain of two memsets fanning out to two kernels, and a 2-D
    one: the edges a stream capture with a fork makes."""
    nodes = {"m0": memset(0x1000, 0), "k1": ("kernel", {"func": 1}),
             "m1": memset(0x2000, 0xDEADBEEF), "m2": memset(0x3002, 0xBEEF, elem=2, width=9),
             "k2": ("kernel", {"func": 2}), "k3": ("kernel", {"func": 3}),
             "m3": memset(0x4000, 0x3C, elem=1, width=100, height=7, pitch=129)}
    edges = [("m0", "k1"), ("k1", "m1"), ("m1", "m2"), ("m2", "k2"), ("m2", "k3"),
             ("k1", "m3"), ("m3", "k3")]
    nodes.update(extra or {})
    return drv.graph(nodes, edges)


def labelled(drv: FakeDriver, gid: int) -> tuple[list[str], set[tuple[str, str]]]:
    """The graph's nodes named by what they do (a memset and the k_fill for it alike, by
    destination and value; another kernel by its function), and its edges by those names."""
    g = drv.graphs[gid]
    names = {}
    for node, (t, p) in g["nodes"].items():
        if t == "memset":
            names[node] = f"fill {p['dst']:#x}={p['value']:#x}"
        elif p.get("func") == FILL_FUNC:
            names[node] = f"fill {p['args'][0]:#x}={p['args'][2] & 0xFFFFFFFF:#x}"
        else:
            names[node] = f"{t} {p.get('func')}"
    return sorted(names.values()), {(names[a], names[b]) for a, b in g["edges"]}


def test_each_memset_becomes_a_fill_with_its_edges(fake: FakeDriver, fill: FillKernel) -> None:
    sample_graph(fake)
    before = labelled(fake, fake.captured)
    g = graphs.capture(1, lambda: None, fill)
    assert g.fill_note == "" and len(g.fills) == 4
    assert g.node_counts() == {"kernel": 7}
    after = labelled(fake, h(g._graph))
    assert len(set(after[0])) == 7 and after == before  # the same nodes, the same edges
    kept = fake.graphs[h(g._graph)]["nodes"]
    by_dst = {f.dst: f for f in g.fills}
    assert by_dst[0x4000] == graphs.Fill(0x4000, 129, 0x3C, 1, 100, 7, by_dst[0x4000].node)
    node = kept[by_dst[0x4000].node][1]
    assert node["args"] == [0x4000, 129, 0x3C, 1, 100, 7] and node["block"] == FILL_BLOCK
    assert node["grid"] == FillKernel.grid(100, 1, 7)
    assert by_dst[0x2000].value == 0xDEADBEEF and by_dst[0x3002].pitch == 0  # 1 row: no pitch
    assert fake.alive() == {h(g._graph)}  # the original went, the edited clone runs


def test_a_fill_takes_its_most_urgent_neighbours_priority(fake: FakeDriver,
                                                          fill: FillKernel) -> None:
    """A memset has no priority; its k_fill takes that of the kernel nodes after it (the most
    urgent of several), else of those before it (a memset neighbour has none; one already
    replaced counts as a kernel), and the graph is instantiated to run with the nodes'
    priorities."""
    sample_graph(fake, {"k1": ("kernel", {"func": 1, "priority": -5}),
                        "k2": ("kernel", {"func": 2, "priority": 0}),
                        "k3": ("kernel", {"func": 3, "priority": -3})})
    g = graphs.capture(1, lambda: None, fill)
    kept = fake.graphs[h(g._graph)]["nodes"]
    got = {f.dst: kept[f.node][1]["priority"] for f in g.fills}
    # m0 -> k1 (-5); k1 (-5) -> m1 -> m2, a memset then: k1's; k1 (-5) -> m2's fill: after it
    # k2 (0) and k3 (-3), not m1's fill before it; k1 (-5) -> m3 -> k3 (-3)
    assert got == {0x1000: -5, 0x2000: -5, 0x3002: -3, 0x4000: -3}
    assert g.kernel_priorities() == {-5: 3, 0: 1, -3: 3}
    assert fake.instantiate_flags == graphs.INSTANTIATE_USE_NODE_PRIORITY


@pytest.mark.parametrize("kind", ["mem_alloc", "conditional", "graph"])
def test_a_graph_the_pass_does_not_edit_runs_as_captured(fake: FakeDriver, fill: FillKernel,
                                                         kind: str) -> None:
    sample_graph(fake, {"x": (kind, {})})
    g = graphs.capture(1, lambda: None, fill)
    assert g.fills == [] and kind in g.fill_note and fake.clones == 0
    assert h(g._graph) == fake.captured and g.node_counts()["memset"] == 4


@pytest.mark.parametrize("refused", ["clone", "add", "destroy_node", "instantiate_edited"])
def test_where_the_driver_refuses_the_memsets_stay(fake: FakeDriver, fill: FillKernel,
                                                   refused: str) -> None:
    sample_graph(fake)
    fake.refuse = {refused}
    g = graphs.capture(1, lambda: None, fill)
    assert g.fills == [] and g.fill_note.startswith("the graph's memset nodes stay memsets")
    assert h(g._graph) == fake.captured and g.node_counts() == {"memset": 4, "kernel": 3}
    assert fake.alive() == {fake.captured}  # a clone made is destroyed, once


def test_a_graph_that_does_not_instantiate_is_not_leaked(fake: FakeDriver,
                                                         fill: FillKernel) -> None:
    sample_graph(fake)
    fake.refuse = {"instantiate", "instantiate_edited"}
    with pytest.raises(RunError, match="cuGraphInstantiate"):
        graphs.capture(1, lambda: None, fill)
    assert fake.alive() == set()


def test_without_fill_nothing_is_edited(fake: FakeDriver) -> None:
    sample_graph(fake)
    g = graphs.capture(1, lambda: None)
    assert g.node_counts() == {"memset": 4, "kernel": 3} and fake.clones == 0


def test_a_graph_without_memsets_is_not_cloned(fake: FakeDriver, fill: FillKernel) -> None:
    fake.graph({"a": ("kernel", {"func": 1}), "b": ("kernel", {"func": 2})}, [("a", "b")])
    g = graphs.capture(1, lambda: None, fill)
    assert g.fills == [] and g.fill_note == "" and fake.clones == 0
    assert h(g._graph) == fake.captured and fake.alive() == {fake.captured}


def test_a_small_memset_takes_one_block() -> None:
    assert FillKernel.grid(1, 4, 1) == (1, 1)
    assert FillKernel.grid(0, 1, 0) == (1, 1)


def test_a_row_takes_a_vector_a_thread() -> None:
    assert FillKernel.grid(FILL_BLOCK * 4, 4, 3) == (1, 3)
    assert FillKernel.grid(FILL_BLOCK * 4 + 1, 4, 1) == (2, 1)
    assert FillKernel.grid(FILL_BLOCK * 16, 1, 1) == (1, 1)
    assert FillKernel.grid(FILL_BLOCK * 8 + 1, 2, 1) == (2, 1)


def test_the_grid_is_capped_where_the_kernel_strides() -> None:
    assert FillKernel.grid(1 << 30, 1, 70000) == (FILL_MAX_BLOCKS, 65535)
