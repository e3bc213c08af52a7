"""GPU kernel benchmark: the memory-bound kernels of a step at its shapes, as the CUDA backend
runs them, timed with CUDA events on one stream. Prints a table per op and shape.

    python3 dev/bench_kernels.py [--ops layernorm,loss,fp8] [--shapes 8192x768,8192x384]
                                 [--fp8-shapes 8192x8192,8192x2048] [--vocab 8449]
                                 [--reps 200] [--rounds 5]

`layernorm`: the LayerNorm backward of one layer (dx, dγ, dβ), each variant the same op
(Ops.layernorm_bwd with accumulate, bf16):
- `three kernels`: k_layernorm_bwd, then k_layernorm_bwd_params + k_colsum_reduce (in the
  step the sums run on the weight-gradient stream, here on the one stream);
- `three kernels, dx only`: k_layernorm_bwd alone, what the step leaves on the main stream, in
  the engine's blocks (ops.LN_BWD_THREADS, 128); `dx only, 256 threads` / `64 threads`: the
  same kernel in other blocks.

Each variant's time is shown as a ratio to the three kernels' in the same run.

`loss`: the step's cross-entropy kernel (k_loss_fwd_bwd_lp: bf16 logits [R, ldv] in, dlogits
written over them, as CudaBackend runs it) for R = 8192 rows and V = --vocab, against its
peer, a device-to-device copy of the same bytes: where a row fits the kernel's registers
(ldv <= ops.LOSS_ROW_MAX) the row read once and written once is all its memory traffic, so the
copy is the speed the memory allows (a longer row is read three times, into a buffer of its
own). Calls after the first run on the dlogits the one before left: the kernel's work depends
on the targets, not on the values.

`fp8`: the FP8 cast kernels on whole 64 x 64 tiles (train/precision "fp8", with an amax
history, as a step after its first runs them) for each --fp8-shapes ROWSxCOLS: k_fp8_cast_t64
(a bf16 tensor into its E4M3 copy and transposed copy: x; dy's E5M2 cast moves the same
bytes), k_fp8_gelu_cast_t64 (GELU(pre) computed and cast: h) and k_fp8_dgelu_cast_t64
(dg·GELU'(pre) in E5M2: dh), each against its peer, a device-to-device copy moving as many
bytes (read and written) as the kernel must.

Rounds are interleaved; the tables show the median of the rounds' times (µs per call).
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


def time_rounds(variants: dict[str, Callable[[], None]], rounds: int, reps: int, drv,
                stream) -> dict[str, list[float]]:
    """µs per call of each variant: `reps` calls between two events, in `rounds` interleaved
    rounds (after one warm-up call each)."""
    for f in variants.values():  # compile, warm
        f()
    stream.synchronize()
    e0, e1 = drv.Event(), drv.Event()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, f in variants.items():
            e0.record(stream)
            for _ in range(reps):
                f()
            e1.record(stream)
            e1.synchronize()
            times[name].append(e1.time_since(e0) * 1e3 / reps)
    return times


def print_table(times: dict[str, list[float]], ref: str, vs: str, rate: str, mb: float) -> None:
    """One row a variant: median µs a call, the rounds' spread, the ratio to variant `ref`'s
    median, and `mb` megabytes a call as GB/s."""
    base = statistics.median(times[ref])
    print(f"  {'variant':<24} {'us/call':>8} {'spread':>7} {vs:>9} {rate:>9}")
    for name, ts in times.items():
        med = statistics.median(ts)
        spread = (max(ts) - min(ts)) / med * 100
        print(f"  {name:<24} {med:8.2f} {spread:6.1f}% {med / base:9.2f} {mb / med * 1e3:9.0f}")


def bench_layernorm(gpu, R: int, d: int, rounds: int, reps: int) -> None:
    from engine.backends.cuda.ops import LN_BWD_THREADS, Ops

    drv, stream = gpu.drv, gpu.stream
    rng = np.random.default_rng(0)
    o = Ops(gpu.kernels("bf16"), None, stream, "bf16")
    x, dout, res = (drv.to_device(bf16_bits(rng.normal(0, 1, (R, d)))) for _ in range(3))
    dx = drv.mem_alloc(R * d * 2)
    mean = drv.to_device(rng.normal(0, 0.1, R).astype(np.float32))
    rstd = drv.to_device(rng.uniform(0.5, 1.5, R).astype(np.float32))
    gamma = drv.to_device(rng.normal(1, 0.1, d).astype(np.float32))
    dgb = drv.to_device(np.zeros(2 * d, np.float32))
    part = drv.mem_alloc(-(-R // o.ln_rows) * 2 * d * 4)
    dout_, x_, gamma_, mean_, rstd_, dx_, dgb_, part_, res_ = (
        int(p) for p in (dout, x, gamma, mean, rstd, dx, dgb, part, res))

    def call(dx_only: bool = False, threads: int = LN_BWD_THREADS) -> None:
        if dx_only:  # a warp a row, whatever the block size
            o._go("k_layernorm_bwd", -(-R // (threads // 32)), dx_, res_, dout_, x_, mean_, rstd_,
                  gamma_, R, d, 1, threads=threads)
            return
        o.layernorm_bwd(dout_, x_, gamma_, mean_, rstd_, dx_, dgb_, part_, R, d, True,
                        resid=res_)

    variants: dict[str, Callable[[], None]] = {
        "three kernels": lambda: call(),
        "three kernels, dx only": lambda: call(dx_only=True),
        # at 72 registers a thread: 3 blocks of 256 threads an SM (24 warps), 7 of 128 (28)
        "dx only, 256 threads": lambda: call(dx_only=True, threads=256),
        "dx only, 64 threads": lambda: call(dx_only=True, threads=64),
    }
    times = time_rounds(variants, rounds, reps, drv, stream)
    mb = R * d * 2 * 4 / 1e6
    print(f"\nLayerNorm backward R={R} d={d}: {mb:.1f} MB of dout, x, resid and dx a call")
    print_table(times, "three kernels", "vs three", "GB/s (dx)", mb)
    for a in (x, dout, res, dx, mean, rstd, gamma, dgb, part):
        a.free()


def bench_loss(gpu, R: int, V: int, rounds: int, reps: int) -> None:
    from engine.backends.cuda.buffers import logits_ld
    from engine.backends.cuda.ops import LOSS_ROW_MAX, Ops

    drv, stream = gpu.drv, gpu.stream
    rng = np.random.default_rng(1)
    o = Ops(gpu.kernels("bf16"), None, stream, "bf16")
    ldv = logits_ld(V)
    nbytes = R * ldv * 2
    logits = drv.to_device(bf16_bits(rng.normal(0, 3, (R, ldv))))
    other = drv.mem_alloc(nbytes)
    targets = drv.to_device(rng.integers(0, V, R).astype(np.int32))
    scale = drv.to_device(np.array([1.0 / R], np.float32))
    lse, losses = drv.mem_alloc(R * 4), drv.mem_alloc(R * 4)
    z, peer = int(logits), int(other)
    # dlogits over the logits, as the step runs it where the row fits the registers
    dz = z if ldv <= LOSS_ROW_MAX else peer
    variants: dict[str, Callable[[], None]] = {
        "k_loss_fwd_bwd_lp": lambda: o._go("k_loss_fwd_bwd_lp", R, int(losses), int(lse), dz, z,
                                           int(targets), int(scale), R, 1, V, ldv),
        "copy of the same bytes": lambda: drv.memcpy_dtod_async(peer, z, nbytes, stream),
    }
    times = time_rounds(variants, rounds, reps, drv, stream)
    mb = 2 * nbytes / 1e6
    print(f"\nloss R={R} V={V} (ldv {ldv}), bf16 logits: {mb:.1f} MB read and written a call")
    print_table(times, "copy of the same bytes", "vs copy", "GB/s", mb)
    for a in (logits, other, targets, scale, lse, losses):
        a.free()


def bench_fp8_casts(gpu, R: int, C: int, rounds: int, reps: int) -> None:
    from engine.backends.cuda.ops import Ops
    from engine.model.fp8 import HISTORY

    if R % 64 or C % 64:
        print(f"\nFP8 casts {R}x{C}: skipped (the 64 x 64 tile kernels need multiples of 64)")
        return
    drv, stream = gpu.drv, gpu.stream
    rng = np.random.default_rng(2)
    o = Ops(gpu.kernels("bf16"), None, stream, "bf16")
    n = R * C
    x, pre = (drv.to_device(bf16_bits(rng.normal(0, 1, (R, C)))) for _ in range(2))
    q, qt = drv.mem_alloc(n), drv.mem_alloc(n)
    src, dst = drv.mem_alloc(3 * n), drv.mem_alloc(3 * n)  # the copies' bytes
    inv = drv.mem_alloc(16)
    amax = drv.to_device(np.zeros(1, np.uint32))
    hist = drv.to_device(np.full(HISTORY, 4.0, np.float32))  # a history: no amax pass first
    x_, pre_, q_, qt_, inv_, amax_, hist_ = (int(a) for a in (x, pre, q, qt, inv, amax, hist))
    grid = (C // 64, R // 64)

    def copy(nbytes: int) -> Callable[[], None]:
        return lambda: drv.memcpy_dtod_async(int(dst), int(src), nbytes, stream)

    # bytes read + written: 2n in and 2n out (q, qt) for a cast, 4n in for the GELU's gradient
    for title, kernel, args, moved in (
            ("k_fp8_cast_t64 (x, dy)", "k_fp8_cast_t64",
             (q_, qt_, inv_, x_, amax_, hist_, HISTORY, R, C, 0), 4 * n),
            ("k_fp8_gelu_cast_t64 (h)", "k_fp8_gelu_cast_t64",
             (q_, qt_, inv_, 0, pre_, amax_, hist_, HISTORY, R, C), 4 * n),
            ("k_fp8_dgelu_cast_t64 (dh)", "k_fp8_dgelu_cast_t64",
             (q_, qt_, inv_, 0, x_, pre_, amax_, hist_, HISTORY, R, C), 6 * n)):
        variants: dict[str, Callable[[], None]] = {
            "kernel": lambda kernel=kernel, args=args: o._go(kernel, grid, *args),
            "copy of the same bytes": copy(moved // 2),
        }
        times = time_rounds(variants, rounds, reps, drv, stream)
        mb = moved / 1e6
        print(f"\n{title} {R}x{C}: {mb:.1f} MB read and written a call")
        print_table(times, "copy of the same bytes", "vs copy", "GB/s", mb)
    for a in (x, pre, q, qt, src, dst, inv, amax, hist):
        a.free()


OPS = ("layernorm", "loss", "fp8")


def parse_shapes(text: str) -> list[tuple[int, int]] | None:
    """"R1xC1,R2xC2" as [(R1, C1), (R2, C2)]; None where it is not that (or a value < 1)."""
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
    except ValueError:
        return None
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        return None
    return [(s[0], s[1]) for s in shapes]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    ap.add_argument("--shapes", default="8192x768,8192x384",
                    help="LayerNorm rows x d, comma-separated")
    ap.add_argument("--fp8-shapes", default="8192x8192,8192x2048",
                    help="the FP8 casts' rows x columns, comma-separated")
    ap.add_argument("--vocab", type=int, default=8449, help="the loss's V (8192 rows)")
    ap.add_argument("--reps", type=int, default=200, help="calls per timing")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    ops = [x for x in args.ops.split(",") if x]
    shapes, fp8_shapes = parse_shapes(args.shapes), parse_shapes(args.fp8_shapes)
    for flag, value, parsed in (("--shapes", args.shapes, shapes),
                                ("--fp8-shapes", args.fp8_shapes, fp8_shapes)):
        if parsed is None:
            print(f"bench_kernels: {flag} wants ROWSxCOLS[,ROWSxCOLS...], got {value!r}",
                  file=sys.stderr)
            return 2
    if not ops or any(x not in OPS for x in ops):
        print(f"bench_kernels: --ops wants some of {', '.join(OPS)}, comma-separated, got "
              f"{args.ops!r}", file=sys.stderr)
        return 2
    for flag, value in (("--vocab", args.vocab), ("--reps", args.reps), ("--rounds", args.rounds)):
        if value < 1:
            print(f"bench_kernels: {flag} wants a positive integer, got {value}", file=sys.stderr)
            return 2

    from engine.backends import cuda_status

    usable, why = cuda_status()
    if not usable:
        print(f"bench_kernels: needs a CUDA GPU with pycuda: {why}", file=sys.stderr)
        return 2
    from engine.backends.cuda.runtime import Gpu

    gpu = Gpu.get()
    print(f"{gpu.describe('bf16')}: median of {args.rounds} interleaved rounds of {args.reps} "
          f"calls")
    if "layernorm" in ops:
        for R, d in shapes:
            bench_layernorm(gpu, R, d, args.rounds, args.reps)
    if "loss" in ops:
        bench_loss(gpu, 8192, args.vocab, args.rounds, args.reps)
    if "fp8" in ops:
        for R, C in fp8_shapes:
            bench_fp8_casts(gpu, R, C, args.rounds, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
