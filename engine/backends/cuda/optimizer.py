"""The end of an optimizer step on the GPU (DESIGN §4) over the flat buffers: the gradient
norm, the clip and the non-finite skip, AdamW, as the fused step runs them (on the device, the
update's values recorded by k_step_clip) and as the host drives them (grad_norm, grad_scale,
adamw: the unfused path). It also keeps the work left deferred on the gradients and weights,
which whatever reads or uses them applies first:
- a gradient scale (clip, 1/n_micro) not yet written into the buffer: grad_norm and adamw apply
  it on the fly, saving a pass over 4·n bytes; anything else settles it (`settle_scale`);
- the layers' weight gradients in grads_lp after a fused bf16 step (`settle_glp`);
- a fused step's AdamW left pending (k_step_clip recorded it): the next step's graph applies it
  layer by layer on the weight-gradient stream while its forward runs, each layer's forward
  waiting for its own range (`apply_update`); anything else applies it first
  (`settle_update`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from engine.backends.cuda.buffers import HP_FIELDS, BatchBuffers, NormRanges
from engine.backends.cuda.flat_buffers import FlatBuffers
from engine.backends.cuda.memory import Plan
from engine.backends.cuda.optim_ops import NORM_RANGE_BLOCKS


def hyper_parameters(grad_mult: float, lr: float, beta1: float, beta2: float, eps: float,
                     weight_decay: float, t: int, max_norm: float, behind: bool = False
                     ) -> dict[str, float]:
    """HP_FIELDS' values. behind: queued behind a step not yet ended, which t - 1 assumes
    applied (bc*_alt: Adam's step t - 1, for when it was skipped)."""
    alt = max(t - 1, 1)
    return {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps,
            "weight_decay": weight_decay, "bc1": 1.0 - beta1**t, "bc2": 1.0 - beta2**t,
            "grad_mult": grad_mult, "max_norm": max_norm, "bc1_alt": 1.0 - beta1**alt,
            "bc2_alt": 1.0 - beta2**alt, "alt_if_skipped": 1.0 if behind else 0.0}


class DeviceOptimizer:
    """Norm, clip and AdamW over FlatBuffers with Ops, and the deferred work (module doc).
    `run(key, issue)` runs work through a captured graph (GraphCache.run); `train`: the
    training buffers, whose io block holds the fused step's staged hyper-parameters."""

    def __init__(self, ops: Any, flat: FlatBuffers, plan: Plan, norm: NormRanges,
                 update_ranges: list[tuple[int, int]], train: BatchBuffers,
                 run: Callable[[tuple[Any, ...], Callable[[], None]], None], drv: Any,
                 stream: Any, fusions: bool) -> None:
        self.o, self.flat, self.plan, self.norm = ops, flat, plan, norm
        self.update_ranges, self.train, self.run = update_ranges, train, run
        self.drv, self.stream, self.fusions = drv, stream, fusions
        self.pending_scale = 1.0
        # the gradients of GRAD_LP_TENSORS are in grads_lp, not in grads (after a step that
        # wrote them so, until `settle_glp`)
        self.glp_live = False
        self.update_pending = False  # a fused step left its AdamW to the next step's graph
        self.h_norm = drv.pagelocked_zeros(2, np.float32)  # norm, clip

    # --- the fused step's end ------------------------------------------------------------------
    def norm_ranges(self, first: int, count: int, side: bool = False, gs: float = 1.0,
                    staged: bool = True, lp: bool = False) -> None:
        """The gradient norm's partials of its ranges first .. first + count - 1 (buffers.
        norm_ranges: the update's, embeddings then each layer, cut where the kind changes),
        scaled by the training buffers' staged grad_mult (staged) or by gs; lp: the layers'
        weight gradients read from grads_lp."""
        gm = self.train.io()["hp"] + 4 * HP_FIELDS.index("grad_mult") if staged else 0
        glp = {"grads_lp": self.flat.glp, "kinds": self.plan["norm_kinds"]} if lp else {}
        self.o.grad_norm_ranges(self.flat.g, self.plan["norm_cuts"], first, count,
                                self.plan["norm_partials"], gs=gs, gs_dev=gm, side=side, **glp)

    def norm_final(self) -> None:
        self.o.grad_norm_final(self.plan["norm_partials"], self.plan["norm"],
                               NORM_RANGE_BLOCKS * len(self.norm))

    def tail(self, b: BatchBuffers, apply: bool = True, partials: bool = True,
             lp: bool = False) -> None:
        """grads·grad_mult → norm → clip (or skip) → AdamW, reading the hyper-parameters staged
        in b's io block; the norm and the clip factor stay in the plan's `norm` and `clip`, and
        the update's values in `update`. apply False: the update is left pending. partials
        False: the norm's partials are already there (the backward queued them). lp: the
        layers' weight gradients are in grads_lp."""
        plan = self.plan
        if partials:
            self.norm_ranges(0, len(self.norm), lp=lp)
        self.norm_final()
        self.o.step_clip(plan["update"], b.io()["hp"], plan["norm"], plan["clip"],
                         plan["skipped"])
        if apply:
            self.adamw_range(0, self.flat.n, lp=lp)

    def adamw_range(self, begin: int, end: int, stream: Any = None, lp: bool = False) -> None:
        """The step's AdamW (k_step_clip's record) over [begin, end); lp: the layers' weight
        gradients read from grads_lp."""
        f, plan = self.flat, self.plan
        glp = {"grads_lp": f.glp, "seg_glp": plan["seg_glp"]} if lp else {}
        self.o.adamw_step(f.p, f.params_lp_or_zero(), f.g, f.m, f.v, plan["seg_start"],
                          plan["seg_decay"], f.nseg, begin, end, plan["update"], stream=stream,
                          **f.lp_rows(), **glp)

    def apply_update(self, beside: bool) -> Callable[[int], None] | None:
        """Queue the pending update (k_step_clip's record). beside: the layers' ranges on the
        weight-gradient stream, returning the `ready` of Network.forward (layer l's forward
        waits for its range); else one launch on the main stream. Same bits either way."""
        o, lp = self.o, self.glp_live  # where the pending step left its gradients
        if not beside or o.side is None:
            self.adamw_range(0, self.flat.n, lp=lp)
            return None
        o._to_side()
        done = []
        for begin, end in self.update_ranges[1:]:
            self.adamw_range(begin, end, stream=o.side, lp=lp)
            ev = o._event()
            ev.record(o.side)
            done.append(ev)
        self.adamw_range(*self.update_ranges[0], lp=lp)  # the embeddings, read first
        return lambda l: self.stream.wait_for_event(done[min(l, len(done) - 1)])

    # --- the deferred work ---------------------------------------------------------------------
    def settle_update(self) -> None:
        """Apply a step's pending update now (before the state is read or used)."""
        if self.update_pending:
            self.run(("update", self.glp_live), lambda: self.apply_update(beside=False))
            self.update_pending = False

    def settle_glp(self) -> None:
        """The layers' weight gradients a step left in grads_lp written into the float32
        buffer (exact), before anything else reads or adds to it: read_grads, the host-driven
        norm and AdamW, accumulation, an all-reduce see the very gradients the step used.
        After `settle_update` (the update pending reads grads_lp)."""
        if self.glp_live:
            self.o.grads_from_lp(self.flat.g, self.flat.glp, self.plan["norm_cuts"],
                                 self.plan["norm_kinds"], len(self.norm))
            self.glp_live = False

    def settle_scale(self) -> None:
        """The pending gradient scale written into the buffer."""
        if self.pending_scale != 1.0:
            self.o.grad_scale(self.flat.g, self.flat.n, self.pending_scale)
            self.pending_scale = 1.0

    def settle(self) -> None:
        """All of it: the gradients and weights as the calls so far left them."""
        self.settle_update()
        self.settle_glp()
        self.settle_scale()

    # --- the host-driven step ------------------------------------------------------------------
    def zero_grads(self) -> None:
        self.settle_update()
        self.drv.memset_d32_async(self.flat.g, 0, self.flat.n, self.stream)
        self.pending_scale = 1.0
        self.glp_live = False

    def grad_scale(self, s: float) -> None:
        """grads *= s, deferred: the next grad_norm or adamw multiplies as it reads, rounding
        g·s to float exactly as a separate pass would have stored it (same bits). A second
        scale while one is pending settles the first, so s1 then s2 stays fl(fl(g·s1)·s2)."""
        self.settle_update()
        self.settle_glp()
        if float(s) == 1.0:
            return
        self.settle_scale()
        self.pending_scale = float(s)

    def grad_norm(self) -> float:
        self.settle_update()
        self.settle_glp()
        partials, norm = self.plan["norm_partials"], self.plan["norm"]
        if self.fusions:
            self.norm_ranges(0, len(self.norm), gs=self.pending_scale, staged=False)
            self.norm_final()
        else:
            self.o.grad_norm_partial(self.flat.g, self.flat.n, partials, self.pending_scale)
            self.o.grad_norm_final(partials, norm)
        return self.read_norm()[0]

    def adamw(self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              t: int) -> None:
        self.settle_update()
        self.settle_glp()
        f, plan = self.flat, self.plan
        self.o.adamw(f.p, f.params_lp_or_zero(), f.g, f.m, f.v, plan["seg_start"],
                     plan["seg_decay"], f.nseg, f.n, float(lr), float(beta1), float(beta2),
                     float(eps), float(weight_decay), int(t), self.pending_scale, **f.lp_rows())

    def read_norm(self, clip: bool = False) -> tuple[float, float]:
        """(the norm, the clip factor: 1.0 unless `clip`) the last norm left on the device,
        waited for."""
        self.drv.memcpy_dtoh_async(self.h_norm[:1], self.plan["norm"], self.stream)
        if clip:
            self.drv.memcpy_dtoh_async(self.h_norm[1:], self.plan["clip"], self.stream)
        self.stream.synchronize()
        return float(self.h_norm[0]), (float(self.h_norm[1]) if clip else 1.0)
