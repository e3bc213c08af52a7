"""The model's flat buffers on the device: the float32 masters, gradients and Adam moments in
DESIGN §2's layout, the GEMM copy of the weights in the compute precision, the bf16 weight
gradients of the fused step, and the tensor tables the optimizer kernels read. `FlatBuffers`
answers where a tensor is in each."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.backends.cuda.buffers import qkv_seg_table
from engine.backends.cuda.memory import Plan
from engine.model.layout import ModelShapes, n_params, tensor_table


class FlatBuffers:
    """Device addresses of the flat buffers (planned by buffers.plan_memory, allocated) and of
    each tensor in them. `ops` decides, through its `wgrad_lp`, where a layer's weight
    gradient is written (`gw`)."""

    def __init__(self, shapes: ModelShapes, plan: Plan, precision: str, es: int,
                 qkv_rows: bool, grads_lp: bool) -> None:
        self.shapes, self.precision, self.es = shapes, precision, es
        self.table = tensor_table(shapes)
        self.n = n_params(shapes)
        self.off = {t.name: t.offset for t in self.table}
        self.nseg = len(self.table)
        self.p, self.g = plan["params"], plan["grads"]
        self.m, self.v = plan["m"], plan["v"]
        # the layers' weight gradients in the compute precision (CudaBuild.grads_lp)
        self.glp = plan["grads_lp"] if grads_lp else 0
        self.plp = plan["params_lp"] if precision != "fp32" else self.p
        # the kernels' table of the tensors the GEMM copy keeps in rows (0: none; cuDNN, and so
        # the rows, never run in fp32, where the GEMMs read the masters)
        assert not (qkv_rows and precision == "fp32")
        self.seg_qkv = qkv_seg_table(shapes) if qkv_rows else None
        self.seg_qkv_dev = plan["seg_qkv"] if qkv_rows else 0
        self.seg_start = np.array([t.offset for t in self.table] + [self.n], dtype=np.int64)
        self.seg_decay = np.array([len(t.shape) == 2 for t in self.table], dtype=np.int32)
        self.seg_start_dev, self.seg_decay_dev = plan["seg_start"], plan["seg_decay"]
        self.ops: Any = None  # set once the kernels are loaded (CudaBuild)

    def w(self, name: str) -> int:
        """The GEMM copy (low precision, or the fp32 master in fp32 mode) of a tensor. With
        Q, K, V in rows, "h.{l}.attn.W_Q" is where layer l's W_QKV [d,3d] begins (its W_K and
        W_V have no address of their own there)."""
        return self.plp + self.off[name] * self.es

    def p32(self, name: str) -> int:
        """The float32 master of a tensor."""
        return self.p + self.off[name] * 4

    def g32(self, name: str) -> int:
        """The float32 gradient of a tensor."""
        return self.g + self.off[name] * 4

    def gw(self, name: str) -> int:
        """Where the backward writes a layer matrix's weight gradient: grads_lp (the compute
        precision, the flat layout of grads) in a step that keeps them there (Ops.wgrad_lp),
        else the float32 buffer."""
        return self.glp + self.off[name] * self.es if self.ops.wgrad_lp else self.g32(name)

    def lp_rows(self) -> dict[str, int]:
        """The arguments that tell the optimizer kernels which tensors the GEMM copy keeps in
        rows (Ops.adamw's seg_qkv, d): none, unless Q, K, V are in rows."""
        d = self.shapes.d_model if self.seg_qkv_dev else 0
        return {"seg_qkv": self.seg_qkv_dev, "d": d}

    def params_lp_or_zero(self) -> int:
        """The GEMM copy the optimizer kernels write beside the masters (0 in fp32, where the
        GEMMs read the masters)."""
        return self.plp if self.precision != "fp32" else 0

    def grad_buckets(self) -> list[tuple[int, int]]:
        """(first, count) float32 ranges of the flat gradient in the order the backward
        completes them: the last layer with the final LayerNorm, the layers down to the first,
        then wte and wpe (the tied wte's gradient is complete only after the embedding's)."""
        L = self.shapes.n_layer
        first = [self.off[f"h.{l}.ln1.gamma"] for l in range(L)] + [self.n]
        out = [(first[L - 1], self.n - first[L - 1])]
        out += [(first[l], first[l + 1] - first[l]) for l in reversed(range(L - 1))]
        return [*out, (0, first[0])]
