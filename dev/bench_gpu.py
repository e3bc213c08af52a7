"""GPU benchmark: one full ANDREA training step (forward, backward, grad norm, clip, AdamW) on the
CUDA backend, on its fused path and on its classic one, against PyTorch on the same model and GPU,
in the same run. Prints one table per model, and with --profile the per-kernel profile of both paths.

    python3 dev/bench_gpu.py [--models 120M,12M] [--torch eager,compile,reduce-overhead]
                             [--steps 30] [--rounds 3] [--profile 120M,12M] [--json FILE]
                             [--sustained 300] [--lead-s 1.5]

Implementations, each built (and compiled) once, then timed in interleaved rounds of --steps
steps back to back (the round's time over its steps; PyTorch's step has no synchronize and the
engine queues the next step behind the running one, so neither waits for the host inside a
round, except `andrea classic`, driven from the host, and the `-sync` PyTorch variants). Each
round comes after at least --lead-s seconds (1.5) of the same implementation's steps, untimed,
so that no round inherits the GPU's power state from the round before it. The table shows the
median of the rounds and the spread between them. With
--sustained N, the engine and the PyTorch modes within 1.3x of the fastest also run N steps back
to back, twice in turn, timed step by step with events on their streams: the median of steps
N/3+1..N, where a long run holds the GPU at its power limit (andrea-train's measure):
- `andrea`: the default path (cuDNN attention where installed, fused kernels, GEMMs timed at
  start, weight-gradient stream, the one-graph step: CudaBackend.train_step);
- `andrea classic`: the classic path (the gpu section's attention `classic`, fusions off: plain
  cuBLAS, separate kernels, the optimizer driven from the host), what the fusions are measured
  against;
- PyTorch at its best practice on the same model (bf16 autocast, fused AdamW, flash SDPA,
  TF32 on, clip_grad_norm_, Q/K/V from one Linear as nanoGPT's c_attn): eager, torch.compile,
  torch.compile(mode="reduce-overhead") (CUDA graphs), the same with cuDNN's fused attention
  (reduce-overhead-cudnn), and max-autotune when asked. A variant is a mode with optional
  suffixes, in this order: -sepqkv (three Linears for Q, K, V), -cudnn (scaled_dot_product_
  attention through cuDNN's fused attention instead of the backend PyTorch picks by itself),
  -sync (the host waits for every step: what a training loop that reads the loss at once
  costs). Its loss at step 1 is checked against the engine's on the same weights and tokens.

MFU = tokens/s · FLOPs per token / peak, with llm.c's count: FLOPs/token = 6·N + 6·L·d·T
(N every parameter, tied wte counted once; the attention term is the causal half of 12·L·d·T)
and the peak dense bf16 of an H100/H200 SXM: 989 TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timing import (
    Clock,
    EnergyMeter,
    andrea_clock,
    andrea_step,
    bench_sustained,
    gpu_step_ms,
    timed_round,
)
from torch_peer import torch_clock, torch_model, torch_step, torch_variant

from engine.model.layout import ModelShapes, init_params, n_params

PEAK_BF16 = 989e12
LEAD_S = 1.5  # seconds of untimed steps before each timed round (timed_round)
MODELS = {
    "120M": ModelShapes(n_layer=12, d_model=768, n_head=12, d_ff=3072, vocab_size=8449,
                        seq_len=1024),
    "12M": ModelShapes(n_layer=6, d_model=384, n_head=6, d_ff=1536, vocab_size=8449,
                       seq_len=1024),
}
B = 8
FUSED = {"attention": "auto", "fusions": True}
CLASSIC = {"attention": "classic", "fusions": False}
FP8 = {**FUSED, "precision": "fp8"}  # train/precision "fp8": the MLP's GEMMs in FP8 (--fp8)






# the fused path with one of the config's gpu choices (engine.config.GpuConfig) switched, timed
# beside it: --variants
VARIANTS = {"andrea no QKV rows": {"qkv_rows": False},
            "andrea cuDNN backward": {"flex_backward": False},
            "andrea untimed GEMMs": {"gemm_tune": False},
            "andrea 32 GEMM candidates": {"gemm_candidates": 32},
            "andrea fp32 logits": {"logits_low_precision": False},
            "andrea fp32 weight grads": {"grads_low_precision": False}}


def flops_per_token(s: ModelShapes) -> float:
    return 6.0 * n_params(s) + 6.0 * s.n_layer * s.d_model * s.seq_len


def batches(s: ModelShapes, n: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, s.vocab_size, (B, s.seq_len + 1)).astype(np.int32) for _ in range(n)]


# --- ANDREA ---------------------------------------------------------------------------------------


def andrea_backend(s: ModelShapes, opts: dict[str, Any], graphs: bool = True,
                   switched: dict[str, Any] | None = None) -> Any:
    """The CUDA backend on the path `opts` names (FUSED, CLASSIC, FP8), with the gpu choices
    `switched` (VARIANTS) over it; graphs False launches every kernel from the host."""
    from engine.backends.cuda import CudaBackend
    from engine.config import GpuConfig

    gpu = GpuConfig(**{**{k: v for k, v in opts.items() if k != "precision"},
                       **(switched or {})})
    bk = CudaBackend(s, B, opts.get("precision", "bf16"), gpu=gpu)
    bk.use_graphs = graphs
    bk.load_params(init_params(s, seed=1337))
    return bk
















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
    that stand for cuDNN's and cuBLASLt's memsets (graph_fills), so that the count is of the
    step's own kernels whether its memsets are kernels or memset nodes."""
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










def loss_check(s: ModelShapes) -> tuple[float, float]:
    """(engine, PyTorch) loss at step 1: the same weights (seed 1337) and tokens, bf16."""
    import torch

    tok = batches(s, 1)[0]
    bk = andrea_backend(s, FUSED)
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
    bk = andrea_backend(s, FUSED)
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








def bench_model(key: str, torch_variants: list[str], steps: int, rounds: int,
                notes: dict[str, Any], variants: tuple[str, ...] = (),
                fp8: bool = False, sustained: int = 0,
                lead_s: float = LEAD_S) -> list[dict[str, Any]]:
    s = MODELS[key]
    toks = batches(s)
    impls: dict[str, tuple[Callable[..., None], Any]] = {}
    clocks: dict[str, Clock] = {}
    info: dict[str, str] = {}
    andreas = [("andrea", FUSED, None), ("andrea classic", CLASSIC, None)]
    if fp8:
        andreas.append(("andrea fp8", FP8, None))
    andreas += [(n, FUSED, VARIANTS[n]) for n in variants]
    for name, opts, switched in andreas:
        bk = andrea_backend(s, opts, switched=switched)
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
        if name.startswith("torch ") and torch_variant(name[6:]).mode != "eager":
            info[name] = f"compile+3 steps {warm:.0f} s"
    for name in ("andrea", "andrea classic", "andrea fp8"):
        if name in impls:
            t_counter[name] += 20
            notes.setdefault(key, {})[name] = backend_notes(impls[name][1], toks,
                                                            t_counter[name] - 19)
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
    return table_rows(key, medians, info)


def backend_notes(bk: Any, toks: list[np.ndarray], t0: int) -> dict[str, Any]:
    """What one of the engine's paths is, besides its time: kernels a step, the memory plan,
    its one line, the attention; the step graph's nodes and the device time of a queued step
    (taking steps t0.. of it) where it has the one-graph step; its timed GEMMs."""
    notes: dict[str, Any] = {"kernels_per_step": kernels_per_step(bk),
                             "memory_plan": bk.memory_plan(), "describe": bk.describe(),
                             "attention": bk.attention_info}
    if bk.fused_step:
        notes["graph_nodes"] = bk.graph_nodes("step")
        notes["graph_fills"] = bk.graph_fills("step")
        notes["gpu_ms"] = gpu_step_ms(bk, toks, t0)
    if bk.gemm is not None:
        timed, best, first = bk.gemm.timing_summary()
        notes["gemm_timing"] = {"problems": timed, "best_ms": best, "first_choice_ms": first}
        notes["gemms"] = gemm_rates(bk.gemm.export_plan())
    return notes


def table_rows(key: str, medians: dict[str, list[float]], info: dict[str, str]
               ) -> list[dict[str, Any]]:
    """One row an implementation of ANDREA-`key`: the median of its rounds (seconds a step in
    `medians`), tok/s, MFU, its ratio to the engine's, the spread and `info`'s note."""
    s = MODELS[key]
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
                         f"steps, untimed, before each of its rounds (default {LEAD_S}; 0: none)")
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", default="", help="models to profile per kernel, e.g. 120M,12M")
    ap.add_argument("--profile-paths", default="classic,fused",
                    help="which paths --profile profiles (classic, fused, fp8)")
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
                    help="also time the fused path with one gpu choice switched at a time: "
                         "all, or the names given (comma-separated, e.g. 'andrea no QKV rows')")
    return ap.parse_args(argv)


def refusal(args: argparse.Namespace, variants: list[str], switched: tuple[str, ...]) -> str:
    """'' when the arguments can run, else the one line that says why not."""
    for v in variants:
        try:
            torch_variant(v)
        except ValueError as e:
            return f"--torch: {e}"
    for flag, value in (("--steps", args.steps), ("--rounds", args.rounds)):
        if value < 1:
            return f"{flag}: expected at least 1, got {value}"
    if not 0 <= args.lead_s <= 60:  # also refuses nan
        return f"--lead-s: expected seconds from 0 to 60, got {args.lead_s}"
    if args.sustained and args.sustained < 3:
        return f"--sustained: expected 0 (none) or at least 3 steps, got {args.sustained}"
    if unknown := [v for v in switched if v not in VARIANTS]:
        return (f"--variants: unknown {', '.join(map(repr, unknown))}; known: "
                f"{', '.join(VARIANTS)}")
    return ""


def run_benchmark(args: argparse.Namespace, models: list[str], variants: list[str],
                  switched: tuple[str, ...]) -> dict[str, Any]:
    """Every figure of the run: the table's rows, each model's notes, the profiles, the loss
    check (what --json writes)."""
    out: dict[str, Any] = {"rows": [], "notes": {}, "profile": {}, "loss_check": {},
                           "timing": {"steps": args.steps, "rounds": args.rounds,
                                      "lead_s": args.lead_s, "sustained": args.sustained}}
    for key in [m for m in args.profile.split(",") if m]:
        for name, opts in (("classic", CLASSIC), ("fused", FUSED), ("fp8", FP8)):
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
    return out


def print_report(out: dict[str, Any], models: list[str], args: argparse.Namespace) -> None:
    """The table of every implementation, each model's ratios to the fastest PyTorch, and the
    fused path's kernels, memory and slowest GEMMs against the classic path's."""
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
    print("\nkernels per step and memory plan (classic → fused):")
    for key, by in out["notes"].items():
        b, a = by.get("andrea classic", {}), by.get("andrea", {})
        if a and b:
            pb, pa = b["memory_plan"], a["memory_plan"]
            print(f"  ANDREA-{key}: kernels {b['kernels_per_step']} → {a['kernels_per_step']}; "
                  f"memory total {pb['total'] / 2**30:.2f} → {pa['total'] / 2**30:.2f} GiB "
                  f"(activations {pb['activations'] / 2**30:.2f} → "
                  f"{pa['activations'] / 2**30:.2f}, scratch {pb['scratch'] / 2**20:.0f} → "
                  f"{pa['scratch'] / 2**20:.0f} MiB)")
            print(f"    fused: {a['describe']}")
            f8 = by.get("andrea fp8")
            if f8:
                print(f"    fp8: {f8['describe']}; memory {f8['memory_plan']['total'] / 2**30:.2f}"
                      f" GiB (FP8 copies {f8['memory_plan'].get('fp8', 0) / 2**20:.0f} MiB)")
            if "graph_nodes" in a:
                print(f"    the step's graph nodes: {a['graph_nodes']}, of which "
                      f"{a.get('graph_fills', 0)} k_fill kernel nodes (in place of memset nodes)")
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


def main() -> int:
    args = parse_args()
    models = [m for m in args.models.split(",") if m]
    variants = [v for v in args.torch.split(",") if v]
    switched = tuple(dict.fromkeys(v.strip() for v in args.variants.split(",") if v.strip()))
    if why := refusal(args, variants, switched):
        print(f"bench_gpu.py: {why}", file=sys.stderr)
        return 2
    from engine.backends import cuda_status

    usable, why = cuda_status()
    if not usable:
        print(f"bench_gpu.py: needs a CUDA GPU with pycuda: {why}", file=sys.stderr)
        return 2
    out = run_benchmark(args, models, variants, switched)
    print_report(out, models, args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
