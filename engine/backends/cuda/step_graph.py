"""The work a CudaBackend queues per call, captured once per shape as CUDA graphs (graphs.py)
and replayed, so a step costs a few host copies and one graph launch: the fused optimizer step
(zero, forward, backward, gradient norm, clip, non-finite skip and AdamW in one graph with one
host read, the AdamW left to the next step's graph beside its forward), the unfused forward +
backward, the evaluation forward, the optimizer's end on accumulated gradients. Up to
STEP_SLOTS fused steps may be queued, each with its own page-locked slot."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import numpy as np

from engine.backends.base import StepOutcome
from engine.backends.cuda import graphs
from engine.backends.cuda.buffers import HP_FIELDS
from engine.backends.cuda.build import CudaBuild
from engine.backends.cuda.network import Network
from engine.backends.cuda.optimizer import DeviceOptimizer, hyper_parameters
from engine.backends.cuda.staging import Staging
from engine.errors import RunError

STEP_SLOTS = 2  # fused steps that can be queued at once (launch_step before step_result)


class GraphCache:
    """Work issued through a graph captured on first use per key (kind, T, and for a step
    whether an update is pending before it and left pending after it), or issued directly
    where graphs are off (ANDREA_CUDA_GRAPHS=0, ANDREA_CUDA_SYNC=1)."""

    def __init__(self, gpu: Any, stream: Any, precision: str, notes: list[str],
                 use_graphs: bool) -> None:
        self.gpu, self.stream, self.precision, self.notes = gpu, stream, precision, notes
        self.use_graphs = use_graphs
        self.graphs: dict[tuple[Any, ...], graphs.CudaGraph] = {}
        # the captured graphs' memset nodes (cuDNN's, cuBLASLt's) as k_fill kernel nodes
        # (graphs.py; the same bytes), unless the fill kernel does not load
        self.memset_kernels = True

    def run(self, key: tuple[Any, ...], issue: Callable[[], None]) -> None:
        if not self.use_graphs:
            issue()
            return
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self.capture(issue)
        graph.launch()

    def capture(self, issue: Callable[[], None]) -> graphs.CudaGraph:
        """The work issue() queues, captured as the step's graphs are (its memset nodes as
        k_fill kernel nodes where the fill kernel loads); the caller owns the graph."""
        fill = None
        if self.memset_kernels:
            try:
                fill = graphs.FillKernel.of(str(self.gpu.cubin(self.precision, "fill")))
            except RunError as e:  # the graphs keep their memset nodes
                self.memset_kernels = False
                self.notes.append(f"the graphs' memset nodes stay memsets: {e}")
        graph = graphs.capture(self.stream.handle, issue, fill)
        if graph.fill_note and graph.fill_note not in self.notes:
            self.notes.append(graph.fill_note)
        return graph

    def latest(self, kind: str) -> graphs.CudaGraph | None:
        """The graph of `kind` at the longest sequence length captured so far."""
        keys = sorted(k for k in self.graphs if k[0] == kind)
        return self.graphs[keys[-1]] if keys else None

    def close(self) -> None:
        for g in self.graphs.values():
            g.close()
        self.graphs.clear()


class StepGraph:
    """The calls that run passes: the fused step (`prepare_step`, `launch_step`,
    `step_result`, `optimizer_step`) and `forward_backward`, `forward_loss`, `logits_last`."""

    def __init__(self, build: CudaBuild, net: Network, optim: DeviceOptimizer,
                 graph_cache: GraphCache, staging: Staging) -> None:
        self.build, self.net, self.optim, self.graphs = build, net, optim, graph_cache
        self.staging = staging
        self.ops, self.flat, self.train = build.ops, build.flat, build.train
        self.drv, self.stream = build.drv, build.stream
        # A fused step may leave its AdamW update pending (DeviceOptimizer), applied beside the
        # next step's forward layer by layer (not in data-parallel steps)
        self.defer_update = build.fused_step
        self.comm: Any = None  # the data-parallel step's all-reduce stream
        # the fused step's slots (prepare_step): page-locked io block and results [R + 2] (row
        # losses, norm, clip) and an event after the copies; the steps queued (slot, T), oldest
        # first; the slot staged next
        drv = self.drv
        self.h_step = [drv.pagelocked_zeros(self.train.io_words, np.int32)
                       for _ in range(STEP_SLOTS)]
        self.h_res = [drv.pagelocked_zeros(self.train.R + 2, np.float32)
                      for _ in range(STEP_SLOTS)]
        self._done = [drv.Event(drv.event_flags.DISABLE_TIMING) for _ in range(STEP_SLOTS)]
        self._queued: collections.deque[tuple[int, int]] = collections.deque()
        self._prepared: tuple[int, int] | None = None  # (slot, T)

    # --- the fused step ------------------------------------------------------------------------
    def prepare_step(self, inputs: np.ndarray, targets: np.ndarray) -> None:
        """The host's share of the next `launch_step(None, None, ...)`: the tokens checked and
        staged with their embedding-gradient buckets, while steps before may still run on the
        device. Each queued step has its own page-locked slot (its io block, sent from there,
        and its results, copied back there); this stages into a slot no queued step holds."""
        x, y = self.staging.xy(inputs, targets)
        busy = {slot for slot, _ in self._queued}
        free = [s for s in range(STEP_SLOTS) if s not in busy]
        if not free:
            raise RunError(f"prepare_step(): {STEP_SLOTS} steps queued; step_result() first")
        slot = free[0]
        T = self.train.stage(self.h_step[slot], x, y, 1.0)
        self._prepared = (slot, T)

    def launch_step(self, inputs: np.ndarray | None, targets: np.ndarray | None, *,
                    loss_scale: float, grad_mult: float, lr: float, beta1: float,
                    beta2: float, eps: float, weight_decay: float, t: int, max_norm: float,
                    reducer: Any = None) -> None:
        """One whole optimizer step of DESIGN §4 for one micro-batch, in one captured graph,
        queued and not waited for (CudaBackend.launch_step says what it computes)."""
        if not self.build.fused_step:
            raise RunError("train_step needs the fused step (fusions on)")
        if t < 1:
            raise ValueError(f"train_step: t is the 1-based Adam step, got {t}")
        if len(self._queued) >= STEP_SLOTS:
            raise RunError(f"launch_step(): {STEP_SLOTS} steps queued; step_result() first")
        if inputs is not None:
            self.prepare_step(inputs, targets)
        elif self._prepared is None:
            raise RunError("launch_step(None, None, ...) without prepare_step()")
        (slot, T), self._prepared = self._prepared, None
        b, h, optim = self.train, self.h_step[slot], self.optim
        b.stage_scale(h, loss_scale, b.B * T)
        # A step queued behind another guesses that one applies its update (Adam's t); the
        # device corrects the guess when it was skipped (k_step_hp)
        b.stage_hp(h, hyper_parameters(grad_mult, lr, beta1, beta2, eps, weight_decay, t,
                                       max_norm, behind=bool(self._queued)))
        self.drv.memcpy_htod_async(b.at("io"), h, self.stream)
        optim.pending_scale = 1.0  # the step zeroes the gradients first
        # At full length every parameter's gradient is written by this micro-batch (GEMMs with
        # beta 0, the LayerNorm and position sums stored): no zeroing pass over the 4·n bytes.
        # A shorter sequence leaves position rows unwritten: zero, then add, as usual.
        write = T == self.build.S
        # ... and with grads_lp, on one rank, the layers' weight gradients into grads_lp
        lp = self.build.grads_lp and write and reducer is None
        if reducer is not None or not write:
            # the gradients are summed eagerly before a data-parallel capture, or zeroed first:
            # the update still pending (it reads them) goes before, on its own
            optim.settle_update()
            optim.glp_live = False  # float32 gradients, written or zeroed whole by this step
        pending = optim.update_pending  # the step ahead left its update to this graph
        # (a deferred update is a step's with `write` on one rank: its gradients' kind is lp's)
        assert not pending or optim.glp_live == lp
        defer = self.defer_update and reducer is None and write
        key = ("step" if reducer is None else "step-ddp", T, pending, defer, lp)
        if reducer is not None:
            self._ready_to_reduce(reducer, key)
        self.graphs.run(key, lambda: self._issue_step(T, write, lp, pending, defer, reducer))
        optim.glp_live = lp
        optim.update_pending = defer
        self._copy_results(self.h_res[slot], T)
        self._done[slot].record(self.stream)
        self._queued.append((slot, T))

    def _issue_step(self, T: int, write: bool, lp: bool, pending: bool, defer: bool,
                    reducer: Any) -> None:
        """The step's work on the streams (captured once per key by launch_step)."""
        o, b, optim, flat = self.ops, self.train, self.optim, self.flat
        buckets = flat.grad_buckets()
        L = self.build.shapes.n_layer

        def reduce_bucket(i: int) -> None:
            first, count = buckets[i]
            o.fork_to(self.comm)
            reducer.all_reduce_sum(flat.g + 4 * first, count, self.comm)

        def norm_range(i: int) -> None:  # bucket i complete: its range's share of the norm
            # (beside the backward, after the side's gradient work)
            optim.norm_ranges(*optim.norm.groups[L - i if i < L else 0], side=True, lp=lp)

        o.step_hp(b.io()["hp"], self.build.plan["skipped"])
        o.begin_pass()
        # the pending update beside the forward needs the gradients it reads left alone until
        # the backward (written, not zeroed first)
        ready = optim.apply_update(beside=write) if pending else None
        if pending and not self.graphs.use_graphs:
            optim.update_pending = False  # applied now: a failure below must not repeat it
        if not write:
            self.drv.memset_d32_async(flat.g, 0, flat.n, self.stream)
        o.overwrite_grads, o.wgrad_lp = write, lp
        try:
            self.net.forward(b, T, loss=True, train=True, ready=ready)
            # the gradient norm's partials as the backward completes each range, beside it;
            # data parallel: after the all-reduce, at the end
            self.net.backward(b, T, reduce_bucket if reducer is not None else norm_range)
        finally:
            o.overwrite_grads = o.wgrad_lp = False
        o.join()
        if reducer is not None:
            o.wait_for(self.comm)
        optim.tail(b, apply=not defer, partials=reducer is not None, lp=lp)

    def _ready_to_reduce(self, reducer: Any, key: tuple[Any, ...]) -> None:
        """Before the data-parallel step's graph is captured: the all-reduce stream, events for
        its forks, and the very all-reduces the graph will hold run once eagerly (NCCL connects
        its channels, per algorithm, on first use, which must not happen under capture; the
        gradients they sum are then overwritten or zeroed by the step)."""
        if self.comm is None:
            self.comm = self.drv.Stream(flags=1)
            graphs.set_stream_priority(self.comm.handle, self.build.gpu.stream_priorities[1])
            self.ops.reserve_events(16 * self.build.shapes.n_layer + 32)
        if key not in self.graphs.graphs and self.graphs.use_graphs:
            self.stream.synchronize()
            for first, count in self.flat.grad_buckets():
                reducer.all_reduce_sum(self.flat.g + 4 * first, count, self.comm)
            self.comm.synchronize()

    def _copy_results(self, h: np.ndarray, T: int) -> None:
        """Queue the copies of a step's row losses, norm and clip factor into h [R + 2]."""
        R = self.train.B * T
        plan = self.build.plan
        self.drv.memcpy_dtoh_async(h[:R], self.train.at("losses"), self.stream)
        self.drv.memcpy_dtoh_async(h[R : R + 1], plan["norm"], self.stream)
        self.drv.memcpy_dtoh_async(h[R + 1 : R + 2], plan["clip"], self.stream)

    @property
    def queued_steps(self) -> int:
        """Steps `launch_step` queued that `step_result` has not returned yet."""
        return len(self._queued)

    def step_result(self) -> StepOutcome:
        """Wait for the oldest step `launch_step` queued (not for any queued after it)."""
        if not self._queued:
            raise RunError("step_result() without launch_step()")
        slot, T = self._queued.popleft()
        self._done[slot].synchronize()
        h, R = self.h_res[slot], self.train.B * T
        rows = h[:R].reshape(T, self.train.B).astype(np.float64).mean(axis=0)
        return StepOutcome(rows, float(h[R]), float(h[R + 1]))

    def optimizer_step(self, *, grad_mult: float, lr: float, beta1: float, beta2: float,
                       eps: float, weight_decay: float, t: int, max_norm: float
                       ) -> tuple[float, float]:
        """The end of the fused step on the gradients accumulated since `zero_grads`
        (CudaBackend.optimizer_step says what it computes): (the norm, the clip factor)."""
        if not self.build.fused_step:
            raise RunError("optimizer_step needs the fused step (fusions on)")
        if t < 1:
            raise ValueError(f"optimizer_step: t is the 1-based Adam step, got {t}")
        b = self.train
        self.optim.settle()
        h = self.staging.h_io[b.p]
        b.stage_hp(h, hyper_parameters(grad_mult, lr, beta1, beta2, eps, weight_decay, t,
                                       max_norm))
        at, n = b.io_fields["hp"], len(HP_FIELDS)
        self.drv.memcpy_htod_async(b.at("io") + 4 * at, h[at : at + n], self.stream)
        self.graphs.run(("opt", 0), lambda: self.optim.tail(b))
        return self.optim.read_norm(clip=True)

    # --- the other passes ----------------------------------------------------------------------
    def forward_backward(self, inputs: np.ndarray, targets: np.ndarray, loss_scale: float,
                         separate: bool) -> np.ndarray:
        """base.Backend.forward_backward."""
        optim, flat = self.optim, self.flat
        optim.settle_update()
        optim.settle_glp()  # the float32 buffer whole before it is added to
        if not separate:
            return self._forward_backward(inputs, targets, loss_scale)
        # This micro-batch's gradient on its own, then one add (see the interface).
        if not self.build.separate_micro:
            raise RunError("separate micro-batch gradients need separate_micro=True")
        optim.settle_scale()
        save = self.build.plan["grads_save"]
        self.drv.memcpy_dtod_async(save, flat.g, flat.n * 4, self.stream)
        self.drv.memset_d32_async(flat.g, 0, flat.n, self.stream)
        rows = self._forward_backward(inputs, targets, loss_scale)
        self.ops.grad_add(flat.g, save, flat.n)
        return rows

    def _forward_backward(self, inputs: np.ndarray, targets: np.ndarray,
                          loss_scale: float) -> np.ndarray:
        b = self.train
        x, y = self.staging.xy(inputs, targets)
        T = self.staging.stage(b, x, y, loss_scale)

        def issue() -> None:
            self.ops.begin_pass()
            self.net.forward(b, T, loss=True, train=True)
            self.net.backward(b, T)
            self.ops.join()

        self.optim.settle_scale()  # accumulating onto scaled gradients
        self.graphs.run(("fb", T), issue)
        return self.staging.row_means(b, T)

    def forward_loss(self, inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """base.Backend.forward_loss."""
        self.optim.settle_update()
        b = self.train
        x, y = self.staging.xy(inputs, targets)
        T = self.staging.stage(b, x, y, 1.0)
        self.graphs.run(("f", T), lambda: self.net.forward(b, T, loss=True))
        return self.staging.row_means(b, T)

    def logits_last(self, tokens: np.ndarray) -> np.ndarray:
        """base.Backend.logits_last."""
        self.optim.settle_update()
        b = self.build.sample
        x = self.staging.check_tokens(np.asarray(tokens).reshape(1, -1), "tokens", 1)
        T = self.staging.stage(b, x, None, 1.0)
        self.ops.begin_pass()
        self.net.forward(b, T, loss=False)  # own buffers; no graph: every prompt length differs
        self.net.last_logits(b, T)
        return self.staging.logits(b, self.build.shapes.vocab_size)
