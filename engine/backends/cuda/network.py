"""The model's forward and backward passes on the GPU (DESIGN §2), as llm.c's gpt2_forward
reads: one straight list of op calls per layer. Which implementation of each op runs (Q, K, V
in rows or slabs, cuDNN or classic attention, a training pass's linear maps in FP8 or not, the
fused residual + LayerNorm and loss kernels) is picked once, when the Network is made
(layers.py).

Activation rows are time-major (row r = t*B + b): see ops.py for why. The buffers are
buffers.BatchBuffers (training, sampling); the weights FlatBuffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.backends.cuda.buffers import BatchBuffers
from engine.backends.cuda.flat_buffers import FlatBuffers
from engine.backends.cuda.layers import (
    AddThenNorm,
    AttnOut,
    ClassicAttentionPath,
    CudnnAttentionPath,
    Fp8AttnOut,
    Fp8MlpPath,
    Fp8QkvRows,
    FusedAddNorm,
    FusedLoss,
    GemmMlp,
    PlainLoss,
    QkvRows,
    QkvSlabs,
)
from engine.model.layout import ModelShapes


def _no_wait(layer: int) -> None:
    """A forward whose parameters are all in place waits for nothing."""


def _nothing_completed(bucket: int) -> None:
    """A backward whose gradient buckets nothing waits for."""


class Network:
    """The forward and backward of the model over one set of BatchBuffers. `fused` (gpu.fusions):
    the fused residual + LayerNorm and loss kernels, and the backward's gradient buffers in
    pairs, so that the weight-gradient GEMMs on the side stream can read one while the main
    stream writes the other."""

    def __init__(self, ops: Any, flat: FlatBuffers, shapes: ModelShapes, *, train: BatchBuffers,
                 attention: str, qkv_rows: bool, fused: bool, fp8: Any, drv: Any,
                 stream: Any, es: int, ldv: int) -> None:
        """fp8: the fp8.Fp8Gemms that a training pass's linear maps run on (None: none)."""
        self.o, self.flat, self.shapes, self.train = ops, flat, shapes, train
        self.fused, self.es, self.fp8 = fused, es, fp8
        d = shapes.d_model
        self.qkv = QkvRows(ops, flat, d) if qkv_rows else QkvSlabs(ops, flat, d)
        self.attention = (CudnnAttentionPath(ops, shapes, drv, stream, es)
                          if attention == "cudnn" else ClassicAttentionPath(ops, shapes))
        # evaluation and sampling passes: never FP8
        self.proj, self.mlp = AttnOut(ops, flat, d), GemmMlp(ops, shapes)
        self.train_qkv, self.train_proj, self.train_mlp = self.qkv, self.proj, self.mlp
        if fp8 is not None:
            self.train_proj, self.train_mlp = Fp8AttnOut(fp8, ops, flat, d), Fp8MlpPath(fp8, flat)
            if qkv_rows:
                self.train_qkv = Fp8QkvRows(fp8, ops, flat, d)
        self.add_norm = FusedAddNorm(ops) if fused else AddThenNorm(ops)
        wte_rows = flat.n // d  # rows readable from wte on (see Ops.loss_fwd)
        self.loss = (FusedLoss if fused else PlainLoss)(ops, flat, shapes, ldv, wte_rows)

    def forward(self, b: BatchBuffers, T: int, loss: bool, train: bool = False,
                ready: Callable[[int], None] | None = None) -> None:
        """train: a training step's forward (fusions: the loss kernel writes dlogits too).
        ready(l): called before layer l's parameters are first read (l = L: the final
        LayerNorm's), where the previous step's update is still being applied.

        Each residual add, x + branch, then a LayerNorm of the sum: `add_norm`."""
        s, o, w = self.shapes, self.o, self.flat
        d, L = s.d_model, s.n_layer
        R = b.B * T
        proj = b.at("proj")
        ready = ready or _no_wait
        fp8 = self.fp8 if train and b is self.train else None
        qkv, attn_out, mlp = ((self.train_qkv, self.train_proj, self.train_mlp) if fp8 else
                              (self.qkv, self.proj, self.mlp))
        if fp8 is not None:
            fp8.begin_pass()
        o.embed_fwd(b.io()["tokens"], w.p32("wte"), w.p32("wpe"), b.at("x", 0), b.B, T, d)
        ready(0)
        a0 = b.layer(0)
        o.layernorm_fwd(b.at("x", 0), w.p32("h.0.ln1.gamma"), w.p32("h.0.ln1.beta"), a0["ln1"],
                        a0["ln1_stats"], a0["ln1_stats"] + R * 4, R, d)
        for l in range(L):
            h = f"h.{l}."
            a = b.layer(l)  # layer l's saved activations, by name
            qkv.fwd(b, a, l, R)
            self.attention.fwd(b, a, T)
            # xmid = x[l] + att @ W_O; ln2 = LayerNorm(xmid)
            attn_out.fwd(a, l, proj, R)
            self.add_norm(b.at("x", l), proj, a["xmid"], w.p32(h + "ln2.gamma"),
                          w.p32(h + "ln2.beta"), a["ln2"], a["ln2_stats"], R, d)
            mlp.fwd(l, a, w.w(h + "mlp.W_1"), w.w(h + "mlp.W_2"), proj, R)
            # x[l+1] = xmid + mlp; then the next LayerNorm: layer l+1's ln1, or lnf
            ready(l + 1)
            self.add_norm(a["xmid"], proj, b.at("x", l + 1), *self._next_norm(b, l), R, d)
        if loss:
            (self.loss.train_fwd if train else self.loss.fwd)(b, T)

    def _next_norm(self, b: BatchBuffers, l: int) -> tuple[int, int, int, int]:
        """(gamma, beta, out, stats) of the LayerNorm after layer l: layer l+1's ln1, or the
        final one after the last layer."""
        w = self.flat
        if l + 1 < self.shapes.n_layer:
            nxt, h1 = b.layer(l + 1), f"h.{l + 1}."
            return (w.p32(h1 + "ln1.gamma"), w.p32(h1 + "ln1.beta"), nxt["ln1"],
                    nxt["ln1_stats"])
        return w.p32("lnf.gamma"), w.p32("lnf.beta"), b.at("lnf"), b.at("lnf_stats")

    def _pair(self, b: BatchBuffers, name: str) -> list[int]:
        """A gradient buffer and its second copy where fused (else the same one twice)."""
        return [b.at(name), b.at(name + "2") if self.fused else b.at(name)]

    def backward(self, b: BatchBuffers, T: int,
                 completed: Callable[[int], None] | None = None) -> None:
        """After `forward(b, T, loss=True, train=True)`. The residual gradient alternates
        between two buffers (dres, dres2 where fused: each LayerNorm backward reads one and
        writes the other), and dpre, dqkv between two by layer parity. completed(i): called
        once the work queued so far completes bucket i of FlatBuffers.grad_buckets (a
        data-parallel step starts that bucket's all-reduce there)."""
        s, o, w = self.shapes, self.o, self.flat
        d, L = s.d_model, s.n_layer
        R = b.B * T
        io = b.io()
        completed = completed or _nothing_completed
        dln, datt, part = b.at("dln"), b.at("datt"), b.at("ln_partial")
        cur, nxt = self._pair(b, "dres")
        dpre, dqkv = self._pair(b, "dpre"), self._pair(b, "dqkv")
        self.loss.bwd(b, T, dln)
        stf = b.at("lnf_stats")
        o.layernorm_bwd(dln, b.at("x", L), w.p32("lnf.gamma"), stf, stf + R * 4, cur,
                        w.g32("lnf.gamma"), part, R, d, accumulate=False)
        for l in reversed(range(L)):
            h = f"h.{l}."
            a = b.layer(l)
            st1, st2 = a["ln1_stats"], a["ln2_stats"]
            # x[l+1] = xmid + mlp(ln2(xmid)); cur holds d x[l+1]
            self.train_mlp.bwd(l, (cur, a["ln2"], w.w(h + "mlp.W_1"), w.w(h + "mlp.W_2"),
                                   a["pre"], a["act"], dln, w.gw(h + "mlp.W_1"),
                                   w.gw(h + "mlp.W_2"), dpre[l % 2]), R)
            o.layernorm_bwd(dln, a["xmid"], w.p32(h + "ln2.gamma"), st2, st2 + R * 4, nxt,
                            w.g32(h + "ln2.gamma"), part, R, d, accumulate=True, resid=cur)
            # xmid = x[l] + attn(ln1(x[l])); nxt holds d xmid
            self.train_proj.bwd(a, l, nxt, datt, R)
            self.attention.bwd(b, a, T, datt, dqkv[l % 2])
            self.train_qkv.bwd(b, a, l, dqkv[l % 2], dln, R)
            o.layernorm_bwd(dln, b.at("x", l), w.p32(h + "ln1.gamma"), st1, st1 + R * 4, cur,
                            w.g32(h + "ln1.gamma"), part, R, d, accumulate=True, resid=nxt)
            completed(L - 1 - l)
        if self.fp8 is not None:
            self.fp8.end_pass()
        o.embed_bwd(cur, (io["n_unique"], io["bucket_tok"], io["bucket_start"], io["rows"]),
                    w.g32("wte"), w.g32("wpe"), b.B, T, d)
        completed(L)

    def last_logits(self, b: BatchBuffers, T: int) -> None:
        """float32 logits [V] of position T - 1 into b's logits, after `forward(b, T,
        loss=False)` (sampling)."""
        s = self.shapes
        last = b.at("lnf") + (T - 1) * s.d_model * self.es
        self.o._mm(b.at("logits"), last, self.flat.w("wte"), 1, s.vocab_size, s.d_model,
                   tb=True, out32=True)
