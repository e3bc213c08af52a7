"""Backends, chosen by name in this one place: "numpy" (CPU reference) and "cuda" (PyCUDA).
Everything else asks the chosen backend (engine.backends.base.Backend) what it is: whether it
runs on a GPU, its device, what it computes.

The CUDA backend and pycuda are imported lazily, so the CPU path never needs them.
"""

from __future__ import annotations

from typing import NamedTuple

from engine.errors import UserError

BACKEND_NAMES = ("numpy", "cuda")


def get_backend(name: str) -> type:
    """The backend class for `name` ("numpy" | "cuda")."""
    if name == "numpy":
        from engine.backends.numpy import NumpyBackend

        return NumpyBackend
    if name == "cuda":
        from engine.backends.cuda import CudaBackend

        return CudaBackend
    raise UserError(f"--backend: expected one of numpy, cuda, got {name!r}")


def cuda_status() -> tuple[bool, str]:
    """(usable, why not): pycuda importable and at least one CUDA device present. Never raises."""
    try:
        import pycuda.driver as drv
    except Exception as e:  # ImportError, or a broken CUDA install raising anything
        return False, f"pycuda is not importable ({type(e).__name__}: {e})"
    try:
        drv.init()
        count = drv.Device.count()
    except Exception as e:
        return False, f"the CUDA driver did not initialise ({type(e).__name__}: {e})"
    if count < 1:
        return False, "no CUDA device found"
    return True, ""


class BackendChoice(NamedTuple):
    """The backend a run uses: its name (BACKEND_NAMES) and why it was chosen."""

    name: str
    why: str

    @property
    def on_gpu(self) -> bool:
        """Whether it computes on a GPU (one process a device)."""
        return bool(get_backend(self.name).on_gpu)


def gpu_count() -> int:
    """CUDA devices on this host (0 where CUDA is not usable)."""
    ok, _ = cuda_status()
    if not ok:
        return 0
    import pycuda.driver as drv

    return int(drv.Device.count())


def resolve_backend(name: str) -> BackendChoice:
    """The backend for a requested name "auto"|"numpy"|"cuda", and why.

    auto picks cuda when usable, else numpy and says why; an explicit "cuda" that is not usable
    is bad input (UserError with the reason)."""
    if name == "numpy":
        return BackendChoice("numpy", "numpy backend (requested)")
    if name == "cuda":
        ok, why = cuda_status()
        if not ok:
            raise UserError(f"--backend cuda: CUDA is not usable: {why}")
        return BackendChoice("cuda", "cuda backend (requested)")
    if name == "auto":
        ok, why = cuda_status()
        if ok:
            return BackendChoice("cuda", "cuda backend (auto: a CUDA device is available)")
        return BackendChoice("numpy", f"numpy backend (auto: {why})")
    raise UserError(f"--backend: expected one of auto, numpy, cuda, got {name!r}")
