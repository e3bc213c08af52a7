"""The optimizer's kernels (DESIGN §4) on the flat float32 buffers: the gradient norm (in
one pass, or range by range as the fused step's backward completes the ranges), the scale and
the add, AdamW (host-driven, or over ranges as k_step_clip decided it on the device), and the
GEMM copy of the weights. DeviceOptimizer (optimizer.py) drives them.
"""

from __future__ import annotations

from typing import Any

from engine.backends.cuda.launch import Launcher, blocks

NORM_BLOCKS = 1024
NORM_RANGE_BLOCKS = 256  # k_grad_norm_ranges' blocks per range (its partials: this many a range)


class OptimizerOps(Launcher):
    """The optimizer's kernels, launched as Launcher launches."""

    def grad_norm_partial(self, grads: int, n: int, partials: int, gs: float = 1.0) -> None:
        """gs: a pending gradient scale, applied on the fly (see DeviceOptimizer.grad_scale)."""
        self._go("k_grad_norm_partial", NORM_BLOCKS, partials, grads, n, gs)

    def grad_norm_final(self, partials: int, norm: int, n: int = NORM_BLOCKS) -> None:
        """norm = sqrt of the sum of the n partials, in their order."""
        self._go("k_grad_norm_final", 1, norm, partials, n)

    def grad_norm_ranges(self, grads: int, cuts: int, first: int, count: int, partials: int,
                         gs: float = 1.0, gs_dev: int = 0, side: bool = False, *,
                         grads_lp: int = 0, kinds: int = 0) -> None:
        """The partials of ranges first .. first + count - 1 of the device table cuts (int64
        [ranges + 1], float4-aligned begins) into partials[r·NORM_RANGE_BLOCKS ...], for
        grad_norm_final over all of them once every range is in. gs_dev: a device float
        holding the gradient scale instead of gs (0: use gs). side: on the weight-gradient
        stream after everything queued so far on the main one (a range the backward has just
        completed), when there is one. grads_lp, kinds: the compute-precision gradients and the
        device table (int32 [ranges]) of the ranges read from there (0: all from grads)."""
        if bool(grads_lp) != bool(kinds):
            raise ValueError("grad_norm_ranges: grads_lp and kinds go together")
        stream = self._to_side() if side and self.side is not None else None
        self._go("k_grad_norm_ranges", (NORM_RANGE_BLOCKS, count), partials, grads, grads_lp,
                 cuts, kinds, first, gs, gs_dev, stream=stream)

    def grads_from_lp(self, grads: int, grads_lp: int, cuts: int, kinds: int,
                      count: int) -> None:
        """grads[i] = grads_lp[i] over the ranges 0 .. count - 1 of the norm's table whose kind
        is 1 (k_grads_from_lp): the fused bf16 step's weight gradients back in float32."""
        self._go("k_grads_from_lp", (NORM_RANGE_BLOCKS, count), grads, grads_lp, cuts, kinds, 0)

    def grad_scale(self, grads: int, n: int, s: float) -> None:
        self._go("k_grad_scale", blocks(n), grads, n, s)

    def grad_add(self, grads: int, other: int, n: int) -> None:
        """grads += other (a micro-batch's own gradient into the sum)."""
        self._go("k_grad_add", blocks(n), grads, other, n)

    @staticmethod
    def _check_lp_rows(seg_qkv: int, d: int) -> None:
        if seg_qkv and not 0 < d * d < 2**31:
            raise ValueError(f"seg_qkv needs the model width d (0 < d² < 2^31), got d={d}")

    def _check_lp(self, params_lp: int, seg_qkv: int, d: int, grads_lp: int = 0,
                  seg_glp: int = 0) -> None:
        """AdamW's arguments for the low-precision copies: seg_qkv's d, params_lp and grads_lp
        aligned for the kernel's 4-wide stores and loads (optim.cu store_lp, load4: 4 elements,
        8 or 16 bytes), grads_lp with its table and the copy it belongs beside."""
        self._check_lp_rows(seg_qkv, d)
        if bool(grads_lp) != bool(seg_glp) or (grads_lp and not params_lp):
            raise ValueError("AdamW: grads_lp needs seg_glp and params_lp (the bf16 step's)")
        for name, ptr in (("params_lp", params_lp), ("grads_lp", grads_lp)):
            if ptr % (4 * self.esize):
                raise ValueError(f"{name} {ptr:#x} is not aligned to {4 * self.esize} bytes "
                                 f"(AdamW stores and loads 4 elements at a time)")

    def adamw(self, params: int, params_lp: int, grads: int, m: int, v: int, seg_start: int,
              seg_decay: int, nseg: int, n: int, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, t: int, gs: float = 1.0, *, seg_qkv: int = 0,
              d: int = 0, grads_lp: int = 0, seg_glp: int = 0) -> None:
        """gs: a pending gradient scale (the clip), folded into the update. seg_qkv: the device
        table (int32 per tensor, buffers.qkv_seg_table) of the tensors that params_lp keeps in
        rows, with d the model width (0: params_lp in the flat layout, as params). grads_lp,
        seg_glp: the compute-precision gradients and the device table (int32 per tensor,
        buffers.grads_lp_table) of the tensors whose gradient is read from there (0: none)."""
        self._check_lp(params_lp, seg_qkv, d, grads_lp, seg_glp)
        bc1, bc2 = 1.0 - beta1**t, 1.0 - beta2**t
        self._go("k_adamw", blocks(-(-n // 4), cap=2048), params, params_lp, grads, grads_lp,
                 m, v, seg_start, seg_decay, seg_qkv, seg_glp, nseg, d, n, lr, beta1, beta2,
                 eps, weight_decay, bc1, bc2, gs)

    def step_clip(self, upd: int, hp: int, norm: int, clip: int, skipped: int) -> None:
        """The step's clip factor (clip[0]) and non-finite skip (skipped[0]) from the norm of
        grad_norm, and into upd (buffers.UPD_WORDS floats) everything its update reads: hp
        (buffers.HP_FIELDS) included, so that the update may run after the io block is
        restaged (k_step_clip)."""
        self._go("k_step_clip", 1, upd, hp, norm, clip, skipped)

    def adamw_step(self, params: int, params_lp: int, grads: int, m: int, v: int,
                   seg_start: int, seg_decay: int, nseg: int, begin: int, end: int, upd: int,
                   stream: Any = None, *, seg_qkv: int = 0, d: int = 0, grads_lp: int = 0,
                   seg_glp: int = 0) -> None:
        """adamw over elements [begin, end) (begin a multiple of 4) as step_clip decided it
        (nothing when the step is skipped); the same bits whichever ranges a step is split
        into. seg_qkv, d, grads_lp, seg_glp: as in adamw."""
        assert begin % 4 == 0, f"adamw_step: begin {begin} is not a multiple of 4 (float4 groups)"
        self._check_lp(params_lp, seg_qkv, d, grads_lp, seg_glp)
        self._go("k_adamw_step", blocks(-(-(end - begin) // 4), cap=2048), params, params_lp,
                 grads, grads_lp, m, v, seg_start, seg_decay, seg_qkv, seg_glp, nseg, d, begin,
                 end, upd, stream=stream)

    def step_hp(self, hp: int, skipped: int) -> None:
        """The bias corrections of hp as Adam's step count stands (k_step_hp)."""
        self._go("k_step_hp", 1, hp, skipped)

    def params_to_lp(self, params_lp: int, params: int, n: int, *, seg_start: int = 0,
                     seg_qkv: int = 0, nseg: int = 0, d: int = 0) -> None:
        """params_lp = params rounded to the compute precision; with seg_qkv (and the tensor
        table seg_start, nseg, and d, as in adamw) the tensors it names in rows."""
        self._check_lp_rows(seg_qkv, d)
        if seg_qkv and not (seg_start and nseg):
            raise ValueError("params_to_lp: seg_qkv needs the tensor table (seg_start, nseg)")
        self._go("k_params_to_lp", blocks(n), params_lp, params, n, seg_start, seg_qkv, nseg, d)
