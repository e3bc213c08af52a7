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

    # --- attention: qkv = ln1 · [W_Q | W_K | W_V], proj = att · W_O ------------------------------

    def qkv_forward(self, layer: int, ln1: np.ndarray, wqkv: np.ndarray,
                    qkv: np.ndarray) -> None:
        """qkv[j] = ln1·W_j for j in (Q, K, V) (ops.attn_qkv_fwd) on FP8 copies: ln1 [N,d] and
        wqkv [3,d,d] in E4M3, the three weights with one scale; qkv [3,N,d]."""
        sc = self.buf
        sl, sw = self._delayed(layer, "ln1", ln1, E4M3), self._delayed(layer, "wqkv", wqkv, E4M3)
        np.matmul(self._copy(sc["a"], ln1, sl, E4M3), self._copy(sc["w"], wqkv, sw, E4M3),
                  out=qkv)
        qkv *= self._inv(layer, "ln1", "wqkv")

    def proj_forward(self, layer: int, att: np.ndarray, wo: np.ndarray, out: np.ndarray) -> None:
        """out = att·W_O (ops.attn_out_fwd) on FP8 copies: att [N,d] and W_O [d,d] in E4M3."""
        sc = self.buf
        sa, sw = self._delayed(layer, "att", att, E4M3), self._delayed(layer, "wo", wo, E4M3)
        np.matmul(self._copy(sc["a"], att, sa, E4M3), self._copy(sc["w"], wo, sw, E4M3),
                  out=out)
        out *= self._inv(layer, "att", "wo")

    # --- MLP: out = GELU(x · W1) · W2 ------------------------------------------------------------

    def mlp_forward(self, layer: int, x: np.ndarray, w1: np.ndarray, w2: np.ndarray,
                    pre: np.ndarray, act: np.ndarray, out: np.ndarray) -> None:
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

    def mlp_backward(self, layer: int, dout: np.ndarray, x: np.ndarray, w1: np.ndarray,
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

    # --- attention's backward --------------------------------------------------------------------

    def proj_backward(self, layer: int, dout: np.ndarray, att: np.ndarray, wo: np.ndarray,
                      datt: np.ndarray, dwo: np.ndarray, wtmp: np.ndarray) -> None:
        """ops.attn_out_bwd's outputs with FP8 GEMMs: dW_O += attᵀ·dproj, datt = dproj·W_Oᵀ
        (written), dproj = dout (proj's output gradient, [N,d]) in E5M2, att and W_O in E4M3
        with the forward's scales."""
        S, sc = self.scales[layer], self.buf
        sd = self._delayed(layer, "dproj", dout, E5M2)
        d8 = self._copy(sc["g"], dout, sd, E5M2)
        att8 = self._copy(sc["a"], att, S[SCALES.index("att")], E4M3)
        self._acc(att8.T, d8, dwo, self._inv(layer, "att", "dproj"), wtmp)
        wo8 = self._copy(sc["w"], wo, S[SCALES.index("wo")], E4M3)
        np.matmul(d8, wo8.T, out=datt)
        datt *= self._inv(layer, "dproj", "wo")

    def qkv_backward(self, layer: int, dqkv: np.ndarray, ln1: np.ndarray, wqkv: np.ndarray,
                     dx: np.ndarray, dwqkv: np.ndarray, xtmp: np.ndarray,
                     wtmp: np.ndarray) -> None:
        """ops.attn_qkv_bwd's outputs with FP8 GEMMs: dW_j += ln1ᵀ·dqkv[j] and
        dx = (Σ_j dqkv[j]·W_jᵀ) (written; the sum then one multiply by the inverse scales),
        dqkv [3,N,d] in E5M2 with one scale, ln1 and W_Q, W_K, W_V in E4M3 with the forward's
        scales. xtmp [N,d] and the flat wtmp (>= 3·d·d) are scratch."""
        S, sc = self.scales[layer], self.buf
        sd = self._delayed(layer, "dqkv", dqkv, E5M2)
        d8 = self._copy(sc["g"], dqkv, sd, E5M2)
        ln1_8 = self._copy(sc["a"], ln1, S[SCALES.index("ln1")], E4M3)
        self._acc(ln1_8.T, d8, dwqkv, self._inv(layer, "ln1", "dqkv"), wtmp)
        w8 = self._copy(sc["w"], wqkv, S[SCALES.index("wqkv")], E4M3)
        np.matmul(d8[0], w8[0].T, out=dx)
        for j in (1, 2):
            np.matmul(d8[j], w8[j].T, out=xtmp)
            dx += xtmp
        dx *= self._inv(layer, "dqkv", "wqkv")

    @staticmethod
    def _acc(a: np.ndarray, b: np.ndarray, acc: np.ndarray, inv: np.float32,
             wtmp: np.ndarray) -> None:
        """acc += (a @ b)·inv, through the flat scratch `wtmp`."""
        tmp = wtmp[: acc.size].reshape(acc.shape)
        np.matmul(a, b, out=tmp)
        tmp *= inv
        acc += tmp
