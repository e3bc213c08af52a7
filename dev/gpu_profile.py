"""The per-kernel profile of a training step (dev/bench_gpu.py --profile, --profile-torch): the
kernels torch.profiler sees in the engine's steps launched from the host, or in PyTorch's step,
their time split into the GEMMs, the attention and the rest (kernel_kind), and the GEMMs' rate:
the model's GEMM FLOPs a step (bench_models.gemm_flops) over their time; each profile printed
(print_profile), summed up by kind at the report's end (print_split) and kept for --json
(profile_entry).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_groups import release_torch
from bench_models import CLASSIC, FP8, FUSED, MODELS, andrea_backend, batches, failed, gemm_flops
from gpu_timing import andrea_step
from torch_peer import torch_step

from engine.model.layout import ModelShapes

KINDS = ("gemm", "attention", "other")  # the profile's split (kernel_kind)
KIND_LABEL = {"gemm": "GEMM", "attention": "attn", "other": ""}
# markers in kernel names (kernel_kind), lower case
ATTENTION_MARKS = ("fmha", "flash", "sdpa", "cudnn", "attn", "attention", "flex")
GEMM_MARKS = ("gemm", "gemv", "xmma", "nvjet", "cutlass", "cublas", "splitkreduce")


def kernel_kind(name: str) -> str:
    """"gemm", "attention" or "other" for a kernel's name as the profiler gives it.

    GEMMs: cuBLAS's and cuBLASLt's kernels (sm90_xmma_gemm_*, nvjet_*, cutlass_*, cublasLt's
    split-K reduction, gemv) and Inductor's matmul templates (triton_tem_*mm*). The attention:
    cuDNN's SDPA graphs (cudnn_generated_*sdpa*), PyTorch's flash and memory-efficient kernels
    (flash_*, fmha_*), the flex backward's CuTe DSL kernels (named after the frontend's
    flex_attention module; matched before the GEMMs, as their names hold "cutlass" too) and the
    classic path's k_attn_* softmax. Everything else: the engine's other k_* kernels
    (LayerNorm, GELU, loss, AdamW, FP8 casts, fills), Inductor's fused triton_* kernels,
    PyTorch's elementwise and reduction kernels, copies and memsets."""
    n = name.lower()
    if n.startswith("triton_"):
        return "gemm" if n.startswith("triton_tem") and "mm" in n else "other"
    if n.startswith("k_"):
        return "attention" if n.startswith("k_attn") else "other"
    if any(m in n for m in ATTENTION_MARKS):
        return "attention"
    if any(m in n for m in GEMM_MARKS):
        return "gemm"
    return "other"


def kernel_split(rows: Iterable[tuple[float, float, str]], flop: float) -> dict[str, float]:
    """A step's kernel time by kind (kernel_kind) from the profile's rows (µs a step, calls a
    step, name): `<kind>_ms` and `<kind>_share` of each, `total_ms`, and the GEMMs' rate,
    `gemm_tflops` = `flop` (gemm_flops) over the GEMMs' time (0 where none ran)."""
    ms = dict.fromkeys(KINDS, 0.0)
    for us, _, name in rows:
        ms[kernel_kind(name)] += us / 1e3
    total = sum(ms.values())
    out = {f"{k}_ms": v for k, v in ms.items()}
    out.update({f"{k}_share": v / total if total else 0.0 for k, v in ms.items()})
    out["total_ms"] = total
    out["gemm_tflops"] = flop / (ms["gemm"] / 1e3) / 1e12 if ms["gemm"] else 0.0
    return out


def kernel_rows(prof: Any, steps: int) -> list[tuple[float, float, str]]:
    """(µs a step, calls a step, name) of every kernel a torch.profiler run saw, slowest first."""
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us > 0:
            rows.append((us / steps, e.count / steps, e.key))
    rows.sort(reverse=True)
    return rows


def profiled(s: ModelShapes, rows: list[tuple[float, float, str]],
             choices: dict[str, Any]) -> dict[str, Any]:
    return {"rows": rows, "total_us": sum(r[0] for r in rows),
            "kernels": sum(r[1] for r in rows), "choices": choices,
            "split": kernel_split(rows, gemm_flops(s))}


def profile_andrea(s: ModelShapes, opts: dict[str, Any], steps: int = 3,
                   one_stream: bool = True) -> dict[str, Any]:
    """Per-kernel GPU time of full steps (CUPTI through torch.profiler sees PyCUDA's, cuBLAS's
    and cuDNN's kernels too, as they share the primary context). Direct launches, so kernels
    are attributable. one_stream: the weight-gradient stream's work (weight gradients,
    LayerNorm parameter sums, the update beside the forward) queued on the main stream, as the
    start-up timing does: each kernel then runs alone, so its time is its own and the split
    reads like PyTorch's one-stream step (with both streams, kernels that run side by side
    each count the time they shared)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    bk = andrea_backend(s, opts, graphs=False)
    if one_stream:
        bk.build.ops.side = None
    tok = batches(s, 1)[0]
    step = andrea_step(bk)
    step(tok, 1)
    bk.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for t in range(steps):
            step(tok, t + 2)
        bk.synchronize()
    choices = bk.gemm.export_plan()["choices"] if bk.gemm is not None else {}
    bk.close()
    out = profiled(s, kernel_rows(prof, steps), choices)
    out["streams"] = 1 if one_stream else 2
    return out


def profile_torch(s: ModelShapes, variant: str, steps: int = 3) -> dict[str, Any]:
    """Per-kernel GPU time of PyTorch's step in `variant` (reduce-overhead: Inductor's kernels
    replayed in CUDA graphs, which the profiler sees one by one), after 5 steps of compilation
    and graph recording; the model is closed after."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step, objs = torch_step(s, variant)
    tok = batches(s, 1)[0]
    try:
        for t in range(5):
            step(tok, t + 1)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for t in range(steps):
                step(tok, t + 6)
            torch.cuda.synchronize()
        rows = kernel_rows(prof, steps)
    finally:
        del step, objs
        release_torch()
    return profiled(s, rows, {})


def split_line(split: dict[str, float]) -> str:
    return (f"GEMMs {split['gemm_ms']:.2f} ms ({100 * split['gemm_share']:.0f}%, "
            f"{split['gemm_tflops']:.0f} TFLOP/s), attention {split['attention_ms']:.2f} ms "
            f"({100 * split['attention_share']:.0f}%), the rest {split['other_ms']:.2f} ms "
            f"({100 * split['other_share']:.0f}%)")


def print_profile(key: str, name: str, prof: dict[str, Any], top: int = 24) -> None:
    total = prof["total_us"]
    how = ("its CUDA graphs" if name.startswith("torch") else
           f"direct launches on {'one stream' if prof.get('streams') == 1 else 'two streams'}")
    print(f"\nANDREA-{key} {name}: kernel time per step {total / 1e3:.2f} ms, "
          f"{prof['kernels']:.0f} kernels per step (profiled, {how})")
    print(f"  {split_line(prof['split'])}; GEMM rate = {gemm_flops(MODELS[key]) / 1e12:.2f} "
          f"TFLOP of the model's GEMMs a step over their time")
    for us, count, kname in prof["rows"][:top]:
        print(f"  {us / 1e3:7.3f} ms {100 * us / total:5.1f}%  x{count:<5.0f} "
              f"{KIND_LABEL[kernel_kind(kname)]:<4} {kname[:80]}")
    for what, c in prof.get("choices", {}).items():  # gemm_plan.GemmChoice.to_json() fields
        times = ", ".join(f"{k[:-3]} {v} ms" for k, v in c.items() if k.endswith("_ms"))
        print(f"  {what}: {c['use']} ({times})")


def profile_entry(prof: dict[str, Any]) -> dict[str, Any]:
    """What --json keeps of a profile."""
    return {"total_ms": prof["total_us"] / 1e3, "kernels": prof["kernels"],
            "split": prof["split"], "top": [(us / 1e3, c, n) for us, c, n in prof["rows"][:40]]}


def run_profiles(keys: Sequence[str], paths: Sequence[str], torch_variant: str,
                 out: dict[str, Any]) -> None:
    """--profile: each model's engine paths (`paths`: --profile-paths), and with `torch_variant`
    (--profile-torch) PyTorch's step, per kernel; printed and kept in `out` (--json's
    "profile")."""
    for key in keys:
        for name, opts in (("classic", CLASSIC), ("fused", FUSED), ("fp8", FP8)):
            if name not in paths:
                continue
            prof = profile_andrea(MODELS[key], opts)
            print_profile(key, name, prof)
            out.setdefault(key, {})[name] = profile_entry(prof)
        if torch_variant:
            name = f"torch {torch_variant}"
            try:
                prof = profile_torch(MODELS[key], torch_variant)
            except Exception as e:  # PyTorch's side failing leaves the engine's profiles
                print(f"\nANDREA-{key} {name}: profile {failed(e)}")
                release_torch()
                continue
            print_profile(key, name, prof)
            out.setdefault(key, {})[name] = profile_entry(prof)


def print_split(profiles: dict[str, Any]) -> None:
    """Where each profiled step (run_profiles' `out`) spends its kernel time: GEMMs, attention,
    the rest."""
    if not profiles:
        return
    print("\nkernel time of a step by kind (profiled; GEMM rate = the model's GEMM FLOPs over "
          "the GEMMs' time):")
    for key, by in profiles.items():
        for name, prof in by.items():
            print(f"  ANDREA-{key} {name}: {prof['total_ms']:.2f} ms: {split_line(prof['split'])}")
