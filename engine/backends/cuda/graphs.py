"""CUDA graphs for a PyCUDA stream, through the driver API (ctypes on libcuda.so.1).

PyCUDA has no stream-capture API, so: begin capture on the stream's handle, issue the same
launches (PyCUDA kernels and cuBLAS GEMMs) as usual, end capture, instantiate, and replay the
whole step with one `cuGraphLaunch` (≈1 µs per kernel against 7–17 µs from Python, DESIGN
§11).
Everything captured must use fixed device buffers; values that change per call (the loss scale,
the tokens) are read from device memory the host fills before each launch.
"""

from __future__ import annotations

import ctypes as C
import gc
from collections.abc import Callable

from engine.errors import RunError

CAPTURE_MODE_THREAD_LOCAL = 1
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty",
              6: "event_wait", 7: "event_record", 8: "ext_signal", 9: "ext_wait", 10: "mem_alloc",
              11: "mem_free", 12: "batch_mem_op", 13: "conditional"}

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
        for f in ("cuStreamBeginCapture_v2", "cuStreamEndCapture", "cuGraphInstantiateWithFlags",
                  "cuGraphLaunch", "cuGraphExecDestroy", "cuGraphDestroy", "cuGetErrorString",
                  "cuGraphGetNodes", "cuGraphNodeGetType"):
            getattr(lib, f).restype = C.c_int
        _lib = lib
    return _lib


def _check(status: int, what: str) -> None:
    if status != 0:
        msg = C.c_char_p()
        _driver().cuGetErrorString(status, C.byref(msg))
        text = msg.value.decode() if msg.value else "unknown"
        raise RunError(f"{what} failed: CUDA error {status} ({text})")


class CudaGraph:
    """An instantiated graph: `launch()` replays everything captured, on the same stream."""

    def __init__(self, graph: C.c_void_p, exec_: C.c_void_p, stream_handle: int) -> None:
        self._graph, self._exec, self._stream = graph, exec_, stream_handle

    def launch(self) -> None:
        _check(_driver().cuGraphLaunch(self._exec, C.c_void_p(self._stream)), "cuGraphLaunch")

    def node_counts(self) -> dict[str, int]:
        """Nodes of the captured graph by type: kernel, memset, memcpy, ... (what one launch
        runs: the step's kernels are the 'kernel' nodes)."""
        lib = _driver()
        n = C.c_size_t(0)
        _check(lib.cuGraphGetNodes(self._graph, None, C.byref(n)), "cuGraphGetNodes")
        nodes = (C.c_void_p * max(1, n.value))()
        _check(lib.cuGraphGetNodes(self._graph, nodes, C.byref(n)), "cuGraphGetNodes")
        out: dict[str, int] = {}
        for i in range(n.value):
            t = C.c_int(-1)
            _check(lib.cuGraphNodeGetType(nodes[i], C.byref(t)), "cuGraphNodeGetType")
            name = NODE_TYPES.get(t.value, f"type{t.value}")
            out[name] = out.get(name, 0) + 1
        return out

    def close(self) -> None:
        if self._exec:
            _driver().cuGraphExecDestroy(self._exec)
            _driver().cuGraphDestroy(self._graph)
            self._exec = self._graph = None


def capture(stream_handle: int, issue: Callable[[], None]) -> CudaGraph:
    """Record the work `issue()` puts on the stream (nothing runs) and instantiate it."""
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
    exec_ = C.c_void_p()
    _check(lib.cuGraphInstantiateWithFlags(C.byref(exec_), graph, 0), "cuGraphInstantiate")
    return CudaGraph(graph, exec_, stream_handle)
