"""The implementations a CudaBackend's layer loop calls, one of each kind picked once at start
(Network, from what CudaBuild resolved), so that the forward and the backward read as a
straight list of calls:

- Q, K, V projection: `QkvRows` (side by side in each row, [R,3d]: one GEMM each way) or
  `QkvSlabs` (three [R,d] slabs, three GEMMs batched); in a training pass in FP8 with rows,
  `Fp8QkvRows`;
- attention's output projection: `AttnOut`, or in a training pass in FP8 `Fp8AttnOut`;
- attention: `CudnnAttentionPath` (cuDNN's fused attention, or the flex backward where Ops has
  it) or `ClassicAttentionPath` (chunked GEMMs and a softmax kernel);
- MLP: `GemmMlp` (Ops.mlp_fwd / mlp_bwd) or, in a training pass in FP8, `Fp8MlpPath`;
- residual add + LayerNorm: `FusedAddNorm` (one kernel) or `AddThenNorm` (two);
- loss: `FusedLoss` (a training forward writes dlogits too, the backward runs its GEMMs) or
  `PlainLoss` (the loss forward, then the loss backward's kernel and GEMMs).

Each takes device addresses (a BatchBuffers `b`, a layer's saved activations `a` by name,
FlatBuffers for the weights) and hands Ops (or fp8.Fp8Gemms, whose FP8 paths make each layer's
weight copies from its masters as the map's forward begins) the same arguments in the same order
whichever the caller.
"""

from __future__ import annotations

from typing import Any

from engine.backends.cuda.buffers import BatchBuffers
from engine.backends.cuda.flat_buffers import FlatBuffers
from engine.model.layout import ModelShapes

Acts = dict[str, int]  # a layer's saved activations by name (BatchBuffers.layer)


class QkvRows:
    """[R,3d] = ln1 @ W_QKV: the GEMM copy holds each layer's W_Q, W_K, W_V as W_QKV [d,3d]."""

    def __init__(self, ops: Any, flat: FlatBuffers, d: int) -> None:
        self.o, self.flat, self.d = ops, flat, d

    def fwd(self, b: BatchBuffers, a: Acts, l: int, R: int) -> None:
        self.o.attn_qkv_fwd_rows(a["ln1"], self.flat.w(f"h.{l}.attn.W_Q"), a["qkv"], R, self.d)

    def bwd(self, b: BatchBuffers, a: Acts, l: int, dq: int, dln: int, R: int) -> None:
        w = f"h.{l}.attn.W_Q"
        self.o.attn_qkv_bwd_rows(dq, a["ln1"], self.flat.w(w), dln, self.flat.gw(w), R, self.d)


class QkvSlabs:
    """Q, K, V in three slabs of b.qkv_slab() elements: one GEMM batched over the three."""

    def __init__(self, ops: Any, flat: FlatBuffers, d: int) -> None:
        self.o, self.flat, self.d = ops, flat, d

    def fwd(self, b: BatchBuffers, a: Acts, l: int, R: int) -> None:
        self.o.attn_qkv_fwd(a["ln1"], self.flat.w(f"h.{l}.attn.W_Q"), a["qkv"], R, self.d,
                            b.qkv_slab())

    def bwd(self, b: BatchBuffers, a: Acts, l: int, dq: int, dln: int, R: int) -> None:
        w = f"h.{l}.attn.W_Q"
        self.o.attn_qkv_bwd(dq, a["ln1"], self.flat.w(w), dln, self.flat.gw(w), R, self.d,
                            b.qkv_slab())


class Fp8QkvRows(QkvRows):
    """QkvRows with its GEMMs in FP8 (fp8.Fp8Gemms)."""

    def __init__(self, fp8: Any, ops: Any, flat: FlatBuffers, d: int) -> None:
        super().__init__(ops, flat, d)
        self.fp8 = fp8

    def fwd(self, b: BatchBuffers, a: Acts, l: int, R: int) -> None:
        w = f"h.{l}.attn.W_Q"
        self.fp8.cast_qkv_weights(l, self.flat.p32(w))
        self.fp8.qkv_forward(l, a["ln1"], self.flat.w(w), a["qkv"], R)

    def bwd(self, b: BatchBuffers, a: Acts, l: int, dq: int, dln: int, R: int) -> None:
        w = f"h.{l}.attn.W_Q"
        self.fp8.qkv_backward(l, dq, a["ln1"], self.flat.w(w), dln, self.flat.gw(w), R)


class AttnOut:
    """out = att @ W_O (Ops.attn_out_fwd / attn_out_bwd)."""

    def __init__(self, ops: Any, flat: FlatBuffers, d: int) -> None:
        self.o, self.flat, self.d = ops, flat, d

    def fwd(self, a: Acts, l: int, out: int, R: int) -> None:
        self.o.attn_out_fwd(a["att"], self.flat.w(f"h.{l}.attn.W_O"), out, R, self.d)

    def bwd(self, a: Acts, l: int, dout: int, datt: int, R: int) -> None:
        w = f"h.{l}.attn.W_O"
        self.o.attn_out_bwd(dout, a["att"], self.flat.w(w), datt, self.flat.gw(w), R, self.d)


class Fp8AttnOut(AttnOut):
    """AttnOut with its GEMMs in FP8 (fp8.Fp8Gemms)."""

    def __init__(self, fp8: Any, ops: Any, flat: FlatBuffers, d: int) -> None:
        super().__init__(ops, flat, d)
        self.fp8 = fp8

    def fwd(self, a: Acts, l: int, out: int, R: int) -> None:
        w = f"h.{l}.attn.W_O"
        self.fp8.cast_proj_weights(l, self.flat.p32(w))
        self.fp8.proj_forward(l, a["att"], self.flat.w(w), out, R)

    def bwd(self, a: Acts, l: int, dout: int, datt: int, R: int) -> None:
        w = f"h.{l}.attn.W_O"
        self.fp8.proj_backward(l, dout, a["att"], self.flat.w(w), datt, self.flat.gw(w), R)


class CudnnAttentionPath:
    """cuDNN's graphs, built for the full length S: causal, so rows past a shorter T are
    computed and unused, and their output gradient must be zero."""

    def __init__(self, ops: Any, shapes: ModelShapes, drv: Any, stream: Any, es: int) -> None:
        self.o, self.d, self.S = ops, shapes.d_model, shapes.seq_len
        self.drv, self.stream, self.es = drv, stream, es

    def fwd(self, b: BatchBuffers, a: Acts, T: int) -> None:
        self.o.attn_fwd_cudnn(a["qkv"], a["att"], a["attn_stats"], b.B, self.S, self.d,
                              b.qkv_slab())

    def bwd(self, b: BatchBuffers, a: Acts, T: int, datt: int, dq: int) -> None:
        d, R = self.d, b.B * T
        if R < b.R:  # the full-length graph: rows past T must add nothing (dO = 0)
            self._memset_act(datt + R * d * self.es, (b.R - R) * d)
        self.o.attn_bwd_cudnn(datt, a["qkv"], a["att"], a["attn_stats"], dq, b.B, self.S, d,
                              b.qkv_slab())

    def _memset_act(self, ptr: int, count: int) -> None:
        if self.es == 2:
            self.drv.memset_d16_async(ptr, 0, count, self.stream)
        else:
            self.drv.memset_d32_async(ptr, 0, count, self.stream)


class ClassicAttentionPath:
    """The engine's attention at the pass's length T: scores, probabilities saved per layer."""

    def __init__(self, ops: Any, shapes: ModelShapes) -> None:
        self.o, self.d, self.H = ops, shapes.d_model, shapes.n_head

    def fwd(self, b: BatchBuffers, a: Acts, T: int) -> None:
        self.o.attn_fwd(a["qkv"], self.H, a["probs"], a["att"], b.at("scores"), b.B, T, self.d,
                        b.qkv_slab())

    def bwd(self, b: BatchBuffers, a: Acts, T: int, datt: int, dq: int) -> None:
        self.o.attn_bwd(datt, a["qkv"], a["probs"], self.H, dq, b.at("scores"), b.B, T, self.d,
                        b.qkv_slab())


class GemmMlp:
    """W_1, GELU, W_2 in the compute precision (Ops.mlp_fwd / mlp_bwd)."""

    def __init__(self, ops: Any, shapes: ModelShapes) -> None:
        self.o, self.d, self.F = ops, shapes.d_model, shapes.d_ff

    def fwd(self, l: int, a: Acts, w1: int, w2: int, out: int, R: int) -> None:
        self.o.mlp_fwd(a["ln2"], w1, w2, a["pre"], a["act"], out, R, self.d, self.F)

    def bwd(self, l: int, args: tuple[int, ...], R: int) -> None:
        """args: Ops.mlp_bwd's (dout, x, w1, w2, pre, act, dx, dw1, dw2, dpre)."""
        self.o.mlp_bwd(*args, R, self.d, self.F)


class Fp8MlpPath:
    """The MLP with its six GEMMs in FP8 (fp8.Fp8Gemms)."""

    def __init__(self, fp8: Any, flat: FlatBuffers) -> None:
        self.fp8, self.flat = fp8, flat

    def fwd(self, l: int, a: Acts, w1: int, w2: int, out: int, R: int) -> None:
        self.fp8.cast_mlp_weights(l, self.flat.p32(f"h.{l}.mlp.W_1"),
                                  self.flat.p32(f"h.{l}.mlp.W_2"))
        self.fp8.mlp_forward(l, a["ln2"], w1, w2, a["pre"], a["act"], out, R)

    def bwd(self, l: int, args: tuple[int, ...], R: int) -> None:
        """args: as GemmMlp.bwd's."""
        self.fp8.mlp_backward(l, *args, R)


class FusedAddNorm:
    """xsum = x + y; out = LayerNorm(xsum): one residual_layernorm_fwd."""

    def __init__(self, ops: Any) -> None:
        self.o = ops

    def __call__(self, x: int, y: int, xsum: int, gamma: int, beta: int, out: int, stats: int,
                 R: int, d: int) -> None:
        self.o.residual_layernorm_fwd(x, y, xsum, gamma, beta, out, stats, stats + R * 4, R, d)


class AddThenNorm:
    """xsum = x + y; out = LayerNorm(xsum): residual_add, then layernorm_fwd."""

    def __init__(self, ops: Any) -> None:
        self.o = ops

    def __call__(self, x: int, y: int, xsum: int, gamma: int, beta: int, out: int, stats: int,
                 R: int, d: int) -> None:
        self.o.residual_add(x, y, xsum, R * d)
        self.o.layernorm_fwd(xsum, gamma, beta, out, stats, stats + R * 4, R, d)


class PlainLoss:
    """The tied LM head and the cross-entropy: logits = lnf @ wteᵀ, then the loss kernel; the
    backward computes dlogits from the saved logits, then its GEMMs."""

    def __init__(self, ops: Any, flat: FlatBuffers, shapes: ModelShapes, ldv: int,
                 wte_rows: int) -> None:
        self.o, self.flat = ops, flat
        self.V, self.d, self.S = shapes.vocab_size, shapes.d_model, shapes.seq_len
        self.ldv, self.wte_rows = ldv, wte_rows  # aligned logits rows; rows readable from wte

    def _fwd_args(self, b: BatchBuffers) -> tuple[int, ...]:
        return (b.at("lnf"), self.flat.w("wte"), b.io()["targets"], b.at("logits"), b.at("lse"),
                b.at("losses"))

    def fwd(self, b: BatchBuffers, T: int) -> None:
        """The row losses of an evaluation (or unfused training) forward."""
        self.o.loss_fwd(*self._fwd_args(b), b.B, T, self.V, self.ldv, self.d, self.wte_rows,
                        lp=b.logits_lp)

    def train_fwd(self, b: BatchBuffers, T: int) -> None:
        """The row losses of a training forward."""
        self.fwd(b, T)

    def bwd(self, b: BatchBuffers, T: int, dln: int) -> None:
        io = b.io()
        self.o.loss_bwd(b.at("lnf"), self.flat.w("wte"), io["targets"], b.at("logits"),
                        b.at("lse"), io["scale"], dln, self.flat.g32("wte"), b.at("dlogits"),
                        b.B, T, self.V, self.ldv, self.d, self.wte_rows)


class FusedLoss(PlainLoss):
    """A training forward writes the loss and dlogits in one pass (Ops.loss_fwd_bwd); the
    backward runs the GEMMs on them (loss_bwd_gemms)."""

    def train_fwd(self, b: BatchBuffers, T: int) -> None:
        self.o.loss_fwd_bwd(*self._fwd_args(b), b.io()["scale"], b.at("dlogits"), b.B, T,
                            self.V, self.ldv, self.d, self.wte_rows, lp=b.logits_lp)

    def bwd(self, b: BatchBuffers, T: int, dln: int) -> None:
        # dlogits came with the forward (loss_fwd_bwd)
        self.o.loss_bwd_gemms(b.at("lnf"), self.flat.w("wte"), dln, self.flat.g32("wte"),
                              b.at("dlogits"), b.B, T, self.V, self.ldv, self.d, self.wte_rows,
                              pad_rows=self.S)
