"""GPU kernel benchmark: the LayerNorm backward of one layer (dx, dγ, dβ) at the step's shapes,
as the CUDA backend can run it, timed with CUDA events on one stream. Prints a table per shape.

    python3 scripts/bench_kernels.py [--shapes 8192x768,8192x384] [--reps 200] [--rounds 5]

Variants (each the same op, Ops.layernorm_bwd with accumulate, bf16):
- `three kernels`: k_layernorm_bwd, then k_layernorm_bwd_params + k_colsum_reduce (the unfused
  path; in the step the sums run on the weight-gradient stream, here on the one stream);
- `three kernels, dx only`: k_layernorm_bwd alone, what the unfused path leaves on the main
  stream;
- `fused, R rows`: k_layernorm_bwd_fused with chunks of R rows, then k_colsum_chunks.

Rounds are interleaved; the table shows the median of the rounds' medians (µs per call) and
each variant's time as a ratio to the three kernels' in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """a's float32 values truncated to bf16, as the raw 16-bit words the kernels read."""
    return (np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8192x768,8192x384", help="rows x d, comma-separated")
    ap.add_argument("--reps", type=int, default=200, help="calls per timing")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="16,32,64", help="chunk rows of the fused variants")
    args = ap.parse_args()
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        fused_rows = [int(r) for r in args.rows.split(",")]
        if any(len(s) != 2 or min(s) < 1 for s in shapes) or min(fused_rows) < 1:
            raise ValueError
    except ValueError:
        print(f"bench_kernels: --shapes wants ROWSxD[,ROWSxD...] and --rows integers, got "
              f"{args.shapes!r} / {args.rows!r}", file=sys.stderr)
        return 2

    from engine.backends import cuda_status

    usable, why = cuda_status()
    if not usable:
        print(f"bench_kernels: needs a CUDA GPU with pycuda: {why}", file=sys.stderr)
        return 2
    from engine.backends.cuda.ops import LN_PARAMS_ROWS, ROWS_PER_BLOCK, Ops
    from engine.backends.cuda.runtime import Gpu

    gpu = Gpu.get()
    drv, stream = gpu.drv, gpu.stream
    precision = "bf16"
    print(f"LayerNorm backward, one call (accumulate, {precision}) on {gpu.describe(precision)}; "
          f"median of {args.rounds} interleaved rounds of {args.reps} calls")
    rng = np.random.default_rng(0)
    for R, d in shapes:
        o = Ops(gpu.kernels(precision), None, stream, precision)
        x, dout, res = (drv.to_device(bf16_bits(rng.normal(0, 1, (R, d)))) for _ in range(3))
        dx = drv.mem_alloc(R * d * 2)
        mean = drv.to_device(rng.normal(0, 0.1, R).astype(np.float32))
        rstd = drv.to_device(rng.uniform(0.5, 1.5, R).astype(np.float32))
        gamma = drv.to_device(rng.normal(1, 0.1, d).astype(np.float32))
        dgb = drv.to_device(np.zeros(2 * d, np.float32))
        part = drv.mem_alloc(-(-R // min([*fused_rows, LN_PARAMS_ROWS])) * 2 * d * 4)
        ptrs = [int(p) for p in (dout, x, gamma, mean, rstd, dx, dgb, part)]

        def call(fused: bool, rows: int = 0, dx_only: bool = False,
                 ptrs: list[int] = ptrs, o: Ops = o, R: int = R, d: int = d,
                 res: int = int(res)) -> None:
            dout_, x_, gamma_, mean_, rstd_, dx_, dgb_, part_ = ptrs
            if dx_only:
                o._go("k_layernorm_bwd", -(-R // ROWS_PER_BLOCK), dx_, res, dout_, x_, mean_,
                      rstd_, gamma_, R, d, 1)
                return
            if rows:
                o.ln_fused_rows = rows
            o.layernorm_bwd(dout_, x_, gamma_, mean_, rstd_, dx_, dgb_, part_, R, d, True,
                            resid=res, fused=fused)

        variants: dict[str, Callable[[], None]] = {
            "three kernels": lambda call=call: call(False),
            "three kernels, dx only": lambda call=call: call(False, dx_only=True),
        }
        if o.fused_ln_bwd_ok(d, *(int(p) for p in (dx, res, dout, x))):
            for rows in fused_rows:
                variants[f"fused, {rows} rows"] = lambda call=call, rows=rows: call(True, rows)
        e0, e1 = drv.Event(), drv.Event()
        times: dict[str, list[float]] = {k: [] for k in variants}
        for f in variants.values():  # compile, warm
            f()
        stream.synchronize()
        for _ in range(args.rounds):
            for name, f in variants.items():
                e0.record(stream)
                for _ in range(args.reps):
                    f()
                e1.record(stream)
                e1.synchronize()
                times[name].append(e1.time_since(e0) * 1e3 / args.reps)
        ref = statistics.median(times["three kernels"])
        print(f"\nR={R} d={d}: {R * d * 2 * 4 / 1e6:.1f} MB of dout, x, resid and dx a call")
        print(f"  {'variant':<24} {'us/call':>8} {'spread':>7} {'vs three':>9} {'GB/s (dx)':>9}")
        for name, ts in times.items():
            med = statistics.median(ts)
            spread = (max(ts) - min(ts)) / med * 100
            print(f"  {name:<24} {med:8.2f} {spread:6.1f}% {med / ref:9.2f} "
                  f"{R * d * 2 * 4 / med / 1e3:9.0f}")
        for p in (x, dout, res, dx, mean, rstd, gamma, dgb, part):
            p.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
