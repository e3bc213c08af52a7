"""The MLP's six GEMMs on FP8 values (train/precision "fp8"): the numpy twin of the CUDA
backend's FP8 MLP (cuda/fp8.py), scaled as engine.model.fp8 says.

Each GEMM multiplies the operands' FP8 values (decoded to the backend's dtype: exact) and then
the product by their inverse scales, as cuBLASLt does with its A and B scale pointers; the
accumulation is numpy's, so the results agree with the GPU's to the rounding of the sums, and
the FP8 values and scales themselves bit for bit. The copies are made as each GEMM needs them
(the backward makes x's and h's again, with the forward's scales: the same values), into three
buffers allocated with the backend (`buffer_sizes`). Validation and text sampling run the plain
forward.
"""

from __future__ import annotations

import numpy as np

from engine.backends.numpy import ops
from engine.model.fp8 import (
    DELAYED,
    E4M3,
    E5M2,
    AmaxHistory,
    Fp8Format,
    amax_of,
    round_fp8,
    scale_for,
)

# the scales of one layer's pass, by column: every FP8 operand is a delayed tensor
SCALES = DELAYED


def buffer_sizes(d: int, F: int, N: int) -> dict[str, int]:
    """The elements of the FP8 copies' buffers for passes of up to N rows: one activation copy
    (x [N, d] or h [N, F]), one gradient copy (dy [N, d] or dh [N, F]), one weight copy
    [d, F]."""
    return {"a": N * max(d, F), "g": N * max(d, F), "w": d * F}


class Fp8Mlp:
    """One training pass's FP8 MLP, layer by layer: `begin_pass`, then `forward` for every layer,
    `backward` for every layer in reverse, then `end_pass` (which records the amax history)."""

    def __init__(self, n_layer: int, d: int, F: int, N: int, dtype: np.dtype) -> None:
        self.n_layer, self.d, self.F = n_layer, d, F
        self.buf = {k: np.zeros(n, dtype) for k, n in buffer_sizes(d, F, N).items()}
        self.history = AmaxHistory.empty(n_layer)
        # this pass's amax of every delayed tensor, in the history's row order
        self.now = np.zeros(n_layer * len(DELAYED), np.float32)
        self.scales = np.ones((n_layer, len(SCALES)), np.float32)

    def begin_pass(self) -> None:
        self.now.fill(0.0)

    def end_pass(self) -> None:
        self.history.record(self.now)

    def _delayed(self, layer: int, tensor: str, x: np.ndarray, fmt: Fp8Format) -> np.float32:
        """The scale of a delayed tensor (an activation, a gradient or a weight) in this pass:
        from its history, or (none yet) from its amax now, which is recorded either way."""
        row = self.history.row(layer, tensor)
        self.now[row] = now = amax_of(x)
        past = self.history.delayed_amax(layer, tensor)
        s = scale_for(past if past > 0 else now, fmt)
        self.scales[layer, SCALES.index(tensor)] = s
        return s

    @staticmethod
    def _copy(buf: np.ndarray, x: np.ndarray, s: np.float32, fmt: Fp8Format) -> np.ndarray:
        """buf's first x.size elements, shaped like x, hold fp8(x·s)."""
        out = buf[: x.size].reshape(x.shape)
        out[...] = round_fp8(x.astype(np.float32) * s, fmt)
        return out

    def _inv(self, layer: int, *names: str) -> np.float32:
        """The product of the named scales' inverses (cuBLASLt's scale_a · scale_b)."""
        inv = np.float32(1.0)
        for n in names:
            inv = np.float32(inv * (np.float32(1.0) / self.scales[layer, SCALES.index(n)]))
        return inv

    def forward(self, layer: int, x: np.ndarray, w1: np.ndarray, w2: np.ndarray, pre: np.ndarray,
                act: np.ndarray, out: np.ndarray) -> None:
        """pre = x·W1, act = GELU(pre), out = act·W2, each GEMM on FP8 copies (ops.mlp_fwd)."""
        sc = self.buf
        sx, sw1 = self._delayed(layer, "x", x, E4M3), self._delayed(layer, "w1", w1, E4M3)
        np.matmul(self._copy(sc["a"], x, sx, E4M3), self._copy(sc["w"], w1, sw1, E4M3),
                  out=pre)
        pre *= self._inv(layer, "x", "w1")
        ops.gelu_fwd(pre, act)
        sh, sw2 = self._delayed(layer, "h", act, E4M3), self._delayed(layer, "w2", w2, E4M3)
        np.matmul(self._copy(sc["a"], act, sh, E4M3), self._copy(sc["w"], w2, sw2, E4M3),
                  out=out)
        out *= self._inv(layer, "h", "w2")

    def backward(self, layer: int, dout: np.ndarray, x: np.ndarray, w1: np.ndarray,
                 w2: np.ndarray, pre: np.ndarray, act: np.ndarray, dx: np.ndarray,
                 dw1: np.ndarray, dw2: np.ndarray, dpre: np.ndarray, ftmp: np.ndarray,
                 gtmp: np.ndarray, wtmp: np.ndarray) -> None:
        """ops.mlp_bwd's outputs (dW1, dW2 +=; dx written) with FP8 GEMMs: dy = dout and
        dh = du in E5M2, x, h and the weights in E4M3 with the forward's scales."""
        S, sc = self.scales[layer], self.buf
        sdy = self._delayed(layer, "dy", dout, E5M2)
        dy8 = self._copy(sc["g"], dout, sdy, E5M2)
        h8 = self._copy(sc["a"], act, S[SCALES.index("h")], E4M3)
        self._acc(h8.T, dy8, dw2, self._inv(layer, "h", "dy"), wtmp)
        w2_8 = self._copy(sc["w"], w2, S[SCALES.index("w2")], E4M3)
        np.matmul(dy8, w2_8.T, out=dpre)  # da
        dpre *= self._inv(layer, "dy", "w2")
        ops.gelu_bwd(pre, dpre, ftmp, gtmp)  # du
        sdh = self._delayed(layer, "dh", dpre, E5M2)
        dh8 = self._copy(sc["g"], dpre, sdh, E5M2)
        x8 = self._copy(sc["a"], x, S[SCALES.index("x")], E4M3)
        self._acc(x8.T, dh8, dw1, self._inv(layer, "x", "dh"), wtmp)
        w1_8 = self._copy(sc["w"], w1, S[SCALES.index("w1")], E4M3)
        np.matmul(dh8, w1_8.T, out=dx)
        dx *= self._inv(layer, "dh", "w1")

    @staticmethod
    def _acc(a: np.ndarray, b: np.ndarray, acc: np.ndarray, inv: np.float32,
             wtmp: np.ndarray) -> None:
        """acc += (a @ b)·inv, through the flat scratch `wtmp`."""
        tmp = wtmp[: acc.size].reshape(acc.shape)
        np.matmul(a, b, out=tmp)
        tmp *= inv
        acc += tmp
