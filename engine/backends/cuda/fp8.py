"""A layer's linear maps with FP8 GEMMs (train/precision "fp8"): fp32 masters, bf16 activations,
FP8 tensor-core GEMMs with fp32 accumulation through cuBLASLt. The MLP's fc1 and fc2, the
attention's output projection (proj) and, with Q, K, V in rows, its QKV projection (qkv), each in
its forward and its two backward GEMMs (engine.model.fp8.FP8_GEMMS).

Scaled as engine/model/fp8.py says (its numpy twin: engine/backends/numpy/fp8.py): the weights,
the activations and the gradients each by the largest amax of their last HISTORY passes
(delayed scaling: the cast kernels take the amax as they go, and a tensor's separate amax pass,
over an fp32 master for a weight, runs only while it has no history). The history lives on the
device (`fp8.hist`, `fp8.next`), is written at the end of every training pass (k_fp8_record,
`end_pass`) and travels in every checkpoint (`read_history`, `load_history`). E4M3 for weights
and activations in the forward, E5M2 for the gradients in the backward; fast accumulation in the
forward only.

Hopper runs FP8 GEMMs only with both operands K-contiguous (cuBLASLt's "TN"). For a linear map
out = A·W with A [R,n_in], W [n_in,n_out] and G the gradient of out [R,n_out]:

    GEMM     product        a [M,K]   b as [N,K]   FP8 copies it reads
    fwd      A·W  [R,n_out] A         Wᵀ           A8, Wᵀ8  (E4M3)
    dgrad    G·Wᵀ [R,n_in]  G         W            G8 (E5M2), W8
    wgrad    Aᵀ·G [n_in,n_out] Aᵀ     Gᵀ           Aᵀ8, Gᵀ8

    map    A                      W                        G
    fc1    x = ln2's output       W1 [d,F]                 dh = fc1 output's gradient
    fc2    h = GELU's output      W2 [F,d]                 dy = the MLP output's gradient
    proj   att = attention's out  W_O [d,d]                dproj = proj output's gradient
    qkv    ln1 = ln1's output     W_QKV [d,3d] (rows)      dqkv [R,3d] (Q, K, V in rows)

The QKV map's W8 is W_QKV = [W_Q | W_K | W_V] (the GEMM copy's rows layout, the masters' three
[d,d] cast into its column blocks: one scale for the three), its Wᵀ8 the three Wⱼᵀ one after
another ([3d,d]); its weight gradient is three GEMMs batched, dWⱼ = ln1ᵀ·dqkvⱼ, into the
gradients' layout (DESIGN §2: W_Q, W_K, W_V one after another). With Q, K, V in slabs (classic
attention) the QKV GEMMs run in bf16.

The weights' copies (W and Wᵀ) are made from the fp32 masters in every training pass, each
layer's at the start of the map's forward (so after each AdamW step, also one still being
applied beside the forward, and after a resume); the activations' copies as the pass makes them:
A8 with Aᵀ8 in one kernel in the forward; fc2's H8 with Hᵀ8 by the kernel that computes
H = GELU(pre) from the GEMM's output (k_fp8_gelu_cast_t64), fc1's dH8 with dHᵀ8 by the one that
computes dH from fc2 dgrad's output times GELU'(pre) (k_fp8_dgelu_cast_t64): the bf16 H and dH
are then written only for a GEMM that may run in bf16. The transposed activations are kept per
layer for the backward's weight gradients, which then need not read A again. A GEMM for which
cuBLASLt proposes no FP8 algorithm at some length runs in bf16 at that length (`use`, `notes`).
Validation and text sampling run the bf16 forward: FP8 is how a step computes, not the model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.backends.cuda.gemm import R_8F_E4M3, R_8F_E5M2, time_interleaved
from engine.backends.cuda.launch import blocks
from engine.errors import RunError
from engine.model.fp8 import DELAYED, FP8_GEMMS, HISTORY, MLP_GEMMS, AmaxHistory

GEMMS = FP8_GEMMS
# per layer, in this order: an amax word, an inverse scale and an amax history of HISTORY passes
# each. One tuple with engine.model.fp8.DELAYED (every FP8 operand is a delayed tensor), so the
# amax words are in the history's row order, as k_fp8_record reads them (tensor i's word at
# (i / per_layer)·stride + i % per_layer, here i itself)
TENSORS = DELAYED
E4M3, E5M2 = 0, 1  # the kernels' e5m2 flag
TILE = 32  # kernels/fp8.cu's transpose tile
# bytes between two inverse scales: cuBLASLt refused (CUBLAS_STATUS_NOT_SUPPORTED) FP8 GEMMs
# whose scale pointers were only 4-byte aligned
SCALE_STRIDE = 16
# a GEMM whose bf16 time at start is below this stays in FP8 without a choice: at a few µs the
# timing (one eager launch each) measures the host's launch more than the GEMM
MIN_CHOICE_MS = 0.05


def weight_sizes(d: int, F: int) -> dict[str, int]:
    """Bytes of each weight copy (W as stored, and transposed: name + "t") per layer."""
    return {"w1": d * F, "w2": F * d, "wqkv": 3 * d * d, "wo": d * d}


def activation_cols(d: int, F: int) -> dict[str, int]:
    """Columns of each activation an FP8 GEMM reads (A of its map), whose transposed copy is
    kept per layer, and of each gradient (G)."""
    return {"x": d, "h": F, "ln1": d, "att": d, "dy": d, "dh": F, "dproj": d, "dqkv": 3 * d}


QKV_COPIES = ("wqkv", "ln1", "dqkv")  # the copies only the QKV map reads
QKV_GEMMS = ("qkv fwd", "qkv dgrad", "qkv wgrad")


def _copies(qkv: bool) -> tuple[list[str], list[str], list[str]]:
    """(weights, activations, gradients) with FP8 copies; the QKV map's only where it runs in
    FP8 (qkv: Q, K, V in rows)."""
    drop = () if qkv else QKV_COPIES
    return ([n for n in ("w1", "w2", "wqkv", "wo") if n not in drop],
            [n for n in ("x", "h", "ln1", "att") if n not in drop],
            [n for n in ("dy", "dh", "dproj", "dqkv") if n not in drop])


def plan_fp8(plan: Any, n_layer: int, d: int, F: int, R: int, qkv: bool) -> None:
    """The FP8 buffers, in the memory plan's "fp8" group: per layer the weight copies (as stored
    and transposed) and the activations' transposed copies (made in the forward, read by the
    backward's weight gradients); one set of the activations' copies as they are and of the
    gradients' both ways (reused layer by layer); the amax words and inverse scales. qkv:
    whether the QKV map runs in FP8 (Q, K, V in rows), else its copies are left out."""
    weights, activations, gradients = _copies(qkv)
    sizes, cols = weight_sizes(d, F), activation_cols(d, F)
    for name in weights:
        plan.add("fp8", f"fp8.{name}", n_layer * _slot(sizes[name]))
        plan.add("fp8", f"fp8.{name}t", n_layer * _slot(sizes[name]))
    for name in activations:
        plan.add("fp8", f"fp8.{name}t", n_layer * _slot(R * cols[name]))
        plan.add("fp8", f"fp8.{name}", R * cols[name])
    for name in gradients:
        plan.add("fp8", f"fp8.{name}", R * cols[name])
        plan.add("fp8", f"fp8.{name}t", R * cols[name])
    plan.add("fp8", "fp8.amax", n_layer * len(TENSORS) * 4)
    plan.add("fp8", "fp8.inv", n_layer * len(TENSORS) * SCALE_STRIDE)
    plan.add("fp8", "fp8.hist", n_layer * len(DELAYED) * HISTORY * 4)
    plan.add("fp8", "fp8.next", 4)


def _slot(nbytes: int) -> int:
    return -(-nbytes // 256) * 256


def _in_turn(*fns: Any) -> Any:
    """One callable running the given ones (None among them skipped) in turn; None if none."""
    given = [f for f in fns if f is not None]
    if not given:
        return None

    def run() -> None:
        for f in given:
            f()

    return run


class Fp8Gemms:
    """A training pass's FP8 GEMMs, layer by layer, on an Ops (its stream, side stream and
    LtGemm): `begin_pass`; in each layer's forward the weights' copies (`cast_*_weights`) and
    `qkv_forward`, `proj_forward`, `mlp_forward`; in its backward `mlp_backward`,
    `proj_backward`, `qkv_backward`; then `end_pass` (the amax history's record)."""

    def __init__(self, ops: Any, drv: Any, plan: Any, n_layer: int, d: int, F: int, act: int,
                 R_max: int, qkv: bool) -> None:
        """qkv: whether the QKV map runs here (Q, K, V in rows: plan_fp8's qkv), else its
        GEMMs run in bf16 (Ops.attn_qkv_fwd, attn_qkv_bwd)."""
        self.o, self.drv, self.L, self.d, self.F, self.act = ops, drv, n_layer, d, F, act
        self.R_max = R_max  # the longest pass's rows (the plan's slots); R below: this pass's
        self.wsize = weight_sizes(d, F)
        self.cols = activation_cols(d, F)
        names = [n for group in _copies(qkv) for n in group]
        self.buf = {name: plan[f"fp8.{name}"] for name in
                    (*names, *(n + "t" for n in names), "amax", "inv", "hist", "next")}
        # False: at full length cuBLASLt had no FP8 algorithm for this GEMM, or the start-up
        # timing found it faster in bf16, or it is the QKV map's with Q, K, V in slabs (it runs
        # in bf16)
        self.use = {g: qkv or g not in QKV_GEMMS for g in GEMMS}
        self._bf16_at: set[tuple[str, int]] = set()  # (GEMM, rows) that fell back to bf16
        self._fp8_ran: set[tuple[str, int]] = set()  # (GEMM, rows) queued in FP8
        # per layer: whether this pass's forward wrote the bf16 GELU output (act), which only a
        # GEMM that runs in bf16 reads (else such a GEMM has it computed first: `_restore_act`)
        self._act_kept = dict.fromkeys(range(n_layer), True)
        self.notes: list[str] = []
        self.load_history(None)  # the plan's memory holds anything until then

    @property
    def fp8_gemms(self) -> list[str]:
        return [g for g in GEMMS if self.use[g]]

    def _scale(self, layer: int, tensor: str) -> tuple[int, int]:
        """(amax word, inverse scale) of one tensor of one layer."""
        i = layer * len(TENSORS) + TENSORS.index(tensor)
        return self.buf["amax"] + 4 * i, self.buf["inv"] + SCALE_STRIDE * i

    def _hist(self, layer: int, tensor: str) -> int:
        """The device address of one tensor's HISTORY floats (its history's row)."""
        return self.buf["hist"] + 4 * HISTORY * (layer * len(DELAYED) + DELAYED.index(tensor))

    def _w(self, name: str, layer: int) -> int:
        """Layer `layer`'s copy of a weight: "w1" (as stored) or "w1t" (transposed), ..."""
        return self.buf[name] + layer * _slot(self.wsize[name.removesuffix("t")])

    def _at(self, name: str, layer: int) -> int:
        """Layer `layer`'s transposed activation copy: "x" → Xᵀ8 [d, R], "h" → Hᵀ8 [F, R], ...
        (R: this pass's rows, in a slot for R_max)."""
        return self.buf[name + "t"] + layer * _slot(self.R_max * self.cols[name])

    # --- kernels -------------------------------------------------------------------------------
    def _amax(self, amax: int, x: int, n: int, hist: int, f32: bool = False) -> None:
        """x's amax while it has no history (hist: its history), else nothing (the cast takes
        it as it goes); x an activation tensor, or (f32) a float32 master weight. A block reads
        8 elements a thread per turn and ends with one atomic."""
        self.o._go("k_fp8_amax_f32_delayed" if f32 else "k_fp8_amax_delayed",
                   blocks(-(-n // 8), cap=1024), amax, x, n, hist, HISTORY)

    def _cast_t(self, q: int, qt: int, inv: int, x: int, amax: int, hist: int, rows: int,
                cols: int, fmt: int, f32: bool = False, ldq: int = 0) -> None:
        """qt = FP8 of xᵀ [cols, rows] (q = FP8 of x too, unless 0), scaled from the history
        `hist` (or, while it is empty, from x's amax now), taking x's amax into `amax` as it
        goes; f32: x a float32 master weight, whose q rows may be ldq bytes apart (default
        cols). Whole 64 x 64 tiles with 16-byte accesses where the shapes and addresses allow,
        else 32 x 32 tiles of bytes."""
        ldq = ldq or cols
        assert f32 or ldq == cols
        self.o._writes(*(p for p in (q, qt) if p))
        wide = (ldq,) if f32 else ()
        if (rows % 64 == 0 and cols % 64 == 0 and ldq % 8 == 0
                and all(p % 16 == 0 for p in (x, q, qt))):
            self.o._go("k_fp8_cast_t64_f32" if f32 else "k_fp8_cast_t64",
                       (cols // 64, rows // 64), q, qt, inv, x, amax, hist, HISTORY, rows, cols,
                       *wide, fmt)
            return
        grid = (-(-cols // TILE), -(-rows // TILE))
        self.o._go("k_fp8_cast_t_f32" if f32 else "k_fp8_cast_t", grid, q, qt, inv, x, amax,
                   hist, HISTORY, rows, cols, *wide, fmt)

    def _record(self) -> None:
        """The pass's amax of every delayed tensor into the history's next slot (k_fp8_record),
        after the pass's backward."""
        n = self.L * len(DELAYED)
        self.o._go("k_fp8_record", 1, self.buf["hist"], self.buf["next"], self.buf["amax"], n,
                   len(DELAYED), len(TENSORS), HISTORY)

    # --- the history ---------------------------------------------------------------------------
    def read_history(self) -> AmaxHistory:
        """The device's amax history (after the work queued so far)."""
        rows = self.L * len(DELAYED)
        amax = np.empty((rows, HISTORY), np.float32)
        nxt = np.empty(1, np.int32)
        self.o.stream.synchronize()
        self.drv.memcpy_dtoh(amax, self.buf["hist"])
        self.drv.memcpy_dtoh(nxt, self.buf["next"])
        return AmaxHistory(amax, int(nxt[0]))

    def load_history(self, history: AmaxHistory | None) -> None:
        """The device's amax history from `history` (None: empty, each tensor then scaled by its
        own amax until it has one). ValueError when it does not fit this model."""
        history = AmaxHistory.for_model(history, self.L)
        self.o.stream.synchronize()
        self.drv.memcpy_htod(self.buf["hist"], np.ascontiguousarray(history.amax, np.float32))
        self.drv.memcpy_htod(self.buf["next"], np.array([history.next], np.int32))

    def _gemm(self, name: str, R: int, fp8: Any, bf16: Any, restore: Any = None) -> None:
        """The FP8 GEMM, or the same product in bf16 where (decided on the first, eager pass,
        before a graph is captured) cuBLASLt proposes no FP8 algorithm for this shape, or the
        start-up timing found bf16 the faster for this GEMM at full length (`_choose`; the
        choice is kept in the GEMM plan, so a resume computes as the run did). A refusal at one
        length (e.g. rows not a multiple of 16 bytes for a K = rows weight gradient) leaves
        the other lengths in FP8; one at full length is what `use` and the notes report.
        restore: writes the bf16 operands that the pass left unwritten (None: all written),
        called before the bf16 GEMM."""
        g = self.o.gemm
        key = self.choice_key(name)
        if key not in g.choices and g.plan_imported and name in MLP_GEMMS:
            # a recorded plan without this MLP choice (written before the choices were made, or
            # in another precision): FP8, as that run computed it; an attention GEMM's missing
            # choice (the run that wrote the plan computed it in bf16) is timed as in a new run
            g.choices[key] = "fp8"
        if (R == self.R_max and key not in g.choices and (name, R) not in self._bf16_at
                and g.tuning and g.timer is not None):
            self._choose(name, key, fp8, bf16)
        if g.choices.get(key) == "bf16":
            self.use[name] = False
            self._bf16_at.add((name, R))
        if (name, R) not in self._bf16_at:
            try:
                fp8()
                self._fp8_ran.add((name, R))
                return
            except RunError as e:
                self._bf16_at.add((name, R))
                if R == self.R_max:
                    self.use[name] = False
                self.notes.append(f"FP8 {name} ({R} rows): {e}; this GEMM runs in bf16 there")
        if restore is not None:
            restore()
        bf16()

    def choice_key(self, name: str) -> str:
        """The GEMM plan's key for the FP8-or-bf16 choice of one GEMM at this model's shape."""
        return f"fp8 {name} R={self.R_max} d={self.d} F={self.F}"

    def _choose(self, name: str, key: str, fp8: Any, bf16: Any) -> None:
        """Time the GEMM in FP8 and in bf16 (each run once first: its algorithm picked) and keep
        the faster in the GEMM plan's choices, where the bf16 GEMM takes MIN_CHOICE_MS or more;
        a shorter one stays in FP8, as asked (its timing would measure the launch more than the
        GEMM). FP8 that cuBLASLt refuses is no candidate (_gemm's fallback says why)."""
        g = self.o.gemm
        try:
            fp8()
        except RunError:
            return
        bf16()
        t8, t16 = time_interleaved(g.timer, [fp8, bf16])
        g.choices[key] = "fp8" if t8 < t16 or t16 < MIN_CHOICE_MS else "bf16"
        g.choice_ms[key] = (t8, t16)

    def gemm_times(self) -> dict[str, tuple[float, float]]:
        """GEMM -> (ms in FP8, ms in bf16) as timed at start (GEMMs not timed are left out)."""
        ms = self.o.gemm.choice_ms if self.o.gemm is not None else {}
        return {g: ms[self.choice_key(g)] for g in GEMMS if self.choice_key(g) in ms}

    # --- the pass ------------------------------------------------------------------------------
    def begin_pass(self) -> None:
        """At the start of a training pass: every amax word to zero (the weights' FP8 copies are
        made layer by layer, `cast_*_weights`)."""
        self.o.zero32(self.buf["amax"], self.L * len(TENSORS))

    def end_pass(self) -> None:
        """After the pass's backward: every amax of the pass into the history."""
        self._record()

    def _cast_weight(self, layer: int, name: str, w: int, rows: int, cols: int,
                     nblocks: int = 1) -> None:
        """Layer `layer`'s FP8 copies of weight `name` (as stored, and transposed) from its fp32
        master at w: `nblocks` [rows, cols] matrices one after another (W_Q, W_K, W_V), kept as
        stored side by side ([rows, nblocks·cols], the rows layout) and transposed one after
        another, under one scale; scaled from the history (the cast taking the amax as it
        goes; the amax pass over the master runs only while the weight has no history)."""
        amax, inv = self._scale(layer, name)
        hist = self._hist(layer, name)
        self._amax(amax, w, nblocks * rows * cols, hist, f32=True)
        for j in range(nblocks):
            self._cast_t(self._w(name, layer) + j * cols, self._w(name + "t", layer)
                         + j * rows * cols, inv, w + 4 * j * rows * cols, amax, hist, rows, cols,
                         E4M3, f32=True, ldq=nblocks * cols)

    def cast_mlp_weights(self, layer: int, w1: int, w2: int) -> None:
        """Layer `layer`'s FP8 copies of W1 and W2 from the fp32 masters w1, w2: in the layer's
        forward, so that an AdamW update still being applied beside the forward (layer by
        layer) has reached them."""
        self._cast_weight(layer, "w1", w1, self.d, self.F)
        self._cast_weight(layer, "w2", w2, self.F, self.d)

    def cast_qkv_weights(self, layer: int, wq: int) -> None:
        """Layer `layer`'s FP8 W_QKV (rows) and its transpose from the fp32 masters W_Q, W_K,
        W_V (one after another from wq), as cast_mlp_weights."""
        self._cast_weight(layer, "wqkv", wq, self.d, self.d, nblocks=3)

    def cast_proj_weights(self, layer: int, wo: int) -> None:
        """Layer `layer`'s FP8 copies of W_O from its fp32 master, as cast_mlp_weights."""
        self._cast_weight(layer, "wo", wo, self.d, self.d)

    def qkv_forward(self, layer: int, ln1: int, w_rows: int, qkv: int, R: int) -> None:
        """qkv [R,3d] = ln1 · W_QKV (Q, K, V in rows; w_rows: the bf16 W_QKV, for a GEMM that
        falls back)."""
        self._linear_fwd("qkv", layer, ln1, "ln1", w_rows, "wqkv", qkv, self.d, 3 * self.d, R)

    def qkv_backward(self, layer: int, dqkv: int, ln1: int, w_rows: int, dx: int, dw: int,
                     R: int) -> None:
        """dWⱼ += ln1ᵀ·dqkvⱼ (or written, as the pass says; W_Q, W_K, W_V one after another
        from dw) and dx = dqkv · W_QKVᵀ, from dqkv [R,3d] (Q, K, V in rows)."""
        self._linear_bwd("qkv", layer, dqkv, "dqkv", ln1, "ln1", w_rows, "wqkv", dx, dw, self.d,
                         3 * self.d, R, nblocks=3)

    def proj_forward(self, layer: int, att: int, wo: int, out: int, R: int) -> None:
        """out = att · W_O (wo: the bf16 W_O, for a GEMM that falls back)."""
        self._linear_fwd("proj", layer, att, "att", wo, "wo", out, self.d, self.d, R)

    def proj_backward(self, layer: int, dout: int, att: int, wo: int, datt: int, dwo: int,
                      R: int) -> None:
        """dW_O += attᵀ·dout (or written) and datt = dout · W_Oᵀ."""
        self._linear_bwd("proj", layer, dout, "dproj", att, "att", wo, "wo", datt, dwo, self.d,
                         self.d, R)

    def mlp_forward(self, layer: int, x: int, w1: int, w2: int, pre: int, act: int, out: int,
                    R: int) -> None:
        """pre = x·W1, act = GELU(pre), out = act·W2 (x: ln2's output; w1, w2: the bf16
        weights, for a GEMM that falls back)."""
        self._linear_fwd("fc1", layer, x, "x", w1, "w1", pre, self.d, self.F, R)
        cast = self._gelu(layer, pre, act, R)
        self._linear_fwd("fc2", layer, act, "h", w2, "w2", out, self.F, self.d, R,
                         amax_done=True, cast=cast,
                         restore_a=self._restore_act(layer, act, pre, R * self.F))

    def mlp_backward(self, layer: int, dout: int, x: int, w1: int, w2: int, pre: int, act: int,
                     dx: int, dw1: int, dw2: int, dpre: int, R: int) -> None:
        """Ops.mlp_bwd's outputs with FP8 GEMMs: dpre, dx, and dW1, dW2 (+= or written, as the
        pass says) from dout = the gradient of the MLP's output."""
        self._linear_bwd("fc2", layer, dout, "dy", act, "h", w2, "w2", dpre, dw2, self.F,
                         self.d, R, restore_a=self._restore_act(layer, act, pre, R * self.F))
        cast, restore = self._dgelu(layer, dpre, pre, R)
        self._linear_bwd("fc1", layer, dpre, "dh", x, "x", w1, "w1", dx, dw1, self.d, self.F,
                         R, amax_done=True, cast=cast, restore_g=restore)

    def _gelu(self, layer: int, pre: int, act: int, R: int) -> bool:
        """H = GELU(pre) with its amax; where the tiles allow, made as its FP8 copies H8, Hᵀ8
        by the kernel that computes it (act written too only for a GEMM that may read it in
        bf16). Returns whether H's copies are still to be made (the plain GELU kernel ran)."""
        n = R * self.F
        ha, hi = self._scale(layer, "h")
        h8, ht8 = self.buf["h"], self._at("h", layer)
        if not self._tiles64(R, self.F, pre, act, h8, ht8):
            self.o.gelu_fwd(act, pre, n, amax=ha)
            self._act_kept[layer] = True
            return True
        hh = self._hist(layer, "h")
        keep = act if self._bf16_may_read(("fc2 fwd", "fc2 wgrad"), R) else 0
        self._act_kept[layer] = bool(keep)
        self.o._go("k_fp8_gelu_amax_delayed", blocks(n // 8, cap=1024), ha, pre, n, hh, HISTORY)
        self.o._writes(h8, ht8, *([keep] if keep else []))
        self.o._go("k_fp8_gelu_cast_t64", (self.F // 64, R // 64), h8, ht8, hi, keep, pre, ha,
                   hh, HISTORY, R, self.F)
        return False

    def _dgelu(self, layer: int, dpre: int, pre: int, R: int) -> tuple[bool, Any]:
        """dH = dpre·GELU'(pre) (dpre: fc2 dgrad's output) with its amax; where the tiles
        allow, made as its FP8 copies dH8, dHᵀ8 by the kernel that computes it (written back
        to dpre only for a GEMM that may read it in bf16). Returns (whether dH's copies are
        still to be made, what fc1's bf16 GEMMs run first where dpre was left as it was)."""
        n = R * self.F
        da, di = self._scale(layer, "dh")
        dh8, dht8 = self.buf["dh"], self.buf["dht"]
        if not self._tiles64(R, self.F, pre, dpre, dh8, dht8):
            self.o.gelu_bwd(dpre, pre, n, amax=da)
            return True, None
        dh = self._hist(layer, "dh")
        keep = dpre if self._bf16_may_read(("fc1 dgrad", "fc1 wgrad"), R) else 0
        self.o._go("k_fp8_dgelu_amax_delayed", blocks(n // 8, cap=1024), da, dpre, pre, n, dh,
                   HISTORY)
        self.o._writes(dh8, dht8, *([keep] if keep else []))
        self.o._go("k_fp8_dgelu_cast_t64", (self.F // 64, R // 64), dh8, dht8, di, keep, dpre,
                   pre, da, dh, HISTORY, R, self.F)
        return False, None if keep else self._restore_dh(dpre, pre, n)

    @staticmethod
    def _tiles64(rows: int, cols: int, *ptrs: int) -> bool:
        """Whether a [rows, cols] tensor and its copies at ptrs take the 64 x 64 tile kernels."""
        return rows % 64 == 0 and cols % 64 == 0 and all(p % 16 == 0 for p in ptrs)

    def _bf16_may_read(self, gemms: tuple[str, ...], R: int) -> bool:
        """Whether one of `gemms` may run in bf16 at R rows, reading the bf16 tensor: until each
        has been queued in FP8 at R, and wherever one has run in bf16 there. (One refused later
        still finds its operand: `_restore_act`, `_restore_dh`.)"""
        return (not all((g, R) in self._fp8_ran for g in gemms)
                or any((g, R) in self._bf16_at for g in gemms))

    def _restore_act(self, layer: int, act: int, pre: int, n: int) -> Any:
        """For a GEMM that falls back to bf16 and reads act where this pass's forward did not
        write it: act = GELU(pre) first (the same values); None where act was written."""
        if self._act_kept[layer]:
            return None

        def restore() -> None:
            self.o._writes(act)
            self.o.gelu_fwd(act, pre, n)

        return restore

    def _restore_dh(self, dpre: int, pre: int, n: int) -> Any:
        """For fc1's GEMMs that fall back to bf16 where the pass left dpre as fc2 dgrad wrote it
        (its FP8 copies made from it directly): dpre *= GELU'(pre), once."""
        done: list[bool] = []

        def restore() -> None:
            if not done:
                self.o._writes(dpre)
                self.o.gelu_bwd(dpre, pre, n)
                done.append(True)

        return restore

    def _linear_fwd(self, fc: str, layer: int, a: int, aname: str, w: int, wname: str,
                    out: int, n_in: int, n_out: int, R: int, amax_done: bool = False,
                    cast: bool = True, restore_a: Any = None) -> None:
        """out [R, n_out] = a [R, n_in] · W, with a's E4M3 copy (its amax and scale now; the
        transposed copy made alongside, for the backward) and W's transposed copy (wname + "t");
        w: the bf16 weight, for a GEMM that falls back. amax_done: a's amax word already holds
        its max (the kernel that wrote a); cast False: a's copies are made already; restore_a:
        writes a for the bf16 GEMM where the pass did not (_gemm)."""
        o, b = self.o, self.buf
        aa, ai = self._scale(layer, aname)
        _, wi = self._scale(layer, wname)
        ah = self._hist(layer, aname)
        if not amax_done:
            self._amax(aa, a, R * n_in, ah)
        if cast:
            self._cast_t(b[aname], self._at(aname, layer), ai, a, aa, ah, R, n_in, E4M3)
        self._gemm(f"{fc} fwd", R,
                   lambda: o._mm(out, b[aname], self._w(wname + "t", layer), R, n_out, n_in,
                                 types=(R_8F_E4M3, R_8F_E4M3, self.act), scales=(ai, wi),
                                 tb=True, fast_accum=True),
                   lambda: o._mm(out, a, w, R, n_out, n_in), restore=restore_a)

    def _linear_bwd(self, fc: str, layer: int, g: int, gname: str, a: int, aname: str, w: int,
                    wname: str, din: int, dw: int, n_in: int, n_out: int, R: int,
                    amax_done: bool = False, cast: bool = True, restore_a: Any = None,
                    restore_g: Any = None, nblocks: int = 1) -> None:
        """For out = a·W with g = d out [R, n_out]: dW += aᵀ·g (or written, as the pass says)
        and din = g·Wᵀ [R, n_in], from g's E5M2 copies (as it is and transposed; its amax and
        scale now, amax_done and cast as in _linear_fwd) and a's transposed E4M3 copy (made by
        the forward, with its scale); w: the bf16 weight; restore_a, restore_g: as _linear_fwd's
        restore_a, for a and g. nblocks: W is that many [n_in, n_out / nblocks] matrices side by
        side (W_QKV), whose gradients dW lie one after another: its GEMM is batched over them."""
        o, b = self.o, self.buf
        ga, gi = self._scale(layer, gname)
        _, ai = self._scale(layer, aname)
        _, wi = self._scale(layer, wname)
        gq, gqt, aqt = b[gname], b[gname + "t"], self._at(aname, layer)
        gh = self._hist(layer, gname)
        if not amax_done:
            self._amax(ga, g, R * n_out, gh)
        if cast:
            self._cast_t(gq, gqt, gi, g, ga, gh, R, n_out, E5M2)
        nb = n_out // nblocks  # the columns of one block
        batch8 = ({"batch": nblocks, "sa": 0, "sb": nb * R, "sc": n_in * nb} if nblocks > 1
                  else {})
        batch16 = ({"ldb": n_out, "batch": nblocks, "sa": 0, "sb": nb, "sc": n_in * nb}
                   if nblocks > 1 else {})
        self._gemm(f"{fc} wgrad", R,
                   lambda: o._wgrad(dw, aqt, gqt, n_in, nb, R, (aqt, gqt), tb=True,
                                    types=(R_8F_E4M3, R_8F_E5M2), scales=(ai, gi), **batch8),
                   lambda: o._wgrad(dw, a, g, n_in, nb, R, (g,), ta=True, **batch16),
                   restore=_in_turn(restore_a, restore_g))
        o._writes(din)
        self._gemm(f"{fc} dgrad", R,
                   lambda: o._mm(din, gq, self._w(wname, layer), R, n_in, n_out, tb=True,
                                 types=(R_8F_E5M2, R_8F_E4M3, self.act), scales=(gi, wi)),
                   lambda: o._mm(din, g, w, R, n_in, n_out, tb=True), restore=restore_g)
