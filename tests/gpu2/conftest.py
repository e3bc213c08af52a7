"""Two-GPU tests: `pytest -m gpu2 tests/gpu2` on a machine with two NVIDIA GPUs, pycuda and
NCCL (libnccl.so.2 on LD_LIBRARY_PATH, or the nvidia-nccl-cu13 wheel). Skipped otherwise."""

from __future__ import annotations

import pytest


def _two_gpus() -> tuple[bool, str]:
    try:
        import pycuda.driver as drv

        drv.init()
        if drv.Device.count() < 2:
            return False, f"{drv.Device.count()} CUDA device(s), two needed"
    except Exception as e:
        return False, f"CUDA not usable: {e}"
    try:
        from engine.backends.cuda.nccl import Nccl

        Nccl()
    except Exception as e:
        return False, f"NCCL not usable: {e}"
    return True, ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ok, why = _two_gpus()
    if not ok:
        for item in items:
            if "gpu2" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=why))
