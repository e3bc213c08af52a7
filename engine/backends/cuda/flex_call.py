"""Calls the ahead-of-time flex attention backward (flex_build.py) on the engine's own buffers.

Pure ctypes: no torch, no tvm_ffi or CuTe DSL Python, no pycuda. `FlexBackward` reads the
library's manifest (flex_build.py) and refuses one built from another recipe (RECIPE_SHA256)
or with other argument names (ARG_NAMES), or for another dtype. It loads `tvm_ffi_lib`
(libtvm_ffi.so) then `cute_runtime_lib` (libcute_dsl_runtime.so) with RTLD_GLOBAL, each by
name (default: the manifest's paths, which are the build machine's; pass both where the
libraries were carried elsewhere), then the built library, and calls its entry point
`__tvm_ffi_flex_bwd_sm90_d64(NULL, args, n, result)` with each tensor passed as a `DLTensor*`
(TVM FFI type 7) over a raw device pointer, the arguments placed by name in ARG_NAMES' order.
Every load or symbol failure is a RunError naming the library (flex_libs.py).

Layout (the engine's, time-major rows r = t·B + b, heads side by side; hd = 64; bf16):
- Q, K, V: views [B, T, H, 64] of one [B·T, 3·H·64] matrix `qkv`, strides (3H·64, B·3H·64, 64, 1),
  K and V H·64 and 2H·64 elements after Q. dQ, dK, dV: the same over `dqkv`.
- O, dO: [B, T, H, 64] of [B·T, H·64], strides (H·64, B·H·64, 64, 1).
- lse: float32 [B, H, T] contiguous, the forward's natural-log log-sum-exp (cuDNN's stats).
- Scratch (`scratch_bytes`): lse2 and dpsum float32 [B, H, T]; dq_accum float32 [B, H, T·64];
  dq_sem int32 [B, H, T/128, 1]. All contiguous, 16-byte aligned.
- The plan (flex_plan.py): `plan_arrays()` gives the nine numpy arrays to upload; `set_plan`
  takes their device pointers, in that order; 0 for an empty array (fidx and forder at T = 128).

Contracts:
- **dq_sem must be zero before every call and every graph replay** (the frontend runs
  `dq_semaphore.zero_()` before its kernels; a nonzero one makes the kernel spin forever). With
  `zero_dq_sem=True` (the default) `run` zeroes it itself, on the same stream just before the
  entry point, with the driver's cuMemsetD32Async (libcuda through ctypes; in a captured graph
  a memset node): this needs libcuda (a RunError at construction without it) and the CUDA
  context owning the buffers current on the calling thread. With `zero_dq_sem=False` the caller
  memsets `semaphores(dq_sem)` (pointer, bytes; int32) itself.
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

from engine.backends.cuda import flex_libs
from engine.backends.cuda.flex_build import (
    ARG_NAMES,
    ENTRY_SYMBOL,
    RECIPE_SHA256,
    read_manifest,
    untested_versions,
)
from engine.backends.cuda.flex_plan import FIELDS, HEAD_DIM, TILE, causal_plan
from engine.errors import RunError, UserError

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


# the manifest's keys FlexBackward reads (the run-time libraries' only when not passed)
MANIFEST_KEYS = ("entry_symbol", "recipe_sha256", "arg_names", "dtype", "head_dim")


@dataclass
class FlexArgs:
    """A prepared argument array; holds the DLTensors and their shape arrays alive, and the
    dq_sem buffer `run` zeroes (pointer, int32 count)."""

    array: ctypes.Array
    keep: list[tuple[ctypes.Array, ctypes.Array, DLTensor]]
    dq_sem: int
    dq_sem_count: int


def _float_any(x: float) -> FFIAny:
    a = FFIAny(_TYPE_FLOAT, 0, 0)
    ctypes.cast(ctypes.byref(a, 8), ctypes.POINTER(ctypes.c_double))[0] = float(x)
    return a


def scratch_bytes(batch: int, seq_len: int, heads: int) -> dict[str, int]:
    """Bytes of each scratch buffer for (B, T, H) (float32 / int32, contiguous): lse2, dpsum,
    dq_accum, dq_sem. Needs no library (the memory plan sizes them before one is loaded)."""
    bht = batch * heads * seq_len
    return {"lse2": 4 * bht, "dpsum": 4 * bht, "dq_accum": 4 * bht * HEAD_DIM,
            "dq_sem": 4 * batch * heads * (seq_len // TILE)}


def check_manifest(manifest: dict, library: Path, dtype: str, need_libs: bool,
                   variant_ok: bool = False) -> None:
    """RunError unless `manifest` has the keys read here and was built by this checkout's recipe
    (RECIPE_SHA256, ARG_NAMES) with the tested package versions (flex_build.TESTED_VERSIONS)
    for `dtype` and head_dim 64 with ENTRY_SYMBOL, and, unless
    `variant_ok`, with the recipe's own kernel config (a variant of flex_build.build_variant
    may need another plan than flex_plan's: only dev/bench_flex_configs.py adapts it)."""
    if manifest.get("overrides") and not variant_ok:
        raise RunError(f"flex attention: {library} is a config variant "
                       f"({manifest.get('variant')}: {manifest['overrides']}), built to be "
                       f"timed by dev/bench_flex_configs.py; its plan may differ from the "
                       f"engine's: use a library from flex_build.build_library (scripts/flex-pack)")
    keys = MANIFEST_KEYS + (("tvm_ffi_lib", "runtime_lib") if need_libs else ())
    missing = [k for k in keys if k not in manifest]
    if missing:
        raise RunError(f"flex attention: the manifest of {library} lacks {', '.join(missing)} "
                       "(built by an older flex_build.py: rebuild it)")
    if manifest["recipe_sha256"] != RECIPE_SHA256:
        raise RunError(f"flex attention: {library} was built from another flex_build_main.py "
                       f"(recipe {str(manifest['recipe_sha256'])[:16]}, this checkout's "
                       f"{RECIPE_SHA256[:16]}): rebuild it")
    if list(manifest["arg_names"]) != list(ARG_NAMES):
        raise RunError(f"flex attention: {library} takes the arguments {manifest['arg_names']}, "
                       f"this checkout passes {list(ARG_NAMES)}: rebuild it")
    if manifest["dtype"] != dtype or manifest["head_dim"] != HEAD_DIM:
        raise RunError(f"flex attention: {library} is for {manifest['dtype']} head_dim "
                       f"{manifest['head_dim']}, asked for {dtype} head_dim {HEAD_DIM}")
    untested = untested_versions(manifest)
    if untested:
        raise RunError(f"flex attention: {library} was built with {untested}: rebuild it with "
                       f"the tested versions (pip install 'andrea[flex]', scripts/flex-pack)")
    if manifest["entry_symbol"] != ENTRY_SYMBOL:
        raise RunError(f"flex attention: {library} exports {manifest['entry_symbol']}, "
                       f"expected {ENTRY_SYMBOL}")


class FlexBackward:
    """The deterministic SM90 attention backward for fixed (B, T, H), hd 64, causal.

    `library`: the built `.so`, with its manifest beside it. `tvm_ffi_lib` and
    `cute_runtime_lib`: the paths of libtvm_ffi.so and libcute_dsl_runtime.so (default: the
    manifest's). `zero_dq_sem`: `run` zeroes dq_sem itself (needs `libcuda`). `variant_ok`: a
    config variant's library is accepted (check_manifest; its caller adapts the plan). UserError for a
    bad shape (before anything is loaded), RunError for a manifest, library or symbol problem."""

    def __init__(self, library: Path | str, batch: int, seq_len: int, heads: int, *,
                 tvm_ffi_lib: Path | str | None = None, cute_runtime_lib: Path | str | None = None,
                 dtype: str = "bf16", device_id: int = 0, zero_dq_sem: bool = True,
                 libcuda: str = flex_libs.LIBCUDA, variant_ok: bool = False) -> None:
        if dtype not in ("bf16", "fp16"):
            raise UserError(f"flex attention: dtype must be bf16 or fp16, got {dtype!r}")
        self.plan = causal_plan(batch, seq_len)  # refuses T % 128 != 0 (UserError)
        if heads < 1:
            raise UserError(f"flex attention backward: heads must be positive, got {heads}")
        self.B, self.T, self.H, self.dtype, self.device_id = batch, seq_len, heads, dtype, device_id
        library = Path(library)
        manifest = read_manifest(library)
        check_manifest(manifest, library, dtype, tvm_ffi_lib is None or cute_runtime_lib is None,
                       variant_ok)
        tvm_path = str(tvm_ffi_lib or manifest["tvm_ffi_lib"])
        runtime_path = str(cute_runtime_lib or manifest["runtime_lib"])
        self._memset = flex_libs.DriverMemset(libcuda) if zero_dq_sem else None
        # libtvm_ffi first: libcute_dsl_runtime and the kernels' library resolve against it.
        self._ffi = flex_libs.load(tvm_path, "libtvm_ffi.so", global_=True)
        self._runtime = flex_libs.load(runtime_path, "libcute_dsl_runtime.so", global_=True)
        self._lib = flex_libs.load(str(library), "the flex attention library")
        self._fn = flex_libs.symbol(
            self._lib, ENTRY_SYMBOL, "the flex attention library",
            [ctypes.c_void_p, ctypes.POINTER(FFIAny), ctypes.c_int32, ctypes.POINTER(FFIAny)],
            ctypes.c_int)
        tvm = "libtvm_ffi.so"
        self._set_stream = flex_libs.symbol(
            self._ffi, "TVMFFIEnvSetStream", tvm,
            [ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int)
        self._move_raised = flex_libs.symbol(
            self._ffi, "TVMFFIErrorMoveFromRaised", tvm, [ctypes.POINTER(ctypes.c_void_p)], None)
        self._dec_ref = flex_libs.symbol(self._ffi, "TVMFFIObjectDecRef", tvm, [ctypes.c_void_p],
                                         ctypes.c_int)
        self._plan_ptrs: list[int] | None = None

    # ---- sizes and the plan -------------------------------------------------------------
    def scratch_bytes(self) -> dict[str, int]:
        """Bytes of each scratch buffer (float32 / int32, contiguous): `scratch_bytes`."""
        return scratch_bytes(self.B, self.T, self.H)

    def semaphores(self, dq_sem: int) -> tuple[int, int]:
        """(pointer, bytes) to zero before every call and every graph replay (done by `run`
        unless zero_dq_sem=False)."""
        return int(dq_sem), self.scratch_bytes()["dq_sem"]

    def plan_arrays(self) -> list[tuple[str, np.ndarray]]:
        """The plan's nine arrays, in the order `set_plan` takes their device pointers."""
        return self.plan.arrays()

    def set_plan(self, pointers: Sequence[int]) -> None:
        """Device pointers of the uploaded plan arrays (same order as `plan_arrays`); 0 (null)
        is accepted, and required to be accepted, only for an empty array (fidx and forder at
        T = 128, where nothing is read)."""
        if len(pointers) != len(FIELDS):
            raise RunError(f"flex attention: set_plan needs {len(FIELDS)} pointers "
                           f"({', '.join(FIELDS)}), got {len(pointers)}")
        for (name, a), p in zip(self.plan.arrays(), pointers, strict=True):
            if int(p) == 0 and a.size == 0:
                continue
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
        """The argument array for these device pointers (reusable across calls and replays),
        in ARG_NAMES' order."""
        if self._plan_ptrs is None:
            raise RunError("flex attention: set_plan must be called before the first call")
        for name, p in (("qkv", qkv), ("o", o), ("do", do), ("dqkv", dqkv), ("lse2", lse2),
                        ("dpsum", dpsum), ("dq_accum", dq_accum)):
            self._check_align(name, int(p), 16)
        for name, p in (("lse", lse), ("dq_sem", dq_sem)):
            self._check_align(name, int(p), 4)
        B, T, H, D = self.B, self.T, self.H, HEAD_DIM
        keep: list[tuple[ctypes.Array, ctypes.Array, DLTensor]] = []

        def tensor(ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], dt: str) -> FFIAny:
            n = len(shape)
            sh, st = (ctypes.c_int64 * n)(*shape), (ctypes.c_int64 * n)(*strides)
            d = DLTensor(ptr, DLDevice(KDLCUDA, self.device_id), n, DLDataType(*_DTYPES[dt], 1),
                         ctypes.cast(sh, ctypes.POINTER(ctypes.c_int64)),
                         ctypes.cast(st, ctypes.POINTER(ctypes.c_int64)), 0)
            keep.append((sh, st, d))
            return FFIAny(_TYPE_DLTENSOR_PTR, 0, ctypes.addressof(d))

        w3, w1, es = 3 * H * D, H * D, _ITEMSIZE[self.dtype]

        def qkv_view(base: int, k: int) -> FFIAny:
            return tensor(int(base) + k * w1 * es, (B, T, H, D), (w3, B * w3, D, 1), self.dtype)

        def slab(base: int) -> FFIAny:
            return tensor(int(base), (B, T, H, D), (w1, B * w1, D, 1), self.dtype)

        def bh(base: int, n: int) -> FFIAny:
            return tensor(int(base), (B, H, n), (H * n, n, 1), "f32")

        nb, rows = T // TILE, B * (T // TILE)
        pc = dict(zip(FIELDS, self._plan_ptrs, strict=True))
        plan = self.plan
        by_name = {
            "mQ": qkv_view(qkv, 0), "mK": qkv_view(qkv, 1), "mV": qkv_view(qkv, 2),
            "mO": slab(o), "mdO": slab(do), "mLSE": bh(lse, T),
            "mdQ": qkv_view(dqkv, 0), "mdK": qkv_view(dqkv, 1), "mdV": qkv_view(dqkv, 2),
            "mLSE2": bh(lse2, T), "mdPsum": bh(dpsum, T), "mdQacc": bh(dq_accum, T * D),
            "mSem": tensor(int(dq_sem), (B, H, nb, 1), (H * nb, nb, 1, 1), "i32"),
            "cnt": tensor(pc["cnt"], (1, rows), (rows, 1), "i32"),
            "fcnt": tensor(pc["fcnt"], (1, rows), (rows, 1), "i32"),
            "masks": tensor(pc["masks"], plan.masks.shape, (512, 512, 2, 1), "u32"),
            "scale": _float_any(scale), "seqlen": FFIAny(_TYPE_INT, 0, T)}
        for name in ("idx", "fidx", "order", "forder", "off", "foff"):
            by_name[name] = tensor(pc[name], (getattr(plan, name).size,), (1,), "i32")
        if set(by_name) != set(ARG_NAMES):
            raise RunError(f"flex attention: the library takes {list(ARG_NAMES)}, this module "
                           f"builds {sorted(by_name)}")
        args = [by_name[name] for name in ARG_NAMES]
        return FlexArgs((FFIAny * len(args))(*args), keep, int(dq_sem), B * H * nb)

    def set_stream(self, stream: int) -> None:
        """Make `stream` (a CUstream handle; 0 = legacy) this thread's stream for the call."""
        rc = self._set_stream(KDLCUDA, self.device_id, ctypes.c_void_p(int(stream) or None), None)
        if rc != 0:
            raise RunError(f"flex attention: TVMFFIEnvSetStream failed: {self._raised()}")

    def run(self, args: FlexArgs, stream: int) -> None:
        """Zero dq_sem (unless zero_dq_sem=False: then it must already be zero), then launch
        preprocess, main kernel and dQ postprocess, all on `stream`."""
        self.set_stream(stream)
        if self._memset is not None:
            self._memset.zero_i32(args.dq_sem, args.dq_sem_count, stream)
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
        self._move_raised(ctypes.byref(h))
        if not h.value:
            return "no error recorded"
        try:
            # TVMFFIObject header (24 bytes), then TVMFFIErrorCell: kind, message (data, size).
            cell = ctypes.cast(h.value + 24, ctypes.POINTER(ctypes.c_void_p * 4))[0]
            kind = ctypes.string_at(cell[0], cell[1] or 0).decode(errors="replace")
            message = ctypes.string_at(cell[2], cell[3] or 0).decode(errors="replace")
        finally:
            self._dec_ref(h)
        return f"{kind}: {message.strip()}"
