"""The CUDA backend's buffer table: every buffer's size, per-layer stride and the io block's
fields, from one place, so the memory plan, the device addresses and the host staging agree.

The saved activations and the shared scratch are engine/backends/activations.py's (the numpy
backend uses the same names); this module adds the CUDA-only scratch and lays it all out.
Each name is one slab in memory.Plan, layer-major: layer l of slab n is at
`plan["t." + n] + l·slot_bytes` (prefix "t." for training, "s." for sampling with B=1).
Importing this needs no GPU (nor pycuda): tests build the plan on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.backends.activations import BY_NAME, LAYER, Dims, saved
from engine.backends.cuda.cublas import WORKSPACE_BYTES
from engine.backends.cuda.memory import Plan
from engine.backends.cuda.ops import LN_ROWS_PER_CHUNK, NORM_BLOCKS
from engine.backends.cuda.runtime import ACT_BYTES
from engine.model.layout import ModelShapes, n_params, tensor_table

LOGITS_ALIGN = 64  # logits rows are padded to a multiple of this many columns (see ops.loss_fwd)


def logits_ld(vocab_size: int) -> int:
    """The aligned row length of the logits buffers (ldv >= V)."""
    return -(-vocab_size // LOGITS_ALIGN) * LOGITS_ALIGN


def io_fields(R: int) -> dict[str, int]:
    """The io block, staged from the host on every call, in 4-byte words: field -> offset, for
    up to R rows. tokens [R] and targets [R], batch-major as given; the embedding-gradient
    buckets of Ops.embed_bwd: n_unique [1], bucket_tok [R], bucket_start [R+1], rows [R]; the
    float loss_scale/(B·T) [1] that k_loss_bwd reads; "end" is the block's length."""
    lengths = (("tokens", R), ("targets", R), ("n_unique", 1), ("bucket_tok", R),
               ("bucket_start", R + 1), ("rows", R), ("scale", 1), ("end", 0))
    out, at = {}, 0
    for name, n in lengths:
        out[name] = at
        at += n
    return out


@dataclass(frozen=True)
class Slab:
    """One plan entry: `slots` equal parts (layers) of `slot_bytes` each, back to back."""

    name: str
    group: str  # "activations" | "scratch" (memory.GROUPS)
    slots: int
    slot_bytes: int

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes


class BatchBuffers:
    """The slabs for one micro-batch size, and their device addresses once the plan is
    allocated. Training adds the backward's scratch."""

    def __init__(self, prefix: str, B: int, s: ModelShapes, es: int, ldv: int,
                 training: bool) -> None:
        self.p, self.B, self.training = prefix, B, training
        dims = Dims(B=B, T=s.seq_len, d=s.d_model, F=s.d_ff, H=s.n_head, V=ldv)
        R = self.R = dims.R  # rows at the longest sequence; strides between layers use it
        self.io_fields = io_fields(R)
        self.io_words = self.io_fields["end"]
        self.slabs: dict[str, Slab] = {}
        self._plan: Plan | None = None
        # saved for the backward ("activations"): the shared table, float32 where it says so
        for a in saved("cuda"):
            self._add("activations", a.name, a.slots(s.n_layer), a.elems(dims) * (4 if a.f32
                                                                                    else es))
        # scratch, in plan order
        self._add("scratch", "scores", 1, dims.B * dims.H * dims.T * dims.T * es)  # S, then dP
        self._add("scratch", "proj", 1, BY_NAME["proj"].elems(dims) * es)
        self._add("scratch", "io", 1, self.io_words * 4)
        if training:
            self._add("scratch", "dres", 1, R * dims.d * es)  # d x[l+1], then d xmid, ...
            for name in ("dln", "datt", "dqkv", "dpre"):
                self._add("scratch", name, 1, BY_NAME[name].elems(dims) * es)
            self._add("scratch", "dlogits", 1, R * ldv * es)
            # ops.layernorm_bwd's per-chunk column sums [ceil(R/64), 2d] float32
            self._add("scratch", "ln_partial", 1, -(-R // LN_ROWS_PER_CHUNK) * 2 * dims.d * 4)

    def _add(self, group: str, name: str, slots: int, slot_bytes: int) -> None:
        self.slabs[name] = Slab(name, group, slots, slot_bytes)

    def plan(self, plan: Plan) -> None:
        """Add every slab to `plan` (addresses are valid once it is allocated)."""
        for slab in self.slabs.values():
            plan.add(slab.group, self.p + slab.name, slab.nbytes)
        self._plan = plan

    def at(self, name: str, layer: int = 0) -> int:
        """Device address of slot `layer` of slab `name`."""
        slab = self.slabs[name]
        if not 0 <= layer < slab.slots:
            raise IndexError(f"{self.p}{name}: slot {layer} of {slab.slots}")
        assert self._plan is not None, "plan() first"
        return self._plan[self.p + name] + layer * slab.slot_bytes

    def layer(self, l: int) -> dict[str, int]:
        """Layer l's saved activations: name -> device address (the names of activations.py)."""
        return {a.name: self.at(a.name, l) for a in saved("cuda", LAYER)}

    def io(self) -> dict[str, int]:
        """The io block's fields: name -> device address."""
        base = self.at("io")
        return {name: base + 4 * off for name, off in self.io_fields.items() if name != "end"}

    def stage(self, h: np.ndarray, inputs: np.ndarray, targets: np.ndarray | None,
              loss_scale: float) -> int:
        """Fill the host copy `h` (int32 [io_words]) of the io block for int32 inputs (and
        targets) [B, T]; the embedding-gradient buckets come from a stable sort of the
        time-major rows by token. Returns T."""
        B, T = inputs.shape
        R = B * T
        f = self.io_fields
        h[f["tokens"] : f["tokens"] + R] = inputs.reshape(-1)
        if targets is not None:
            h[f["targets"] : f["targets"] + R] = targets.reshape(-1)
        tok_tm = inputs.T.reshape(-1)  # row r = t*B + b
        order = np.argsort(tok_tm, kind="stable")
        sorted_tok = tok_tm[order]
        starts = np.flatnonzero(np.r_[True, sorted_tok[1:] != sorted_tok[:-1]])
        nu = starts.size
        h[f["n_unique"]] = nu
        h[f["bucket_tok"] : f["bucket_tok"] + nu] = sorted_tok[starts]
        h[f["bucket_start"] : f["bucket_start"] + nu] = starts
        h[f["bucket_start"] + nu] = R
        h[f["rows"] : f["rows"] + R] = order
        h[f["scale"] : f["end"]].view(np.float32)[0] = loss_scale / R
        return T


def plan_memory(shapes: ModelShapes, micro_batch: int, precision: str,
                separate_micro: bool = False) -> tuple[Plan, BatchBuffers, BatchBuffers]:
    """The whole memory plan (DESIGN §5), not yet allocated: weights, grads, Adam m and v, the
    training and sampling buffers, and the step's own scratch. Returns (plan, train, sample)."""
    n, es, ldv = n_params(shapes), ACT_BYTES[precision], logits_ld(shapes.vocab_size)
    plan = Plan()
    plan.add("weights", "params", n * 4)
    if precision != "fp32":
        plan.add("weights", "params_lp", n * es)
    plan.add("grads", "grads", n * 4)
    if separate_micro:  # the sum so far, while a micro-batch forms its own gradient
        plan.add("grads", "grads_save", n * 4)
    plan.add("adam_m", "m", n * 4)
    plan.add("adam_v", "v", n * 4)
    train = BatchBuffers("t.", micro_batch, shapes, es, ldv, training=True)
    sample = BatchBuffers("s.", 1, shapes, es, ldv, training=False)
    train.plan(plan)
    sample.plan(plan)
    nseg = len(tensor_table(shapes))
    for name, nbytes in (("cublas_ws", WORKSPACE_BYTES), ("norm_partials", NORM_BLOCKS * 4),
                         ("norm", 4), ("seg_start", (nseg + 1) * 8), ("seg_decay", nseg * 4)):
        plan.add("scratch", name, nbytes)
    return plan, train, sample
