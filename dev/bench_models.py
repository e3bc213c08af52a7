"""What dev/bench_gpu.py times: the shipped configs' models at its micro-batch B, their FLOPs
(MFU's count and the GEMMs'), the tokens of a step, and the engine's paths on them: each path's
options and each variant's gpu choices, the CUDA backend built on one, and what a backend tells
besides its time (kernels a step, the memory plan, its timed GEMMs and their rates); and the
one line a failure leaves in a row's note (failed).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timing import gpu_step_ms

from engine.config import GpuConfig, load_config
from engine.model.layout import ModelShapes, init_params, n_params

ROOT = Path(__file__).resolve().parents[1]
PEAK_BF16 = 989e12  # dense bf16 of an H100/H200 SXM, FLOP/s: MFU's peak


def shipped_shapes(key: str) -> ModelShapes:
    """The `model` section of the shipped config experiments/ANDREA-`key`-TRAIN.json."""
    cfg = load_config(ROOT / "experiments" / f"ANDREA-{key}-TRAIN.json")
    return ModelShapes.from_config(cfg.model)


MODELS = {key: shipped_shapes(key) for key in ("120M", "12M", "312M", "1.2B")}
B = 8
# the ratios the report prints as each size's goal: the engine's bf16 step against the fastest
# PyTorch mode (lower at d 1024 and 2048, where the GEMMs dominate the step and PyTorch's
# framework overhead shrinks with them), and FP8's step against the engine's bf16 at 1.2B, where
# the GEMMs are large enough for FP8 to pay well (elsewhere its ratio is printed as measured)
SPEEDUP_GOAL = {"12M": 1.25, "120M": 1.25, "312M": 1.15, "1.2B": 1.15}
FP8_GOAL = {"1.2B": 1.2}
FUSED = {"attention": "auto", "fusions": True}
CLASSIC = {"attention": "classic", "fusions": False}
FP8 = {**FUSED, "precision": "fp8"}  # train/precision "fp8": the linear maps' GEMMs in FP8
# the engine's paths (--paths): their names in the table and their options
PATHS = {"fused": ("andrea", FUSED), "classic": ("andrea classic", CLASSIC),
         "fp8": ("andrea fp8", FP8)}
# the fused path with one of the config's gpu choices (engine.config.GpuConfig) switched, timed
# beside it: --variants
VARIANTS = {"andrea no QKV rows": {"qkv_rows": False},
            "andrea cuDNN backward": {"flex_backward": False},
            "andrea untimed GEMMs": {"gemm_tune": False},
            "andrea 32 GEMM candidates": {"gemm_candidates": 32},
            "andrea fp32 logits": {"logits_low_precision": False},
            "andrea fp32 weight grads": {"grads_low_precision": False}}


def flops_per_token(s: ModelShapes) -> float:
    """MFU's count, llm.c's: 6·N + 6·L·d·T (N every parameter, tied wte counted once; the
    attention term is the causal half of 12·L·d·T)."""
    return 6.0 * n_params(s) + 6.0 * s.n_layer * s.d_model * s.seq_len


def gemm_flops(s: ModelShapes, batch: int = B) -> float:
    """The GEMM FLOPs of one training step of `batch` sequences: the forward's 2·R·(L·(4d² +
    2·d·d_ff) + d·V) with R = batch·T rows (Q, K, V and the attention's output, the MLP's two,
    the LM head), times 3 for the forward and the backward's input and weight gradients. The
    attention's own products (QKᵀ, PV) are not GEMMs of the count: they run in the attention."""
    d, rows = s.d_model, batch * s.seq_len
    return 3 * 2.0 * rows * (s.n_layer * (4 * d * d + 2 * d * s.d_ff) + d * s.vocab_size)


def batches(s: ModelShapes, n: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, s.vocab_size, (B, s.seq_len + 1)).astype(np.int32) for _ in range(n)]


def failed(e: BaseException) -> str:
    """The one line an implementation's failure leaves in its row's note or its profile's line."""
    return f"failed: {type(e).__name__}: {e}"[:70]


# --- the engine's backend on a path ---------------------------------------------------------


def andrea_backend(s: ModelShapes, opts: dict[str, Any], graphs: bool = True,
                   switched: dict[str, Any] | None = None) -> Any:
    """The CUDA backend on the path `opts` names (FUSED, CLASSIC, FP8), with the gpu choices
    `switched` (VARIANTS) over it; graphs False launches every kernel from the host."""
    from engine.backends.cuda import CudaBackend

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
