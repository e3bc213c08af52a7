"""GPU tests: run with `pytest -m gpu tests/gpu` on a machine with an NVIDIA GPU and pycuda.

Without either, every test here is skipped with the reason (never an error), so the CPU suite
and CI collect this folder safely.
"""

from __future__ import annotations

import numpy as np
import pytest


def _cuda_usable() -> tuple[bool, str]:
    try:
        import pycuda.driver as drv
    except Exception as e:
        return False, f"pycuda not importable: {e}"
    try:
        drv.init()
        if drv.Device.count() < 1:
            return False, "no CUDA device"
    except Exception as e:
        return False, f"CUDA driver unusable: {e}"
    return True, ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ok, why = _cuda_usable()
    if ok:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The measured error of every bounded check (worst per quantity), next to its bound."""
    from devarrays import MEASURED

    if not MEASURED:
        return
    worst: dict[tuple[str, str], tuple[float, float]] = {}
    for what, precision, err, bound in MEASURED:
        key = (what, precision)
        if key not in worst or err > worst[key][0]:
            worst[key] = (err, bound)
    tr = terminalreporter
    tr.write_sep("-", "measured relative errors (worst over runs) vs bounds")
    for (what, precision), (err, bound) in sorted(worst.items()):
        tr.write_line(f"{what:<40} {precision:<5} {err:10.2e}  <= {bound:.0e}")


@pytest.fixture(scope="session")
def gpu():
    from engine.backends.cuda.runtime import Gpu

    return Gpu.get()


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """Fresh random inputs per test, seeded by the test's name (reproducible failures)."""
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)
