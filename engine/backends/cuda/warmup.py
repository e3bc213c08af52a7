"""The start-up pass of a CudaBackend, before any graph is captured: one eager forward +
backward at full length and a sampling forward. cuDNN's first execution of each graph does host
set-up that must not happen under graph capture, and with `tune` every GEMM's algorithm is
chosen by timing (on random weights: timing on zeros is not representative), and in fp8 each
FP8 GEMM's FP8 against bf16 and whether FP8 pays at this size (fp8_pays.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from engine.backends.cuda import fp8_pays
from engine.backends.cuda.build import CudaBuild
from engine.backends.cuda.network import Network
from engine.backends.cuda.staging import Staging
from engine.backends.cuda.state_io import StateIO
from engine.model.layout import init_params


def warm_up(build: CudaBuild, net: Network, staging: Staging, state: StateIO, tune: bool,
            capture: Callable[[Callable[[], None]], Any] | None) -> None:
    """The pass, then what it decided in build.notes. The caller zeroes the state after.
    capture: captures work as the step's CUDA graphs are (GraphCache.capture), None where the
    step runs without graphs; FP8's start-up timing times each path as the step runs it."""
    drv, ops, gemm, stream = build.drv, build.ops, build.gemm, build.stream

    def time_ms(fn: Callable[[], None]) -> float:
        """GPU time of one fn() on the stream (CUDA events); gemm.time_interleaved repeats it."""
        e0, e1 = drv.Event(), drv.Event()
        e0.record(stream)
        fn()
        e1.record(stream)
        e1.synchronize()
        return e1.time_since(e0)

    if tune:
        drv.memcpy_htod(build.flat.p, init_params(build.shapes, seed=12345))
        drv.Context.synchronize()
        state.params_to_lp()
    rng = np.random.default_rng(0)
    tok = rng.integers(0, build.shapes.vocab_size, (build.B, build.S + 1)).astype(np.int32)
    b = build.train
    T = staging.stage(b, tok[:, :-1], tok[:, 1:], 1.0)
    side = ops.side
    if gemm is not None:
        gemm.tuning = tune
        gemm.timer = time_ms  # only while tuning (no reference cycle after)
        ops.side = None  # timed on the main stream (the choice holds for both)
    try:
        ops.begin_pass()
        # as train_step runs at full length (the weight-gradient GEMMs with beta 0): those
        # are the problems to time
        ops.overwrite_grads = build.fused_step
        ops.wgrad_lp = ops.overwrite_grads and build.grads_lp
        net.forward(b, T, loss=True, train=True)
        net.backward(b, T)
        if ops.wgrad_lp and tune:  # a data-parallel step's float32 weight gradients
            ops.wgrad_lp = False
            net.backward(b, T)
        ops.overwrite_grads = ops.wgrad_lp = False
        if build.fp8_ops is not None and tune:  # whether FP8 pays here: said at start
            # the weight gradients' GEMMs as the step's (written, in bf16 where it keeps them)
            ops.overwrite_grads = build.fused_step
            ops.wgrad_lp = ops.overwrite_grads and build.grads_lp
            build.notes.append(fp8_pays.measure(build.fp8_ops, net, b, T, time_ms, capture))
            ops.overwrite_grads = ops.wgrad_lp = False
        ops.join()
        s = build.sample
        Ts = staging.stage(s, tok[:1, :-1], None, 1.0)
        net.forward(s, Ts, loss=False)
        stream.synchronize()
    finally:
        ops.side = side
        ops.overwrite_grads = ops.wgrad_lp = False
        if gemm is not None:
            gemm.tuning = False
            gemm.timer = None
    _say(build)


def _say(build: CudaBuild) -> None:
    """What the pass decided, in the notes: FP8 GEMMs that fell back, GEMM warnings, timing."""
    if build.fp8_ops is not None:
        build.notes.extend(build.fp8_ops.notes)
    if build.gemm is not None:
        build.notes.extend(build.gemm.warnings)
        timed, best, first = build.gemm.timing_summary()
        if timed:
            build.notes.append(f"GEMMs: {timed} problems timed ({best:.3f} ms with the "
                               f"fastest candidates, {first:.3f} ms with cuBLASLt's first "
                               f"choices, once each)")
