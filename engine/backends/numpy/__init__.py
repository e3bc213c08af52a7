"""The numpy reference backend: the CPU default and the oracle for the CUDA kernels."""

from engine.backends.numpy.model import NumpyBackend

__all__ = ["NumpyBackend"]
