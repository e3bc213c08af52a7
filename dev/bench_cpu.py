"""CPU benchmark: one full training step of the numpy backend vs PyTorch CPU eager, same model.

Usage: .venv/bin/python dev/bench_cpu.py [--steps 20] [--rss-steps 200] [--profile]

A step is forward, backward, grad norm, clip and AdamW on ANDREA-tiny (B=8, T=128, d=128, 4
layers, 4 heads, d_ff=512, V=8449), the DESIGN §2 model in both (no biases, tied wte, pre-LN,
GELU tanh). Torch runs with as many threads as numpy's BLAS. Both are timed in this one run,
alternating rounds so machine noise hits both alike; the table shows median tokens/s. Also the
numpy process RSS before and after `--rss-steps` steps (DESIGN §5: no allocation in the loop).
Needs torch (`.venv/bin/pip install torch==2.13.0`, a CPU build) — it is not an engine dependency.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from engine.backends.numpy import NumpyBackend
from engine.backends.numpy.model import blas_threads
from engine.model.layout import ModelShapes, init_params, tensor_table
from engine.model.optim import clip_scale

TINY = ModelShapes(n_layer=4, d_model=128, n_head=4, d_ff=512, vocab_size=8449, seq_len=128)
B = 8
LR, BETAS, EPS, WD, MAX_NORM = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def numpy_step(be: NumpyBackend, x: np.ndarray, y: np.ndarray, t: int) -> None:
    be.zero_grads()
    be.forward_backward(x, y)
    norm = be.grad_norm()
    scale = clip_scale(norm, MAX_NORM)
    if scale != 1.0:
        be.grad_scale(scale)
    be.adamw(LR, BETAS[0], BETAS[1], EPS, WD, t)


def build_torch(params: np.ndarray):
    import torch
    import torch.nn.functional as F

    s = TINY
    named = {
        t.name: torch.nn.Parameter(
            torch.from_numpy(params[t.offset : t.offset + t.size].reshape(t.shape).copy())
        )
        for t in tensor_table(s)
    }
    plist = list(named.values())
    H, hd = s.n_head, s.d_model // s.n_head

    def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        Bx, T = x.shape
        h = named["wte"][x] + named["wpe"][:T]
        for i in range(s.n_layer):
            p = f"h.{i}."
            a = F.layer_norm(h, (s.d_model,), named[p + "ln1.gamma"], named[p + "ln1.beta"], 1e-5)
            q, k, v = (
                (a @ named[p + f"attn.W_{n}"]).view(Bx, T, H, hd).transpose(1, 2) for n in "QKV"
            )
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + o.transpose(1, 2).reshape(Bx, T, s.d_model) @ named[p + "attn.W_O"]
            a = F.layer_norm(h, (s.d_model,), named[p + "ln2.gamma"], named[p + "ln2.beta"], 1e-5)
            h = h + F.gelu(a @ named[p + "mlp.W_1"], approximate="tanh") @ named[p + "mlp.W_2"]
        h = F.layer_norm(h, (s.d_model,), named["lnf.gamma"], named["lnf.beta"], 1e-5)
        logits = h @ named["wte"].T
        return F.cross_entropy(logits.view(-1, s.vocab_size), y.reshape(-1))

    decay = [p for n, p in named.items() if p.ndim == 2]
    no_decay = [p for n, p in named.items() if p.ndim != 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=EPS,
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=False)
        loss = forward(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plist, MAX_NORM)
        opt.step()
        return float(loss.detach())

    return step, forward


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per backend")
    ap.add_argument("--rss-steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="cProfile 10 numpy steps")
    args = ap.parse_args()

    threads = blas_threads()
    params = init_params(TINY, 1337)
    rng = np.random.default_rng(0)
    seq = rng.integers(0, TINY.vocab_size, (B, TINY.seq_len + 1)).astype(np.int32)
    x, y = seq[:, :-1], seq[:, 1:]
    tokens_per_step = x.size

    be = NumpyBackend(TINY, B)
    be.load_params(params)
    if args.profile:
        import cProfile
        import pstats

        numpy_step(be, x, y, 1)
        prof = cProfile.Profile()
        prof.enable()
        for t in range(10):
            numpy_step(be, x, y, t + 2)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return 0

    try:
        import torch
    except ImportError:
        print("torch is not installed: .venv/bin/pip install torch==2.13.0", file=sys.stderr)
        return 1
    torch.set_num_threads(threads)
    tstep, tforward = build_torch(params)
    tx, ty = torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64))

    # same model, same weights: the first losses must agree
    with torch.no_grad():
        t_loss = float(tforward(tx, ty))
    n_loss = float(be.forward_loss(x, y).mean())
    print(f"initial loss: numpy {n_loss:.6f}  torch {t_loss:.6f}")

    for t in range(3):  # warm-up (allocator, BLAS thread start)
        numpy_step(be, x, y, t + 1)
        tstep(tx, ty)
    times: dict[str, list[float]] = {"numpy": [], "torch": []}
    for t in range(args.steps):
        t0 = time.perf_counter()
        numpy_step(be, x, y, t + 4)
        t1 = time.perf_counter()
        tstep(tx, ty)
        t2 = time.perf_counter()
        times["numpy"].append(t1 - t0)
        times["torch"].append(t2 - t1)

    rss0 = rss_bytes()
    for t in range(args.rss_steps):
        numpy_step(be, x, y, args.steps + 4 + t)
    rss1 = rss_bytes()

    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: tokens_per_step / v for k, v in med.items()}
    print(f"\nANDREA-tiny, B={B}, T={TINY.seq_len}: {tokens_per_step} tokens/step, "
          f"{threads} threads (numpy BLAS = torch.set_num_threads), torch {torch.__version__}, "
          f"numpy {np.__version__}, median of {args.steps} steps")
    print("| backend | step ms (median) | step ms (min) | tokens/s |")
    print("|---|---|---|---|")
    for k in ("numpy", "torch"):
        print(f"| {k} | {med[k] * 1e3:.1f} | {min(times[k]) * 1e3:.1f} | {tps[k]:,.0f} |")
    print(f"| ratio numpy/torch | | | {tps['numpy'] / tps['torch']:.2f}x |")
    print(f"\nnumpy RSS over {args.rss_steps} steps: {rss0 / 2**20:.1f} MiB -> "
          f"{rss1 / 2**20:.1f} MiB ({(rss1 - rss0) / 2**20:+.1f} MiB)")
    if not math.isfinite(n_loss) or abs(n_loss - t_loss) > 1e-3:
        print("WARNING: initial losses differ: the two models are not the same", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
