"""NCCL through ctypes on `libnccl.so.2`: the few calls data parallelism needs, on raw pointers.

Why ctypes and not NVIDIA's `nccl4py`: the engine already talks to cuBLAS and cuBLASLt this way
(the same error handling, the same raw device pointers and stream handles), it adds no coupling to
a `cuda-core` version, and 40 lines cover what is used: a unique id, a communicator per rank, an
fp32 sum in place on the training stream, and an abort for when a peer is gone. The library
comes from LD_LIBRARY_PATH, or from the `nvidia-nccl-cu13` wheel (`pip install andrea[nccl]`).
"""

from __future__ import annotations

import ctypes as C
import glob
import importlib.util
import os
from typing import Any

from engine.errors import RunError

UNIQUE_ID_BYTES = 128
NCCL_FLOAT32, NCCL_SUM = 7, 0


class _UniqueId(C.Structure):
    _fields_ = [("internal", C.c_char * UNIQUE_ID_BYTES)]


def _find_library() -> str:
    candidates = ["libnccl.so.2"]
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        candidates += glob.glob(os.path.join(base, "nccl", "lib", "libnccl.so*"))
    errors = []
    for c in candidates:
        try:
            C.CDLL(c)
            return c
        except OSError as e:
            errors.append(str(e))
    raise RunError("NCCL library (libnccl.so.2) not found: install the nccl extra "
                   "(pip install 'andrea[nccl]') or put it on LD_LIBRARY_PATH; "
                   + "; ".join(errors[:2]))


class Nccl:
    """One communicator of a data-parallel job (this process's rank of `world`)."""

    def __init__(self) -> None:
        lib = self.lib = C.CDLL(_find_library())
        vp, i32 = C.c_void_p, C.c_int
        for name, args in {"ncclGetVersion": [C.POINTER(i32)],
                           "ncclGetUniqueId": [C.POINTER(_UniqueId)],
                           "ncclCommInitRank": [C.POINTER(vp), i32, _UniqueId, i32],
                           "ncclAllReduce": [vp, vp, C.c_size_t, i32, i32, vp, vp],
                           "ncclCommDestroy": [vp], "ncclCommAbort": [vp],
                           "ncclGetErrorString": [i32]}.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = C.c_char_p if name == "ncclGetErrorString" else i32
        v = C.c_int()
        self._ok(lib.ncclGetVersion(C.byref(v)), "ncclGetVersion")
        self.version = v.value
        self.comm = C.c_void_p()

    def _ok(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RunError(f"{what}: NCCL error {rc} ({self.lib.ncclGetErrorString(rc).decode()})")

    def new_id(self) -> bytes:
        """A fresh unique id (rank 0 makes it; the others receive it through the channel)."""
        uid = _UniqueId()
        self._ok(self.lib.ncclGetUniqueId(C.byref(uid)), "ncclGetUniqueId")
        return C.string_at(C.addressof(uid), UNIQUE_ID_BYTES)

    def init(self, world: int, rank: int, uid: bytes) -> None:
        """Join the communicator (on the current CUDA device); blocks until every rank has."""
        if len(uid) != UNIQUE_ID_BYTES:
            raise RunError(f"NCCL unique id: expected {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        self._ok(self.lib.ncclCommInitRank(C.byref(self.comm), world,
                                           _UniqueId.from_buffer_copy(uid), rank),
                 "ncclCommInitRank")

    def all_reduce_sum(self, ptr: int, count: int, stream: Any) -> None:
        """ptr[:count] (float32, on the device) = the sum over the ranks, in place, queued on
        `stream` (a PyCUDA stream or its handle); capturable in a CUDA graph."""
        handle = getattr(stream, "handle", stream)
        self._ok(self.lib.ncclAllReduce(C.c_void_p(ptr), C.c_void_p(ptr), count, NCCL_FLOAT32,
                                        NCCL_SUM, self.comm, C.c_void_p(handle)),
                 "ncclAllReduce")

    def abort(self) -> None:
        """End the communicator now, from any thread: a collective blocked on a dead peer
        returns with an error instead of waiting forever."""
        if self.comm:
            self.lib.ncclCommAbort(self.comm)
            self.comm = C.c_void_p()

    def close(self) -> None:
        if self.comm:
            self.lib.ncclCommDestroy(self.comm)
            self.comm = C.c_void_p()
