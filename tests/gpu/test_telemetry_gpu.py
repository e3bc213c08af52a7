"""NVML for real (the CPU suite reads it through a stand-in): the GPU the engine trains on, as
the dashboard's system panel shows it, agrees with what CUDA says of the same device."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu]


def test_nvml_reads_the_training_gpu_for_real() -> None:
    import pycuda.driver as drv

    pytest.importorskip("pynvml", reason="the nvml extra (nvidia-ml-py) is not installed")
    from engine.run.telemetry import Nvml, SystemSampler, nvml_indices

    drv.init()
    dev = drv.Device(0)
    nv = Nvml.open(nvml_indices([0]))
    assert nv is not None, "NVML did not open on a GPU machine (is nvidia-ml-py installed?)"
    try:
        (g,) = nv.sample()
        assert g.name and (g.name in dev.name() or dev.name() in g.name), (g.name, dev.name())
        # the very device: NVML's PCI bus id is CUDA's (NVML writes an 8-digit domain)
        bus = nv.nvml.nvmlDeviceGetPciInfo(nv.handles[0][1]).busId
        bus = bus.decode() if isinstance(bus, bytes) else str(bus)
        assert bus.lower().split(":", 1)[1] == dev.pci_bus_id().lower().split(":", 1)[1]
        assert g.mem_total is not None and g.mem_used is not None
        assert abs(g.mem_total - dev.total_memory()) <= 0.05 * dev.total_memory()
        assert 0 < g.mem_used <= g.mem_total
        assert 0.0 <= g.util <= 100.0
        assert 5.0 < g.temp_c < 110.0 and 1.0 < g.power_w < 2000.0
        assert 100.0 < g.sm_clock_mhz < 5000.0
    finally:
        nv.close()
    # the engine's sampler (what writes system.jsonl) on CUDA ordinal 0
    sampler = SystemSampler(lambda _rec: None, lambda: 7, [0])
    try:
        assert sampler.nvml is not None
        rec = sampler.sample()
        assert rec.step == 7 and len(rec.gpus) == 1 and rec.gpus[0].name == g.name
        assert rec.rss_bytes is not None and rec.rss_bytes > 0
    finally:
        if sampler.nvml is not None:
            sampler.nvml.close()
