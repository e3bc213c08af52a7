"""cuBLASLt through ctypes, for the two MLP GEMMs whose epilogue can do the GELU work:

    mlp_fwd:  act = GELU(x @ W_1), pre = x @ W_1 saved     (epilogue GELU_AUX)
    mlp_bwd:  dpre = (dout @ W_2ᵀ) ⊙ GELU'(pre)             (epilogue DGELU)

That removes k_mlp_gelu_fwd/_bwd and their passes over the [B·T, d_ff] tensors. Descriptors and
the chosen algorithm are made once per shape (the heuristic is host work worth tens of µs) and
reused, so the same shape always runs the same kernel (determinism, resume). The workspace is the
backend's fixed cuBLAS workspace: both libraries run in order on the one stream.
"""

from __future__ import annotations

import ctypes as C
import functools
from typing import Any

from engine.backends.cuda.cublas import COMPUTE_32F, OP_N, OP_T, R_32F, load_library
from engine.errors import RunError

EPILOGUE_GELU_AUX = 160
EPILOGUE_DGELU = 192
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE = 3, 4, 7
DESC_AUX_POINTER, DESC_AUX_LD = 11, 12
PREF_MAX_WORKSPACE = 1


class LtAlgo(C.Structure):
    """cublasLtMatmulAlgo_t: 64 opaque bytes (gemm.py keeps them in the run's gemm_plan.json)."""

    _fields_ = [("data", C.c_uint64 * 8)]


class LtHeuristic(C.Structure):
    """cublasLtMatmulHeuristicResult_t: one algorithm the heuristic proposes."""

    _fields_ = [("algo", LtAlgo), ("workspaceSize", C.c_size_t), ("state", C.c_int),
                ("wavesCount", C.c_float), ("reserved", C.c_int * 4)]


@functools.cache
def load_cublaslt() -> C.CDLL:
    """libcublasLt (cublas.load_library) with the signatures of the calls the fused path's
    LtGemm and this module's CublasLt make (every status an int)."""
    lib = load_library("cublasLt", "cuBLASLt")
    vp, i32, u64, i64 = C.c_void_p, C.c_int, C.c_uint64, C.c_int64
    sigs: dict[str, list[Any]] = {
        "cublasLtCreate": [C.POINTER(vp)],
        "cublasLtDestroy": [vp],
        "cublasLtMatmulDescCreate": [C.POINTER(vp), i32, i32],
        "cublasLtMatmulDescSetAttribute": [vp, i32, vp, C.c_size_t],
        "cublasLtMatrixLayoutCreate": [C.POINTER(vp), i32, u64, u64, i64],
        "cublasLtMatrixLayoutSetAttribute": [vp, i32, vp, C.c_size_t],
        "cublasLtMatmulPreferenceCreate": [C.POINTER(vp)],
        "cublasLtMatmulPreferenceDestroy": [vp],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, C.c_size_t],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32,
                                           C.POINTER(LtHeuristic), C.POINTER(i32)],
        "cublasLtMatmulAlgoCheck": [vp, vp, vp, vp, vp, vp, C.POINTER(LtAlgo),
                                    C.POINTER(LtHeuristic)],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                           C.POINTER(LtAlgo), vp, C.c_size_t, vp],
    }
    for name, args in sigs.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, C.c_int
    lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], C.c_size_t
    return lib


def lt_check(status: int, what: str) -> None:
    if status != 0:
        raise RunError(f"{what} failed with cuBLAS status {status}")


def lt_set(fn: Any, obj: C.c_void_p, attr: int, value: Any) -> None:
    """One cuBLASLt descriptor/layout/preference attribute (`fn` the matching setter)."""
    lt_check(fn(obj, attr, C.byref(value), C.sizeof(value)), f"set attribute {attr}")


class CublasLt:
    """GELU-epilogue GEMMs on one stream with a fixed workspace."""

    def __init__(self, stream_handle: int, workspace_ptr: int, workspace_bytes: int) -> None:
        lib = load_cublaslt()
        vp = C.c_void_p
        self._lib = lib
        self.handle = vp()
        self._check(lib.cublasLtCreate(C.byref(self.handle)), "cublasLtCreate")
        self._stream, self._ws, self._ws_bytes = vp(stream_handle), vp(workspace_ptr), \
            workspace_bytes
        self._plans: dict[tuple, Any] = {}
        self._one, self._zero = C.c_float(1.0), C.c_float(0.0)

    _check = staticmethod(lt_check)
    _set = staticmethod(lt_set)

    def _plan(self, epilogue: int, transa: int, m: int, n: int, k: int, lda: int, ldb: int,
              ldd: int, dtype: int) -> Any:
        """(desc, layouts, algo) for one shape, made once. None: no algorithm (use unfused)."""
        key = (epilogue, transa, m, n, k, lda, ldb, ldd, dtype)
        if key in self._plans:
            return self._plans[key]
        lib, vp = self._lib, C.c_void_p
        desc = vp()
        self._check(lib.cublasLtMatmulDescCreate(C.byref(desc), COMPUTE_32F, R_32F), "desc")
        set_desc = lib.cublasLtMatmulDescSetAttribute
        self._set(set_desc, desc, DESC_TRANSA, C.c_int32(transa))
        self._set(set_desc, desc, DESC_TRANSB, C.c_int32(OP_N))
        self._set(set_desc, desc, DESC_EPILOGUE, C.c_uint32(epilogue))
        self._set(set_desc, desc, DESC_AUX_LD, C.c_int64(ldd))
        a_rows, a_cols = (m, k) if transa == OP_N else (k, m)
        layouts = []
        for rows, cols, ld in ((a_rows, a_cols, lda), (k, n, ldb), (m, n, ldd)):
            lay = vp()
            self._check(lib.cublasLtMatrixLayoutCreate(C.byref(lay), dtype, rows, cols, ld),
                        "layout")
            layouts.append(lay)
        pref = vp()
        self._check(lib.cublasLtMatmulPreferenceCreate(C.byref(pref)), "preference")
        self._set(lib.cublasLtMatmulPreferenceSetAttribute, pref, PREF_MAX_WORKSPACE,
                  C.c_uint64(self._ws_bytes))
        result, count = LtHeuristic(), C.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, desc, layouts[0], layouts[1], layouts[2], layouts[2], pref, 1,
            C.byref(result), C.byref(count))
        plan = (desc, layouts, result.algo) if status == 0 and count.value > 0 else None
        self._plans[key] = plan
        return plan

    def gelu_gemm(self, epilogue: int, transa: int, m: int, n: int, k: int, a: int, lda: int,
                  b: int, ldb: int, d: int, aux: int, dtype: int) -> bool:
        """Column-major D[m,n] = epilogue(op(A)[m,k] · B[k,n]) with aux (ld m); False when
        cuBLASLt has no algorithm for this shape (the caller then runs the unfused ops)."""
        plan = self._plan(epilogue, transa, m, n, k, lda, ldb, m, dtype)
        if plan is None:
            return False
        desc, (la, lb, ld), algo = plan
        self._set(self._lib.cublasLtMatmulDescSetAttribute, desc, DESC_AUX_POINTER,
                  C.c_void_p(aux))
        vp = C.c_void_p
        status = self._lib.cublasLtMatmul(
            self.handle, desc, C.byref(self._one), vp(a), la, vp(b), lb, C.byref(self._zero),
            vp(d), ld, vp(d), ld, C.byref(algo), self._ws, self._ws_bytes, self._stream)
        if status != 0:
            # The algorithm was chosen without these pointers' alignment; when it refuses them
            # nothing was launched, so the unfused kernels can run instead (from now on).
            self._plans[(epilogue, transa, m, n, k, lda, ldb, m, dtype)] = None
            return False
        return True

    def close(self) -> None:
        if self.handle:
            self._lib.cublasLtDestroy(self.handle)
            self.handle = C.c_void_p()


__all__ = ["EPILOGUE_DGELU", "EPILOGUE_GELU_AUX", "OP_N", "OP_T", "CublasLt"]
