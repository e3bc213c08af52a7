"""Calls the ahead-of-time flex attention backward (flex_build.py) on the engine's own buffers.

Pure ctypes: no torch, no tvm_ffi or CuTe DSL Python, no pycuda. `FlexBackward` loads
libtvm_ffi.so and libcute_dsl_runtime.so with RTLD_GLOBAL, then the built library, and calls its
entry point `__tvm_ffi_flex_bwd_sm90_d64(NULL, args, n, result)` with each tensor passed as a
`DLTensor*` (TVM FFI type 7) over a raw device pointer.

Layout (the engine's, time-major rows r = t·B + b, heads side by side; hd = 64; bf16):
- Q, K, V: views [B, T, H, 64] of one [B·T, 3·H·64] matrix `qkv`, strides (3H·64, B·3H·64, 64, 1),
  K and V H·64 and 2H·64 elements after Q. dQ, dK, dV: the same over `dqkv`.
- O, dO: [B, T, H, 64] of [B·T, H·64], strides (H·64, B·H·64, 64, 1).
- lse: float32 [B, H, T] contiguous, the forward's natural-log log-sum-exp (cuDNN's stats).
- Scratch (`scratch_bytes`): lse2 and dpsum float32 [B, H, T]; dq_accum float32 [B, H, T·64];
  dq_sem int32 [B, H, T/128, 1]. All contiguous, 16-byte aligned.
- The plan (flex_plan.py): `plan_arrays()` gives the nine numpy arrays to upload; `set_plan`
  takes their device pointers, in that order.

Contracts the caller keeps:
- **dq_sem must be zero before every call and every graph replay** (the frontend runs
  `dq_semaphore.zero_()` before its kernels). The call does not zero it: `semaphores(dq_sem)`
  gives the (pointer, bytes) to memset (cuMemsetD32Async / a memset node, 4 bytes per element).
- The stream is set with `TVMFFIEnvSetStream` (thread-local) before each call; the entry point
  launches its three kernels on it.
- All bf16 tensors and the float32 scratch 16-byte aligned (checked here before any CUDA call:
  RunError naming the buffer), the plan arrays 4-byte aligned and the masks 16.
A nonzero return from the entry point is a RunError carrying TVM FFI's error kind and message.
The first call loads the cubin: run it once eagerly before capturing it in a CUDA graph.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.backends.cuda.flex_build import ENTRY_SYMBOL, read_manifest
from engine.backends.cuda.flex_plan import FIELDS, TILE, causal_plan
from engine.errors import RunError

HD = 64
KDLCUDA = 2
_TYPE_INT, _TYPE_FLOAT, _TYPE_DLTENSOR_PTR = 1, 3, 7
_DTYPES = {"bf16": (4, 16), "fp16": (2, 16), "f32": (2, 32), "i32": (0, 32), "u32": (1, 32)}
_ITEMSIZE = {"bf16": 2, "fp16": 2, "f32": 4, "i32": 4, "u32": 4}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class FFIAny(ctypes.Structure):
    """TVMFFIAny: type index, padding, 8-byte payload (c_api.h)."""

    _fields_ = [("type_index", ctypes.c_int32), ("pad", ctypes.c_uint32), ("v", ctypes.c_int64)]


@dataclass
class FlexArgs:
    """A prepared argument array; holds the DLTensors and their shape arrays alive."""

    array: ctypes.Array
    keep: list


def _float_any(x: float) -> FFIAny:
    a = FFIAny(_TYPE_FLOAT, 0, 0)
    ctypes.cast(ctypes.byref(a, 8), ctypes.POINTER(ctypes.c_double))[0] = float(x)
    return a


class FlexBackward:
    """The deterministic SM90 attention backward for fixed (B, T, H), hd 64, causal."""

    def __init__(self, library: Path | str, batch: int, seq_len: int, heads: int, *,
                 runtime_libs: Sequence[Path | str] | None = None, dtype: str = "bf16",
                 device_id: int = 0) -> None:
        if dtype not in ("bf16", "fp16"):
            raise RunError(f"flex attention: dtype must be bf16 or fp16, got {dtype!r}")
        self.plan = causal_plan(batch, seq_len)  # refuses T % 128 != 0 (UserError)
        if heads < 1:
            raise RunError(f"flex attention: heads must be positive, got {heads}")
        self.B, self.T, self.H, self.dtype, self.device_id = batch, seq_len, heads, dtype, device_id
        library = Path(library)
        if runtime_libs is None:
            m = read_manifest(library)
            runtime_libs = [m["tvm_ffi_lib"], m["runtime_lib"]]
        try:
            # libtvm_ffi first: libcute_dsl_runtime and the kernels' library resolve against it.
            self._runtime = [ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL) for p in runtime_libs]
            self._lib = ctypes.CDLL(str(library))
        except OSError as e:
            raise RunError(f"flex attention: cannot load its libraries ({e})") from None
        self._ffi = self._runtime[0]
        try:
            self._fn = getattr(self._lib, ENTRY_SYMBOL)
        except AttributeError:
            raise RunError(f"flex attention: {library} has no entry point {ENTRY_SYMBOL}") from None
        self._fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(FFIAny), ctypes.c_int32,
                             ctypes.POINTER(FFIAny)]
        self._fn.restype = ctypes.c_int
        self._ffi.TVMFFIEnvSetStream.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p,
                                                 ctypes.c_void_p]
        self._ffi.TVMFFIEnvSetStream.restype = ctypes.c_int
        self._ffi.TVMFFIErrorMoveFromRaised.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._ffi.TVMFFIErrorMoveFromRaised.restype = None
        self._ffi.TVMFFIObjectDecRef.argtypes = [ctypes.c_void_p]
        self._plan_ptrs: list[int] | None = None

    # ---- sizes and the plan -------------------------------------------------------------
    def scratch_bytes(self) -> dict[str, int]:
        """Bytes of each scratch buffer (float32 / int32, contiguous)."""
        bht = self.B * self.H * self.T
        return {"lse2": 4 * bht, "dpsum": 4 * bht, "dq_accum": 4 * bht * HD,
                "dq_sem": 4 * self.B * self.H * (self.T // TILE)}

    def semaphores(self, dq_sem: int) -> tuple[int, int]:
        """(pointer, bytes) the caller zeroes before every call and every graph replay."""
        return int(dq_sem), self.scratch_bytes()["dq_sem"]

    def plan_arrays(self) -> list[tuple[str, np.ndarray]]:
        """The plan's nine arrays, in the order `set_plan` takes their device pointers."""
        return self.plan.arrays()

    def set_plan(self, pointers: Sequence[int]) -> None:
        """Device pointers of the uploaded plan arrays (same order as `plan_arrays`)."""
        if len(pointers) != len(FIELDS):
            raise RunError(f"flex attention: set_plan needs {len(FIELDS)} pointers "
                           f"({', '.join(FIELDS)}), got {len(pointers)}")
        for name, p in zip(FIELDS, pointers, strict=True):
            self._check_align(name, int(p), 16 if name == "masks" else 4)
        self._plan_ptrs = [int(p) for p in pointers]

    # ---- the call -----------------------------------------------------------------------
    @staticmethod
    def _check_align(name: str, ptr: int, align: int) -> None:
        if ptr == 0 or ptr % align:
            raise RunError(f"flex attention: {name} pointer {ptr:#x} is not {align}-byte aligned"
                           + (" (null)" if ptr == 0 else ""))

    def make_args(self, *, qkv: int, o: int, do: int, lse: int, dqkv: int, lse2: int,
                  dpsum: int, dq_accum: int, dq_sem: int, scale: float) -> FlexArgs:
        """The argument array for these device pointers (reusable across calls and replays)."""
        if self._plan_ptrs is None:
            raise RunError("flex attention: set_plan must be called before the first call")
        for name, p in (("qkv", qkv), ("o", o), ("do", do), ("dqkv", dqkv), ("lse2", lse2),
                        ("dpsum", dpsum), ("dq_accum", dq_accum)):
            self._check_align(name, int(p), 16)
        for name, p in (("lse", lse), ("dq_sem", dq_sem)):
            self._check_align(name, int(p), 4)
        B, T, H = self.B, self.T, self.H
        keep: list = []

        def tensor(ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], dt: str) -> FFIAny:
            n = len(shape)
            sh, st = (ctypes.c_int64 * n)(*shape), (ctypes.c_int64 * n)(*strides)
            d = DLTensor(ptr, DLDevice(KDLCUDA, self.device_id), n, DLDataType(*_DTYPES[dt], 1),
                         ctypes.cast(sh, ctypes.POINTER(ctypes.c_int64)),
                         ctypes.cast(st, ctypes.POINTER(ctypes.c_int64)), 0)
            keep.append((sh, st, d))
            return FFIAny(_TYPE_DLTENSOR_PTR, 0, ctypes.addressof(d))

        w3, w1, es = 3 * H * HD, H * HD, _ITEMSIZE[self.dtype]

        def qkv_views(base: int) -> list[FFIAny]:
            return [tensor(int(base) + k * w1 * es, (B, T, H, HD), (w3, B * w3, HD, 1), self.dtype)
                    for k in range(3)]

        def slab(base: int) -> FFIAny:
            return tensor(int(base), (B, T, H, HD), (w1, B * w1, HD, 1), self.dtype)

        def bh(base: int, n: int) -> FFIAny:
            return tensor(int(base), (B, H, n), (H * n, n, 1), "f32")

        nb, rows = T // TILE, B * (T // TILE)
        pc = dict(zip(FIELDS, self._plan_ptrs, strict=True))
        plan = self.plan
        args = [*qkv_views(qkv), slab(o), slab(do), bh(lse, T), *qkv_views(dqkv),
                bh(lse2, T), bh(dpsum, T), bh(dq_accum, T * HD),
                tensor(int(dq_sem), (B, H, nb, 1), (H * nb, nb, 1, 1), "i32"),
                tensor(pc["cnt"], (1, rows), (rows, 1), "i32"),
                tensor(pc["idx"], (plan.idx.size,), (1,), "i32"),
                tensor(pc["fcnt"], (1, rows), (rows, 1), "i32"),
                tensor(pc["fidx"], (plan.fidx.size,), (1,), "i32"),
                tensor(pc["order"], (plan.order.size,), (1,), "i32"),
                tensor(pc["forder"], (plan.forder.size,), (1,), "i32"),
                tensor(pc["off"], (rows + 1,), (1,), "i32"),
                tensor(pc["foff"], (rows + 1,), (1,), "i32"),
                tensor(pc["masks"], plan.masks.shape, (512, 512, 2, 1), "u32"),
                _float_any(scale), FFIAny(_TYPE_INT, 0, T)]
        return FlexArgs((FFIAny * len(args))(*args), keep)

    def set_stream(self, stream: int) -> None:
        """Make `stream` (a CUstream handle; 0 = legacy) this thread's stream for the call."""
        rc = self._ffi.TVMFFIEnvSetStream(KDLCUDA, self.device_id, ctypes.c_void_p(int(stream)),
                                          None)
        if rc != 0:
            raise RunError(f"flex attention: TVMFFIEnvSetStream failed: {self._raised()}")

    def run(self, args: FlexArgs, stream: int) -> None:
        """Launch preprocess, main kernel and dQ postprocess on `stream`. dq_sem must be zero."""
        self.set_stream(stream)
        result = FFIAny(0, 0, 0)
        rc = self._fn(None, args.array, len(args.array), ctypes.byref(result))
        if rc != 0:
            raise RunError(f"flex attention backward failed: {self._raised()}")

    def __call__(self, *, stream: int, **pointers: int | float) -> None:
        """make_args(**pointers) then run(stream): convenient, but builds the structs each time."""
        self.run(self.make_args(**pointers), stream)  # type: ignore[arg-type]

    def _raised(self) -> str:
        """'Kind: message' of the error TVM FFI raised on this thread (and release it)."""
        h = ctypes.c_void_p()
        self._ffi.TVMFFIErrorMoveFromRaised(ctypes.byref(h))
        if not h.value:
            return "no error recorded"
        try:
            # TVMFFIObject header (24 bytes), then TVMFFIErrorCell: kind, message (data, size).
            cell = ctypes.cast(h.value + 24, ctypes.POINTER(ctypes.c_void_p * 4))[0]
            kind = ctypes.string_at(cell[0], cell[1] or 0).decode(errors="replace")
            message = ctypes.string_at(cell[2], cell[3] or 0).decode(errors="replace")
        finally:
            self._ffi.TVMFFIObjectDecRef(h)
        return f"{kind}: {message.strip()}"
