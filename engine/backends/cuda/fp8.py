"""The MLP's six GEMMs in FP8 (train/precision "fp8"): fp32 masters, bf16 activations, FP8
tensor-core GEMMs with fp32 accumulation through cuBLASLt.

Scaled as engine/model/fp8.py says (its numpy twin: engine/backends/numpy/fp8.py): the weights,
the activations and the gradients each by the largest amax of their last HISTORY passes
(delayed scaling: the cast kernels take the amax as they go, and a tensor's separate amax pass,
over an fp32 master for a weight, runs only while it has no history). The history lives on the
device (`fp8.hist`, `fp8.next`), is written at the end of every training pass (k_fp8_record,
after the last layer's backward) and travels in every checkpoint (`read_history`,
`load_history`). E4M3 for weights and activations in the forward, E5M2 for the gradients in
the backward; fast accumulation in the forward only.

Hopper runs FP8 GEMMs only with both operands K-contiguous (cuBLASLt's "TN"): with X = ln2's
output [R,d], W1 [d,F], H = GELU(X·W1) [R,F], W2 [F,d], dY the gradient of the MLP's output
[R,d] and dH that of its pre-activation [R,F]:

    GEMM        product          a [M,K]   b as [N,K]   FP8 copies it reads
    fc1 fwd     X·W1   [R,F]     X         W1ᵀ          X8, W1ᵀ8  (E4M3)
    fc2 fwd     H·W2   [R,d]     H         W2ᵀ          H8, W2ᵀ8  (E4M3)
    fc2 dgrad   dY·W2ᵀ [R,F]     dY        W2           dY8 (E5M2), W2_8
    fc1 dgrad   dH·W1ᵀ [R,d]     dH        W1           dH8 (E5M2), W1_8
    fc2 wgrad   Hᵀ·dY  [F,d]     Hᵀ        dYᵀ          Hᵀ8, dYᵀ8
    fc1 wgrad   Xᵀ·dH  [d,F]     Xᵀ        dHᵀ          Xᵀ8, dHᵀ8

The weights' copies (W and Wᵀ) are made from the fp32 masters in every training pass, each
layer's at the start of its MLP forward (so after each AdamW step, also one still being applied
beside the forward, and after a resume); the activations' copies as the pass makes them: X8 with
Xᵀ8 in one kernel in the forward, H8 with Hᵀ8 by the kernel that computes H = GELU(pre) from
the GEMM's output (k_fp8_gelu_cast_t64), dH8 with dHᵀ8 by the one that computes dH from
fc2 dgrad's output times GELU'(pre) (k_fp8_dgelu_cast_t64): the bf16 H and dH are then written
only for a GEMM that may run in bf16. The transposed activations are kept per layer for the
backward's weight gradients, which then need not read X and H again. A GEMM for which cuBLASLt
proposes no FP8 algorithm at some length runs in bf16 at that length (`use`, `notes`).
Validation and text sampling run the bf16 forward: FP8 is how a step computes, not the model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.backends.cuda.gemm import R_8F_E4M3, R_8F_E5M2, time_interleaved
from engine.backends.cuda.launch import blocks
from engine.errors import RunError
from engine.model.fp8 import DELAYED, FP8_GEMMS, HISTORY, AmaxHistory

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


def plan_fp8(plan: Any, n_layer: int, d: int, F: int, R: int) -> None:
    """The FP8 buffers, in the memory plan's "fp8" group: per layer the four weight copies and
    the transposed activations Xᵀ8, Hᵀ8 (made in the forward, read in the backward); one set of
    the other activation and gradient copies (reused layer by layer); the amax words and
    inverse scales."""
    for name in ("w1", "w1t", "w2", "w2t"):
        plan.add("fp8", f"fp8.{name}", n_layer * _slot(d * F))
    for name, n in (("xt", R * d), ("ht", R * F)):
        plan.add("fp8", f"fp8.{name}", n_layer * _slot(n))
    for name, n in (("x", R * d), ("h", R * F), ("dy", R * d), ("dyt", R * d), ("dh", R * F),
                    ("dht", R * F)):
        plan.add("fp8", f"fp8.{name}", n)
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


class Fp8Mlp:
    """The MLP forward and backward of one layer with FP8 GEMMs, on an Ops (its stream, side
    stream and LtGemm)."""

    def __init__(self, ops: Any, drv: Any, plan: Any, n_layer: int, d: int, F: int, act: int,
                 R_max: int) -> None:
        self.o, self.drv, self.L, self.d, self.F, self.act = ops, drv, n_layer, d, F, act
        self.R_max = R_max  # the longest pass's rows (the plan's slots); R below: this pass's
        self.buf = {name: plan[f"fp8.{name}"] for name in
                    ("w1", "w1t", "w2", "w2t", "x", "xt", "h", "ht", "dy", "dyt", "dh", "dht",
                     "amax", "inv", "hist", "next")}
        # False: at full length cuBLASLt had no FP8 algorithm for this GEMM, or the start-up
        # timing found it faster in bf16 (it runs in bf16)
        self.use = dict.fromkeys(GEMMS, True)
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
        return self.buf[name] + layer * _slot(self.d * self.F)

    def _at(self, name: str, layer: int) -> int:
        """Layer `layer`'s transposed activation copy: "x" → Xᵀ8 [d, R], "h" → Hᵀ8 [F, R]
        (R: this pass's rows, in a slot for R_max)."""
        cols = self.d if name == "x" else self.F
        return self.buf[name + "t"] + layer * _slot(self.R_max * cols)

    # --- kernels -------------------------------------------------------------------------------
    def _amax(self, amax: int, x: int, n: int, hist: int, f32: bool = False) -> None:
        """x's amax while it has no history (hist: its history), else nothing (the cast takes
        it as it goes); x an activation tensor, or (f32) a float32 master weight. A block reads
        8 elements a thread per turn and ends with one atomic."""
        self.o._go("k_fp8_amax_f32_delayed" if f32 else "k_fp8_amax_delayed",
                   blocks(-(-n // 8), cap=1024), amax, x, n, hist, HISTORY)

    def _cast_t(self, q: int, qt: int, inv: int, x: int, amax: int, hist: int, rows: int,
                cols: int, fmt: int, f32: bool = False) -> None:
        """qt = FP8 of xᵀ [cols, rows] (q = FP8 of x too, unless 0), scaled from the history
        `hist` (or, while it is empty, from x's amax now), taking x's amax into `amax` as it
        goes; f32: x a float32 master weight. Whole 64 x 64 tiles with 16-byte accesses where
        the shapes and addresses allow, else 32 x 32 tiles of bytes."""
        self.o._writes(*(p for p in (q, qt) if p))
        if rows % 64 == 0 and cols % 64 == 0 and all(p % 16 == 0 for p in (x, q, qt)):
            self.o._go("k_fp8_cast_t64_f32" if f32 else "k_fp8_cast_t64",
                       (cols // 64, rows // 64), q, qt, inv, x, amax, hist, HISTORY, rows, cols,
                       fmt)
            return
        grid = (-(-cols // TILE), -(-rows // TILE))
        self.o._go("k_fp8_cast_t_f32" if f32 else "k_fp8_cast_t", grid, q, qt, inv, x, amax,
                   hist, HISTORY, rows, cols, fmt)

    def _record(self) -> None:
        """The pass's amax of every delayed tensor into the history's next slot (k_fp8_record),
        after the last layer's backward."""
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
        if key not in g.choices and g.plan_imported:
            g.choices[key] = "fp8"  # a plan from before these choices: what its run computed
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
        made layer by layer, `cast_weights`)."""
        self.o.zero32(self.buf["amax"], self.L * len(TENSORS))

    def cast_weights(self, layer: int, w1: int, w2: int) -> None:
        """Layer `layer`'s FP8 copies of W1 and W2 (as stored, and transposed) from the fp32
        masters w1, w2, scaled from their history (the cast taking their amax as it goes; their
        amax pass over the master runs only while a weight has no history): in the layer's
        forward, so that an AdamW update still being applied beside the forward (layer by
        layer) has reached them."""
        d, F = self.d, self.F
        for name, w, rows, cols in (("w1", w1, d, F), ("w2", w2, F, d)):
            amax, inv = self._scale(layer, name)
            hist = self._hist(layer, name)
            self._amax(amax, w, rows * cols, hist, f32=True)
            self._cast_t(self._w(name, layer), self._w(name + "t", layer), inv, w, amax, hist,
                         rows, cols, E4M3, f32=True)

    def forward(self, layer: int, x: int, w1: int, w2: int, pre: int, act: int, out: int,
                R: int) -> None:
        """pre = x·W1, act = GELU(pre), out = act·W2 (x: ln2's output; w1, w2: the bf16
        weights, for a GEMM that falls back)."""
        self._linear_fwd("fc1", layer, x, "x", w1, "w1", pre, self.d, self.F, R)
        cast = self._gelu(layer, pre, act, R)
        self._linear_fwd("fc2", layer, act, "h", w2, "w2", out, self.F, self.d, R,
                         amax_done=True, cast=cast,
                         restore_a=self._restore_act(layer, act, pre, R * self.F))

    def backward(self, layer: int, dout: int, x: int, w1: int, w2: int, pre: int, act: int,
                 dx: int, dw1: int, dw2: int, dpre: int, R: int) -> None:
        """Ops.mlp_bwd's outputs with FP8 GEMMs: dpre, dx, and dW1, dW2 (+= or written, as the
        pass says) from dout = the gradient of the MLP's output."""
        self._linear_bwd("fc2", layer, dout, "dy", act, "h", w2, "w2", dpre, dw2, self.F,
                         self.d, R, restore_a=self._restore_act(layer, act, pre, R * self.F))
        cast, restore = self._dgelu(layer, dpre, pre, R)
        self._linear_bwd("fc1", layer, dpre, "dh", x, "x", w1, "w1", dx, dw1, self.d, self.F,
                         R, amax_done=True, cast=cast, restore_g=restore)
        if layer == 0:  # the pass's last MLP backward: every amax of the pass is known
            self._record()

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
                    restore_g: Any = None) -> None:
        """For out = a·W with g = d out [R, n_out]: dW += aᵀ·g (or written, as the pass says)
        and din = g·Wᵀ [R, n_in], from g's E5M2 copies (as it is and transposed; its amax and
        scale now, amax_done and cast as in _linear_fwd) and a's transposed E4M3 copy (made by
        the forward, with its scale); w: the bf16 weight; restore_a, restore_g: as _linear_fwd's
        restore_a, for a and g."""
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
        self._gemm(f"{fc} wgrad", R,
                   lambda: o._wgrad(dw, aqt, gqt, n_in, n_out, R, (aqt, gqt), tb=True,
                                    types=(R_8F_E4M3, R_8F_E5M2), scales=(ai, gi)),
                   lambda: o._wgrad(dw, a, g, n_in, n_out, R, (g,), ta=True),
                   restore=_in_turn(restore_a, restore_g))
        o._writes(din)
        self._gemm(f"{fc} dgrad", R,
                   lambda: o._mm(din, gq, self._w(wname, layer), R, n_in, n_out, tb=True,
                                 types=(R_8F_E5M2, R_8F_E4M3, self.act), scales=(gi, wi)),
                   lambda: o._mm(din, g, w, R, n_in, n_out, tb=True), restore=restore_g)
