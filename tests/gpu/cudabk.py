"""The CUDA backend as the GPU tests build it: the config's gpu section given by its fields,
on cuBLASLt's first choices unless a test asks for gemm_tune (so two backends of one test run
the same GEMM algorithms, timing picking by noise, and start-up stays short)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.config import GpuConfig
from engine.model.layout import ModelShapes


def gpu_config(**fields: Any) -> GpuConfig:
    """GpuConfig with these fields, gemm_tune off unless given."""
    return GpuConfig(**{"gemm_tune": False, **fields})


def cuda_backend(shapes: ModelShapes, micro_batch: int, precision: str = "bf16", *,
                 gemm_plan: Mapping[str, Any] | None = None, separate_micro: bool = False,
                 **fields: Any) -> Any:
    """A CudaBackend with `gpu_config(**fields)`."""
    from engine.backends.cuda import CudaBackend

    return CudaBackend(shapes, micro_batch, precision, gpu=gpu_config(**fields),
                       gemm_plan=gemm_plan, separate_micro=separate_micro)
