"""Each layer's linear maps on FP8 values (train/precision "fp8"): the attention's qkv and proj
and the MLP's fc1 and fc2, each in its forward and its two backward GEMMs (engine.model.fp8's
FP8_GEMMS). The numpy twin of the CUDA backend's FP8 GEMMs (cuda/fp8.py), scaled as
engine.model.fp8 says.

Each GEMM multiplies the operands' FP8 values (decoded to the backend's dtype: exact) and then
the product by their inverse scales, as cuBLASLt does with its A and B scale pointers; the
accumulation is numpy's, so the results agree with the GPU's to the rounding of the sums, and
the FP8 values and scales themselves bit for bit. W_Q, W_K and W_V are one operand (one amax,
one scale), and so is the gradient of Q, K and V: the qkv backward's input gradient sums the
three products before it multiplies by the inverse scales once (the GPU's one GEMM over
K = 3·d). The copies are made as each GEMM needs them (the backward makes the activations' and
weights' again, with the forward's scales: the same values), into three buffers allocated with
the backend (`buffer_sizes`). Validation and text sampling run the plain forward.
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
    (ln1, att, x [N, d] or h [N, F]), one gradient copy (dproj, dy [N, d], dh [N, F] or
    dqkv [3, N, d]), one weight copy (W_O [d, d], W1 [d, F], W2 [F, d] or W_Q, W_K, W_V
    [3, d, d])."""
    return {"a": N * max(d, F), "g": max(N * F, 3 * N * d), "w": max(d * F, 3 * d * d)}


class Fp8Gemms:
    """One training pass's FP8 GEMMs of every layer: `begin_pass`, then for every layer
    `qkv_forward`, `proj_forward` and `mlp_forward`, for every layer in reverse `mlp_backward`,
    `proj_backward` and `qkv_backward`, then `end_pass` (which records the amax history)."""

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

    def _linear_forward(self, layer: int, a: np.ndarray, aname: str, w: np.ndarray, wname: str,
                        out: np.ndarray) -> None:
        """out = a·W on FP8 copies: a and W in E4M3, each scaled as its delayed tensor says (W
        [3,d,d]: W_Q, W_K, W_V under one scale, out [3,N,d])."""
        sc = self.buf
        sa, sw = self._delayed(layer, aname, a, E4M3), self._delayed(layer, wname, w, E4M3)
        np.matmul(self._copy(sc["a"], a, sa, E4M3), self._copy(sc["w"], w, sw, E4M3), out=out)
        out *= self._inv(layer, aname, wname)

    def _linear_backward(self, layer: int, g: np.ndarray, gname: str, a: np.ndarray, aname: str,
                         w: np.ndarray, wname: str, din: np.ndarray, dw: np.ndarray,
                         wtmp: np.ndarray, xtmp: np.ndarray | None = None) -> None:
        """For out = a·W with g = d out: dW += aᵀ·g and din = g·Wᵀ (written) on FP8 copies: g in
        E5M2 (scaled as its delayed tensor says), a and W in E4M3 with the forward's scales.
        W [3,d,d] (W_Q, W_K, W_V; g [3,N,d]): din = Σ_j g[j]·W_jᵀ, the sum before the one
        multiply by the inverse scales (the GPU's one GEMM over K = 3d), through xtmp."""
        S, sc = self.scales[layer], self.buf
        g8 = self._copy(sc["g"], g, self._delayed(layer, gname, g, E5M2), E5M2)
        a8 = self._copy(sc["a"], a, S[SCALES.index(aname)], E4M3)
        self._acc(a8.T, g8, dw, self._inv(layer, aname, gname), wtmp)
        w8 = self._copy(sc["w"], w, S[SCALES.index(wname)], E4M3)
        if w8.ndim == 2:
            np.matmul(g8, w8.T, out=din)
        else:
            assert xtmp is not None
            np.matmul(g8[0], w8[0].T, out=din)
            for j in range(1, len(w8)):
                np.matmul(g8[j], w8[j].T, out=xtmp)
                din += xtmp
        din *= self._inv(layer, gname, wname)

    # --- attention: qkv = ln1 · [W_Q | W_K | W_V], proj = att · W_O ------------------------------

    def qkv_forward(self, layer: int, ln1: np.ndarray, wqkv: np.ndarray,
                    qkv: np.ndarray) -> None:
        """qkv[j] = ln1·W_j for j in (Q, K, V) (ops.attn_qkv_fwd) on FP8 copies: ln1 [N,d] and
        wqkv [3,d,d] in E4M3, the three weights with one scale; qkv [3,N,d]."""
        self._linear_forward(layer, ln1, "ln1", wqkv, "wqkv", qkv)

    def proj_forward(self, layer: int, att: np.ndarray, wo: np.ndarray, out: np.ndarray) -> None:
        """out = att·W_O (ops.attn_out_fwd) on FP8 copies: att [N,d] and W_O [d,d] in E4M3."""
        self._linear_forward(layer, att, "att", wo, "wo", out)

    def qkv_backward(self, layer: int, dqkv: np.ndarray, ln1: np.ndarray, wqkv: np.ndarray,
                     dx: np.ndarray, dwqkv: np.ndarray, xtmp: np.ndarray,
                     wtmp: np.ndarray) -> None:
        """ops.attn_qkv_bwd's outputs with FP8 GEMMs: dW_j += ln1ᵀ·dqkv[j] and
        dx = Σ_j dqkv[j]·W_jᵀ (written), dqkv [3,N,d] in E5M2 with one scale. xtmp [N,d] and
        the flat wtmp (>= 3·d·d) are scratch."""
        self._linear_backward(layer, dqkv, "dqkv", ln1, "ln1", wqkv, "wqkv", dx, dwqkv, wtmp,
                              xtmp)

    def proj_backward(self, layer: int, dout: np.ndarray, att: np.ndarray, wo: np.ndarray,
                      datt: np.ndarray, dwo: np.ndarray, wtmp: np.ndarray) -> None:
        """ops.attn_out_bwd's outputs with FP8 GEMMs: dW_O += attᵀ·dproj, datt = dproj·W_Oᵀ
        (written), dproj = dout (proj's output gradient, [N,d])."""
        self._linear_backward(layer, dout, "dproj", att, "att", wo, "wo", datt, dwo, wtmp)

    # --- MLP: out = GELU(x · W1) · W2 ------------------------------------------------------------

    def mlp_forward(self, layer: int, x: np.ndarray, w1: np.ndarray, w2: np.ndarray,
                    pre: np.ndarray, act: np.ndarray, out: np.ndarray) -> None:
        """pre = x·W1, act = GELU(pre), out = act·W2, each GEMM on FP8 copies (ops.mlp_fwd)."""
        self._linear_forward(layer, x, "x", w1, "w1", pre)
        ops.gelu_fwd(pre, act)
        self._linear_forward(layer, act, "h", w2, "w2", out)

    def mlp_backward(self, layer: int, dout: np.ndarray, x: np.ndarray, w1: np.ndarray,
                     w2: np.ndarray, pre: np.ndarray, act: np.ndarray, dx: np.ndarray,
                     dw1: np.ndarray, dw2: np.ndarray, dpre: np.ndarray, ftmp: np.ndarray,
                     gtmp: np.ndarray, wtmp: np.ndarray) -> None:
        """ops.mlp_bwd's outputs (dW1, dW2 +=; dx written) with FP8 GEMMs: dy = dout, then
        dh = da·GELU'(pre) (da: fc2's input gradient, in dpre)."""
        self._linear_backward(layer, dout, "dy", act, "h", w2, "w2", dpre, dw2, wtmp)
        ops.gelu_bwd(pre, dpre, ftmp, gtmp)  # dh
        self._linear_backward(layer, dpre, "dh", x, "x", w1, "w1", dx, dw1, wtmp)

    @staticmethod
    def _acc(a: np.ndarray, b: np.ndarray, acc: np.ndarray, inv: np.float32,
             wtmp: np.ndarray) -> None:
        """acc += (a @ b)·inv, through the flat scratch `wtmp`."""
        tmp = wtmp[: acc.size].reshape(acc.shape)
        np.matmul(a, b, out=tmp)
        tmp *= inv
        acc += tmp
