"""GPU benchmark: one full ANDREA training step (forward, backward, grad norm, clip, AdamW) on the
CUDA backend, before and after the speed work, against PyTorch on the same model and GPU, in the
same run. Prints one table per model, and with --profile the per-kernel profile of both paths.

    python3 scripts/bench_gpu.py [--models 120M,12M] [--torch eager,compile,reduce-overhead]
                                 [--steps 30] [--rounds 3] [--profile 120M,12M] [--json FILE]
                                 [--sustained 300] [--lead-s 1.5]

Implementations, each built (and compiled) once, then timed in interleaved rounds of --steps
steps back to back (the round's time over its steps; PyTorch's step has no synchronize and the
engine queues the next step behind the running one, so neither waits for the host inside a
round, except `andrea before`, driven from the host, and the `-sync` PyTorch variants). Each
round comes after at least --lead-s seconds (1.5) of the same implementation's steps, untimed,
so that no round inherits the GPU's power state from the round before it. The table shows the
median of the rounds and the spread between them. With
--sustained N, the engine and the PyTorch modes within 1.3x of the fastest also run N steps back
to back, twice in turn, timed step by step with events on their streams: the median of steps
N/3+1..N, where a long run holds the GPU at its power limit (andrea-train's measure):
- `andrea`: the default path (cuDNN attention where installed, fused kernels, GEMMs timed at
  start, weight-gradient stream, the one-graph step: CudaBackend.train_step);
- `andrea before`: the path before (`--attention classic`, fusions off: plain cuBLAS, separate
  kernels, the optimizer driven from the host), as the step was measured until now;
- PyTorch at its best practice on the same model (bf16 autocast, fused AdamW, flash SDPA,
  TF32 on, clip_grad_norm_, Q/K/V from one Linear as nanoGPT's c_attn): eager, torch.compile,
  torch.compile(mode="reduce-overhead") (CUDA graphs), the same with cuDNN's fused attention
  (reduce-overhead-cudnn), and max-autotune when asked. A variant is a mode with optional
  suffixes, in this order: -sepqkv (three Linears for Q, K, V), -cudnn (scaled_dot_product_
  attention through cuDNN's fused attention instead of the backend PyTorch picks by itself),
  -sync (the host waits for every step, as this benchmark's PyTorch step did until the eleventh
  session). Its loss at step 1 is checked against the engine's on the same weights and tokens.

MFU = tokens/s · FLOPs per token / peak, with llm.c's count: FLOPs/token = 6·N + 6·L·d·T
(N every parameter, tied wte counted once; the attention term is the causal half of 12·L·d·T)
and the peak dense bf16 of an H100/H200 SXM: 989 TFLOP/s.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model.layout import ModelShapes, init_params, n_params, tensor_table
from engine.model.optim import clip_scale

PEAK_BF16 = 989e12
LEAD_S = 1.5  # seconds of untimed steps before each timed round (timed_round)
MODELS = {
    "120M": ModelShapes(n_layer=12, d_model=768, n_head=12, d_ff=3072, vocab_size=8449,
                        seq_len=1024),
    "12M": ModelShapes(n_layer=6, d_model=384, n_head=6, d_ff=1536, vocab_size=8449,
                       seq_len=1024),
}
B = 8
QKV = ("attn.W_Q", "attn.W_K", "attn.W_V")
AFTER = {"attention": "auto", "fusions": True}
BEFORE = {"attention": "classic", "fusions": False}
# the optimizer step every implementation takes (PyTorch's AdamW gets the same values)
STEP_HP = {"loss_scale": 1.0, "grad_mult": 1.0, "lr": 3e-4, "beta1": 0.9, "beta2": 0.95,
           "eps": 1e-8, "weight_decay": 0.1, "max_norm": 1.0}
FP8 = {**AFTER, "precision": "fp8"}  # train/precision "fp8": the MLP's GEMMs in FP8 (--fp8)
TORCH_MODES = ("eager", "compile", "reduce-overhead", "max-autotune")
# a PyTorch variant is a mode and any of these suffixes, in this order (torch_variant parses it)
SEPARATE_QKV = "-sepqkv"  # Q, K, V as three Linears (not best practice)
CUDNN_SDPA = "-cudnn"  # scaled_dot_product_attention through cuDNN's attention, not its default
SYNC = "-sync"  # the host waits for each step (as this benchmark's PyTorch step once did)


@dataclass(frozen=True)
class TorchVariant:
    mode: str
    fused_qkv: bool = True
    cudnn_sdpa: bool = False
    sync: bool = False


def torch_variant(name: str) -> TorchVariant:
    """`mode[-sepqkv][-cudnn][-sync]`, e.g. reduce-overhead-cudnn; ValueError for anything else
    (a misspelt variant must fail, not run as another one under its name)."""
    rest, flags = name, {}
    for suffix, key in ((SYNC, "sync"), (CUDNN_SDPA, "cudnn_sdpa"), (SEPARATE_QKV, "sepqkv")):
        flags[key] = rest.endswith(suffix)
        rest = rest.removesuffix(suffix)
    if rest not in TORCH_MODES:
        raise ValueError(f"PyTorch variant {name!r}: expected one of {', '.join(TORCH_MODES)}, "
                         f"then optionally {SEPARATE_QKV}, {CUDNN_SDPA}, {SYNC} in that order")
    return TorchVariant(rest, not flags["sepqkv"], flags["cudnn_sdpa"], flags["sync"])


# the default with one fusion switched (engine/backends/cuda/settings.py), timed beside it: --variants
VARIANTS = {"andrea no QKV rows": {"ANDREA_QKV_ROWS": "0"},
            "andrea no side stream": {"ANDREA_SIDE_STREAM": "0"},
            "andrea with fused LN": {"ANDREA_FUSED_LN": "1"},
            "andrea LN sums on main": {"ANDREA_SIDE_LN": "0"},
            "andrea AdamW not deferred": {"ANDREA_DEFER_ADAMW": "0"},
            "andrea with resid GEMM": {"ANDREA_RESID_GEMM": "1"},
            "andrea 32 GEMM candidates": {"ANDREA_GEMM_CANDIDATES": "32"},
            "andrea memset nodes": {"ANDREA_MEMSET_KERNELS": "0"},
            "andrea fp32 logits": {"ANDREA_LOGITS_LP": "0"},
            "andrea fp32 weight grads": {"ANDREA_GRADS_LP": "0"}}


def flops_per_token(s: ModelShapes) -> float:
    return 6.0 * n_params(s) + 6.0 * s.n_layer * s.d_model * s.seq_len


def batches(s: ModelShapes, n: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, s.vocab_size, (B, s.seq_len + 1)).astype(np.int32) for _ in range(n)]


# --- ANDREA ---------------------------------------------------------------------------------------


def andrea_backend(s: ModelShapes, opts: dict[str, Any], graphs: bool = True,
                   env: dict[str, str] | None = None) -> Any:
    import os

    from engine.backends.cuda import CudaBackend

    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        bk = CudaBackend(s, B, opts.get("precision", "bf16"),
                         **{k: v for k, v in opts.items() if k != "precision"})
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    bk.use_graphs = graphs
    bk.load_params(init_params(s, seed=1337))
    return bk


def andrea_step(bk: Any) -> Callable[..., None]:
    """One optimizer step as the trainer runs it: the one-graph step when the backend has it
    (given `nxt`, the next step is queued behind it before it is waited for, as andrea-train
    queues it: the device never waits for the host), else zero_grads / forward_backward /
    grad_norm / clip / adamw from the host."""
    hp = STEP_HP

    def step(tok: np.ndarray, t: int, nxt: np.ndarray | None = None) -> None:
        x, y = tok[:, :-1], tok[:, 1:]
        if bk.fused_step:
            if bk.queued_steps == 0:
                bk.launch_step(x, y, t=t, **hp)
            if nxt is not None:
                bk.launch_step(nxt[:, :-1], nxt[:, 1:], t=t + 1, **hp)
            bk.step_result()
            return
        bk.zero_grads()
        bk.forward_backward(x, y)
        norm = bk.grad_norm()
        sc = clip_scale(norm, hp["max_norm"])
        if sc < 1.0:
            bk.grad_scale(sc)
        bk.adamw(hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"], t)
        bk.synchronize()

    return step


@dataclass
class Clock:
    """Device time on one implementation's stream: mark() records an event there now,
    elapsed(a, b) is the ms between two marks once both ran, finish() waits for all queued
    work."""

    mark: Callable[[], Any]
    elapsed: Callable[[Any, Any], float]
    finish: Callable[[], None]


def andrea_clock(bk: Any) -> Clock:
    def mark() -> Any:
        e = bk.drv.Event()
        e.record(bk.stream)
        return e

    def finish() -> None:
        while bk.fused_step and bk.queued_steps:
            bk.step_result()
        bk.synchronize()

    return Clock(mark, lambda a, b: b.time_since(a), finish)


class EnergyMeter:
    """A GPU's total-energy counter (engine.run.telemetry.Nvml.energy_mj: millijoules, moving
    about every 100 ms on the H200, NOTES.md tenth session), read every `every_s` in a thread:
    `watts(t0, t1)` is the average power between its first and last change inside [t0, t1]
    (time.perf_counter seconds), None when fewer than three changes fall inside (under about
    0.2 s). At the power limit a step's time is its energy over the limit, so the joules per
    step say what a faster step would have to save (NOTES.md, sixteenth session)."""

    def __init__(self, read: Callable[[], int | None], every_s: float = 0.002,
                 on_close: Callable[[], None] | None = None) -> None:
        import threading

        self.read, self.every_s, self.on_close = read, every_s, on_close
        self.points: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="energy", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, index: int = 0) -> EnergyMeter | None:
        """GPU `index`'s meter, or None without NVML (the `nvml` extra) or the counter."""
        from engine.run.telemetry import Nvml

        nvml = Nvml.open([index])
        if nvml is None:
            return None
        if nvml.energy_mj() is None:
            nvml.close()
            return None
        return cls(nvml.energy_mj, on_close=nvml.close)

    def _run(self) -> None:
        last = None
        while not self._stop.is_set():
            e = self.read()
            if e is None:  # the counter went away: no more points
                return
            if e != last:
                self.points.append((time.perf_counter(), e))
                last = e
            self._stop.wait(self.every_s)

    def watts(self, t0: float, t1: float) -> float | None:
        inside = [p for p in self.points if t0 <= p[0] <= t1]
        if len(inside) < 3 or inside[-1][0] <= inside[0][0]:
            return None
        (ta, ea), (tb, eb) = inside[0], inside[-1]
        return (eb - ea) / 1e3 / (tb - ta)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.on_close is not None:
            self.on_close()


def sustained_ms(step: Callable[[int], None], clock: Clock, n: int) -> list[float]:
    """n steps back to back, as a training run takes them (step(i) queues step i and returns
    when the implementation lets the host go on), and each step's device time: the interval
    between the marks recorded on the stream after each step was queued, so a gap in which the
    GPU waits for the host counts too."""
    marks = [clock.mark()]
    for i in range(n):
        step(i)
        marks.append(clock.mark())
    clock.finish()
    return [clock.elapsed(a, b) for a, b in itertools.pairwise(marks)]


def andrea_queued(bk: Any, toks: list[np.ndarray], t0: int) -> Callable[[int], None]:
    """andrea-train's loop: step i is staged and queued, then the host waits for the step
    before it (two steps in flight)."""

    def step(i: int) -> None:
        tok = toks[(t0 + i) % len(toks)]
        bk.launch_step(tok[:, :-1], tok[:, 1:], t=t0 + i, **STEP_HP)
        if bk.queued_steps > 1:
            bk.step_result()

    return step


def gpu_step_ms(bk: Any, toks: list[np.ndarray], t0: int, n: int = 20) -> float:
    """Median device time of the one-graph step (CUDA events around the queued step: its
    copies and graph, not the host's staging before it)."""
    drv = bk.drv
    e0, e1 = drv.Event(), drv.Event()
    times = []
    for i in range(n):
        tok = toks[i % len(toks)]
        bk.prepare_step(tok[:, :-1], tok[:, 1:])
        e0.record(bk.stream)
        bk.launch_step(None, None, t=t0 + i, **STEP_HP)
        e1.record(bk.stream)
        bk.step_result()
        times.append(e1.time_since(e0))
    return statistics.median(times)


def gemm_rates(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Each timed GEMM problem of a plan with its best time and rate, slowest rate first."""
    out = []
    for key, e in plan.get("gemms", {}).items():
        m = re.match(r"(\d+)x(\d+)x(\d+) .*?batch=(\d+):.*?epi=(\S+)", key)
        if not m or not e.get("ms"):
            continue
        M, N, K, batch = (int(m.group(i)) for i in range(1, 5))
        flop = 2.0 * M * N * K * batch
        out.append({"problem": key, "ms": e["ms"], "tflops": flop / e["ms"] / 1e9,
                    "rank": e.get("rank"), "top1_ms": e.get("top1_ms"), "epilogue": m.group(5)})
    return sorted(out, key=lambda r: r["tflops"])


def kernels_per_step(bk: Any) -> int:
    """Kernels one step launches: the step graph's kernel nodes (the fused step), or the
    forward/backward graph's plus the optimizer's three launches; without the k_fill nodes
    that stand for cuDNN's and cuBLASLt's memsets (graph_fills), so that the count compares
    with the ones measured before them."""
    if bk.fused_step:
        return bk.graph_nodes("step").get("kernel", 0) - bk.graph_fills("step")
    return bk.graph_nodes("fb").get("kernel", 0) - bk.graph_fills("fb") + 3


def profile_andrea(s: ModelShapes, opts: dict[str, Any], steps: int = 3) -> dict[str, Any]:
    """Per-kernel GPU time of full steps (CUPTI through torch.profiler sees PyCUDA's, cuBLAS's
    and cuDNN's kernels too, as they share the primary context). Direct launches, so kernels
    are attributable; the weight-gradient stream's kernels are counted like the others."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    bk = andrea_backend(s, opts, graphs=False)
    tok = batches(s, 1)[0]
    step = andrea_step(bk)
    step(tok, 1)
    bk.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for t in range(steps):
            step(tok, t + 2)
        bk.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us > 0:
            rows.append((us / steps, e.count / steps, e.key))
    rows.sort(reverse=True)
    choices = bk.gemm.export_plan()["choices"] if bk.gemm is not None else {}
    bk.close()
    return {"rows": rows, "total_us": sum(r[0] for r in rows),
            "kernels": sum(r[1] for r in rows), "choices": choices}


def print_profile(key: str, name: str, prof: dict[str, Any], top: int = 24) -> None:
    total = prof["total_us"]
    print(f"\nANDREA-{key} {name}: kernel time per step {total / 1e3:.2f} ms, "
          f"{prof['kernels']:.0f} kernels per step (profiled, direct launches)")
    for us, count, kname in prof["rows"][:top]:
        print(f"  {us / 1e3:7.3f} ms {100 * us / total:5.1f}%  x{count:<5.0f} {kname[:86]}")
    for what, c in prof.get("choices", {}).items():
        print(f"  GELU {what}: {c['use']} (epilogue GEMM {c['epilogue_ms']} ms, "
              f"GEMM + kernel {c['kernel_ms']} ms)")


# --- PyTorch ----------------------------------------------------------------------------------------


def torch_model(s: ModelShapes, fused_qkv: bool = True, cudnn_sdpa: bool = False):
    """The engine's model in PyTorch; fused_qkv: Q, K and V from one Linear (nanoGPT's c_attn,
    the faster), else three; cudnn_sdpa: scaled_dot_product_attention through cuDNN's fused
    attention (torch.nn.attention.sdpa_kernel) instead of the backend PyTorch picks itself."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch import nn

    def attention_backend() -> Any:
        if not cudnn_sdpa:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.CUDNN_ATTENTION])

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = s.d_model
            self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
            if fused_qkv:  # nanoGPT's c_attn: one GEMM for Q, K and V
                self.qkv = nn.Linear(d, 3 * d, bias=False)
            else:
                self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
            self.o = nn.Linear(d, d, bias=False)
            self.w1, self.w2 = nn.Linear(d, s.d_ff, bias=False), nn.Linear(s.d_ff, d, bias=False)

        def forward(self, x):
            Bq, T, d = x.shape
            h = self.ln1(x)
            parts = (self.qkv(h).split(d, dim=-1) if fused_qkv
                     else (self.q(h), self.k(h), self.v(h)))
            q, k, v = (m.view(Bq, T, s.n_head, -1).transpose(1, 2) for m in parts)
            with attention_backend():
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

        def forward(self, idx, targets):
            T = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            logits = self.lnf(x) @ self.wte.weight.T
            return F.cross_entropy(logits.float().view(-1, s.vocab_size), targets.reshape(-1))

    model = GPT().cuda()
    assert sum(p.numel() for p in model.parameters()) == n_params(s)
    load_engine_weights(model, s, init_params(s, seed=1337), fused_qkv)
    return model


def load_engine_weights(model: Any, s: ModelShapes, flat: np.ndarray,
                        fused_qkv: bool = True) -> None:
    """The engine's flat parameters (DESIGN §2 order, `x @ W` with W [in, out]) into the
    PyTorch model (nn.Linear keeps W [out, in])."""
    import torch

    by = {t.name: flat[t.offset:t.offset + t.size].reshape(t.shape) for t in tensor_table(s)}

    def put(p: Any, a: np.ndarray) -> None:
        with torch.no_grad():
            p.copy_(torch.from_numpy(np.ascontiguousarray(a)))

    put(model.wte.weight, by["wte"])
    put(model.wpe.weight, by["wpe"])
    for i, blk in enumerate(model.blocks):
        h = f"h.{i}."
        put(blk.ln1.weight, by[h + "ln1.gamma"])
        put(blk.ln1.bias, by[h + "ln1.beta"])
        put(blk.ln2.weight, by[h + "ln2.gamma"])
        put(blk.ln2.bias, by[h + "ln2.beta"])
        if fused_qkv:
            put(blk.qkv.weight, np.concatenate([by[h + n] for n in QKV], axis=1).T)
        else:
            for m, n in zip((blk.q, blk.k, blk.v), QKV, strict=True):
                put(m.weight, by[h + n].T)
        for m, n in ((blk.o, "attn.W_O"), (blk.w1, "mlp.W_1"), (blk.w2, "mlp.W_2")):
            put(m.weight, by[h + n].T)
    put(model.lnf.weight, by["lnf.gamma"])
    put(model.lnf.bias, by["lnf.beta"])


def torch_step(s: ModelShapes, variant: str) -> tuple[Callable[[np.ndarray, int], None], Any]:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    v = torch_variant(variant)
    model = torch_model(s, v.fused_qkv, v.cudnn_sdpa)
    run = model
    if v.mode == "compile":
        run = torch.compile(model)
    elif v.mode in ("reduce-overhead", "max-autotune"):
        run = torch.compile(model, mode=v.mode)
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": STEP_HP["weight_decay"]},
                             {"params": other, "weight_decay": 0.0}],
                            lr=STEP_HP["lr"], betas=(STEP_HP["beta1"], STEP_HP["beta2"]),
                            eps=STEP_HP["eps"], fused=True)
    dev: dict[int, Any] = {}

    def step(tok: np.ndarray, t: int) -> None:
        key = id(tok)
        if key not in dev:
            dev[key] = torch.from_numpy(tok.astype(np.int64)).cuda()
        d = dev[key]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(d[:, :-1], d[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), STEP_HP["max_norm"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        # Without `sync` the host queues the next step while this one runs, as the engine's two
        # steps in flight let it (a synchronize per step adds PyTorch's launch time to each of
        # its steps); the timed loops wait for the device at their end.
        if v.sync:
            torch.cuda.synchronize()

    return step, (model, run, opt)


def torch_clock() -> Clock:
    import torch

    def mark() -> Any:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    return Clock(mark, lambda a, b: a.elapsed_time(b), torch.cuda.synchronize)


def loss_check(s: ModelShapes) -> tuple[float, float]:
    """(engine, PyTorch) loss at step 1: the same weights (seed 1337) and tokens, bf16."""
    import torch

    tok = batches(s, 1)[0]
    bk = andrea_backend(s, AFTER)
    ours = float(bk.forward_loss(tok[:, :-1], tok[:, 1:]).mean())
    bk.close()
    model = torch_model(s)
    d = torch.from_numpy(tok.astype(np.int64)).cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        theirs = float(model(d[:, :-1], d[:, 1:]))
    del model
    torch.cuda.empty_cache()
    return ours, theirs


# --- the benchmark ----------------------------------------------------------------------------------


def bench_telemetry(key: str, steps: int, rounds: int) -> dict[str, float]:
    """What system telemetry (engine.run.telemetry.SystemSampler: NVML, /proc) costs the
    engine's step: one sample timed alone, then the step timed in interleaved rounds without
    the sampler and with it sampling every 10 ms (500x the default rate: its cost made
    measurable), and the share of step time at the default rate."""
    from engine.run.telemetry import SAMPLE_EVERY_S, SystemSampler

    s = MODELS[key]
    toks = batches(s)
    bk = andrea_backend(s, AFTER)
    step = andrea_step(bk)
    probe = SystemSampler(lambda _r: None, lambda: 0, [0])
    gpus = len(probe.sample().gpus)
    t0 = time.perf_counter()
    for _ in range(50):
        probe.sample()
    per_sample = (time.perf_counter() - t0) / 50
    if probe.nvml is not None:
        probe.nvml.close()
    t = 0
    for _ in range(5):
        t += 1
        step(toks[t % len(toks)], t)
    med: dict[str, list[float]] = {"off": [], "every 10 ms": []}
    for _ in range(rounds):
        for mode in med:
            sampler = None
            if mode != "off":
                sampler = SystemSampler(lambda _r: None, lambda: 0, [0], every_s=0.01)
                sampler.start()
            times = []
            for _ in range(steps):
                t += 1
                t0 = time.perf_counter()
                step(toks[t % len(toks)], t)
                times.append(time.perf_counter() - t0)
            if sampler is not None:
                sampler.stop()
            med[mode].append(statistics.median(times))
    bk.close()
    off, fast = statistics.median(med["off"]), statistics.median(med["every 10 ms"])
    share = per_sample / SAMPLE_EVERY_S
    print(f"\ntelemetry, ANDREA-{key}: one sample {per_sample * 1e6:.0f} µs ({gpus} GPU(s) through "
          f"NVML); step {off * 1e3:.3f} ms without the sampler, {fast * 1e3:.3f} ms with it "
          f"sampling every 10 ms ({(fast / off - 1) * 100:+.2f}%); at the default every "
          f"{SAMPLE_EVERY_S:g} s the sampler holds {share * 100:.4f}% of the time (goal < 0.5%)")
    return {"sample_us": per_sample * 1e6, "step_ms_off": off * 1e3,
            "step_ms_every_10ms": fast * 1e3, "default_share": share, "gpus": gpus}


def bench_sustained(key: str, impls: dict[str, tuple[Callable[..., None], Any]],
                    clocks: dict[str, Clock], toks: list[np.ndarray], t_counter: dict[str, int],
                    n: int, meter: EnergyMeter | None = None) -> dict[str, dict[str, Any]]:
    """The engine (one-graph step) and each PyTorch mode for n steps back to back, twice, in
    turn (the second pass in reverse order): the median step of all but the first third of
    each run (steps 101..300 of 300, about andrea-train's median of steps 100..300), which is
    where a long run holds the GPU at its power limit while short rounds may not. With a
    meter, each run's average power over the same part ("W", the median of the two runs) and
    the energy of a median step ("J" = W x ms). A run that fails is reported as
    {"failed": why} and not run again; the others go on."""
    names = [n_ for n_ in impls if n_ == "andrea" or n_.startswith("torch")]
    names = [n_ for n_ in names if not (n_ == "andrea" and not impls[n_][1].fused_step)]
    skip = n // 3
    times: dict[str, list[float]] = {n_: [] for n_ in names}
    watts: dict[str, list[float]] = {n_: [] for n_ in names}
    failed: dict[str, str] = {}
    for order in (names, names[::-1]):
        for name in order:
            if name in failed:
                continue
            step, obj = impls[name]
            t0 = t_counter[name] + 1
            t_counter[name] += n
            if name == "andrea":
                one = andrea_queued(obj, toks, t0)
            else:
                def one(i: int, step: Callable[..., None] = step, t0: int = t0) -> None:
                    step(toks[(t0 + i) % len(toks)], t0 + i)
            try:
                clocks[name].finish()
                t0 = time.perf_counter()
                times[name] += sustained_ms(one, clocks[name], n)[skip:]
                t1 = time.perf_counter()
                w = meter.watts(t0 + (t1 - t0) * skip / n, t1) if meter is not None else None
                if w is not None:
                    watts[name].append(w)
            except Exception as e:
                failed[name] = f"failed: {type(e).__name__}: {e}"[:120]
                print(f"  {key} sustained {name}: {failed[name]}", flush=True)
    out: dict[str, dict[str, Any]] = {name: {"failed": why} for name, why in failed.items()}
    for name, t in times.items():
        if name in failed:
            continue
        t = sorted(t)
        out[name] = {"ms": statistics.median(t), "p10": t[len(t) // 10],
                     "p90": t[9 * len(t) // 10], "steps": len(t)}
        energy = ""
        if watts[name]:
            w = statistics.median(watts[name])
            out[name].update(W=w, J=w * out[name]["ms"] / 1e3)
            energy = f"; {w:.0f} W, {out[name]['J']:.2f} J a step"
        print(f"  {key} sustained {name}: median {out[name]['ms']:.2f} ms (p10 "
              f"{out[name]['p10']:.2f}, p90 {out[name]['p90']:.2f}; steps {skip + 1}..{n} of two"
              f" runs of {n}{energy})", flush=True)
    return out


def play(name: str, step: Callable[..., None], toks: list[np.ndarray],
         t_counter: dict[str, int], n: int) -> None:
    """n steps of one implementation back to back, continuing its step count (the engine's with
    the next batch queued behind each, as andrea-train queues it; the last one queues none)."""
    for i in range(n):
        t_counter[name] += 1
        c = t_counter[name]
        ahead = ((toks[(c + 1) % len(toks)],) if name.startswith("andrea") and i + 1 < n
                 else ())
        step(toks[c % len(toks)], c, *ahead)


def timed_round(name: str, step: Callable[..., None], clock: Clock, toks: list[np.ndarray],
                t_counter: dict[str, int], steps: int, lead_s: float,
                now: Callable[[], float] = time.perf_counter) -> float:
    """One round of one implementation: at least lead_s seconds of its own steps, untimed, then
    `steps` steps timed from the first one's start to the last one's end; seconds a step.

    The lead puts the GPU at this implementation's own load before it is timed. Without it a
    round inherits the power limiter's state from the round before it: in the nineteenth
    session (NOTES.md) the engine's first 120M round, after an idle spell, took 11.36 ms and
    its next two, after PyTorch's rounds, 11.88 and 12.01; PyTorch reduce-overhead's rounds,
    after torch.compile's, 14.26–14.35 ms, against 14.61 in its 300-step runs."""
    clock.finish()
    end = now() + lead_s
    while now() < end:
        play(name, step, toks, t_counter, steps)
    clock.finish()
    t0 = now()
    play(name, step, toks, t_counter, steps)
    clock.finish()
    return (now() - t0) / steps


def bench_model(key: str, torch_variants: list[str], steps: int, rounds: int,
                notes: dict[str, Any], variants: tuple[str, ...] = (),
                fp8: bool = False, sustained: int = 0,
                lead_s: float = LEAD_S) -> list[dict[str, Any]]:
    s = MODELS[key]
    toks = batches(s)
    impls: dict[str, tuple[Callable[..., None], Any]] = {}
    clocks: dict[str, Clock] = {}
    info: dict[str, str] = {}
    andreas = [("andrea", AFTER, None), ("andrea before", BEFORE, None)]
    if fp8:
        andreas.append(("andrea fp8", FP8, None))
    andreas += [(n, AFTER, VARIANTS[n]) for n in variants]
    for name, opts, env in andreas:
        bk = andrea_backend(s, opts, env=env)
        impls[name], clocks[name] = (andrea_step(bk), bk), andrea_clock(bk)
    for v in torch_variants:
        try:
            impls[f"torch {v}"], clocks[f"torch {v}"] = torch_step(s, v), torch_clock()
        except Exception as e:  # a failed variant is reported, not fatal
            info[f"torch {v}"] = f"failed: {type(e).__name__}: {e}"[:70]
    # warm-up: graph capture, compilation (timed), cuBLAS/cuDNN set-up
    t_counter = dict.fromkeys(impls, 0)
    for name, (step, _) in list(impls.items()):
        t0 = time.perf_counter()
        try:
            for _ in range(3):
                t_counter[name] += 1
                step(toks[t_counter[name] % len(toks)], t_counter[name])
            clocks[name].finish()
        except Exception as e:
            info[name] = f"failed: {type(e).__name__}: {e}"[:70]
            del impls[name]
            continue
        warm = time.perf_counter() - t0
        if name.startswith("torch ") and name != "torch eager":
            info[name] = f"compile+3 steps {warm:.0f} s"
    for name in ("andrea", "andrea before", "andrea fp8"):
        if name in impls:
            bk = impls[name][1]
            k = kernels_per_step(bk)
            plan = bk.memory_plan()
            notes.setdefault(key, {})[name] = {
                "kernels_per_step": k, "memory_plan": plan, "describe": bk.describe(),
                "attention": bk.attention_info}
            if bk.fused_step:
                notes[key][name]["graph_nodes"] = bk.graph_nodes("step")
                notes[key][name]["graph_fills"] = bk.graph_fills("step")
                t_counter[name] += 20
                notes[key][name]["gpu_ms"] = gpu_step_ms(bk, toks, t_counter[name] - 19)
            if bk.gemm is not None:
                timed, best, first = bk.gemm.timing_summary()
                notes[key][name]["gemm_timing"] = {"problems": timed, "best_ms": best,
                                                   "first_choice_ms": first}
                notes[key][name]["gemms"] = gemm_rates(bk.gemm.export_plan())
    # rounds: `steps` steps back to back after lead_s of untimed ones (timed_round), timed from
    # the first step's start to the last one's end (every implementation queues ahead where it
    # can: PyTorch without a host sync inside the step, the engine with the next step queued
    # behind the running one)
    medians: dict[str, list[float]] = {n: [] for n in impls}
    for rnd in range(rounds):
        for name, (step, _) in impls.items():
            medians[name].append(timed_round(name, step, clocks[name], toks, t_counter, steps,
                                             lead_s))
            print(f"  {key} round {rnd + 1} {name}: {medians[name][-1] * 1e3:.2f} ms", flush=True)
    if sustained:
        # the PyTorch modes within 1.3x of the fastest one's rounds (eager and compile are
        # far behind reduce-overhead: their long runs would only spend device time)
        torch_ms = {n: statistics.median(m) for n, m in medians.items()
                    if n.startswith("torch") and m}
        near = [n for n, ms in torch_ms.items() if ms <= 1.3 * min(torch_ms.values())]
        if near:  # nothing to compare the engine's long runs with otherwise
            meter = EnergyMeter.open()
            try:
                notes.setdefault(key, {})["sustained"] = bench_sustained(
                    key, {n: impls[n] for n in ("andrea", *near) if n in impls}, clocks, toks,
                    t_counter, sustained, meter)
            finally:
                if meter is not None:
                    meter.close()
    for name, _, _ in andreas:
        if name in impls:
            impls[name][1].close()
    impls.clear()
    try:
        import torch

        torch.cuda.empty_cache()
    except Exception:
        pass
    tokens, fpt = B * s.seq_len, flops_per_token(s)
    rows = []
    ours = statistics.median(medians["andrea"]) if medians.get("andrea") else float("nan")
    for name in [*medians, *[n for n in info if n not in medians]]:
        m = medians.get(name, [])
        sec = statistics.median(m) if m else float("nan")
        spread = f"±{(max(m) - min(m)) / min(m) * 100:.1f}%" if len(m) > 1 else ""
        rows.append({"model": f"ANDREA-{key}", "impl": name, "ms": sec * 1e3,
                     "tok_s": tokens / sec, "mfu": tokens / sec * fpt / PEAK_BF16,
                     "vs_andrea": sec / ours, "rounds_ms": [x * 1e3 for x in m],
                     "note": " ".join(x for x in (spread, info.get(name, "")) if x)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="120M,12M")
    ap.add_argument("--torch", default="eager,compile,reduce-overhead,reduce-overhead-cudnn",
                    help="PyTorch variants to compare, comma-separated ('' for none): a mode "
                         "(eager, compile, reduce-overhead, max-autotune) with optional suffixes "
                         "-sepqkv, -cudnn, -sync")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3,
                    help="time every implementation this many times, interleaved")
    ap.add_argument("--lead-s", type=float, default=LEAD_S, metavar="S",
                    help="at least this many seconds (0 to 60) of an implementation's own "
                         f"steps, untimed, before each of its rounds (default {LEAD_S}; 0: none, "
                         "as before the nineteenth session)")
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", default="", help="models to profile per kernel, e.g. 120M,12M")
    ap.add_argument("--profile-paths", default="before,after",
                    help="which paths --profile profiles (before, after, fp8)")
    ap.add_argument("--telemetry", default="",
                    help="models whose step is timed with the telemetry sampler running, e.g. 12M")
    ap.add_argument("--sustained", type=int, default=0, metavar="N",
                    help="also run the engine and the fastest PyTorch modes for N steps back to "
                         "back, twice in turn, and compare their median step past the first "
                         "third (steps 101..300 of 300: andrea-train's window)")
    ap.add_argument("--no-loss-check", action="store_true")
    ap.add_argument("--fp8", action="store_true",
                    help="also time the engine with train/precision fp8 (the MLP in FP8)")
    ap.add_argument("--variants", nargs="?", const=",".join(VARIANTS), default="",
                    help="also time the default with one fusion switched at a time: all, or "
                         "the names given (comma-separated, e.g. 'andrea no QKV rows')")
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    variants = [v for v in args.torch.split(",") if v]
    switched = tuple(dict.fromkeys(v.strip() for v in args.variants.split(",") if v.strip()))
    for v in variants:
        try:
            torch_variant(v)
        except ValueError as e:
            print(f"bench_gpu.py: --torch: {e}", file=sys.stderr)
            return 2
    for flag, value in (("--steps", args.steps), ("--rounds", args.rounds)):
        if value < 1:
            print(f"bench_gpu.py: {flag}: expected at least 1, got {value}", file=sys.stderr)
            return 2
    if not 0 <= args.lead_s <= 60:  # also refuses nan
        print(f"bench_gpu.py: --lead-s: expected seconds from 0 to 60, got {args.lead_s}",
              file=sys.stderr)
        return 2
    if args.sustained and args.sustained < 3:
        print(f"bench_gpu.py: --sustained: expected 0 (none) or at least 3 steps, got "
              f"{args.sustained}", file=sys.stderr)
        return 2
    if unknown := [v for v in switched if v not in VARIANTS]:
        print(f"bench_gpu.py: --variants: unknown {', '.join(map(repr, unknown))}; known: "
              f"{', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    from engine.backends import cuda_status

    usable, why = cuda_status()
    if not usable:
        print(f"bench_gpu.py: needs a CUDA GPU with pycuda: {why}", file=sys.stderr)
        return 2
    out: dict[str, Any] = {"rows": [], "notes": {}, "profile": {}, "loss_check": {},
                           "timing": {"steps": args.steps, "rounds": args.rounds,
                                      "lead_s": args.lead_s, "sustained": args.sustained}}
    for key in [m for m in args.profile.split(",") if m]:
        for name, opts in (("before", BEFORE), ("after", AFTER), ("fp8", FP8)):
            if name not in args.profile_paths.split(","):
                continue
            prof = profile_andrea(MODELS[key], opts)
            print_profile(key, name, prof)
            out["profile"].setdefault(key, {})[name] = {
                "total_ms": prof["total_us"] / 1e3, "kernels": prof["kernels"],
                "top": [(us / 1e3, c, n) for us, c, n in prof["rows"][:40]]}
    for key in [m for m in args.telemetry.split(",") if m]:
        out["telemetry"] = bench_telemetry(key, args.steps, args.rounds)
    for key in models:
        if variants and not args.no_loss_check:
            ours, theirs = loss_check(MODELS[key])
            out["loss_check"][key] = {"andrea": ours, "torch": theirs}
            print(f"\nANDREA-{key} loss at step 1, same weights and tokens: engine {ours:.5f}, "
                  f"PyTorch {theirs:.5f} (|diff| {abs(ours - theirs):.2e})")
        out["rows"] += bench_model(key, variants, args.steps, args.rounds, out["notes"],
                                   switched, args.fp8, args.sustained, args.lead_s)
    print(f"\nGPU benchmark: B={B}, T=1024, one full step (fwd, bwd, clip, AdamW); median of "
          f"{args.rounds} interleaved rounds of {args.steps} steps back to back, each after at "
          f"least {args.lead_s:g} s of its own steps untimed (± the spread between rounds); MFU = "
          f"tok/s·(6N + 6·L·d·T)/989 TFLOP/s")
    print(f"{'model':<12} {'implementation':<24} {'ms/step':>8} {'tok/s':>9} {'MFU':>6} "
          f"{'vs andrea':>9}  note")
    for r in out["rows"]:
        print(f"{r['model']:<12} {r['impl']:<24} {r['ms']:>8.2f} {r['tok_s'] / 1e3:>8.0f}K "
              f"{r['mfu'] * 100:>5.1f}% {r['vs_andrea']:>9.2f}  {r['note']}")
    for key in models:
        rows = [r for r in out["rows"] if r["model"] == f"ANDREA-{key}"]
        torch_rows = [r for r in rows if r["impl"].startswith("torch") and r["ms"] == r["ms"]]
        ours = next((r for r in rows if r["impl"] == "andrea"), None)
        if torch_rows and ours:
            best = min(torch_rows, key=lambda r: r["ms"])
            print(f"ANDREA-{key}: andrea {ours['ms']:.2f} ms vs the fastest PyTorch "
                  f"({best['impl']}) {best['ms']:.2f} ms: {best['ms'] / ours['ms']:.2f}x "
                  f"(goal 1.25x)")
        sus = out["notes"].get(key, {}).get("sustained", {})
        sus = {n: v for n, v in sus.items() if "ms" in v}  # not the runs that failed
        sus_torch = {n: v for n, v in sus.items() if n.startswith("torch")}
        if "andrea" in sus and sus_torch:
            name, best_s = min(sus_torch.items(), key=lambda kv: kv[1]["ms"])
            print(f"ANDREA-{key}, {args.sustained} steps back to back: andrea "
                  f"{sus['andrea']['ms']:.2f} ms vs the fastest PyTorch ({name}) "
                  f"{best_s['ms']:.2f} ms: {best_s['ms'] / sus['andrea']['ms']:.2f}x")
        f8 = next((r for r in rows if r["impl"] == "andrea fp8" and r["ms"] == r["ms"]), None)
        if f8 and ours:
            print(f"ANDREA-{key}: andrea fp8 {f8['ms']:.2f} ms vs the engine's bf16 "
                  f"{ours['ms']:.2f} ms: {ours['ms'] / f8['ms']:.2f}x (goal 1.15x)"
                  + (f"; vs the fastest PyTorch {best['ms'] / f8['ms']:.2f}x" if torch_rows
                     else ""))
    print("\nkernels per step and memory plan (before → after):")
    for key, by in out["notes"].items():
        b, a = by.get("andrea before", {}), by.get("andrea", {})
        if a and b:
            pb, pa = b["memory_plan"], a["memory_plan"]
            print(f"  ANDREA-{key}: kernels {b['kernels_per_step']} → {a['kernels_per_step']}; "
                  f"memory total {pb['total'] / 2**30:.2f} → {pa['total'] / 2**30:.2f} GiB "
                  f"(activations {pb['activations'] / 2**30:.2f} → "
                  f"{pa['activations'] / 2**30:.2f}, scratch {pb['scratch'] / 2**20:.0f} → "
                  f"{pa['scratch'] / 2**20:.0f} MiB)")
            print(f"    after: {a['describe']}")
            f8 = by.get("andrea fp8")
            if f8:
                print(f"    fp8: {f8['describe']}; memory {f8['memory_plan']['total'] / 2**30:.2f}"
                      f" GiB (FP8 copies {f8['memory_plan'].get('fp8', 0) / 2**20:.0f} MiB)")
            if "graph_nodes" in a:
                print(f"    the step's graph nodes: {a['graph_nodes']}, of which "
                      f"{a.get('graph_fills', 0)} k_fill kernel nodes (memset nodes before)")
            if "gpu_ms" in a:
                print(f"    device time of the step (CUDA events around the queued step): "
                      f"{a['gpu_ms']:.2f} ms")
            g = a.get("gemm_timing")
            if g and g["problems"]:
                print(f"    GEMMs timed: {g['problems']} problems, fastest of the candidates "
                      f"{g['best_ms']:.3f} ms vs cuBLASLt's first choices {g['first_choice_ms']:.3f}"
                      f" ms (one run each)")
            for r in a.get("gemms", [])[:8]:  # the slowest rates: where GEMM time goes
                print(f"      {r['tflops']:6.0f} TFLOP/s {r['ms'] * 1e3:7.1f} us  rank "
                      f"{r['rank']}  {r['problem'][:100]}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
