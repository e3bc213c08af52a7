"""The buffer vocabulary both backends share: the saved activations and the shared scratch.

DESIGN §3: the values the backward needs go into dedicated saved-tensor buffers allocated at
start. They are named here once, so the numpy backend's region "ln1" (layer i's is "ln1.i") and
the CUDA backend's slab "ln1" (layer i at stride i) hold the same tensor.

Shapes are per slot, for micro-batches of B sequences of up to T = seq_len tokens (R = B·T rows);
a shorter sequence uses the leading part. A buffer has one slot per model ("model"), per layer
("layer") or per layer plus one ("stream": x[l] is layer l's input, x[n_layer] the last output).
The tables list buffers in the CUDA memory plan's order, which fixes the device addresses.

Two things differ between the backends and stay different (layout, never math):
- rows: numpy's row r = b·T + t (batch-major), CUDA's r = t·B + b (time-major, see cuda/ops.py);
- dtype: numpy holds everything in its one dtype; on the GPU buffers marked `f32` are float32
  and the others are in the compute precision (fp32, bf16 or fp16);
- qkv, dqkv: the CUDA backend with cuDNN keeps Q, K, V (and their gradients) side by side in
  each row, [R, 3d] in the same slot (cuda/backend.py `qkv_rows`), where numpy has [3, R, d].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

MODEL, LAYER, STREAM = "model", "layer", "stream"


@dataclass(frozen=True)
class Dims:
    """The sizes buffer shapes depend on. V is the length of a logits row: the vocabulary for
    numpy, the aligned ldv >= vocab for CUDA."""

    B: int
    T: int
    d: int
    F: int
    H: int
    V: int

    @property
    def R(self) -> int:
        return self.B * self.T


@dataclass(frozen=True)
class Buffer:
    """One named buffer: its shape per slot, how many slots, what it holds."""

    name: str
    shape: Callable[[Dims], tuple[int, ...]]
    what: str
    per: str = MODEL
    f32: bool = False  # float32 on the GPU whatever the compute precision
    part: str = "trunk"  # "trunk" (embedding, blocks, final LayerNorm) or "loss"
    only: str | None = None  # "numpy" or "cuda" when one backend alone keeps it
    attention: str | None = None  # "classic" or "cudnn" when one attention alone keeps it

    def slots(self, n_layer: int) -> int:
        return {MODEL: 1, LAYER: n_layer, STREAM: n_layer + 1}[self.per]

    def elems(self, dims: Dims) -> int:
        """Elements in one slot."""
        return math.prod(self.shape(dims))

    def kept_by(self, backend: str, attention: str = "classic") -> bool:
        return self.only in (None, backend) and self.attention in (None, attention)


SAVED: tuple[Buffer, ...] = (
    Buffer("x", lambda m: (m.R, m.d), "the residual stream: x[l] feeds layer l, x[L] lnf",
           per=STREAM),
    Buffer("ln1", lambda m: (m.R, m.d), "ln1(x[l]), the attention's input", per=LAYER),
    Buffer("ln1_stats", lambda m: (2, m.R), "ln1's per-row mean, then rstd", per=LAYER,
           f32=True),
    Buffer("qkv", lambda m: (3, m.R, m.d), "Q, K, V = ln1 @ W_Q, W_K, W_V", per=LAYER),
    Buffer("probs", lambda m: (m.B, m.H, m.T, m.T), "P = causal softmax(Q Kᵀ/sqrt(hd))",
           per=LAYER, attention="classic"),
    Buffer("attn_stats", lambda m: (m.B, m.H, m.T), "cuDNN attention: each row's log-sum-exp "
           "of the scores (the backward recomputes P from it)", per=LAYER, f32=True, only="cuda",
           attention="cudnn"),
    Buffer("att", lambda m: (m.R, m.d), "P V, heads side by side: W_O's input", per=LAYER),
    Buffer("xmid", lambda m: (m.R, m.d), "x[l] + att @ W_O: the MLP half's input", per=LAYER),
    Buffer("ln2", lambda m: (m.R, m.d), "ln2(xmid), the MLP's input", per=LAYER),
    Buffer("ln2_stats", lambda m: (2, m.R), "ln2's per-row mean, then rstd", per=LAYER,
           f32=True),
    Buffer("pre", lambda m: (m.R, m.F), "u = ln2 @ W_1, GELU's input", per=LAYER),
    Buffer("act", lambda m: (m.R, m.F), "GELU(u), W_2's input", per=LAYER),
    Buffer("lnf", lambda m: (m.R, m.d), "lnf(x[L]), the output projection's input"),
    Buffer("lnf_stats", lambda m: (2, m.R), "lnf's per-row mean, then rstd", f32=True),
    Buffer("logits", lambda m: (m.R, m.V),
           "numpy: E = exp(z - max z) after loss_fwd; CUDA: z = lnf @ wteᵀ", f32=True,
           part="loss"),
    Buffer("lse", lambda m: (m.R,), "log Σ exp z per row", f32=True, part="loss", only="cuda"),
    Buffer("row_sum", lambda m: (m.R,), "Σ exp(z - max z) per row", part="loss", only="numpy"),
    Buffer("losses", lambda m: (m.R,), "cross-entropy per row", f32=True, part="loss"),
)

# Scratch both backends name alike (each has more of its own: see their modules).
SCRATCH: tuple[Buffer, ...] = (
    Buffer("proj", lambda m: (m.R, m.d), "a branch's output (att @ W_O, act @ W_2) before "
           "residual_add"),
    Buffer("dln", lambda m: (m.R, m.d), "the gradient at a LayerNorm's output"),
    Buffer("datt", lambda m: (m.R, m.d), "the gradient at att"),
    Buffer("dqkv", lambda m: (3, m.R, m.d), "the gradient at qkv"),
    Buffer("dpre", lambda m: (m.R, m.F), "the gradient at pre"),
)

BY_NAME: dict[str, Buffer] = {b.name: b for b in SAVED + SCRATCH}


def saved(backend: str, per: str | None = None, attention: str = "classic") -> tuple[Buffer, ...]:
    """The saved activations `backend` keeps ("numpy" | "cuda") with `attention` ("classic": the
    probabilities; "cudnn": cuDNN's row statistics), in table order; `per` selects one kind of
    slot count (MODEL, LAYER or STREAM)."""
    return tuple(b for b in SAVED if b.kept_by(backend, attention) and per in (None, b.per))
