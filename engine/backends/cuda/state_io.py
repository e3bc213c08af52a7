"""The training state between host and device: weights, gradients and Adam moments in and out
as flat float32 arrays (DESIGN §2's layout), the GEMM copy of the weights derived from the
masters, and everything zeroed. Whatever reads or replaces the state applies the deferred work
first (DeviceOptimizer), so callers see the state as the calls so far left it."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.backends.cuda.buffers import lp_positions
from engine.backends.cuda.flat_buffers import FlatBuffers
from engine.backends.cuda.memory import Plan
from engine.backends.cuda.optimizer import DeviceOptimizer
from engine.errors import UserError


class StateIO:
    """Host <-> device copies of the flat buffers, and their zeroing."""

    def __init__(self, flat: FlatBuffers, ops: Any, optim: DeviceOptimizer, plan: Plan,
                 drv: Any, stream: Any) -> None:
        self.flat, self.ops, self.optim, self.plan = flat, ops, optim, plan
        self.drv, self.stream = drv, stream

    def zero_state(self) -> None:
        """Weights, gradients, m and v to zero (and the GEMM copy with them)."""
        drv, f = self.drv, self.flat
        for ptr in (f.p, f.g, f.m, f.v):
            drv.memset_d32_async(ptr, 0, f.n, self.stream)
        if f.glp:
            drv.memset_d16_async(f.glp, 0, f.n, self.stream)
        self.optim.glp_live = False
        self.params_to_lp()

    def params_to_lp(self) -> None:
        """The GEMM copy from the masters (rounded; each layer's W_Q, W_K, W_V in rows where
        Q, K, V are); nothing in fp32, where the GEMMs read the masters."""
        f = self.flat
        if f.precision != "fp32":
            self.ops.params_to_lp(f.plp, f.p, f.n, seg_start=self.plan["seg_start"],
                                  nseg=f.nseg, **f.lp_rows())

    def _put(self, ptr: int, a: np.ndarray, what: str) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        if a.shape != (self.flat.n,):
            raise UserError(f"{what}: expected a flat float32 array of {self.flat.n}, got "
                            f"{a.shape}")
        self.stream.synchronize()
        self.drv.memcpy_htod(ptr, a)
        # A pageable copy can return before its DMA lands, and our stream does not wait for the
        # legacy stream: make sure the kernels launched next read the new values.
        self.drv.Context.synchronize()

    def _get(self, ptr: int) -> np.ndarray:
        out = np.empty(self.flat.n, dtype=np.float32)
        self.stream.synchronize()
        self.drv.memcpy_dtoh(out, ptr)
        return out

    def load_params(self, params: np.ndarray) -> None:
        self.optim.settle_update()
        self._put(self.flat.p, params, "params")
        self.params_to_lp()
        self.stream.synchronize()

    def load_optimizer(self, m: np.ndarray, v: np.ndarray) -> None:
        self.optim.settle_update()
        self._put(self.flat.m, m, "adam m")
        self._put(self.flat.v, v, "adam v")

    def read_params(self) -> np.ndarray:
        self.optim.settle_update()
        return self._get(self.flat.p)

    def read_params_lp(self) -> np.ndarray:
        """The GEMM copy of the weights as float32 values in the flat layout (each layer's
        W_Q, W_K, W_V taken back from rows, buffers.lp_positions)."""
        self.optim.settle_update()
        f = self.flat
        if f.precision == "fp32":
            return self._get(f.p)
        raw = np.empty(f.n, dtype=np.uint16)
        self.stream.synchronize()
        self.drv.memcpy_dtoh(raw, f.plp)
        vals = ((raw.astype(np.uint32) << 16).view(np.float32) if f.precision == "bf16"
                else raw.view(np.float16).astype(np.float32))
        if f.seg_qkv is None:
            return vals
        return vals[lp_positions(f.seg_start, f.seg_qkv, f.shapes.d_model)]

    def read_grads(self) -> np.ndarray:
        self.optim.settle()
        return self._get(self.flat.g)

    def read_optimizer(self) -> tuple[np.ndarray, np.ndarray]:
        self.optim.settle_update()
        return self._get(self.flat.m), self._get(self.flat.v)

    def copy_state_into(self, params: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
        self.optim.settle_update()
        self.stream.synchronize()
        f = self.flat
        for out, ptr in ((params, f.p), (m, f.m), (v, f.v)):
            if out.dtype != np.float32 or out.shape != (f.n,) or not out.flags.c_contiguous:
                raise ValueError(f"copy_state_into: expected contiguous float32 [{f.n}]")
            self.drv.memcpy_dtoh(out, ptr)
