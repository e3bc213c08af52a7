"""System telemetry of a run: `system.jsonl`, sampled every few seconds in a daemon thread.

Each sample (engine.records.SystemRecord) holds the engine process's CPU use (percent of one core
since the previous sample, all its threads) and resident memory, and, when the run trains on
NVIDIA GPUs and NVML can be loaded (`pip install nvidia-ml-py`, the `nvml` extra; imported as
`pynvml`), each of its GPUs: utilization, memory used and total, power, temperature, SM clock.
Sampling runs beside training in a thread of its own and never waits on the loop; NVML calls take
tens of microseconds, /proc reads less (`dev/bench_tui.py` measures a sample).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.records import GpuSample, SystemRecord

SAMPLE_EVERY_S = 5.0
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """This process's resident set size (from /proc; None where there is none)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class CpuMeter:
    """Percent of one core this process used since the previous `read()` (all threads)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = self._now()

    def _now(self) -> tuple[float, float]:
        t = os.times()
        return self._clock(), t.user + t.system

    def read(self) -> float:
        wall, cpu = self._now()
        dw, dc = wall - self._last[0], cpu - self._last[1]
        self._last = (wall, cpu)
        return 100.0 * dc / dw if dw >= 0.05 else math.nan  # too short to say


def nvml_indices(cuda_ordinals: list[int], visible: str | None = None) -> list[int | str]:
    """The NVML devices of CUDA ordinals, as NVML indices or UUIDs: through
    CUDA_VISIBLE_DEVICES when it lists integers or UUIDs (GPU-…, MIG-…; NVML ignores the
    variable), else the same numbers (CUDA and NVML agree in PCI order)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible:
        listed = [v.strip() for v in visible.split(",")]
        if all(v.isdigit() for v in listed):
            return [int(listed[k]) for k in cuda_ordinals if k < len(listed)]
        if all(v.startswith(("GPU-", "MIG-")) for v in listed):
            return [listed[k] for k in cuda_ordinals if k < len(listed)]
    return list(cuda_ordinals)


class Nvml:
    """The GPUs `indices` through NVML; `open` returns None when NVML is not to be had."""

    def __init__(self, nvml: Any, indices: list[int | str]) -> None:
        self.nvml = nvml
        self.handles = [self._handle(i) for i in indices]
        self.names = {i: self._name(h) for i, h in self.handles}

    def _handle(self, key: int | str) -> tuple[int, Any]:
        """(NVML index, handle) of an index or a UUID."""
        if isinstance(key, int):
            return key, self.nvml.nvmlDeviceGetHandleByIndex(key)
        h = self.nvml.nvmlDeviceGetHandleByUUID(key)
        index = self._get("nvmlDeviceGetIndex", h)
        return (int(index) if index is not None else -1), h

    @classmethod
    def open(cls, indices: list[int | str]) -> Nvml | None:
        if not indices:
            return None
        try:
            import pynvml  # the optional `nvml` extra (nvidia-ml-py)
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            return cls(pynvml, indices)
        except Exception:  # no driver, no such device: telemetry without GPUs
            return None

    def _name(self, h: Any) -> str:
        try:
            name = self.nvml.nvmlDeviceGetName(h)
        except Exception:
            return ""
        return name.decode(errors="replace") if isinstance(name, bytes) else str(name)

    def _get(self, fn: str, *args: Any) -> Any:
        try:
            return getattr(self.nvml, fn)(*args)
        except Exception:  # a field this GPU or driver does not report
            return None

    def sample(self) -> list[GpuSample]:
        n = self.nvml
        out = []
        for i, h in self.handles:
            util = self._get("nvmlDeviceGetUtilizationRates", h)
            mem = self._get("nvmlDeviceGetMemoryInfo", h)
            power = self._get("nvmlDeviceGetPowerUsage", h)  # milliwatts
            temp = self._get("nvmlDeviceGetTemperature", h, getattr(n, "NVML_TEMPERATURE_GPU", 0))
            clock = self._get("nvmlDeviceGetClockInfo", h, getattr(n, "NVML_CLOCK_SM", 1))
            out.append(GpuSample(
                index=i, name=self.names.get(i, ""),
                util=float(util.gpu) if util is not None else math.nan,
                mem_used=int(mem.used) if mem is not None else None,
                mem_total=int(mem.total) if mem is not None else None,
                power_w=power / 1000.0 if power is not None else math.nan,
                temp_c=float(temp) if temp is not None else math.nan,
                sm_clock_mhz=float(clock) if clock is not None else math.nan))
        return out

    def energy_mj(self) -> int | None:
        """The first GPU's total-energy counter (millijoules since the driver loaded; NVML
        moves it about every 100 ms), or None where it is not reported."""
        return self._get("nvmlDeviceGetTotalEnergyConsumption", self.handles[0][1])

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:
            pass


class SystemSampler:
    """Writes a SystemRecord through `write` at once and then every `every_s` seconds, from a
    daemon thread, until `stop()`. `step()` says which step the run has reached."""

    def __init__(self, write: Callable[[SystemRecord], None], step: Callable[[], int | None],
                 gpus: list[int], every_s: float = SAMPLE_EVERY_S) -> None:
        self.write = write
        self.step = step
        self.every_s = every_s
        self.cpu = CpuMeter()
        self.nvml = Nvml.open(nvml_indices(gpus))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> SystemRecord:
        """One sample, now."""
        return SystemRecord(t=time.time(), step=self.step(), cpu_pct=self.cpu.read(),
                            rss_bytes=rss_bytes(),
                            gpus=self.nvml.sample() if self.nvml is not None else [])

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="andrea-telemetry", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.write(self.sample())
            except Exception:  # telemetry never takes the run down
                pass
            if self._stop.wait(self.every_s):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.nvml is not None:
            self.nvml.close()
            self.nvml = None
