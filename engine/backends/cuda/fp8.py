"""The MLP's six GEMMs in FP8 (train/precision "fp8"): fp32 masters, bf16 activations, FP8
tensor-core GEMMs with fp32 accumulation through cuBLASLt.

Per-tensor current scaling (kernels/fp8.cu): each FP8 copy is scaled by its own tensor's amax
in this step, so there is no amax history and the checkpoint format stays as it is. E4M3 for
weights and activations in the forward, E5M2 for the gradients in the backward; fast
accumulation in the forward only (Transformer Engine's current-scaling recipe).

Hopper runs FP8 GEMMs only with both operands K-contiguous (NOTES.md, "FP8"): with X = ln2's
output [R,d], W1 [d,F], H = GELU(X·W1) [R,F], W2 [F,d], dY the gradient of the MLP's output
[R,d] and dH that of its pre-activation [R,F]:

    GEMM        product          a [M,K]   b as [N,K]   FP8 copies it reads
    fc1 fwd     X·W1   [R,F]     X         W1ᵀ          X8, W1ᵀ8  (E4M3)
    fc2 fwd     H·W2   [R,d]     H         W2ᵀ          H8, W2ᵀ8  (E4M3)
    fc2 dgrad   dY·W2ᵀ [R,F]     dY        W2           dY8 (E5M2), W2_8
    fc1 dgrad   dH·W1ᵀ [R,d]     dH        W1           dH8 (E5M2), W1_8
    fc2 wgrad   Hᵀ·dY  [F,d]     Hᵀ        dYᵀ          Hᵀ8, dYᵀ8
    fc1 wgrad   Xᵀ·dH  [d,F]     Xᵀ        dHᵀ          Xᵀ8, dHᵀ8

The weights' copies (W and Wᵀ) are made from the fp32 masters at the start of every training
pass (so after each AdamW step, and after a resume); the activations' copies as the pass makes
them. A GEMM for which cuBLASLt proposes no FP8 algorithm runs in bf16 (`use`, `notes`).
Validation and text sampling run the bf16 forward: FP8 is how a step computes, not the model.
"""

from __future__ import annotations

from typing import Any

from engine.backends.cuda.cublas import R_32F
from engine.backends.cuda.gemm import R_8F_E4M3, R_8F_E5M2
from engine.backends.cuda.ops import _blocks
from engine.errors import RunError

GEMMS = ("fc1 fwd", "fc2 fwd", "fc2 dgrad", "fc1 dgrad", "fc2 wgrad", "fc1 wgrad")
TENSORS = ("x", "h", "dy", "dh", "w1", "w2")  # per layer: an amax word and an inverse scale each
E4M3, E5M2 = 0, 1  # the kernels' e5m2 flag
TILE = 32  # kernels/fp8.cu's transpose tile
# bytes between two inverse scales: cuBLASLt refused (CUBLAS_STATUS_NOT_SUPPORTED) FP8 GEMMs
# whose scale pointers were only 4-byte aligned
SCALE_STRIDE = 16


def plan_fp8(plan: Any, n_layer: int, d: int, F: int, R: int) -> None:
    """The FP8 buffers, in the memory plan's "fp8" group: per layer the four weight copies,
    one set of activation copies (reused layer by layer), and the amax words and inverse
    scales."""
    for name in ("w1", "w1t", "w2", "w2t"):
        plan.add("fp8", f"fp8.{name}", n_layer * _slot(d * F))
    for name, n in (("x", R * d), ("xt", R * d), ("h", R * F), ("ht", R * F), ("dy", R * d),
                    ("dyt", R * d), ("dh", R * F), ("dht", R * F)):
        plan.add("fp8", f"fp8.{name}", n)
    plan.add("fp8", "fp8.amax", n_layer * len(TENSORS) * 4)
    plan.add("fp8", "fp8.inv", n_layer * len(TENSORS) * SCALE_STRIDE)


def _slot(nbytes: int) -> int:
    return -(-nbytes // 256) * 256


class Fp8Mlp:
    """The MLP forward and backward of one layer with FP8 GEMMs, on an Ops (its stream, side
    stream and LtGemm)."""

    def __init__(self, ops: Any, plan: Any, n_layer: int, d: int, F: int, act: int) -> None:
        self.o, self.L, self.d, self.F, self.act = ops, n_layer, d, F, act
        self.buf = {name: plan[f"fp8.{name}"] for name in
                    ("w1", "w1t", "w2", "w2t", "x", "xt", "h", "ht", "dy", "dyt", "dh", "dht",
                     "amax", "inv")}
        self.use = dict.fromkeys(GEMMS, True)  # False: cuBLASLt had no FP8 algorithm (bf16)
        self.notes: list[str] = []

    @property
    def fp8_gemms(self) -> list[str]:
        return [g for g in GEMMS if self.use[g]]

    def _scale(self, layer: int, tensor: str) -> tuple[int, int]:
        """(amax word, inverse scale) of one tensor of one layer."""
        i = layer * len(TENSORS) + TENSORS.index(tensor)
        return self.buf["amax"] + 4 * i, self.buf["inv"] + SCALE_STRIDE * i

    def _w(self, name: str, layer: int) -> int:
        return self.buf[name] + layer * _slot(self.d * self.F)

    # --- kernels -------------------------------------------------------------------------------
    def _amax(self, amax: int, x: int, n: int, f32: bool = False) -> None:
        # a block reads 8 elements a thread per turn and ends with one atomic
        self.o._go("k_fp8_amax_f32" if f32 else "k_fp8_amax", _blocks(-(-n // 8), cap=1024),
                   amax, x, n)

    def _cast(self, q: int, inv: int, x: int, amax: int, n: int, fmt: int) -> None:
        self.o._writes(q)
        self.o._go("k_fp8_cast", _blocks(-(-n // 8)), q, inv, x, amax, n, fmt)

    def _cast_t(self, q: int, qt: int, inv: int, x: int, amax: int, rows: int, cols: int,
                fmt: int, f32: bool = False) -> None:
        """qt = FP8 of xᵀ [cols, rows] (q = FP8 of x too, unless 0): whole 64 x 64 tiles with
        16-byte accesses where the shapes and addresses allow, else 32 x 32 tiles of bytes."""
        self.o._writes(*(p for p in (q, qt) if p))
        if rows % 64 == 0 and cols % 64 == 0 and all(p % 16 == 0 for p in (x, q, qt)):
            self.o._go("k_fp8_cast_t64_f32" if f32 else "k_fp8_cast_t64",
                       (cols // 64, rows // 64), q, qt, inv, x, amax, rows, cols, fmt)
            return
        grid = (-(-cols // TILE), -(-rows // TILE))
        self.o._go("k_fp8_cast_t_f32" if f32 else "k_fp8_cast_t", grid, q, qt, inv, x, amax,
                   rows, cols, fmt)

    def _gemm(self, name: str, fp8: Any, bf16: Any) -> None:
        """The FP8 GEMM, or (cuBLASLt proposing no FP8 algorithm: decided on the first, eager
        pass, before any graph is captured) the same product in bf16."""
        if self.use[name]:
            try:
                fp8()
                return
            except RunError as e:
                self.use[name] = False
                self.notes.append(f"FP8 {name}: {e}; this GEMM runs in bf16")
        bf16()

    # --- the pass ------------------------------------------------------------------------------
    def begin_pass(self, weight: Any) -> None:
        """At the start of a training pass: every amax word to zero, then each layer's FP8
        copies of W1 and W2 (as stored, and transposed) from the fp32 masters.
        weight(layer, "mlp.W_1") -> the master's device address."""
        o, d, F = self.o, self.d, self.F
        o.zero32(self.buf["amax"], self.L * len(TENSORS))
        for layer in range(self.L):
            for name, rows, cols in (("w1", d, F), ("w2", F, d)):
                amax, inv = self._scale(layer, name)
                w = weight(layer, "mlp.W_1" if name == "w1" else "mlp.W_2")
                self._amax(amax, w, rows * cols, f32=True)
                self._cast_t(self._w(name, layer), self._w(name + "t", layer), inv, w, amax,
                             rows, cols, E4M3, f32=True)

    def forward(self, layer: int, x: int, w1: int, w2: int, pre: int, act: int, out: int,
                R: int) -> None:
        """pre = x·W1, act = GELU(pre), out = act·W2 (x: ln2's output; w1, w2: the bf16
        weights, for a GEMM that falls back)."""
        o, d, F, b = self.o, self.d, self.F, self.buf
        xa, xi = self._scale(layer, "x")
        _, w1i = self._scale(layer, "w1")
        ha, hi = self._scale(layer, "h")
        _, w2i = self._scale(layer, "w2")
        fwd = {"tb": True, "fast_accum": True}
        self._amax(xa, x, R * d)
        self._cast(b["x"], xi, x, xa, R * d, E4M3)
        self._gemm("fc1 fwd",
                   lambda: o._mm(pre, b["x"], self._w("w1t", layer), R, F, d,
                                 types=(R_8F_E4M3, R_8F_E4M3, self.act), scales=(xi, w1i), **fwd),
                   lambda: o._mm(pre, x, w1, R, F, d))
        o.gelu_fwd(act, pre, R * F)
        self._amax(ha, act, R * F)
        self._cast(b["h"], hi, act, ha, R * F, E4M3)
        self._gemm("fc2 fwd",
                   lambda: o._mm(out, b["h"], self._w("w2t", layer), R, d, F,
                                 types=(R_8F_E4M3, R_8F_E4M3, self.act), scales=(hi, w2i), **fwd),
                   lambda: o._mm(out, act, w2, R, d, F))

    def backward(self, layer: int, dout: int, x: int, w1: int, w2: int, pre: int, act: int,
                 dx: int, dw1: int, dw2: int, dpre: int, R: int) -> None:
        """Ops.mlp_bwd's outputs with FP8 GEMMs: dpre, dx, and dW1, dW2 (+= or written, as the
        pass says) from dout = the gradient of the MLP's output."""
        o, d, F, b = self.o, self.d, self.F, self.buf
        xa, xi = self._scale(layer, "x")
        _, w1i = self._scale(layer, "w1")
        ha, hi = self._scale(layer, "h")
        _, w2i = self._scale(layer, "w2")
        ya, yi = self._scale(layer, "dy")
        da, di = self._scale(layer, "dh")
        self._amax(ya, dout, R * d)
        self._cast_t(b["dy"], b["dyt"], yi, dout, ya, R, d, E5M2)
        self._cast_t(0, b["ht"], hi, act, ha, R, F, E4M3)
        self._gemm("fc2 wgrad",
                   lambda: o._wgrad(dw2, b["ht"], b["dyt"], F, d, R, (b["ht"], b["dyt"]),
                                    tb=True, types=(R_8F_E4M3, R_8F_E5M2, R_32F),
                                    scales=(hi, yi)),
                   lambda: o._wgrad(dw2, act, dout, F, d, R, (dout,), ta=True))
        o._writes(dpre)
        self._gemm("fc2 dgrad",
                   lambda: o._mm(dpre, b["dy"], self._w("w2", layer), R, F, d, tb=True,
                                 types=(R_8F_E5M2, R_8F_E4M3, self.act), scales=(yi, w2i)),
                   lambda: o._mm(dpre, dout, w2, R, F, d, tb=True))
        o.gelu_bwd(dpre, pre, R * F)
        self._amax(da, dpre, R * F)
        self._cast_t(b["dh"], b["dht"], di, dpre, da, R, F, E5M2)
        self._cast_t(0, b["xt"], xi, x, xa, R, d, E4M3)
        self._gemm("fc1 wgrad",
                   lambda: o._wgrad(dw1, b["xt"], b["dht"], d, F, R, (b["xt"], b["dht"]),
                                    tb=True, types=(R_8F_E4M3, R_8F_E5M2, R_32F),
                                    scales=(xi, di)),
                   lambda: o._wgrad(dw1, x, dpre, d, F, R, (dpre,), ta=True))
        o._writes(dx)
        self._gemm("fc1 dgrad",
                   lambda: o._mm(dx, b["dh"], self._w("w1", layer), R, d, F, tb=True,
                                 types=(R_8F_E5M2, R_8F_E4M3, self.act), scales=(di, w1i)),
                   lambda: o._mm(dx, dpre, w1, R, d, F, tb=True))
