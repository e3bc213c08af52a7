"""ctypes loading for the flex attention backward (flex_call.py): the libraries, their symbols
and the driver's memset that zeroes dq_sem. Every failure is a RunError naming the library.

- `load(path, what, global_=...)`: `ctypes.CDLL`, RTLD_GLOBAL when asked (libtvm_ffi.so and
  libcute_dsl_runtime.so must be global: the kernels' library resolves against them).
- `symbol(lib, name, what, argtypes, restype)`: a bound function, typed.
- `DriverMemset(libcuda)`: `cuMemsetD32Async` of libcuda (default "libcuda.so.1"), which
  enqueues on the given stream (under capture it becomes a memset node); it needs the CUDA
  context that owns the pointer current on the calling thread (the engine's pycuda context).
  A nonzero CUresult is a RunError with the driver's error name.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

from engine.errors import RunError

LIBCUDA = "libcuda.so.1"


def load(path: str, what: str, *, global_: bool = False) -> ctypes.CDLL:
    """`ctypes.CDLL(path)`; RunError naming `what` and the loader's message if it fails."""
    try:
        return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL if global_ else ctypes.DEFAULT_MODE)
    except OSError as e:
        raise RunError(f"flex attention: cannot load {what} from {path} ({e})") from None


def symbol(lib: ctypes.CDLL, name: str, what: str, argtypes: Sequence[object],
           restype: object) -> Callable[..., Any]:
    """`lib.name` with its argument and result types set; RunError naming `what` if absent."""
    try:
        fn = getattr(lib, name)
    except AttributeError:
        raise RunError(f"flex attention: {what} ({lib._name}) has no symbol {name}") from None
    fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn


class DriverMemset:
    """Zeroes int32 buffers on a stream with the driver's cuMemsetD32Async."""

    def __init__(self, libcuda: str = LIBCUDA) -> None:
        lib = load(libcuda, "the CUDA driver (libcuda, for zeroing dq_sem)")
        self._memset = symbol(lib, "cuMemsetD32Async", "the CUDA driver",
                              [ctypes.c_uint64, ctypes.c_uint32, ctypes.c_size_t, ctypes.c_void_p],
                              ctypes.c_int)
        self._name = symbol(lib, "cuGetErrorName", "the CUDA driver",
                            [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)], ctypes.c_int)

    def zero_i32(self, ptr: int, count: int, stream: int) -> None:
        """Enqueue zeroing `count` int32 at device pointer `ptr` on `stream`; RunError on a
        nonzero CUresult."""
        rc = self._memset(int(ptr), 0, int(count), ctypes.c_void_p(int(stream) or None))
        if rc != 0:
            name = ctypes.c_char_p()
            self._name(rc, ctypes.byref(name))
            what = name.value.decode() if name.value else "unknown"
            raise RunError(f"flex attention: zeroing dq_sem (cuMemsetD32Async) failed: "
                           f"{what} ({rc})")
