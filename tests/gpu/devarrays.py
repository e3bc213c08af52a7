"""Host <-> device helpers for the op tests: upload in the compute precision, poison outputs with
NaN, read back as float64."""

from __future__ import annotations

from typing import Any

import numpy as np

NAN_BITS16 = {"bf16": 0x7FC0, "fp16": 0x7E00}


def to_act_host(a: np.ndarray, precision: str) -> np.ndarray:
    """The array as the GPU stores it: float32, float16, or bf16 bits (round to nearest even)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if precision == "fp32":
        return a
    if precision == "fp16":
        return a.astype(np.float16)
    u = a.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_act_host(raw: np.ndarray, precision: str) -> np.ndarray:
    if precision == "bf16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return raw.astype(np.float64)


def rounded(a: np.ndarray, precision: str) -> np.ndarray:
    """float64 values exactly representable in the compute precision."""
    return from_act_host(to_act_host(a, precision), precision).reshape(np.shape(a))


class DevArrays:
    """Device buffers for one test: kind 'act' (compute precision), 'f32', 'i32'."""

    def __init__(self, drv: Any, precision: str) -> None:
        self.drv, self.precision = drv, precision
        self._allocs: list[Any] = []
        self._meta: dict[int, tuple[tuple[int, ...], str]] = {}

    def _host(self, a: np.ndarray, kind: str) -> np.ndarray:
        if kind == "act":
            return to_act_host(a, self.precision)
        return np.ascontiguousarray(a, dtype=np.float32 if kind == "f32" else np.int32)

    def put(self, a: np.ndarray, kind: str = "act") -> int:
        h = self._host(a, kind)
        mem = self.drv.mem_alloc(max(h.nbytes, 4))
        self._allocs.append(mem)
        self.drv.memcpy_htod(int(mem), h)
        self._meta[int(mem)] = (np.shape(a), kind)
        return int(mem)

    def empty(self, shape: tuple[int, ...], kind: str = "act") -> int:
        """A buffer filled with NaN, so an element the kernel fails to write shows up."""
        n = int(np.prod(shape))
        esize = 2 if kind == "act" and self.precision != "fp32" else 4
        mem = self.drv.mem_alloc(max(n * esize, 4))
        self._allocs.append(mem)
        if esize == 2:
            self.drv.memset_d16(int(mem), NAN_BITS16[self.precision], n)
        else:
            self.drv.memset_d32(int(mem), 0x7FC00000, n)
        self.drv.Context.synchronize()  # memsets run on the legacy stream; the ops do not
        self._meta[int(mem)] = (shape, kind)
        return int(mem)

    def get(self, ptr: int) -> np.ndarray:
        self.drv.Context.synchronize()
        shape, kind = self._meta[ptr]
        if kind == "act":
            dt = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16}[self.precision]
            h = np.empty(shape, dtype=dt)
            self.drv.memcpy_dtoh(h, ptr)
            return from_act_host(h, self.precision)
        h = np.empty(shape, dtype=np.float32 if kind == "f32" else np.int32)
        self.drv.memcpy_dtoh(h, ptr)
        return h.astype(np.float64)

    def free(self) -> None:
        for m in self._allocs:
            m.free()
        self._allocs.clear()


# (what, precision, measured, bound) of every bounded check, printed at the end of the session
MEASURED: list[tuple[str, str, float, float]] = []


def check_close(got: np.ndarray, want: np.ndarray, bound: float, what: str,
                precision: str = "") -> float:
    """Assert rel_err(got, want) <= bound and record the figure for the session summary."""
    err = rel_err(got, want)
    MEASURED.append((what, precision, err, bound))
    assert err <= bound, f"{what} ({precision}): relative error {err:.3g} > {bound:.3g}"
    return err


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """‖got − want‖ / ‖want‖ in float64; NaN anywhere (an unwritten output) fails."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
