"""NumpyBackend: the DESIGN §2 model on the CPU, calling the op twins of `ops.py` in order.

Every buffer is allocated once in `__init__`: params, grads, Adam m/v (flat), the saved
activations (views into one flat arena, named as in engine/backends/activations.py: region "ln1.i"
is layer i's "ln1", the CUDA backend's slab "ln1" at layer i) and scratch. A micro-batch with
T < seq_len uses the leading part of each buffer. float32 by default; float64 for gradient checks.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from engine.backends import hostmem
from engine.backends.activations import BY_NAME, LAYER, MODEL, STREAM, Dims, saved
from engine.backends.numpy import fp8, ops
from engine.config import GpuConfig
from engine.env import usable_cores
from engine.errors import UserError
from engine.model.fp8 import FP8_GEMMS, AmaxHistory
from engine.model.layout import ModelShapes, decay_mask, n_params, tensor_table, views

# every precision computes in fp32 here; fp8 has the layers' linear maps on FP8 values
# (numpy/fp8.py)
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


def blas_threads() -> int:
    """Threads numpy's OpenBLAS uses (asked from the library itself; CPU count as a fallback)."""
    libdir = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in glob.glob(os.path.join(libdir, "*openblas*.so*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for sym in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads"):
            fn = getattr(lib, sym, None)
            if fn is not None:
                return int(fn())
    return usable_cores()


class _Arena:
    """One flat buffer carved into named regions; `view` reshapes a region's leading part.
    A region kept per layer slot i is named "name.i"."""

    def __init__(self, sizes: dict[str, int], dtype: type) -> None:
        self.offsets: dict[str, tuple[int, int]] = {}
        total = 0
        for name, size in sizes.items():
            self.offsets[name] = (total, size)
            total += size
        self.flat = np.zeros(total, dtype=dtype)

    def view(self, name: str, shape: tuple[int, ...], slot: int | None = None) -> np.ndarray:
        """The leading part of region `name` (of layer slot `slot`), reshaped to `shape`."""
        start, size = self.offsets[name if slot is None else f"{name}.{slot}"]
        need = math.prod(shape)
        assert need <= size, (name, slot, shape, size)
        return self.flat[start : start + need].reshape(shape)

    def stats(self, name: str, rows: int,
              slot: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """A LayerNorm's `*_stats` region, [2, rows it was sized for]: its (mean, rstd) for the
        first `rows` rows."""
        start, size = self.offsets[name if slot is None else f"{name}.{slot}"]
        both = self.flat[start : start + size].reshape(2, size // 2)
        return both[0, :rows], both[1, :rows]

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes


def _saved_sizes(s: ModelShapes, B: int, sampling: bool) -> dict[str, int]:
    """Region sizes (elements) of the saved activations numpy keeps (activations.py), plus the
    "proj" scratch. Training keeps every layer and x[0..L]. Sampling (B = 1) keeps one layer
    slot, reused, two slots of x, used in turn, and the loss buffers for one row."""
    dims = Dims(B=B, T=s.seq_len, d=s.d_model, F=s.d_ff, H=s.n_head, V=s.vocab_size)
    n_slots, n_x = (1, 2) if sampling else (s.n_layer, s.n_layer + 1)
    loss_dims = dataclasses.replace(dims, B=1, T=1) if sampling else dims
    sizes = {}
    for a in saved("numpy", STREAM):
        sizes |= {f"{a.name}.{i}": a.elems(dims) for i in range(n_x)}
    for i in range(n_slots):
        sizes |= {f"{a.name}.{i}": a.elems(dims) for a in saved("numpy", LAYER)}
    once = saved("numpy", MODEL)
    sizes |= {a.name: a.elems(dims) for a in once if a.part == "trunk"}
    sizes["proj"] = BY_NAME["proj"].elems(dims)  # scratch; here so that sampling has its own
    sizes |= {a.name: a.elems(loss_dims) for a in once if a.part == "loss"}
    return sizes


COPY_CHUNK = 1 << 22  # values per call of a state copy (tens of ms, first touch included)


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """np.copyto in chunks: the first write to a large buffer takes seconds (its pages are
    mapped then), and a stop signal is answered between two calls, not after all of them."""
    src = np.asarray(src)
    for start in range(0, dst.size, COPY_CHUNK):
        np.copyto(dst[start : start + COPY_CHUNK], src[start : start + COPY_CHUNK])


def _scratch_sizes(s: ModelShapes, B: int) -> dict[str, int]:
    """Region sizes (elements) of the backward's and the optimizer's scratch."""
    d, F, V = s.d_model, s.d_ff, s.vocab_size
    N, T = B * s.seq_len, s.seq_len
    dims = Dims(B=B, T=T, d=d, F=F, H=s.n_head, V=V)
    return {
        "ga": N * d,  # ga, gb: the residual stream's gradient, in turn
        "gb": N * d,
        "dln": BY_NAME["dln"].elems(dims),
        "xtmp": N * d,
        "datt": BY_NAME["datt"].elems(dims),
        "dqkv": BY_NAME["dqkv"].elems(dims),
        "dprobs": B * s.n_head * T * T,
        "dpre": BY_NAME["dpre"].elems(dims),
        "ftmp": N * F,
        "gtmp": N * F,
        "wtmp": max(V * d, d * F, 3 * d * d),
        "adam": 2 * ops.ADAMW_CHUNK,
    }


def host_plan(shapes: ModelShapes, micro_batch: int, dtype: type = np.float32,
              separate_micro: bool = False) -> dict[str, int]:
    """The bytes NumpyBackend(shapes, micro_batch, ...) allocates, by group (its memory_plan,
    without the total), computed without allocating anything."""
    n = n_params(shapes)
    es = np.dtype(dtype).itemsize
    acts = _saved_sizes(shapes, micro_batch, sampling=False)
    sample = _saved_sizes(shapes, 1, sampling=True)
    scratch = _scratch_sizes(shapes, micro_batch)
    return {"weights": n * es, "grads": n * es * (2 if separate_micro else 1), "adam_m": n * es,
            "adam_v": n * es, "activations": sum(acts.values()) * es,
            # the sampling arena and the weight-decay mask count as scratch
            "scratch": (sum(scratch.values()) + sum(sample.values()) + n) * es}


class NumpyBackend:
    """The numpy reference backend (see engine.backends.base.Backend for the interface). It has
    no choices of its own: the config's gpu section and a GEMM plan mean nothing here."""

    name = "numpy"
    on_gpu = False
    host_plan = staticmethod(host_plan)

    def __init__(
        self,
        shapes: ModelShapes,
        micro_batch: int,
        precision: str = "fp32",
        dtype: type = np.float32,
        *,
        gpu: GpuConfig | None = None,
        gemm_plan: Mapping[str, Any] | None = None,
        separate_micro: bool = False,
    ) -> None:
        if precision not in PRECISIONS:
            raise UserError(f"train/precision: expected one of {PRECISIONS}, got {precision!r}")
        if micro_batch < 1:
            raise UserError(f"train/batch_size: expected a positive integer, got {micro_batch}")
        self.shapes = shapes
        self.micro_batch = micro_batch
        # numpy has no bf16/fp16 GEMMs worth using: it computes in fp32 (or float64 for checks)
        self.precision = "fp32" if dtype == np.float32 else "fp64"
        self.requested_precision = precision
        self.dtype = np.dtype(dtype)
        self.device = f"cpu (numpy {np.__version__}, {blas_threads()} BLAS threads)"
        self.notes: list[str] = []
        self.resolved: dict[str, bool | int | str] = {}
        self.attention_info = ""
        # fp8: the layers' linear maps (qkv, proj, the MLP's) on FP8 values (numpy/fp8.py), the
        # rest as fp32
        self.fp8_gemms: list[str] = list(FP8_GEMMS) if precision == "fp8" else []
        self.gemm_plan: dict[str, Any] | None = None

        s, B = shapes, micro_batch
        d, L = s.d_model, s.n_layer
        n = n_params(s)
        acts = _saved_sizes(s, B, sampling=False)
        scratch = _scratch_sizes(s, B)
        sample = _saved_sizes(s, 1, sampling=True)
        plan = host_plan(s, B, dtype, separate_micro)
        if self.fp8_gemms:
            plan["fp8"] = sum(fp8.buffer_sizes(d, s.d_ff, B * s.seq_len).values()) \
                * self.dtype.itemsize
        hostmem.require(plan, "the numpy backend")
        self.fp8 = (fp8.Fp8Gemms(L, d, s.d_ff, B * s.seq_len, self.dtype) if self.fp8_gemms
                    else None)
        self._params = np.zeros(n, dtype=self.dtype)
        self._grads = np.zeros(n, dtype=self.dtype)
        self._gsave = np.zeros(n, dtype=self.dtype) if separate_micro else None
        self._m = np.zeros(n, dtype=self.dtype)
        self._v = np.zeros(n, dtype=self.dtype)
        self._decay = decay_mask(s).astype(self.dtype)
        self.p = views(self._params, s)
        self.g = views(self._grads, s)
        table = {t.name: t for t in tensor_table(s)}
        # W_Q, W_K, W_V lie back to back: one [3,d,d] view feeds a batched matmul
        self._wqkv = []
        self._dwqkv = []
        for i in range(L):
            off = table[f"h.{i}.attn.W_Q"].offset
            self._wqkv.append(self._params[off : off + 3 * d * d].reshape(3, d, d))
            self._dwqkv.append(self._grads[off : off + 3 * d * d].reshape(3, d, d))

        self._acts = _Arena(acts, self.dtype)
        self._scratch = _Arena(scratch, self.dtype)
        # sampling has its own buffers (batch 1, one reusable layer slot, one logits row)
        self._sample = _Arena(sample, self.dtype)

    def describe(self) -> str:
        """One line: what computes (the reference ops in numpy, in one precision)."""
        fp8 = ", the layers' linear maps on FP8 values (delayed scaling)" if self.fp8 else ""
        return f"the numpy reference ops in {self.precision}{fp8}"

    def device_step(self) -> None:
        """None: the trainer drives the step call by call."""
        return None

    # --- state in and out --------------------------------------------------------------------

    def _check_flat(self, what: str, a: np.ndarray) -> None:
        if a.ndim != 1 or a.size != self._params.size:
            raise UserError(
                f"{what}: expected a flat array of {self._params.size} values, got shape {a.shape}"
            )

    def load_params(self, params: np.ndarray) -> None:
        self._check_flat("params", params)
        _copy(self._params, params)

    def load_optimizer(self, m: np.ndarray, v: np.ndarray) -> None:
        self._check_flat("adam m", m)
        self._check_flat("adam v", v)
        _copy(self._m, m)
        _copy(self._v, v)

    @staticmethod
    def _readonly(a: np.ndarray) -> np.ndarray:
        view = a.view()
        view.flags.writeable = False
        return view

    def read_params(self) -> np.ndarray:
        """A read-only VIEW of the live weights (no copy): it changes as training goes on."""
        return self._readonly(self._params)

    def read_grads(self) -> np.ndarray:
        """A read-only VIEW of the live gradients (no copy)."""
        return self._readonly(self._grads)

    def read_optimizer(self) -> tuple[np.ndarray, np.ndarray]:
        """Read-only VIEWS of Adam m and v (no copies)."""
        return self._readonly(self._m), self._readonly(self._v)

    def copy_state_into(self, params: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
        np.copyto(params, self._params)
        np.copyto(m, self._m)
        np.copyto(v, self._v)

    def zero_grads(self) -> None:
        self._grads.fill(0.0)

    # --- forward and backward ----------------------------------------------------------------

    def _check_tokens(self, what: str, a: np.ndarray, B: int | None) -> None:
        s = self.shapes
        ok = (
            isinstance(a, np.ndarray)
            and np.issubdtype(a.dtype, np.integer)
            and a.ndim == (2 if B is not None else 1)
            and (B is None or a.shape[0] == B)
            and 1 <= a.shape[-1] <= s.seq_len
        )
        if not ok:
            want = f"int [{B}, 1..{s.seq_len}]" if B is not None else f"int [1..{s.seq_len}]"
            got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
            raise UserError(f"{what}: expected {want}, got {got}")
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= s.vocab_size:
            raise UserError(f"{what}: token ids must be in [0, {s.vocab_size}), got {lo}..{hi}")

    def _trunk(self, ar: _Arena, tokens: np.ndarray, train: bool,
               fp8: bool = False) -> np.ndarray:
        """Embedding, the blocks and the final LayerNorm; returns lnf [N,d].
        Training saves every layer's activations; sampling reuses one slot. fp8: the linear maps
        (qkv, proj, the MLP's) on FP8 values (a training pass of precision fp8)."""
        s, p = self.shapes, self.p
        f8 = self.fp8 if fp8 else None
        B, T = tokens.shape
        N, d, F, H = B * T, s.d_model, s.d_ff, s.n_head
        nd, nf = (N, d), (N, F)

        def x(i: int) -> np.ndarray:
            return ar.view("x", nd, i if train else i % 2)

        ops.embed_fwd(tokens, p["wte"], p["wpe"], x(0).reshape(B, T, d))
        proj = ar.view("proj", nd)
        for i in range(s.n_layer):
            j = i if train else 0
            h = f"h.{i}."
            xmid = ar.view("xmid", nd, j)
            ln1, ln2 = ar.view("ln1", nd, j), ar.view("ln2", nd, j)
            qkv, att = ar.view("qkv", (3, N, d), j), ar.view("att", nd, j)
            ops.layernorm_fwd(x(i), p[h + "ln1.gamma"], p[h + "ln1.beta"], ln1,
                              *ar.stats("ln1_stats", N, j))
            if f8 is not None:
                f8.qkv_forward(i, ln1, self._wqkv[i], qkv)
            else:
                ops.attn_qkv_fwd(ln1, self._wqkv[i], qkv)
            ops.attn_fwd(qkv.reshape(3, B, T, d), H, ar.view("probs", (B, H, T, T), j),
                         att.reshape(B, T, d))
            if f8 is not None:
                f8.proj_forward(i, att, p[h + "attn.W_O"], proj)
            else:
                ops.attn_out_fwd(att, p[h + "attn.W_O"], proj)
            ops.residual_add(x(i), proj, xmid)
            ops.layernorm_fwd(xmid, p[h + "ln2.gamma"], p[h + "ln2.beta"], ln2,
                              *ar.stats("ln2_stats", N, j))
            w1, w2 = p[h + "mlp.W_1"], p[h + "mlp.W_2"]
            pre, act = ar.view("pre", nf, j), ar.view("act", nf, j)
            if f8 is not None:
                f8.mlp_forward(i, ln2, w1, w2, pre, act, proj)
            else:
                ops.mlp_fwd(ln2, w1, w2, pre, act, proj)
            ops.residual_add(xmid, proj, x(i + 1))
        lnf = ar.view("lnf", nd)
        ops.layernorm_fwd(x(s.n_layer), p["lnf.gamma"], p["lnf.beta"], lnf,
                          *ar.stats("lnf_stats", N))
        return lnf

    def _forward(self, inputs: np.ndarray, targets: np.ndarray,
                 fp8: bool = False) -> np.ndarray:
        self._check_tokens("inputs", inputs, self.micro_batch)
        self._check_tokens("targets", targets, self.micro_batch)
        if targets.shape != inputs.shape:
            raise UserError(f"targets: expected shape {inputs.shape}, got {targets.shape}")
        B, T = inputs.shape
        N, V = B * T, self.shapes.vocab_size
        ar = self._acts
        lnf = self._trunk(ar, inputs, train=True, fp8=fp8)
        losses = ar.view("losses", (N,))
        ops.loss_fwd(lnf, self.p["wte"], targets.reshape(N), ar.view("logits", (N, V)),
                     ar.view("row_sum", (N,)), losses)
        return losses.reshape(B, T).mean(axis=1, dtype=np.float64)

    def forward_loss(self, inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
        return self._forward(inputs, targets)

    def forward_backward(
        self, inputs: np.ndarray, targets: np.ndarray, loss_scale: float = 1.0,
        separate: bool = False,
    ) -> np.ndarray:
        if not separate:
            return self._forward_backward(inputs, targets, loss_scale)
        # This micro-batch's gradient on its own, then one add: the sum over micro-batches is
        # then the sum a data-parallel all-reduce forms from whole micro-batch gradients.
        if self._gsave is None:
            raise RuntimeError("separate micro-batch gradients need separate_micro=True")
        np.copyto(self._gsave, self._grads)
        self._grads.fill(0)
        rows = self._forward_backward(inputs, targets, loss_scale)
        self._grads += self._gsave
        return rows

    def grad_array(self) -> np.ndarray:
        """The live gradient buffer (writable): what a data-parallel all-reduce sums."""
        return self._grads

    def _forward_backward(
        self, inputs: np.ndarray, targets: np.ndarray, loss_scale: float
    ) -> np.ndarray:
        if self.fp8 is not None:
            self.fp8.begin_pass()
        row_losses = self._forward(inputs, targets, fp8=self.fp8 is not None)
        s, p, g, ar, sc = self.shapes, self.p, self.g, self._acts, self._scratch
        B, T = inputs.shape
        N, d, F, H, V = B * T, s.d_model, s.d_ff, s.n_head, s.vocab_size
        nd, nf = (N, d), (N, F)
        ga, gb, dln, xtmp, datt = (sc.view(k, nd) for k in ("ga", "gb", "dln", "xtmp", "datt"))
        dqkv = sc.view("dqkv", (3, N, d))
        dprobs = sc.view("dprobs", (B, H, T, T))
        dpre, ftmp, gtmp = (sc.view(k, nf) for k in ("dpre", "ftmp", "gtmp"))
        wtmp = sc.view("wtmp", (sc.offsets["wtmp"][1],))

        ops.loss_bwd(ar.view("lnf", nd), p["wte"], targets.reshape(N), ar.view("logits", (N, V)),
                     ar.view("row_sum", (N,)), loss_scale / N, dln, g["wte"], xtmp, wtmp)
        ops.layernorm_bwd(dln, ar.view("x", nd, s.n_layer), p["lnf.gamma"],
                          *ar.stats("lnf_stats", N), ga, g["lnf.gamma"], g["lnf.beta"], xtmp)
        # ga holds dL/d(block output); gb dL/d(xmid); they swap roles through each block
        for i in reversed(range(s.n_layer)):
            h = f"h.{i}."
            mlp_args = (ga, ar.view("ln2", nd, i), p[h + "mlp.W_1"], p[h + "mlp.W_2"],
                        ar.view("pre", nf, i), ar.view("act", nf, i), dln, g[h + "mlp.W_1"],
                        g[h + "mlp.W_2"], dpre, ftmp, gtmp, wtmp)
            if self.fp8 is not None:
                self.fp8.mlp_backward(i, *mlp_args)
            else:
                ops.mlp_bwd(*mlp_args)
            ops.layernorm_bwd(dln, ar.view("xmid", nd, i), p[h + "ln2.gamma"],
                              *ar.stats("ln2_stats", N, i), gb, g[h + "ln2.gamma"],
                              g[h + "ln2.beta"], xtmp)
            ops.residual_add_bwd(ga, gb)
            proj_args = (gb, ar.view("att", nd, i), p[h + "attn.W_O"], datt, g[h + "attn.W_O"],
                         wtmp)
            if self.fp8 is not None:
                self.fp8.proj_backward(i, *proj_args)
            else:
                ops.attn_out_bwd(*proj_args)
            ops.attn_bwd(datt.reshape(B, T, d), ar.view("qkv", (3, B, T, d), i),
                         ar.view("probs", (B, H, T, T), i), H, dqkv.reshape(3, B, T, d), dprobs)
            qkv_args = (dqkv, ar.view("ln1", nd, i), self._wqkv[i], dln, self._dwqkv[i], xtmp,
                        wtmp)
            if self.fp8 is not None:
                self.fp8.qkv_backward(i, *qkv_args)
            else:
                ops.attn_qkv_bwd(*qkv_args)
            ops.layernorm_bwd(dln, ar.view("x", nd, i), p[h + "ln1.gamma"],
                              *ar.stats("ln1_stats", N, i), ga, g[h + "ln1.gamma"],
                              g[h + "ln1.beta"], xtmp)
            ops.residual_add_bwd(gb, ga)
        ops.embed_bwd(ga.reshape(B, T, d), inputs, g["wte"], g["wpe"])
        if self.fp8 is not None:
            self.fp8.end_pass()
        return row_losses

    # --- optimizer -----------------------------------------------------------------------------

    def scale_grads(self, s: float) -> None:
        self._grads *= s

    def grad_norm(self) -> float:
        return ops.grad_norm_final(ops.grad_norm_partial(self._grads))

    def grad_scale(self, s: float) -> None:
        ops.grad_scale(self._grads, s)

    def adamw(
        self,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        t: int,
    ) -> None:
        if t < 1:
            raise ValueError(f"adamw: t is the 1-based step, got {t}")
        tmp = self._scratch.view("adam", (2, ops.ADAMW_CHUNK))
        ops.adamw(self._params, self._grads, self._m, self._v, self._decay, lr, beta1, beta2,
                  eps, weight_decay, t, tmp)

    # --- sampling and memory -------------------------------------------------------------------

    def logits_last(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens)
        self._check_tokens("tokens", tokens, None)
        ar = self._sample
        lnf = self._trunk(ar, tokens.reshape(1, -1), train=False)
        logits = ar.view("logits", (self.shapes.vocab_size,))
        np.matmul(self.p["wte"], lnf[-1], out=logits)
        return logits.astype(np.float32)

    def fp8_history(self) -> AmaxHistory | None:
        """A copy of the FP8 amax history (None unless train/precision is fp8)."""
        return None if self.fp8 is None else AmaxHistory(self.fp8.history.amax.copy(),
                                                         self.fp8.history.next)

    def load_fp8_history(self, history: AmaxHistory | None) -> None:
        """Go on from this history (a checkpoint's); None: start afresh. ValueError when it
        does not fit this model."""
        if self.fp8 is None:
            return
        history = AmaxHistory.for_model(history, self.shapes.n_layer)
        np.copyto(self.fp8.history.amax, history.amax)
        self.fp8.history.next = history.next

    def memory_plan(self) -> dict[str, int]:
        plan = {
            "weights": self._params.nbytes,
            "grads": self._grads.nbytes + (self._gsave.nbytes if self._gsave is not None else 0),
            "adam_m": self._m.nbytes,
            "adam_v": self._v.nbytes,
            "activations": self._acts.nbytes,
            "scratch": self._scratch.nbytes + self._sample.nbytes + self._decay.nbytes,
        }
        if self.fp8 is not None:
            plan["fp8"] = sum(b.nbytes for b in self.fp8.buf.values())
        plan["total"] = sum(plan.values())
        return plan
