"""Whether FP8 pays at this model's size (train/precision "fp8"), measured at start.

With the GEMMs timed at start (gpu.gemm_tune), after the start-up pass, where the GEMMs are
long enough to time (fp8.MIN_CHOICE_MS): one layer's linear maps (QKV, the output projection,
the MLP) forward and backward on the FP8 paths (Fp8QkvRows, Fp8AttnOut, Fp8MlpPath: the layer's
weight copies, the casts, the transposes and the GEMMs as each was chosen,
fp8.Fp8Gemms._choose) against the same on the bf16 paths, timed in turn on the pass's own
buffers, each captured as a CUDA graph and replayed, as the step runs it.
Launched one by one from the host, the FP8 path's extra kernels (its casts, the no-op amax
passes) would each add the host's launch time to its figure where its kernels are short: at
d 1024 that timing called FP8 the slower while the step in its graph was the faster
(docs/gpu.md, the larger configs). The backend's notes (engine.log at start) then say both
times, each GEMM's time in FP8 and in bf16, and, where FP8 is not the faster, that it does not
pay here and runs as asked. Nothing of this changes what runs: the per-GEMM choices do that,
and they are in the GEMM plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.backends.cuda.fp8 import MIN_CHOICE_MS
from engine.backends.cuda.gemm import time_interleaved
from engine.errors import RunError

PASS_MIN_MS = 12 * MIN_CHOICE_MS  # a layer's linear maps are twelve GEMMs and their kernels


def layer_pass(qkv: Any, proj: Any, mlp: Any, net: Any, b: Any, T: int) -> Callable[[], None]:
    """Layer 0's linear maps forward and backward on the paths `qkv`, `proj`, `mlp` (the
    Network's bf16 ones, or its training pass's FP8 ones), on the training buffers `b` as the
    start-up pass left them, the weight gradients written where the Ops says (as the step
    writes them; the gradients are zeroed after the start-up)."""
    w, a, R = net.flat, b.layer(0), b.B * T
    w1, w2 = w.w("h.0.mlp.W_1"), w.w("h.0.mlp.W_2")
    args = (b.at("dres"), a["ln2"], w1, w2, a["pre"], a["act"], b.at("dln"),
            w.gw("h.0.mlp.W_1"), w.gw("h.0.mlp.W_2"), b.at("dpre"))

    def run() -> None:
        qkv.fwd(b, a, 0, R)
        proj.fwd(a, 0, b.at("proj"), R)
        mlp.fwd(0, a, w1, w2, b.at("proj"), R)
        mlp.bwd(0, args, R)
        proj.bwd(a, 0, b.at("dres"), b.at("datt"), R)
        qkv.bwd(b, a, 0, b.at("dqkv"), b.at("dln"), R)

    return run


def measure(fp8: Any, net: Any, b: Any, T: int, timer: Callable[[Callable[[], None]], float],
            capture: Callable[[Callable[[], None]], Any] | None) -> str:
    """The note on FP8 at this size (fp8: the backend's Fp8Gemms), after its GEMMs' choices.
    capture: captures a pass as the step's graphs are (GraphCache.capture); None where the step
    runs without graphs (ANDREA_CUDA_GRAPHS=0, ANDREA_CUDA_SYNC=1): the passes are then timed
    as it runs them, launched one by one. A capture the driver refuses is timed so too, and
    the note says why."""
    times = fp8.gemm_times()
    if times and max(t16 for _, t16 in times.values()) < MIN_CHOICE_MS:
        return (f"FP8 at d {net.shapes.d_model}: the layers' GEMMs take under {MIN_CHOICE_MS} "
                f"ms each in bf16, too short for a start-up timing to tell FP8 from bf16 (the "
                f"launches dominate it); they run in FP8, as asked")
    passes = [layer_pass(net.train_qkv, net.train_proj, net.train_mlp, net, b, T),
              layer_pass(net.qkv, net.proj, net.mlp, net, b, T)]
    for run in passes:
        run()  # untimed: any problem met only here has its algorithm picked now (not in a graph)
    captured: list[Any] = []
    how = "launched one by one"
    gemm = net.o.gemm
    tuning = gemm.tuning if gemm is not None else False
    try:
        if capture is not None:
            if gemm is not None:
                gemm.tuning = False  # every problem was met above: nothing is timed in a capture
            try:
                for run in passes:
                    captured.append(capture(run))
                how = "a CUDA graph"
            except RunError as e:
                for g in captured:
                    g.close()
                captured, how = [], f"launched one by one (its capture failed: {e})"
            finally:
                if gemm is not None:
                    gemm.tuning = tuning
        t8, t16 = time_interleaved(timer, [g.launch for g in captured] or passes)
    finally:
        for g in captured:
            g.close()
    if t16 < PASS_MIN_MS:
        return (f"FP8 at d {net.shapes.d_model}: a layer's linear maps take {t16:.3f} ms in "
                f"bf16, too short for a start-up timing to tell FP8 from bf16")
    per_gemm = ", ".join(f"{g} {a:.3f}/{c:.3f}" for g, (a, c) in fp8.gemm_times().items())
    note = (f"FP8 at d {net.shapes.d_model}: a layer's linear maps forward and backward "
            f"{t8:.3f} ms (the weights' FP8 copies included; each path {how}, as the step runs "
            f"it) against {t16:.3f} ms in bf16, {t16 / t8:.2f}x; each GEMM in FP8/bf16 ms: "
            f"{per_gemm or 'not timed'}")
    if t8 >= t16:
        note += ("; FP8 does not pay at this size: its casts and transposes cost more than its "
                 "GEMMs save. It runs as asked (train.precision bf16 is the faster here)")
    return note
