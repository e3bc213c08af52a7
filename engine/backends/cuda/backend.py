"""CudaBackend: the DESIGN §2 model trained on one NVIDIA GPU (engine/backends/base.py interface).

Everything is allocated in `__init__` (memory.Plan); `forward_backward` and `forward_loss` are
captured once per sequence length as CUDA graphs (graphs.py) and replayed, so a step costs a few
host copies and one graph launch. Precision: float32 master weights, gradients and Adam moments
always; activations and the GEMM weight copy in `precision` (bf16 default, fp16, or fp32).

Activation rows are time-major (row r = t*B + b): see ops.py for why. Buffers are named, sized
and laid out by buffers.py (the saved activations by engine/backends/activations.py, the
names the numpy backend uses too).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from engine.backends.cuda import graphs
from engine.backends.cuda.buffers import BatchBuffers, logits_ld, plan_memory
from engine.backends.cuda.cublas import WORKSPACE_BYTES, Cublas
from engine.backends.cuda.cublaslt import CublasLt
from engine.backends.cuda.memory import format_plan
from engine.backends.cuda.ops import Ops
from engine.backends.cuda.runtime import ACT_BYTES, Gpu
from engine.errors import RunError, UserError
from engine.model.layout import ModelShapes, n_params, tensor_table

ADAMW_MAX_SEGS = 1024  # the same cap as kernels/optim.cu
SAFETY_BYTES = 256 << 20  # left free for the driver, cuBLAS's own state and graph instantiation


class CudaBackend:
    """The interface of engine/backends/base.py on one GPU."""

    name = "cuda"

    def __init__(self, shapes: ModelShapes, micro_batch: int, precision: str = "bf16",
                 dtype: type = np.float32, separate_micro: bool = False) -> None:
        if precision not in ACT_BYTES:
            raise UserError(f"train/precision: expected fp32, bf16 or fp16, got {precision!r}")
        if np.dtype(dtype) != np.float32:
            raise UserError("the CUDA backend computes in float32 masters; dtype must be float32")
        if micro_batch < 1:
            raise UserError(f"train/batch_size: expected a positive integer, got {micro_batch}")
        self.shapes, self.B, self.precision = shapes, micro_batch, precision
        self.gpu = gpu = Gpu.get()
        self.drv = drv = gpu.drv
        self.device = gpu.describe(precision)
        if precision == "bf16" and gpu.dev.compute_capability() < (8, 0):
            raise RunError(f"bf16 needs compute capability 8.0 or newer, {self.device} has not")
        self.stream = gpu.stream
        self.table = tensor_table(shapes)
        self.n = n = n_params(shapes)
        self.off = {t.name: t.offset for t in self.table}
        self.es = ACT_BYTES[precision]
        self.ldv = logits_ld(shapes.vocab_size)  # aligned logits rows
        self.wte_rows = n // shapes.d_model  # rows readable from wte on (see ops.loss_fwd)
        self.use_graphs = os.environ.get("ANDREA_CUDA_GRAPHS", "1") != "0"

        plan, self.train, self.sample = plan_memory(shapes, micro_batch, precision,
                                                    separate_micro)
        self.separate_micro = separate_micro
        self._plan = plan
        nseg = len(self.table)
        if nseg > ADAMW_MAX_SEGS:  # k_adamw keeps the tensor table in shared memory
            raise UserError(f"model.n_layer: the CUDA backend handles at most "
                            f"{(ADAMW_MAX_SEGS - 4) // 10} layers, got {shapes.n_layer}")
        free, _total = drv.mem_get_info()
        totals = plan.totals()
        if totals["total"] + SAFETY_BYTES > free:
            raise RunError(
                f"the model does not fit on {self.device}: memory plan {format_plan(totals)}; "
                f"free device memory {free / 2**20:.1f} MiB (of which {SAFETY_BYTES >> 20} MiB "
                f"is kept in reserve). Use a smaller batch_size, seq_len or model.")
        plan.allocate(drv)

        self.blas = Cublas(self.stream.handle, plan["cublas_ws"], WORKSPACE_BYTES)
        # GELU in the MLP GEMMs' epilogues (ANDREA_GELU_FUSION=0: separate GELU kernels)
        self.lt = (CublasLt(self.stream.handle, plan["cublas_ws"], WORKSPACE_BYTES)
                   if os.environ.get("ANDREA_GELU_FUSION", "1") != "0" else None)
        self.ops = Ops(gpu.kernels(precision), self.blas, self.stream, precision, self.lt)
        self.p, self.g = plan["params"], plan["grads"]
        self.plp = plan["params_lp"] if precision != "fp32" else self.p
        self.m, self.v = plan["m"], plan["v"]
        starts = np.array([t.offset for t in self.table] + [n], dtype=np.int64)
        decay = np.array([len(t.shape) == 2 for t in self.table], dtype=np.int32)
        drv.memcpy_htod(plan["seg_start"], starts)
        drv.memcpy_htod(plan["seg_decay"], decay)
        drv.Context.synchronize()  # pageable copies may still be in flight for our stream
        self.nseg = nseg
        # page-locked host staging for the per-call inputs and outputs
        self.h_io = {b.p: drv.pagelocked_zeros(b.io_words, np.int32)
                     for b in (self.train, self.sample)}
        self.h_losses = drv.pagelocked_zeros(self.train.R, np.float32)
        self.h_norm = drv.pagelocked_zeros(1, np.float32)
        self.h_logits = drv.pagelocked_zeros(self.ldv, np.float32)
        self._graphs: dict[tuple[str, int], graphs.CudaGraph] = {}
        # A gradient scale (clip, 1/n_micro) not yet written into the buffer: grad_norm and
        # adamw apply it on the fly, saving a pass over 4·n bytes; anything else settles it.
        self._pending_scale = 1.0
        drv.memset_d32_async(self.p, 0, n, self.stream)
        drv.memset_d32_async(self.g, 0, n, self.stream)
        drv.memset_d32_async(self.m, 0, n, self.stream)
        drv.memset_d32_async(self.v, 0, n, self.stream)
        if precision != "fp32":
            self.ops.params_to_lp(self.plp, self.p, n)
        self.stream.synchronize()

    # --- pointers ---------------------------------------------------------------------------------
    def _w(self, name: str) -> int:
        """The GEMM copy (low precision, or the fp32 master in fp32 mode) of a tensor."""
        return self.plp + self.off[name] * self.es

    def _p32(self, name: str) -> int:
        return self.p + self.off[name] * 4

    def _g32(self, name: str) -> int:
        return self.g + self.off[name] * 4

    # --- the model --------------------------------------------------------------------------------
    def _forward(self, b: BatchBuffers, T: int, loss: bool) -> None:
        s, o = self.shapes, self.ops
        d, F, H, L = s.d_model, s.d_ff, s.n_head, s.n_layer
        B, R = b.B, b.B * T
        io = b.io()
        proj, scores = b.at("proj"), b.at("scores")
        o.embed_fwd(io["tokens"], self._p32("wte"), self._p32("wpe"), b.at("x", 0), B, T, d)
        for l in range(L):
            h = f"h.{l}."
            a = b.layer(l)  # layer l's saved activations, by name
            st1, st2 = a["ln1_stats"], a["ln2_stats"]  # mean [R] floats, then rstd [R]
            o.layernorm_fwd(b.at("x", l), self._p32(h + "ln1.gamma"), self._p32(h + "ln1.beta"),
                            a["ln1"], st1, st1 + R * 4, R, d)
            o.attn_qkv_fwd(a["ln1"], self._w(h + "attn.W_Q"), a["qkv"], R, d)
            o.attn_fwd(a["qkv"], H, a["probs"], a["att"], scores, B, T, d)
            o.attn_out_fwd(a["att"], self._w(h + "attn.W_O"), proj, R, d)
            o.residual_add(b.at("x", l), proj, a["xmid"], R * d)
            o.layernorm_fwd(a["xmid"], self._p32(h + "ln2.gamma"), self._p32(h + "ln2.beta"),
                            a["ln2"], st2, st2 + R * 4, R, d)
            o.mlp_fwd(a["ln2"], self._w(h + "mlp.W_1"), self._w(h + "mlp.W_2"), a["pre"],
                      a["act"], proj, R, d, F)
            o.residual_add(a["xmid"], proj, b.at("x", l + 1), R * d)
        stf = b.at("lnf_stats")
        o.layernorm_fwd(b.at("x", L), self._p32("lnf.gamma"), self._p32("lnf.beta"), b.at("lnf"),
                        stf, stf + R * 4, R, d)
        if loss:
            o.loss_fwd(b.at("lnf"), self._w("wte"), io["targets"], b.at("logits"), b.at("lse"),
                       b.at("losses"), B, T, s.vocab_size, self.ldv, d, self.wte_rows)

    def _backward(self, b: BatchBuffers, T: int) -> None:
        s, o = self.shapes, self.ops
        d, F, H, L = s.d_model, s.d_ff, s.n_head, s.n_layer
        B, R = b.B, b.B * T
        io = b.io()
        dres, dln, datt = b.at("dres"), b.at("dln"), b.at("datt")
        dqkv, dpre, part = b.at("dqkv"), b.at("dpre"), b.at("ln_partial")
        o.loss_bwd(b.at("lnf"), self._w("wte"), io["targets"], b.at("logits"), b.at("lse"),
                   io["scale"], dln, self._g32("wte"), b.at("dlogits"), B, T, s.vocab_size,
                   self.ldv, d, self.wte_rows)
        stf = b.at("lnf_stats")
        o.layernorm_bwd(dln, b.at("x", L), self._p32("lnf.gamma"), stf, stf + R * 4, dres,
                        self._g32("lnf.gamma"), part, R, d, accumulate=False)
        for l in reversed(range(L)):
            h = f"h.{l}."
            a = b.layer(l)
            st1, st2 = a["ln1_stats"], a["ln2_stats"]
            # x[l+1] = xmid + mlp(ln2(xmid)); dres holds d x[l+1]
            o.mlp_bwd(dres, a["ln2"], self._w(h + "mlp.W_1"), self._w(h + "mlp.W_2"), a["pre"],
                      a["act"], dln, self._g32(h + "mlp.W_1"), self._g32(h + "mlp.W_2"), dpre, R,
                      d, F)
            o.layernorm_bwd(dln, a["xmid"], self._p32(h + "ln2.gamma"), st2, st2 + R * 4, dres,
                            self._g32(h + "ln2.gamma"), part, R, d, accumulate=True)
            # xmid = x[l] + attn(ln1(x[l])); dres now holds d xmid
            o.attn_out_bwd(dres, a["att"], self._w(h + "attn.W_O"), datt,
                           self._g32(h + "attn.W_O"), R, d)
            o.attn_bwd(datt, a["qkv"], a["probs"], H, dqkv, b.at("scores"), B, T, d)
            o.attn_qkv_bwd(dqkv, a["ln1"], self._w(h + "attn.W_Q"), dln,
                           self._g32(h + "attn.W_Q"), R, d)
            o.layernorm_bwd(dln, b.at("x", l), self._p32(h + "ln1.gamma"), st1, st1 + R * 4,
                            dres, self._g32(h + "ln1.gamma"), part, R, d, accumulate=True)
        o.embed_bwd(dres, (io["n_unique"], io["bucket_tok"], io["bucket_start"], io["rows"]),
                    self._g32("wte"), self._g32("wpe"), B, T, d)

    # --- per-call plumbing ------------------------------------------------------------------------
    def _check_tokens(self, inputs: np.ndarray, what: str, B: int) -> np.ndarray:
        a = np.asarray(inputs)
        if a.ndim != 2 or a.shape[0] != B or not 1 <= a.shape[1] <= self.shapes.seq_len:
            raise UserError(f"{what}: expected int [{B}, 1..{self.shapes.seq_len}], got shape "
                            f"{a.shape}")
        if not np.issubdtype(a.dtype, np.integer):
            raise UserError(f"{what}: expected integer token ids, got {a.dtype}")
        if a.size and (a.min() < 0 or a.max() >= self.shapes.vocab_size):
            raise UserError(f"{what}: token ids must be in [0, {self.shapes.vocab_size}), got "
                            f"[{a.min()}, {a.max()}]")
        return a.astype(np.int32, copy=False)

    def _stage(self, b: BatchBuffers, inputs: np.ndarray, targets: np.ndarray | None,
               loss_scale: float) -> int:
        """Fill the page-locked io block (tokens, targets, embedding-gradient buckets, loss
        scale: buffers.io_fields) and queue its copy to the device. Returns T."""
        h = self.h_io[b.p]
        T = b.stage(h, inputs, targets, loss_scale)
        self.drv.memcpy_htod_async(b.at("io"), h, self.stream)
        return T

    def _run(self, key: tuple[str, int], issue: Any) -> None:
        """Issue the work directly, or through a graph captured on first use per (kind, T)."""
        if not self.use_graphs:
            issue()
            return
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = graphs.capture(self.stream.handle, issue)
        graph.launch()

    def _row_means(self, b: BatchBuffers, T: int) -> np.ndarray:
        R = b.B * T
        self.drv.memcpy_dtoh_async(self.h_losses[:R], b.at("losses"), self.stream)
        self.stream.synchronize()
        return self.h_losses[:R].reshape(T, b.B).astype(np.float64).mean(axis=0)

    # --- the interface ----------------------------------------------------------------------------
    def forward_backward(self, inputs: np.ndarray, targets: np.ndarray,
                         loss_scale: float = 1.0, separate: bool = False) -> np.ndarray:
        if separate:
            # This micro-batch's gradient on its own, then one add (see the interface).
            if not self.separate_micro:
                raise RunError("separate micro-batch gradients need separate_micro=True")
            self._settle_scale()
            save = self._plan["grads_save"]
            self.drv.memcpy_dtod_async(save, self.g, self.n * 4, self.stream)
            self.drv.memset_d32_async(self.g, 0, self.n, self.stream)
            rows = self._forward_backward(inputs, targets, loss_scale)
            self.ops.grad_add(self.g, save, self.n)
            return rows
        return self._forward_backward(inputs, targets, loss_scale)

    def grad_device(self) -> tuple[int, int, Any]:
        """(device pointer, float32 count, stream) of the live gradient buffer, every deferred
        scale settled: what a data-parallel all-reduce sums in place, on this stream."""
        self._settle_scale()
        return self.g, self.n, self.stream

    def _forward_backward(self, inputs: np.ndarray, targets: np.ndarray,
                          loss_scale: float) -> np.ndarray:
        b = self.train
        x = self._check_tokens(inputs, "inputs", self.B)
        y = self._check_tokens(targets, "targets", self.B)
        if y.shape != x.shape:
            raise UserError(f"targets: expected shape {x.shape}, got {y.shape}")
        T = self._stage(b, x, y, loss_scale)

        def issue() -> None:
            self._forward(b, T, loss=True)
            self._backward(b, T)

        self._settle_scale()  # accumulating onto scaled gradients
        self._run(("fb", T), issue)
        return self._row_means(b, T)

    def forward_loss(self, inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
        b = self.train
        x = self._check_tokens(inputs, "inputs", self.B)
        y = self._check_tokens(targets, "targets", self.B)
        if y.shape != x.shape:
            raise UserError(f"targets: expected shape {x.shape}, got {y.shape}")
        T = self._stage(b, x, y, 1.0)
        self._run(("f", T), lambda: self._forward(b, T, loss=True))
        return self._row_means(b, T)

    def logits_last(self, tokens: np.ndarray) -> np.ndarray:
        b, s = self.sample, self.shapes
        x = self._check_tokens(np.asarray(tokens).reshape(1, -1), "tokens", 1)
        T = self._stage(b, x, None, 1.0)
        self._forward(b, T, loss=False)  # own buffers; no graph: every prompt length differs
        last = b.at("lnf") + (T - 1) * s.d_model * self.es
        self.blas.matmul(b.at("logits"), last, self._w("wte"), 1, s.vocab_size,
                         s.d_model, types=(self.ops.act, self.ops.act, 0), tb=True)
        V = s.vocab_size
        self.drv.memcpy_dtoh_async(self.h_logits[:V], b.at("logits"), self.stream)
        self.stream.synchronize()
        return self.h_logits[:V].copy()

    def _put(self, ptr: int, a: np.ndarray, what: str) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        if a.shape != (self.n,):
            raise UserError(f"{what}: expected a flat float32 array of {self.n}, got {a.shape}")
        self.stream.synchronize()
        self.drv.memcpy_htod(ptr, a)
        # A pageable copy can return before its DMA lands, and our stream does not wait for the
        # legacy stream: make sure the kernels launched next read the new values.
        self.drv.Context.synchronize()

    def _get(self, ptr: int) -> np.ndarray:
        out = np.empty(self.n, dtype=np.float32)
        self.stream.synchronize()
        self.drv.memcpy_dtoh(out, ptr)
        return out

    def load_params(self, params: np.ndarray) -> None:
        self._put(self.p, params, "params")
        if self.precision != "fp32":
            self.ops.params_to_lp(self.plp, self.p, self.n)
        self.stream.synchronize()

    def load_optimizer(self, m: np.ndarray, v: np.ndarray) -> None:
        self._put(self.m, m, "adam m")
        self._put(self.v, v, "adam v")

    def read_params(self) -> np.ndarray:
        return self._get(self.p)

    def read_grads(self) -> np.ndarray:
        self._settle_scale()
        return self._get(self.g)

    def read_optimizer(self) -> tuple[np.ndarray, np.ndarray]:
        return self._get(self.m), self._get(self.v)

    def copy_state_into(self, params: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
        self.stream.synchronize()
        for out, ptr in ((params, self.p), (m, self.m), (v, self.v)):
            if out.dtype != np.float32 or out.shape != (self.n,) or not out.flags.c_contiguous:
                raise ValueError(f"copy_state_into: expected contiguous float32 [{self.n}]")
            self.drv.memcpy_dtoh(out, ptr)

    def zero_grads(self) -> None:
        self.drv.memset_d32_async(self.g, 0, self.n, self.stream)
        self._pending_scale = 1.0

    def _settle_scale(self) -> None:
        if self._pending_scale != 1.0:
            self.ops.grad_scale(self.g, self.n, self._pending_scale)
            self._pending_scale = 1.0

    def scale_grads(self, s: float) -> None:
        self.grad_scale(s)

    def grad_scale(self, s: float) -> None:
        """grads *= s, deferred: the next grad_norm or adamw multiplies as it reads, rounding
        g·s to float exactly as a separate pass would have stored it (same bits). A second
        scale while one is pending settles the first, so s1 then s2 stays fl(fl(g·s1)·s2)."""
        if float(s) == 1.0:
            return
        self._settle_scale()
        self._pending_scale = float(s)

    def grad_norm(self) -> float:
        partials, norm = self._plan["norm_partials"], self._plan["norm"]
        self.ops.grad_norm_partial(self.g, self.n, partials, self._pending_scale)
        self.ops.grad_norm_final(partials, norm)
        self.drv.memcpy_dtoh_async(self.h_norm, norm, self.stream)
        self.stream.synchronize()
        return float(self.h_norm[0])

    def adamw(self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              t: int) -> None:
        lp = self.plp if self.precision != "fp32" else 0
        self.ops.adamw(self.p, lp, self.g, self.m, self.v, self._plan["seg_start"],
                       self._plan["seg_decay"], self.nseg, self.n, float(lr), float(beta1),
                       float(beta2), float(eps), float(weight_decay), int(t),
                       self._pending_scale)

    def memory_plan(self) -> dict[str, int]:
        return self._plan.totals()

    def synchronize(self) -> None:
        """Wait for all queued GPU work (for timing; the interface calls sync where needed)."""
        self.stream.synchronize()

    def close(self) -> None:
        """Free the graphs, the cuBLAS handle and the device memory now (tests make many)."""
        self.stream.synchronize()
        for g in self._graphs.values():
            g.close()
        self._graphs.clear()
        self.blas.close()
        if self.lt:
            self.lt.close()
        self._plan.free()
