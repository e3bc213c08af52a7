"""Probe (PyTorch + Triton, not the engine): does AdamW beside the forward's GEMMs cost less when
the GEMMs leave it SMs of its own? dev/README.md has its figures on an H200.

    python3 dev/probe_sm_split.py        (KS=8,16,24,32: the SM splits to try)

A 120M-shaped forward's GEMM chain (12 layers: qkv, proj, fc1, fc2 at 8192 rows) and an AdamW
stand-in over 92M fp32 params (p, g, m, v read; p, m, v, bf16 copy written: 30 B a param), each
step a CUDA graph replayed back to back at the power cap. Variants:
  gemm       the GEMMs alone
  adam       AdamW alone (full grid)
  serial     AdamW(l) then GEMMs(l), one stream
  side       AdamW on a second stream (low priority), GEMMs(l) waits for AdamW(l): the engine's way
  part K     as side, GEMMs with an SM carveout of K, AdamW a persistent grid on ~K SMs
Median ms of the last 2/3 of the replays (about 1.5 s of them); NVML's average power over them.
"""
import os
import statistics
import sys
import time

try:
    import torch
    import triton
    import triton.language as tl
except ImportError as e:
    print(f"probe_sm_split.py: needs PyTorch and Triton ({e})", file=sys.stderr)
    sys.exit(2)
if not torch.cuda.is_available():
    print("probe_sm_split.py: needs a CUDA GPU", file=sys.stderr)
    sys.exit(2)

try:
    import pynvml
    pynvml.nvmlInit()
    NV = pynvml.nvmlDeviceGetHandleByIndex(0)
except Exception:
    NV = None

torch.backends.cuda.preferred_blas_library("cublaslt")
dev = torch.device("cuda")
R, D, F, L = 8192, 768, 3072, 12
N_LAYER = 12 * D * D + 13 * D  # about 7.1M params a layer


@triton.jit
def adam_kernel(p, g, m, v, plp, n, nprog, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nblk = tl.cdiv(n, BLOCK)
    for b in range(pid, nblk, nprog):
        off = b * BLOCK + tl.arange(0, BLOCK)
        mask = off < n
        gg = tl.load(g + off, mask=mask)
        pp = tl.load(p + off, mask=mask)
        mm = tl.load(m + off, mask=mask)
        vv = tl.load(v + off, mask=mask)
        mm = 0.9 * mm + 0.1 * gg
        vv = 0.95 * vv + 0.05 * gg * gg
        pp = pp - 3e-4 * (mm / (tl.sqrt(vv) + 1e-8) + 0.1 * pp)
        tl.store(p + off, pp, mask=mask)
        tl.store(m + off, mm, mask=mask)
        tl.store(v + off, vv, mask=mask)
        tl.store(plp + off, pp.to(tl.bfloat16), mask=mask)


BLOCK = 1024


def adam(bufs, l, nprog=None):
    p, g, m, v, plp = (b[l] for b in bufs)
    n = p.numel()
    full = triton.cdiv(n, BLOCK)
    grid = full if nprog is None else min(nprog, full)
    adam_kernel[(grid,)](p, g, m, v, plp, n, grid, BLOCK=BLOCK, num_warps=4)


def make():
    x = torch.randn(R, D, device=dev, dtype=torch.bfloat16)
    h = torch.randn(R, F, device=dev, dtype=torch.bfloat16)
    W = [(torch.randn(D, 3 * D, device=dev, dtype=torch.bfloat16) * .03,
          torch.randn(D, D, device=dev, dtype=torch.bfloat16) * .03,
          torch.randn(D, F, device=dev, dtype=torch.bfloat16) * .03,
          torch.randn(F, D, device=dev, dtype=torch.bfloat16) * .03) for _ in range(L)]
    out = [torch.empty(R, 3 * D, device=dev, dtype=torch.bfloat16),
           torch.empty(R, D, device=dev, dtype=torch.bfloat16),
           torch.empty(R, F, device=dev, dtype=torch.bfloat16),
           torch.empty(R, D, device=dev, dtype=torch.bfloat16)]
    bufs = [[torch.randn(N_LAYER, device=dev) * s for _ in range(L)] for s in (.02, .01, .001, 1e-4)]
    bufs[3] = [b.abs() for b in bufs[3]]
    bufs.append([torch.empty(N_LAYER, device=dev, dtype=torch.bfloat16) for _ in range(L)])
    return x, h, W, out, bufs


def gemms(x, h, W, out, l):
    wq, wp, w1, w2 = W[l]
    torch.mm(x, wq, out=out[0])
    torch.mm(x, wp, out=out[1])
    torch.mm(x, w1, out=out[2])
    torch.mm(h, w2, out=out[3])


def build(kind, k, data):
    x, h, W, out, bufs = data
    side = torch.cuda.Stream(priority=0)
    main = torch.cuda.Stream(priority=-5)
    torch._C._set_sm_carveout_experimental(k if kind == "part" else None)
    nprog = k * 8 if kind == "part" else None  # 8 programs of 128 threads an SM
    g = torch.cuda.CUDAGraph()
    # warm (compiles, picks algos) outside capture
    with torch.cuda.stream(main):
        for l in range(L):
            adam(bufs, l, nprog)
            gemms(x, h, W, out, l)
    torch.cuda.synchronize()
    with torch.cuda.graph(g, stream=main):
        if kind == "gemm":
            for l in range(L):
                gemms(x, h, W, out, l)
        elif kind == "adam":
            for l in range(L):
                adam(bufs, l)
        elif kind == "serial":
            for l in range(L):
                adam(bufs, l)
                gemms(x, h, W, out, l)
        else:
            ev0 = torch.cuda.Event()
            ev0.record(main)
            side.wait_event(ev0)
            evs = []
            with torch.cuda.stream(side):
                for l in range(L):
                    adam(bufs, l, nprog)
                    e = torch.cuda.Event()
                    e.record(side)
                    evs.append(e)
            for l in range(L):
                main.wait_event(evs[l])
                gemms(x, h, W, out, l)
    torch._C._set_sm_carveout_experimental(None)
    torch.cuda.synchronize()
    return g, main


def energy():
    return pynvml.nvmlDeviceGetTotalEnergyConsumption(NV) if NV else None  # mJ


def run(g, stream, window_s=1.5):
    """Replays back to back: the median ms of the last two thirds, and NVML's average power over
    them. Their number makes that part last about window_s (at least 400 replays): NVML's
    energy counter moves about every 100 ms, so a shorter window reads it too coarsely."""
    with torch.cuda.stream(stream):
        t0 = time.perf_counter()
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
    n = max(400, int(1.5 * window_s / ((time.perf_counter() - t0) / 20)))
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    with torch.cuda.stream(stream):
        ends[0].record(stream)
        e0 = t0 = None
        for i in range(n):
            g.replay()
            ends[i + 1].record(stream)
            if i == n // 3:
                torch.cuda.synchronize()
                e0, t0 = energy(), time.perf_counter()
    torch.cuda.synchronize()
    e1, t1 = energy(), time.perf_counter()
    ms = [ends[i].elapsed_time(ends[i + 1]) for i in range(n // 3 + 1, n)]
    w = (e1 - e0) / 1e3 / (t1 - t0) if e0 is not None else float("nan")
    return statistics.median(ms), w


def main():
    raw = os.environ.get("KS", "8,16,24,32")
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    ks = [int(a) for a in raw.split(",") if a.strip().isdigit()]
    if len(ks) != len(raw.split(",")) or not all(0 < k < nsm for k in ks):
        print(f"probe_sm_split.py: KS: expected SM counts from 1 to {nsm - 1}, comma-separated, "
              f"got {raw!r}", file=sys.stderr)
        return 2
    data = make()
    # carveout check: one GEMM at carveout 0 and 66
    x, _, W, out, _ = data
    for k in (None, 66):
        torch._C._set_sm_carveout_experimental(k)
        torch.mm(x, W[0][2], out=out[2])
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            torch.mm(x, W[0][2], out=out[2])
        e.record()
        torch.cuda.synchronize()
        print(f"carveout {k}: fc1 GEMM {s.elapsed_time(e) / 20 * 1e3:.1f} us", flush=True)
    torch._C._set_sm_carveout_experimental(None)
    variants = [("gemm", 0), ("adam", 0), ("serial", 0), ("side", 0)] + [("part", k) for k in ks]
    graphs = {v: build(*v, data) for v in variants}
    res = {v: [] for v in variants}
    for order in (variants, variants[::-1], variants):
        for v in order:
            ms, w = run(*graphs[v])
            res[v].append((ms, w))
            print(f"  {v[0]} {v[1]}: {ms:.3f} ms {w:.0f} W", flush=True)
    print("variant | ms (passes) | W | J")
    for v in variants:
        ms = [a for a, _ in res[v]]
        w = statistics.median(b for _, b in res[v])
        print(f"{v[0]} {v[1]} | {' / '.join(f'{a:.3f}' for a in ms)} | {w:.0f} | {w * statistics.median(ms) / 1e3:.3f}")


if __name__ == "__main__":
    sys.exit(main())
