"""cuBLAS through ctypes on raw device pointers, in the primary context PyCUDA shares.

One handle, one stream, one fixed user workspace (so results are bit-reproducible and graph
capture allocates nothing). `Cublas.matmul` speaks row-major, like the numpy twins:
`out[M,N] = alpha * op(a)[M,K] @ op(b)[K,N] + beta * out`, with optional strided batching.
"""

from __future__ import annotations

import ctypes as C

from engine.errors import RunError

OP_N, OP_T = 0, 1
R_32F, R_16F, R_16BF = 0, 2, 14  # cudaDataType
COMPUTE_32F = 68  # cublasComputeType_t: fp32 accumulation (no TF32: exact fp32 mode)
GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20  # NVIDIA's recommendation for Hopper

DTYPE_OF_PRECISION = {"fp32": R_32F, "bf16": R_16BF, "fp16": R_16F}


def load_library(name: str, what: str) -> C.CDLL:
    """libNAME (cublas, cublasLt): the pip wheels' copy as PyTorch finds it (cuda.pathfinder),
    else the CUDA 13 or 12 soname on the loader's path; RunError naming what was tried."""
    errors = []
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        path = load_nvidia_dynamic_lib(name).abs_path
        if path:  # None when it was loaded already: then the soname below finds that copy
            return C.CDLL(path)
    except Exception as e:
        errors.append(f"cuda.pathfinder: {e}")
    for soname in (f"lib{name}.so.13", f"lib{name}.so.12", f"lib{name}.so"):
        try:
            return C.CDLL(soname)
        except OSError as e:
            errors.append(str(e))
    raise RunError(f"{what} library not found: " + "; ".join(errors))


class Cublas:
    """A cuBLAS handle bound to one stream and one workspace."""

    def __init__(self, stream_handle: int, workspace_ptr: int, workspace_bytes: int) -> None:
        lib = load_library("cublas", "cuBLAS")
        vp, i32, ll = C.c_void_p, C.c_int, C.c_longlong
        lib.cublasCreate_v2.argtypes = [C.POINTER(vp)]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, C.c_size_t]
        lib.cublasDestroy_v2.argtypes = [vp]
        lib.cublasGemmEx.argtypes = [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, vp, i32, i32,
                                     vp, vp, i32, i32, i32, i32]
        lib.cublasGemmStridedBatchedEx.argtypes = [
            vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, ll, vp, i32, i32, ll, vp, vp, i32, i32,
            ll, i32, i32, i32]
        for f in ("cublasCreate_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2",
                  "cublasDestroy_v2", "cublasGemmEx", "cublasGemmStridedBatchedEx"):
            getattr(lib, f).restype = C.c_int
        self._lib = lib
        self.handle = vp()
        self._check(lib.cublasCreate_v2(C.byref(self.handle)), "cublasCreate")
        self._check(lib.cublasSetStream_v2(self.handle, vp(stream_handle)), "cublasSetStream")
        # after SetStream: it resets the workspace to cuBLAS's own pool
        self._check(lib.cublasSetWorkspace_v2(self.handle, vp(workspace_ptr), workspace_bytes),
                    "cublasSetWorkspace")
        self._one, self._zero = C.c_float(1.0), C.c_float(0.0)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RunError(f"{what} failed with cuBLAS status {status}")

    def close(self) -> None:
        if self.handle:
            self._lib.cublasDestroy_v2(self.handle)
            self.handle = C.c_void_p()

    def matmul(self, out: int, a: int, b: int, M: int, N: int, K: int, *,
               types: tuple[int, int, int], ta: bool = False, tb: bool = False,
               lda: int | None = None, ldb: int | None = None, ldc: int | None = None,
               alpha: float = 1.0, beta: float = 0.0, batch: int = 1,
               sa: int = 0, sb: int = 0, sc: int = 0) -> None:
        """Row-major out[M,N] = alpha·op(a)@op(b) + beta·out; a is [M,K] (stored [K,M] when ta),
        b is [K,N] (stored [N,K] when tb); ld* are row strides, s* batch strides, in elements.
        types = (a, b, out) cudaDataType. cuBLAS is column-major, so this computes
        outᵀ = op(b)ᵀ·op(a)ᵀ: the operands swap places."""
        ta_, tb_, tc_ = types
        lda = lda if lda is not None else (M if ta else K)
        ldb = ldb if ldb is not None else (K if tb else N)
        ldc = ldc if ldc is not None else N
        al = self._one if alpha == 1.0 else C.c_float(alpha)
        be = self._zero if beta == 0.0 else (self._one if beta == 1.0 else C.c_float(beta))
        opa, opb = (OP_T if tb else OP_N), (OP_T if ta else OP_N)
        if batch == 1:
            st = self._lib.cublasGemmEx(
                self.handle, opa, opb, N, M, K, C.byref(al), C.c_void_p(b), tb_, ldb,
                C.c_void_p(a), ta_, lda, C.byref(be), C.c_void_p(out), tc_, ldc, COMPUTE_32F,
                GEMM_DEFAULT)
        else:
            st = self._lib.cublasGemmStridedBatchedEx(
                self.handle, opa, opb, N, M, K, C.byref(al), C.c_void_p(b), tb_, ldb, sb,
                C.c_void_p(a), ta_, lda, sa, C.byref(be), C.c_void_p(out), tc_, ldc, sc, batch,
                COMPUTE_32F, GEMM_DEFAULT)
        if st != 0:
            raise RunError(f"cublasGemm (M={M} N={N} K={K} batch={batch}) failed: status {st}")
