"""GPU benchmark: one full ANDREA training step (forward, backward, grad norm, clip, AdamW) on
the CUDA backend against PyTorch on the same model and GPU, in the same run. Prints one table.

    python3 scripts/bench_gpu.py [--models 120M,12M] [--torch eager,compile,reduce-overhead]
                                 [--steps 20] [--json FILE]

MFU = tokens/s · FLOPs per token / peak, with llm.c's count: FLOPs/token = 6·N + 6·L·d·T
(N every parameter, tied wte counted once; the attention term is the causal half of 12·L·d·T)
and the peak dense bf16 of an H100/H200 SXM: 989 TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model.layout import ModelShapes, init_params, n_params
from engine.model.optim import clip_scale

PEAK_BF16 = 989e12
MODELS = {
    "120M": ModelShapes(n_layer=12, d_model=768, n_head=12, d_ff=3072, vocab_size=8449,
                        seq_len=1024),
    "12M": ModelShapes(n_layer=6, d_model=384, n_head=6, d_ff=1536, vocab_size=8449,
                       seq_len=1024),
}
B = 8


def flops_per_token(s: ModelShapes) -> float:
    return 6.0 * n_params(s) + 6.0 * s.n_layer * s.d_model * s.seq_len


def bench_andrea(s: ModelShapes, steps: int, graphs: bool) -> list[float]:
    from engine.backends.cuda import CudaBackend

    bk = CudaBackend(s, B, "bf16")
    bk.use_graphs = graphs
    bk.load_params(init_params(s, seed=1337))
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, s.vocab_size, (B, s.seq_len + 1)).astype(np.int32)
               for _ in range(4)]
    times = []
    for i in range(steps + 3):
        tok = batches[i % len(batches)]
        t0 = time.perf_counter()
        bk.zero_grads()
        bk.forward_backward(tok[:, :-1], tok[:, 1:])
        norm = bk.grad_norm()
        sc = clip_scale(norm, 1.0)
        if sc < 1.0:
            bk.grad_scale(sc)
        bk.adamw(3e-4, 0.9, 0.95, 1e-8, 0.1, i + 1)
        bk.synchronize()
        if i >= 3:  # warm-up: graph capture, cuBLAS heuristics
            times.append(time.perf_counter() - t0)
    bk.close()
    return times


def profile_andrea(s: ModelShapes, steps: int = 3) -> None:
    """Per-kernel GPU time of full steps (CUPTI through torch.profiler sees PyCUDA's and cuBLAS's
    kernels too, as they share the primary context). Direct launches, so kernels are attributable."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine.backends.cuda import CudaBackend

    torch.cuda.init()
    bk = CudaBackend(s, B, "bf16")
    bk.use_graphs = False
    bk.load_params(init_params(s, seed=1337))
    tok = np.random.default_rng(0).integers(0, s.vocab_size, (B, s.seq_len + 1)).astype(np.int32)

    def step(t: int) -> None:
        bk.zero_grads()
        bk.forward_backward(tok[:, :-1], tok[:, 1:])
        bk.grad_norm()
        bk.adamw(3e-4, 0.9, 0.95, 1e-8, 0.1, t)
        bk.synchronize()

    step(1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for t in range(steps):
            step(t + 2)
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us > 0:
            rows.append((us / steps, e.count // steps, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"\nkernel time per step (profiled, direct launches): {total / 1e3:.2f} ms")
    for us, count, name in rows[:22]:
        print(f"  {us / 1e3:7.3f} ms {100 * us / total:5.1f}%  x{count:<4} {name[:80]}")
    bk.close()


def torch_model(s: ModelShapes):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = s.d_model
            self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
            self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
            self.w1, self.w2 = nn.Linear(d, s.d_ff, bias=False), nn.Linear(s.d_ff, d, bias=False)

        def forward(self, x):
            Bq, T, d = x.shape
            h = self.ln1(x)
            q, k, v = (m(h).view(Bq, T, s.n_head, -1).transpose(1, 2)
                       for m in (self.q, self.k, self.v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(Bq, T, d))
            return x + self.w2(F.gelu(self.w1(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(s.vocab_size, s.d_model)
            self.wpe = nn.Embedding(s.seq_len, s.d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(s.n_layer))
            self.lnf = nn.LayerNorm(s.d_model, eps=1e-5)
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, 0.0, 0.02)

        def forward(self, idx, targets):
            T = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            logits = self.lnf(x) @ self.wte.weight.T
            return F.cross_entropy(logits.float().view(-1, s.vocab_size), targets.reshape(-1))

    model = GPT().cuda()
    assert sum(p.numel() for p in model.parameters()) == n_params(s)
    return model


def bench_torch(s: ModelShapes, steps: int, variant: str) -> tuple[list[float], float]:
    import torch

    torch.manual_seed(0)
    model = torch_model(s)
    run = model
    if variant == "compile":
        run = torch.compile(model)
    elif variant == "reduce-overhead":
        run = torch.compile(model, mode="reduce-overhead")
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tok = torch.randint(0, s.vocab_size, (4, B, s.seq_len + 1), device="cuda", generator=gen)
    times = []
    t_start = time.perf_counter()
    compile_s = 0.0
    for i in range(steps + 3):
        x, y = tok[i % 4, :, :-1], tok[i % 4, :, 1:]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i == 2:
            compile_s = time.perf_counter() - t_start
        if i >= 3:
            times.append(time.perf_counter() - t0)
    del model, run, opt
    torch.cuda.empty_cache()
    return times, compile_s


def measure(key: str, impl: str, steps: int, chunk: int) -> tuple[list[float], str]:
    """Per-step seconds of one implementation, and a note."""
    s = MODELS[key]
    if impl.startswith("andrea"):
        os.environ["ANDREA_ATTN_CHUNK"] = str(chunk)
        return bench_andrea(s, steps, graphs="no graph" not in impl), ""
    variant = impl.split()[1]
    t, comp = bench_torch(s, steps, variant)
    return t, (f"first 3 steps (compile) {comp:.0f} s" if variant != "eager" else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="120M,12M")
    ap.add_argument("--torch", default="eager,compile,reduce-overhead",
                    help="PyTorch variants to compare ('' for none)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2,
                    help="measure every implementation this many times, interleaved; the table "
                         "shows the best median and the spread between rounds")
    ap.add_argument("--attn-chunks", default="256",
                    help="ANDREA attention query-chunk sizes to time (the first is the default)")
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", default="", help="models to profile per kernel, e.g. 120M")
    args = ap.parse_args()
    for key in [m for m in args.profile.split(",") if m]:
        profile_andrea(MODELS[key])
    chunks = [int(c) for c in args.attn_chunks.split(",") if c]
    impls = ["andrea cuda bf16 (graph)", "andrea cuda bf16 (no graph)"]
    impls += [f"andrea cuda bf16 (graph, chunk {c})" for c in chunks[1:]]
    impls += [f"torch {v} bf16" for v in args.torch.split(",") if v]
    rows = []
    for key in [m for m in args.models.split(",") if m]:
        s = MODELS[key]
        tokens, fpt = B * s.seq_len, flops_per_token(s)
        medians: dict[str, list[float]] = {i: [] for i in impls}
        notes: dict[str, str] = dict.fromkeys(impls, "")
        for rnd in range(args.rounds):
            for impl in impls:
                chunk = int(impl.rsplit(" ", 1)[1].rstrip(")")) if "chunk" in impl else chunks[0]
                try:
                    t, note = measure(key, impl, args.steps, chunk)
                except Exception as e:  # a failed variant is reported, not fatal
                    notes[impl] = f"failed: {e}"[:60]
                    continue
                medians[impl].append(statistics.median(t))
                if rnd == 0:
                    notes[impl] = note
                print(f"  {key} round {rnd + 1} {impl}: {medians[impl][-1] * 1e3:.2f} ms",
                      flush=True)
        best = {i: min(m) if m else float("nan") for i, m in medians.items()}
        ours = best[impls[0]]
        for impl in impls:
            sec, m = best[impl], medians[impl]
            spread = f"rounds ±{(max(m) - min(m)) / min(m) * 100:.0f}%" if len(m) > 1 else ""
            rows.append({"model": f"ANDREA-{key}", "impl": impl, "ms": sec * 1e3,
                         "tok_s": tokens / sec, "mfu": tokens / sec * fpt / PEAK_BF16,
                         "andrea_speedup": sec / ours, "rounds_ms": [x * 1e3 for x in m],
                         "note": " ".join(x for x in (spread, notes[impl]) if x)})
    print(f"\nGPU benchmark: B={B}, T=1024, one full step (fwd, bwd, clip, AdamW); best of "
          f"{args.rounds} interleaved rounds of the median of {args.steps} steps; "
          f"MFU = tok/s·(6N + 6·L·d·T)/989 TFLOP/s")
    print(f"{'model':<12} {'implementation':<33} {'ms/step':>8} {'tok/s':>9} {'MFU':>6} "
          f"{'andrea x':>9}  note")
    for r in rows:
        print(f"{r['model']:<12} {r['impl']:<33} {r['ms']:>8.2f} {r['tok_s'] / 1e3:>8.0f}K "
              f"{r['mfu'] * 100:>5.1f}% {r['andrea_speedup']:>9.2f}  {r['note']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
