"""`LtGemm.matmul` in numpy, for checking on the CPU (no GPU, no pycuda) what the CUDA ops hand
to cuBLASLt: `EmuGemm` carries out its row-major contract (gemm.py: out[M,N] =
epilogue(alpha·op(a)@op(b) + beta·out), ld* row strides and s* batch strides in elements) over a
fake device memory, in float64, with the GELU_AUX epilogue and the one kernel the MLP forward runs
beside its GEMMs (k_mlp_gelu_fwd, `EmuGelu`). Used by test_qkv_rows."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from engine.backends.cuda.cublas import R_32F
from engine.backends.cuda.cublaslt import EPILOGUE_GELU_AUX
from engine.backends.cuda.ops import Ops
from engine.backends.numpy.ops import GELU_C, GELU_K

ES = 4  # float32 addresses: the emulation runs Ops in fp32, where every element is 4 bytes
ALIGN = 256
EPILOGUE_DEFAULT = 1


def gelu(u: np.ndarray) -> np.ndarray:
    """The tanh GELU of numpy's mlp_fwd (and of k_mlp_gelu_fwd, and cuBLASLt's GELU epilogue)."""
    return 0.5 * u * (1.0 + np.tanh(GELU_K * (u + GELU_C * u**3)))


class EmuGemm:
    """LtGemm.matmul in numpy over `mem` (float64; address a holds element a // ES). Every
    operand is read through the strides the call gives (and must lie inside the memory handed
    out so far), so a wrong leading dimension or batch stride reads the wrong elements, as it
    would on the device."""

    def __init__(self, words: int) -> None:
        self.mem = np.full(words, np.nan)
        self.top = ALIGN  # address 0 stays unused, as a null pointer
        self.calls: list[tuple[int, int, int, int]] = []  # (M, N, K, batch) per GEMM
        self.log: list[dict[str, Any]] = []  # per GEMM: out, beta, epilogue
        # what Ops._gelu_variant reads of an LtGemm (never tuning here: no timer)
        self.choices: dict[str, str] = {}
        self.choice_ms: dict[str, tuple[float, float]] = {}
        self.tuning = False
        self.timer = None

    def put(self, a: np.ndarray) -> int:
        ptr = self.alloc(a.size)
        self.mem[ptr // ES : ptr // ES + a.size] = np.ravel(a)
        return ptr

    def alloc(self, n: int) -> int:
        ptr = self.top
        self.top += -(-n * ES // ALIGN) * ALIGN
        assert self.top // ES <= self.mem.size, "emulated memory full"
        return ptr

    def get(self, ptr: int, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        return self.mem[ptr // ES : ptr // ES + n].reshape(shape).copy()

    def _view(self, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
        assert ptr % ES == 0 and ptr >= ALIGN, ptr
        first = ptr // ES
        last = first + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
        assert last < self.top // ES, "a GEMM operand reaches past its buffers"
        return as_strided(self.mem[first:], shape, tuple(s * self.mem.itemsize for s in strides))

    def matmul(self, out: int, a: int, b: int, M: int, N: int, K: int, *,
               types: tuple[int, int, int], stream: int, ws: int, ta: bool = False,
               tb: bool = False, lda: int | None = None, ldb: int | None = None,
               ldc: int | None = None, alpha: float = 1.0, beta: float = 0.0, batch: int = 1,
               sa: int = 0, sb: int = 0, sc: int = 0, epilogue: int = EPILOGUE_DEFAULT,
               aux: int = 0, scales: tuple[int, int] = (0, 0), fast_accum: bool = False
               ) -> None:
        assert types == (R_32F, R_32F, R_32F) and not any(scales)
        assert epilogue in (EPILOGUE_DEFAULT, EPILOGUE_GELU_AUX), epilogue
        assert bool(aux) == (epilogue == EPILOGUE_GELU_AUX)
        lda = lda if lda is not None else (M if ta else K)
        ldb = ldb if ldb is not None else (K if tb else N)
        ldc = ldc if ldc is not None else N
        A = self._view(a, (batch, M, K), (sa, 1, lda) if ta else (sa, lda, 1))
        B = self._view(b, (batch, K, N), (sb, 1, ldb) if tb else (sb, ldb, 1))
        D = self._view(out, (batch, M, N), (sc, ldc, 1))
        z = alpha * (A @ B)
        if beta != 0.0:  # beta 0: the output's old contents are not read
            z = z + beta * D
        if epilogue == EPILOGUE_GELU_AUX:
            self._view(aux, (batch, M, N), (sc, ldc, 1))[...] = z
            z = gelu(z)
        D[...] = z
        self.calls.append((M, N, K, batch))
        self.log.append({"out": out, "beta": beta, "epilogue": epilogue})


class EmuGelu:
    """k_mlp_gelu_fwd(act, pre, n, amax) over an EmuGemm's memory (Ops._go's launch)."""

    def __init__(self, emu: EmuGemm) -> None:
        self.emu = emu
        self.launches = 0

    def prepared_async_call(self, grid: Any, block: Any, stream: Any, act: int, pre: int, n: int,
                            amax: int, shared_size: int = 0) -> None:
        assert amax == 0
        self.emu.mem[act // ES : act // ES + n] = gelu(self.emu.get(pre, (n,)))
        self.launches += 1


def emulated_ops(words: int = 1 << 22) -> tuple[Ops, EmuGemm]:
    """Ops in fp32 with every GEMM through an EmuGemm (and k_mlp_gelu_fwd through EmuGelu);
    ANDREA_CUDA_SYNC must be unset (Ops would wait on the fake stream)."""
    emu = EmuGemm(words)
    kernels = {"k_mlp_gelu_fwd": EmuGelu(emu)}
    return Ops(kernels, None, SimpleNamespace(handle=0), "fp32", gemm=emu), emu
