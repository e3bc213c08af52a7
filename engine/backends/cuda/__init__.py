"""The CUDA backend: PyCUDA kernels (`kernels/*.cu`) + cuBLAS through ctypes, one H200-class GPU.

pycuda is imported only when `CudaBackend` is first used, so importing this package (to find the
kernel sources, say) works on machines without CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"

__all__ = ["KERNEL_DIR", "CudaBackend"]


def __getattr__(name: str) -> Any:
    if name == "CudaBackend":
        from engine.backends.cuda.backend import CudaBackend

        return CudaBackend
    raise AttributeError(name)
