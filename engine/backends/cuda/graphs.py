"""CUDA graphs for a PyCUDA stream, through the driver API (ctypes on libcuda.so.1).

PyCUDA has no stream-capture API, so: begin capture on the stream's handle, issue the same
launches (PyCUDA kernels and cuBLAS GEMMs) as usual, end capture, instantiate, and replay the
whole step with one `cuGraphLaunch` (≈1 µs per kernel against 7–17 µs from Python, DESIGN
§11).
Everything captured must use fixed device buffers; values that change per call (the loss scale,
the tokens) are read from device memory the host fills before each launch.

`capture(..., fill=)` turns the graph's memset nodes (the 4-byte counters that cuDNN and
cuBLASLt zero inside their calls) into kernel nodes of kernels/fill.cu's k_fill before
instantiating: on the H200 the step graph's GPU sat idle for a median 3–4 µs (up to 7) before
each memset node, 1.6 µs before a kernel node. The bytes written are the same.

Stream priorities: a captured kernel node keeps the priority of the stream it was captured
from, and graphs are instantiated to run with these per-node priorities
(CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY), so that where two streams' kernels wait for SMs
the block scheduler serves the higher one first (`set_stream_priority`: runtime.Gpu puts the
main stream at the greatest priority, a backend its weight-gradient stream below it). Graphs
whose streams share one priority run as before.
"""

from __future__ import annotations

import ctypes as C
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from engine.errors import RunError

CAPTURE_MODE_THREAD_LOCAL = 1
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty",
              6: "event_wait", 7: "event_record", 8: "ext_signal", 9: "ext_wait", 10: "mem_alloc",
              11: "mem_free", 12: "batch_mem_op", 13: "conditional"}

LAUNCH_ATTRIBUTE_PRIORITY = 8  # CU_LAUNCH_ATTRIBUTE_PRIORITY: for streams and kernel nodes
INSTANTIATE_USE_NODE_PRIORITY = 8  # CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY

FILL_BLOCK = 256  # k_fill's threads per block
FILL_MAX_BLOCKS = 1024  # blocks along a row (the kernel strides over the rest)


class _MemsetParams(C.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", C.c_uint64), ("pitch", C.c_size_t), ("value", C.c_uint),
                ("elementSize", C.c_uint), ("width", C.c_size_t), ("height", C.c_size_t)]


class _KernelParams(C.Structure):  # CUDA_KERNEL_NODE_PARAMS (v2)
    _fields_ = [("func", C.c_void_p), ("gridDimX", C.c_uint), ("gridDimY", C.c_uint),
                ("gridDimZ", C.c_uint), ("blockDimX", C.c_uint), ("blockDimY", C.c_uint),
                ("blockDimZ", C.c_uint), ("sharedMemBytes", C.c_uint),
                ("kernelParams", C.POINTER(C.c_void_p)), ("extra", C.POINTER(C.c_void_p)),
                ("kern", C.c_void_p), ("ctx", C.c_void_p)]


class _LaunchAttrValue(C.Union):  # CUlaunchAttributeValue (64 bytes), its priority member
    _fields_ = [("priority", C.c_int), ("_size", C.c_ubyte * 64), ("_align", C.c_uint64)]


class _EdgeData(C.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", C.c_ubyte), ("to_port", C.c_ubyte), ("type", C.c_ubyte),
                ("reserved", C.c_ubyte * 5)]

    def is_default(self) -> bool:
        return not (self.from_port or self.to_port or self.type or any(self.reserved))


_lib: C.CDLL | None = None


def _driver() -> C.CDLL:
    global _lib
    if _lib is None:
        lib = C.CDLL("libcuda.so.1")
        vp = C.c_void_p
        lib.cuStreamBeginCapture_v2.argtypes = [vp, C.c_int]
        lib.cuStreamEndCapture.argtypes = [vp, C.POINTER(vp)]
        lib.cuGraphInstantiateWithFlags.argtypes = [C.POINTER(vp), vp, C.c_ulonglong]
        lib.cuGraphLaunch.argtypes = [vp, vp]
        lib.cuGraphExecDestroy.argtypes = [vp]
        lib.cuGraphDestroy.argtypes = [vp]
        lib.cuGetErrorString.argtypes = [C.c_int, C.POINTER(C.c_char_p)]
        lib.cuGraphGetNodes.argtypes = [vp, C.POINTER(vp), C.POINTER(C.c_size_t)]
        lib.cuGraphNodeGetType.argtypes = [vp, C.POINTER(C.c_int)]
        lib.cuGraphMemsetNodeGetParams.argtypes = [vp, C.POINTER(_MemsetParams)]
        edges = [vp, C.POINTER(vp), C.POINTER(_EdgeData), C.POINTER(C.c_size_t)]
        lib.cuGraphNodeGetDependencies_v2.argtypes = edges
        lib.cuGraphNodeGetDependentNodes_v2.argtypes = edges
        lib.cuGraphAddKernelNode_v2.argtypes = [C.POINTER(vp), vp, C.POINTER(vp), C.c_size_t,
                                                C.POINTER(_KernelParams)]
        lib.cuGraphAddDependencies_v2.argtypes = [vp, C.POINTER(vp), C.POINTER(vp),
                                                  C.POINTER(_EdgeData), C.c_size_t]
        lib.cuGraphDestroyNode.argtypes = [vp]
        lib.cuGraphClone.argtypes = [C.POINTER(vp), vp]
        lib.cuModuleLoad.argtypes = [C.POINTER(vp), C.c_char_p]
        lib.cuModuleGetFunction.argtypes = [C.POINTER(vp), vp, C.c_char_p]
        lib.cuModuleUnload.argtypes = [vp]
        lib.cuCtxGetStreamPriorityRange.argtypes = [C.POINTER(C.c_int), C.POINTER(C.c_int)]
        lib.cuStreamSetAttribute.argtypes = [vp, C.c_int, C.POINTER(_LaunchAttrValue)]
        lib.cuGraphKernelNodeGetAttribute.argtypes = [vp, C.c_int, C.POINTER(_LaunchAttrValue)]
        lib.cuGraphKernelNodeSetAttribute.argtypes = [vp, C.c_int, C.POINTER(_LaunchAttrValue)]
        for f in ("cuStreamBeginCapture_v2", "cuStreamEndCapture", "cuGraphInstantiateWithFlags",
                  "cuGraphLaunch", "cuGraphExecDestroy", "cuGraphDestroy", "cuGetErrorString",
                  "cuGraphGetNodes", "cuGraphNodeGetType", "cuGraphMemsetNodeGetParams",
                  "cuGraphNodeGetDependencies_v2", "cuGraphNodeGetDependentNodes_v2",
                  "cuGraphAddKernelNode_v2", "cuGraphAddDependencies_v2", "cuGraphDestroyNode",
                  "cuModuleLoad", "cuModuleGetFunction", "cuGraphClone", "cuModuleUnload",
                  "cuCtxGetStreamPriorityRange", "cuStreamSetAttribute",
                  "cuGraphKernelNodeGetAttribute", "cuGraphKernelNodeSetAttribute"):
            getattr(lib, f).restype = C.c_int
        _lib = lib
    return _lib


def _check(status: int, what: str) -> None:
    if status != 0:
        msg = C.c_char_p()
        _driver().cuGetErrorString(status, C.byref(msg))
        text = msg.value.decode() if msg.value else "unknown"
        raise RunError(f"{what} failed: CUDA error {status} ({text})")


def stream_priority_range() -> tuple[int, int]:
    """(least, greatest) stream priority of the current context; greatest is the smaller number
    (on the H200: 0 and -5)."""
    least, greatest = C.c_int(), C.c_int()
    _check(_driver().cuCtxGetStreamPriorityRange(C.byref(least), C.byref(greatest)),
           "cuCtxGetStreamPriorityRange")
    return least.value, greatest.value


def set_stream_priority(stream_handle: int, priority: int) -> None:
    """The priority of the kernels launched into the stream from now on (and of the kernel
    nodes captured from it)."""
    v = _LaunchAttrValue()
    v.priority = priority
    _check(_driver().cuStreamSetAttribute(C.c_void_p(stream_handle), LAUNCH_ATTRIBUTE_PRIORITY,
                                          C.byref(v)), "cuStreamSetAttribute")


def _nodes(graph: C.c_void_p) -> list[tuple[C.c_void_p, str]]:
    """The graph's nodes with their types (NODE_TYPES' names)."""
    lib = _driver()
    n = C.c_size_t(0)
    _check(lib.cuGraphGetNodes(graph, None, C.byref(n)), "cuGraphGetNodes")
    nodes = (C.c_void_p * max(1, n.value))()
    _check(lib.cuGraphGetNodes(graph, nodes, C.byref(n)), "cuGraphGetNodes")
    out = []
    for i in range(n.value):
        t = C.c_int(-1)
        _check(lib.cuGraphNodeGetType(nodes[i], C.byref(t)), "cuGraphNodeGetType")
        out.append((C.c_void_p(nodes[i]), NODE_TYPES.get(t.value, f"type{t.value}")))
    return out


def _kernel_priority(node: C.c_void_p) -> int | None:
    """A kernel node's priority; None for a node of another type."""
    lib = _driver()
    t = C.c_int(-1)
    _check(lib.cuGraphNodeGetType(node, C.byref(t)), "cuGraphNodeGetType")
    if t.value != 0:
        return None
    v = _LaunchAttrValue()
    _check(lib.cuGraphKernelNodeGetAttribute(node, LAUNCH_ATTRIBUTE_PRIORITY, C.byref(v)),
           "cuGraphKernelNodeGetAttribute")
    return v.priority


def _edges(query: Callable[..., int], node: C.c_void_p) -> tuple[Any, Any, int]:
    """A node's dependencies or dependents (by `query`) and their edge data."""
    n = C.c_size_t(0)
    _check(query(node, None, None, C.byref(n)), query.__name__)
    others, data = (C.c_void_p * max(1, n.value))(), (_EdgeData * max(1, n.value))()
    if n.value:  # (a second query of none is an invalid argument)
        _check(query(node, others, data, C.byref(n)), query.__name__)
    return others, data, n.value


class FillKernel:
    """kernels/fill.cu's k_fill, loaded through the driver API (a graph's kernel node needs the
    CUfunction, which PyCUDA does not expose). `FillKernel.of(cubin)`: one per cubin and
    process (the module is never unloaded)."""

    _loaded: ClassVar[dict[str, FillKernel]] = {}

    @classmethod
    def of(cls, cubin: str) -> FillKernel:
        if cubin not in cls._loaded:
            cls._loaded[cubin] = cls(cubin)
        return cls._loaded[cubin]

    def __init__(self, cubin: str) -> None:
        lib = _driver()
        self._module, self.func = C.c_void_p(), C.c_void_p()
        _check(lib.cuModuleLoad(C.byref(self._module), cubin.encode()), "cuModuleLoad")
        status = lib.cuModuleGetFunction(C.byref(self.func), self._module, b"k_fill")
        if status != 0:
            lib.cuModuleUnload(self._module)
            _check(status, "cuModuleGetFunction k_fill")

    @staticmethod
    def grid(width: int, elem: int, height: int) -> tuple[int, int]:
        """Blocks along a row (one 16-byte vector a thread, at most FILL_MAX_BLOCKS) and rows."""
        vectors = -(-width * elem // 16)
        return (max(1, min(FILL_MAX_BLOCKS, -(-vectors // FILL_BLOCK))), max(1, min(height, 65535)))


@dataclass(frozen=True)
class Fill:
    """One memset node's parameters, as memsets_as_kernels gave them to k_fill."""

    dst: int
    pitch: int
    value: int
    elem: int
    width: int
    height: int
    node: int  # the k_fill node's handle in the graph that holds it


# nodes that keep a graph as it is: cuGraphClone refuses graphs with stream-ordered allocations
# or conditional nodes (and cuGraphDestroyNode edits of the former); a child graph's memsets
# are not visited
NOT_EDITED = ("mem_alloc", "mem_free", "graph", "conditional")


def memsets_as_kernels(graph: C.c_void_p, fill: FillKernel) -> list[Fill]:
    """Replace each memset node of a captured (not yet instantiated) graph's top level by a
    k_fill kernel node with the same parameters and the same edges in and out. Returns what
    was replaced. The caller checks NOT_EDITED first (_with_fills)."""
    lib = _driver()
    nodes = _nodes(graph)
    done = []
    for node, kind in nodes:
        if kind != "memset":
            continue
        m = _MemsetParams()
        _check(lib.cuGraphMemsetNodeGetParams(node, C.byref(m)), "cuGraphMemsetNodeGetParams")
        es = int(m.elementSize)
        if es not in (1, 2, 4) or m.dst % es or (m.height > 1 and m.pitch % es):
            continue
        deps, dep_data, n_in = _edges(lib.cuGraphNodeGetDependencies_v2, node)
        # (only kernel nodes have edges with data, programmatic ones, and only to kernel nodes;
        # a memset reached by one would stay)
        if not all(dep_data[i].is_default() for i in range(n_in)):
            continue
        outs, out_data, n_out = _edges(lib.cuGraphNodeGetDependentNodes_v2, node)
        pitch = int(m.pitch) if m.height > 1 else 0
        args = (C.c_uint64(m.dst), C.c_int64(pitch), C.c_int32(m.value), C.c_int32(es),
                C.c_int64(m.width), C.c_int64(m.height))
        ptrs = (C.c_void_p * len(args))(*(C.cast(C.pointer(a), C.c_void_p) for a in args))
        gx, gy = fill.grid(int(m.width), es, int(m.height))
        kp = _KernelParams(func=fill.func, gridDimX=gx, gridDimY=gy, gridDimZ=1,
                           blockDimX=FILL_BLOCK, blockDimY=1, blockDimZ=1, sharedMemBytes=0,
                           kernelParams=ptrs, extra=None, kern=None, ctx=None)
        new = C.c_void_p()
        _check(lib.cuGraphAddKernelNode_v2(C.byref(new), graph, deps, n_in, C.byref(kp)),
               "cuGraphAddKernelNode")
        # a memset has no priority: the fill takes its stream's, that is the kernels' after it
        # (the library call that zeroes its counter), else before it (a fork's first node may
        # depend on the other stream's kernel), the most urgent where there are several
        after, before = (
            [q for q in (_kernel_priority(C.c_void_p(x)) for x in nodes_[:n]) if q is not None]
            for nodes_, n in ((outs, n_out), (deps, n_in)))
        near = after or before
        if near:
            v = _LaunchAttrValue()
            v.priority = min(near)
            _check(lib.cuGraphKernelNodeSetAttribute(new, LAUNCH_ATTRIBUTE_PRIORITY, C.byref(v)),
                   "cuGraphKernelNodeSetAttribute")
        if n_out:
            _check(lib.cuGraphAddDependencies_v2(graph, (C.c_void_p * n_out)(*[new] * n_out),
                                                 outs, out_data, n_out),
                   "cuGraphAddDependencies")
        _check(lib.cuGraphDestroyNode(node), "cuGraphDestroyNode")
        done.append(Fill(int(m.dst), pitch, int(m.value), es, int(m.width), int(m.height),
                         int(new.value or 0)))
    return done


def _with_fills(graph: C.c_void_p, fill: FillKernel) -> tuple[C.c_void_p | None, list[Fill], str]:
    """memsets_as_kernels on a clone of the graph: (the edited clone, what it replaced, ""), or
    (None, [], why) where the graph is not to be edited or the driver refuses (the original
    then runs as captured). The original is left to the caller either way."""
    present = {kind for _, kind in _nodes(graph)}
    if "memset" not in present:
        return None, [], ""  # nothing to replace: the graph as captured
    kinds = sorted(present & set(NOT_EDITED))
    if kinds:
        return None, [], f"the graph's memset nodes stay memsets: it holds {', '.join(kinds)} nodes"
    lib = _driver()
    clone = C.c_void_p()
    try:
        _check(lib.cuGraphClone(C.byref(clone), graph), "cuGraphClone")
        return clone, memsets_as_kernels(clone, fill), ""
    except RunError as e:
        if clone:
            lib.cuGraphDestroy(clone)
        return None, [], f"the graph's memset nodes stay memsets: {e}"
    except BaseException:
        if clone:
            lib.cuGraphDestroy(clone)
        raise


def _instantiate(graph: C.c_void_p) -> tuple[C.c_void_p, int]:
    exec_ = C.c_void_p()
    return exec_, _driver().cuGraphInstantiateWithFlags(C.byref(exec_), graph,
                                                        INSTANTIATE_USE_NODE_PRIORITY)


class CudaGraph:
    """An instantiated graph: `launch()` replays everything captured, on the same stream."""

    def __init__(self, graph: C.c_void_p, exec_: C.c_void_p, stream_handle: int,
                 fills: list[Fill] | None = None, fill_note: str = "") -> None:
        self._graph, self._exec, self._stream = graph, exec_, stream_handle
        self.fills = fills or []  # the memset nodes that became k_fill nodes
        self.fill_note = fill_note  # why they did not, where the driver refused

    def launch(self) -> None:
        _check(_driver().cuGraphLaunch(self._exec, C.c_void_p(self._stream)), "cuGraphLaunch")

    def node_counts(self) -> dict[str, int]:
        """Nodes of the captured graph by type: kernel, memset, memcpy, ... (what one launch
        runs: the step's kernels are the 'kernel' nodes, k_fill's included)."""
        out: dict[str, int] = {}
        for _, name in _nodes(self._graph):
            out[name] = out.get(name, 0) + 1
        return out

    def kernel_priorities(self) -> dict[int, int]:
        """Kernel nodes of the captured graph by their priority (what each runs with); {} once
        closed."""
        if not self._graph:
            return {}
        out: dict[int, int] = {}
        for node, name in _nodes(self._graph):
            if name == "kernel":
                q = _kernel_priority(node)
                assert q is not None
                out[q] = out.get(q, 0) + 1
        return out

    def close(self) -> None:
        if self._exec:
            _driver().cuGraphExecDestroy(self._exec)
            _driver().cuGraphDestroy(self._graph)
            self._exec = self._graph = None


def capture(stream_handle: int, issue: Callable[[], None],
            fill: FillKernel | None = None) -> CudaGraph:
    """Record the work `issue()` puts on the stream (nothing runs) and instantiate it; with
    `fill`, its memset nodes become k_fill kernel nodes first (memsets_as_kernels)."""
    lib = _driver()
    stream = C.c_void_p(stream_handle)
    # Python's garbage collector must not run during the capture: freeing a dead object's
    # page-locked memory (cuMemFreeHost) is not permitted while a stream captures, and the failed
    # call invalidates the capture (seen with many backends in one test process).
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        _check(lib.cuStreamBeginCapture_v2(stream, CAPTURE_MODE_THREAD_LOCAL),
               "cuStreamBeginCapture")
        graph = C.c_void_p()
        try:
            issue()
        except BaseException:
            lib.cuStreamEndCapture(stream, C.byref(graph))  # leave the stream usable
            if graph:
                lib.cuGraphDestroy(graph)
            raise
        _check(lib.cuStreamEndCapture(stream, C.byref(graph)), "cuStreamEndCapture")
    finally:
        if was_enabled:
            gc.enable()
    try:
        edited, fills, note = _with_fills(graph, fill) if fill is not None else (None, [], "")
    except BaseException:
        lib.cuGraphDestroy(graph)
        raise
    if edited is not None:
        exec_, status = _instantiate(edited)
        if status == 0:
            lib.cuGraphDestroy(graph)
            return CudaGraph(edited, exec_, stream_handle, fills)
        lib.cuGraphDestroy(edited)  # the memsets' graph, as captured, instead
        fills, note = [], f"the graph's memset nodes stay memsets: cuGraphInstantiate of the " \
                          f"edited graph failed (CUDA error {status})"
    exec_, status = _instantiate(graph)
    if status != 0:
        lib.cuGraphDestroy(graph)
        _check(status, "cuGraphInstantiate")
    return CudaGraph(graph, exec_, stream_handle, fills, note)
