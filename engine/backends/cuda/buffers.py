"""The CUDA backend's buffer table: every buffer's size, per-layer stride and the io block's
fields, from one place, so the memory plan, the device addresses and the host staging agree.

The saved activations and the shared scratch are engine/backends/activations.py's (the numpy
backend uses the same names); this module adds the CUDA-only scratch and lays it all out.
Each name is one slab in memory.Plan, layer-major: layer l of slab n is at
`plan["t." + n] + l·slot_bytes` (prefix "t." for training, "s." for sampling with B=1).
Importing this needs no GPU (nor pycuda): tests build the plan on the CPU.

Two choices change the table: `attention` ("classic": the saved probabilities [B,H,T,T] per
layer and a scores scratch; "cudnn": neither, cuDNN's row statistics [B,H,T] and its workspace
instead) and `fused` (the fused step: a second copy of the gradient buffers that the weight-
gradient GEMMs on the second stream read — dres, dpre, dqkv — so the main stream can write the
next layer's while they run; the step's hyper-parameters in the io block; a second cuBLAS
workspace). The defaults are the unfused path's classic-attention plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.backends.activations import BY_NAME, LAYER, Dims, saved
from engine.backends.cuda.cublas import WORKSPACE_BYTES
from engine.backends.cuda.memory import Plan
from engine.backends.cuda.ops import LN_ROWS_PER_CHUNK, LOSS_ROW_MAX
from engine.backends.cuda.optim_ops import NORM_BLOCKS, NORM_RANGE_BLOCKS
from engine.backends.cuda.runtime import ACT_BYTES
from engine.model.layout import ModelShapes, n_params, tensor_table

LOGITS_ALIGN = 64  # logits rows are padded to a multiple of this many columns (see ops.loss_fwd)


def logits_ld(vocab_size: int) -> int:
    """The aligned row length of the logits buffers (ldv >= V)."""
    return -(-vocab_size // LOGITS_ALIGN) * LOGITS_ALIGN


# k_adamw_step's hyper-parameters, in its order; then k_step_hp's: the bias corrections of
# Adam's step t - 1, taken instead of bc1, bc2 when alt_if_skipped != 0 and the step before was
# skipped (a step queued before the one ahead of it has ended guesses that one applied)
HP_FIELDS = ("lr", "beta1", "beta2", "eps", "weight_decay", "bc1", "bc2", "grad_mult",
             "max_norm", "bc1_alt", "bc2_alt", "alt_if_skipped")
UPD_WORDS = len(HP_FIELDS) + 2  # k_step_clip's record of a step's update: hp, clip, skip


def io_fields(R: int, step: bool = False) -> dict[str, int]:
    """The io block, staged from the host on every call, in 4-byte words: field -> offset, for
    up to R rows. tokens [R] and targets [R], batch-major as given; the embedding-gradient
    buckets of Ops.embed_bwd: n_unique [1], bucket_tok [R], bucket_start [R+1], rows [R]; the
    float loss_scale/(B·T) [1] that k_loss_bwd reads; with `step` (the fused step), the floats
    of HP_FIELDS that k_step_hp fixes and k_step_clip reads (and keeps, with the clip factor
    and the skip, in the UPD_WORDS floats k_adamw_step reads); "end" is the block's length."""
    lengths = (("tokens", R), ("targets", R), ("n_unique", 1), ("bucket_tok", R),
               ("bucket_start", R + 1), ("rows", R), ("scale", 1),
               *((("hp", len(HP_FIELDS)),) if step else ()), ("end", 0))
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
                 training: bool, attention: str = "classic", fused: bool = False,
                 logits_lp: bool = False) -> None:
        """logits_lp: the logits in the compute precision (es bytes, CudaBackend.logits_lp),
        not float32; a training buffer's dlogits then share their slab when a row fits the
        loss kernel's registers (ops.LOSS_ROW_MAX)."""
        if attention not in ("classic", "cudnn"):
            raise ValueError(f"attention: expected classic or cudnn, got {attention!r}")
        self.p, self.B, self.training = prefix, B, training
        self.attention, self.fused = attention, fused
        self.logits_lp = logits_lp
        self.dlogits_in_logits = logits_lp and training and ldv <= LOSS_ROW_MAX
        dims = Dims(B=B, T=s.seq_len, d=s.d_model, F=s.d_ff, H=s.n_head, V=ldv)
        R = self.R = dims.R  # rows at the longest sequence; strides between layers use it
        self.d = dims.d
        self.io_fields = io_fields(R, step=fused and training)
        self.io_words = self.io_fields["end"]
        self.slabs: dict[str, Slab] = {}
        self._plan: Plan | None = None
        # saved for the backward ("activations"): the shared table, float32 where it says so
        for a in saved("cuda", attention=attention):
            f32 = a.f32 and not (logits_lp and a.name == "logits")
            self._add("activations", a.name, a.slots(s.n_layer), a.elems(dims) * (4 if f32
                                                                                    else es))
        # scratch, in plan order
        if attention == "classic":  # S, then dP
            self._add("scratch", "scores", 1, dims.B * dims.H * dims.T * dims.T * es)
        self._add("scratch", "proj", 1, BY_NAME["proj"].elems(dims) * es)
        self._add("scratch", "io", 1, self.io_words * 4)
        if training:
            self._add("scratch", "dres", 1, R * dims.d * es)  # d x[l+1], then d xmid, ...
            for name in ("dln", "datt", "dqkv", "dpre"):
                self._add("scratch", name, 1, BY_NAME[name].elems(dims) * es)
            if not self.dlogits_in_logits:
                self._add("scratch", "dlogits", 1, R * ldv * es)
            # ops.layernorm_bwd's per-chunk column sums [ceil(R/rows), 2d] float32
            self._add("scratch", "ln_partial", 1, -(-R // LN_ROWS_PER_CHUNK) * 2 * dims.d * 4)
            if fused:  # the second copies the weight-gradient stream reads (see module doc)
                self._add("scratch", "dres2", 1, R * dims.d * es)
                for name in ("dqkv", "dpre"):
                    self._add("scratch", name + "2", 1, BY_NAME[name].elems(dims) * es)

    def _add(self, group: str, name: str, slots: int, slot_bytes: int) -> None:
        self.slabs[name] = Slab(name, group, slots, slot_bytes)

    def plan(self, plan: Plan) -> None:
        """Add every slab to `plan` (addresses are valid once it is allocated)."""
        for slab in self.slabs.values():
            plan.add(slab.group, self.p + slab.name, slab.nbytes)
        self._plan = plan

    def at(self, name: str, layer: int = 0) -> int:
        """Device address of slot `layer` of slab `name` (dlogits: the logits' slab where they
        share it)."""
        if name == "dlogits" and self.dlogits_in_logits:
            name = "logits"
        slab = self.slabs[name]
        if not 0 <= layer < slab.slots:
            raise IndexError(f"{self.p}{name}: slot {layer} of {slab.slots}")
        assert self._plan is not None, "plan() first"
        return self._plan[self.p + name] + layer * slab.slot_bytes

    def layer(self, l: int) -> dict[str, int]:
        """Layer l's saved activations: name -> device address (the names of activations.py)."""
        return {a.name: self.at(a.name, l) for a in saved("cuda", LAYER, self.attention)}

    def qkv_slab(self) -> int:
        """Elements between the Q, K and V slabs of `qkv` and `dqkv`: R_max·d whatever the
        sequence length, so the slabs never overlap (cuDNN writes whole slabs). In rows
        (CudaBackend.qkv_rows) the same buffers hold [R_max, 3d] instead: Q, K, V d apart."""
        return self.R * self.d

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
        # a stable sort; on 16-bit keys numpy's is a radix sort, ten times faster here
        keys = tok_tm.astype(np.uint16) if tok_tm.size and 0 <= tok_tm.min() and \
            tok_tm.max() < 1 << 16 else tok_tm
        order = np.argsort(keys, kind="stable")
        sorted_tok = tok_tm[order]
        starts = np.flatnonzero(np.r_[True, sorted_tok[1:] != sorted_tok[:-1]])
        nu = starts.size
        h[f["n_unique"]] = nu
        h[f["bucket_tok"] : f["bucket_tok"] + nu] = sorted_tok[starts]
        h[f["bucket_start"] : f["bucket_start"] + nu] = starts
        h[f["bucket_start"] + nu] = R
        h[f["rows"] : f["rows"] + R] = order
        self.stage_scale(h, loss_scale, R)
        return T

    def stage_scale(self, h: np.ndarray, loss_scale: float, R: int) -> None:
        """Write the float loss_scale/R (R = B·T rows) into the host io block."""
        at = self.io_fields["scale"]
        h[at : at + 1].view(np.float32)[0] = loss_scale / R

    def stage_hp(self, h: np.ndarray, values: dict[str, float]) -> None:
        """Write the fused step's hyper-parameters (HP_FIELDS, float32) into the host io block."""
        at = self.io_fields["hp"]
        h[at : at + len(HP_FIELDS)].view(np.float32)[:] = [values[k] for k in HP_FIELDS]



QKV_TENSORS = ("attn.W_Q", "attn.W_K", "attn.W_V")  # j = 0, 1, 2 of the rows layout


def qkv_seg_table(shapes: ModelShapes) -> np.ndarray:
    """The kernels' seg_qkv (kernels/optim.cu, lp_index), int32 per tensor of the layout's table:
    j + 1 for each layer's W_Q, W_K, W_V (j = 0, 1, 2), 0 for every other tensor. Asserted: what
    the rows layout assumes of DESIGN §2 (each layer's three [d,d] one after the other, W_Q
    first), and d² < 2³¹ (the kernels' 32-bit division)."""
    d = shapes.d_model
    assert d * d < 2**31, f"d_model {d}: d² must stay below 2^31"
    table = tensor_table(shapes)
    off = {t.name: t.offset for t in table}
    out = np.zeros(len(table), np.int32)
    for k, t in enumerate(table):
        layer, _, name = t.name.rpartition(".attn.")
        if layer and "attn." + name in QKV_TENSORS:
            j = QKV_TENSORS.index("attn." + name)
            assert t.shape == (d, d) and t.offset == off[layer + ".attn.W_Q"] + j * d * d, \
                f"{t.name}: not the {j}th [d,d] after its layer's W_Q"
            out[k] = j + 1
    return out


def lp_positions(seg_start: np.ndarray, seg_qkv: np.ndarray, d: int) -> np.ndarray:
    """The host's copy of kernels/optim.cu's lp_index: int64 [n], where the GEMM copy (p_lp)
    keeps each flat element (n = seg_start[-1]). Tensors with seg_qkv 0 stay in place; element
    (r, c) of W_j (seg_qkv j + 1; its layer's W_Q at base) is kept at base + r·3d + j·d + c, so
    that each layer's 3d² range holds W_QKV [d,3d] = [W_Q | W_K | W_V]. A permutation of
    range(n) that keeps every element in its own layer's range."""
    seg_start = np.asarray(seg_start, np.int64)
    pos = np.arange(seg_start[-1], dtype=np.int64)
    r, c = np.divmod(np.arange(d * d, dtype=np.int64), d)  # W_j[r, c] is its element r·d + c
    for s in np.flatnonzero(np.asarray(seg_qkv)):
        j, start = int(seg_qkv[s]) - 1, int(seg_start[s])
        pos[start : start + d * d] = start - j * d * d + r * 3 * d + j * d + c
    return pos


# The tensors whose gradients the fused step (bf16, fp8) keeps in bf16 (`grads_lp`,
# CudaBackend.grads_lp): each layer's weight matrices, which only their weight-gradient GEMMs
# write. The embeddings (wte's sum of the LM head's GEMM and the embedding's scatter) and the
# LayerNorms' parameters keep float32 gradients.
GRAD_LP_TENSORS = ("attn.W_Q", "attn.W_K", "attn.W_V", "attn.W_O", "mlp.W_1", "mlp.W_2")


def grads_lp_table(shapes: ModelShapes) -> np.ndarray:
    """The kernels' seg_glp (kernels/optim.cu adamw_body): int32 per tensor of the layout's
    table, 1 where the tensor's gradient is one of GRAD_LP_TENSORS'."""
    def in_lp(name: str) -> bool:  # "h.3.attn.W_Q" is layer 3's "attn.W_Q"
        h, _, rest = name.partition(".")
        return h == "h" and rest.partition(".")[2] in GRAD_LP_TENSORS

    return np.array([in_lp(t.name) for t in tensor_table(shapes)], np.int32)


def layer_ranges(shapes: ModelShapes) -> list[tuple[int, int]]:
    """The flat parameters cut where each layer begins (rounded up to a 16-byte float group):
    the embeddings, then layer 0 .. L-1, the last with the final LayerNorm: the ranges the
    fused step's AdamW runs over, one per layer beside the forward (DeviceOptimizer.apply_update).
    A layer's few elements before its cut are in the range before it, applied earlier."""
    off = {t.name: t.offset for t in tensor_table(shapes)}
    n = n_params(shapes)
    cuts = [0] + [min(n, -(-off[f"h.{l}.ln1.gamma"] // 4) * 4) for l in range(shapes.n_layer)]
    return list(zip(cuts, [*cuts[1:], n], strict=True))


@dataclass(frozen=True)
class NormRanges:
    """The gradient norm's ranges (k_grad_norm_ranges): each of `layer_ranges` cut where the
    gradient's kind changes. cuts: int64 [ranges + 1]; kinds: int32 [ranges], 1 where the range
    is read from grads_lp; groups: for each layer range, (first, count) of its norm ranges."""

    cuts: np.ndarray
    kinds: np.ndarray
    groups: list[tuple[int, int]]

    def __len__(self) -> int:
        return len(self.kinds)


def norm_ranges(shapes: ModelShapes, by_kind: bool) -> NormRanges:
    """The norm's ranges; without by_kind, one per layer range (kind 0). With it, each layer's
    [ln1][W_Q .. W_O][ln2][W_1, W_2] are four ranges, kinds 0 1 0 1: every cut must then be a
    multiple of 4 (the kernels read groups of four), which d_model % 4 == 0 gives."""
    table = tensor_table(shapes)
    lp = grads_lp_table(shapes) if by_kind else np.zeros(len(table), np.int32)
    cuts: list[int] = []
    kinds: list[int] = []
    groups: list[tuple[int, int]] = []
    for begin, end in layer_ranges(shapes):
        first = len(kinds)
        at, kind = begin, None
        for t, k in zip(table, lp, strict=True):
            lo, hi = max(t.offset, begin), min(t.offset + t.size, end)
            if lo >= hi:
                continue
            if kind is not None and k != kind:
                cuts.append(at)
                kinds.append(kind)
                at = lo
            kind = int(k)
        if kind is not None:
            cuts.append(at)
            kinds.append(kind)
        groups.append((first, len(kinds) - first))
    cuts.append(n_params(shapes))
    if by_kind and any(c % 4 for c in cuts):
        raise ValueError(f"norm_ranges: by kind needs every cut a multiple of 4 "
                         f"(d_model % 4 == 0), got d_model {shapes.d_model}")
    return NormRanges(np.array(cuts, np.int64), np.array(kinds, np.int32), groups)


def plan_memory(shapes: ModelShapes, micro_batch: int, precision: str,
                attention: str = "classic", fused: bool = False, cudnn_workspace: int = 0,
                separate_micro: bool = False, qkv_rows: bool = False, logits_lp: bool = False,
                grads_lp: bool = False, norm_by_kind: bool | None = None
                ) -> tuple[Plan, BatchBuffers, BatchBuffers]:
    """The whole memory plan (DESIGN §5), not yet allocated: weights, grads, Adam m and v, the
    training and sampling buffers, and the step's own scratch. Returns (plan, train, sample).
    attention/fused: see the module doc; cudnn_workspace: the bytes cuDNN's graphs need;
    qkv_rows: Q, K, V side by side in rows (qkv and dqkv then hold [R,3d], same size), and the
    GEMM copy's W_Q, W_K, W_V too, which adds only the kernels' table of them (seg_qkv,
    `qkv_seg_table`); logits_lp: the training buffers' logits in the compute precision
    (BatchBuffers; the sampling buffer's stay float32, for logits_last); grads_lp: the fused
    bf16 step's weight gradients in the compute precision (GRAD_LP_TENSORS; `grads_lp`, the
    flat layout of `grads`, with the optimizer's seg_glp); norm_by_kind (default grads_lp):
    the norm's ranges cut where the gradients' kind changes (norm_ranges), with their table of
    kinds."""
    if logits_lp and not fused:  # the unfused k_loss_bwd reads float32 logits
        raise ValueError("plan_memory: logits_lp needs the fused path")
    if grads_lp and not (fused and precision == "bf16"):
        raise ValueError("plan_memory: grads_lp needs the fused path in bf16")
    norm_by_kind = grads_lp if norm_by_kind is None else norm_by_kind
    if grads_lp and not norm_by_kind:
        raise ValueError("plan_memory: grads_lp reads the norm's ranges by kind")
    n, es, ldv = n_params(shapes), ACT_BYTES[precision], logits_ld(shapes.vocab_size)
    plan = Plan()
    plan.add("weights", "params", n * 4)
    if precision != "fp32":
        plan.add("weights", "params_lp", n * es)
    plan.add("grads", "grads", n * 4)
    if grads_lp:
        plan.add("grads", "grads_lp", n * es)
    if separate_micro:  # the sum so far, while a micro-batch forms its own gradient
        plan.add("grads", "grads_save", n * 4)
    plan.add("adam_m", "m", n * 4)
    plan.add("adam_v", "v", n * 4)
    train = BatchBuffers("t.", micro_batch, shapes, es, ldv, True, attention, fused,
                         logits_lp and precision != "fp32")
    sample = BatchBuffers("s.", 1, shapes, es, ldv, False, attention, fused)
    train.plan(plan)
    sample.plan(plan)
    nseg = len(tensor_table(shapes))
    # the norm's partials: k_grad_norm_partial's, or (fused) k_grad_norm_ranges' over the
    # embeddings and each layer (norm_cuts, norm_kinds: norm_ranges)
    ranges = len(norm_ranges(shapes, norm_by_kind)) if fused else 0
    partials = max(NORM_BLOCKS, NORM_RANGE_BLOCKS * ranges) if fused else NORM_BLOCKS
    for name, nbytes in (("cublas_ws", WORKSPACE_BYTES), ("norm_partials", partials * 4),
                         ("norm", 4), ("seg_start", (nseg + 1) * 8), ("seg_decay", nseg * 4)):
        plan.add("scratch", name, nbytes)
    if qkv_rows:
        plan.add("scratch", "seg_qkv", nseg * 4)
    if grads_lp:
        plan.add("scratch", "seg_glp", nseg * 4)
    if attention == "cudnn":
        plan.add("scratch", "cudnn_ws", cudnn_workspace)
    if fused:  # the weight-gradient stream's cuBLAS workspace; the norm's ranges; clip;
        # whether the last fused step was skipped (k_step_clip writes it, k_step_hp reads it);
        # the last step's update as k_step_clip decided it (k_adamw_step reads it)
        plan.add("scratch", "cublas_ws2", WORKSPACE_BYTES)
        plan.add("scratch", "norm_cuts", (ranges + 1) * 8)
        plan.add("scratch", "norm_kinds", ranges * 4)
        plan.add("scratch", "clip", 4)
        plan.add("scratch", "skipped", 4)
        plan.add("scratch", "update", UPD_WORDS * 4)
    return plan, train, sample
