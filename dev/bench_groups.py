"""Which of dev/bench_gpu.py's implementations are built and timed together, and the memory it
decides from.

Each implementation holds its own weights, gradients, optimizer state and activations: at 1.2B
the engine's memory plan is 37.8 GiB a path (engine_bytes), and torch_bytes estimates 40 GiB a
PyTorch mode. Where they do not all fit the GPU's free memory at once (fits), --groups auto
builds them in groups: each group holds the fused path and one PyTorch mode, or the fused path
and the engine's other paths; what does not fit even beside the fused path is timed alone.
--groups all and pairs force one group, or a pair for every implementation (groups). Between
groups, release_torch gives PyTorch's memory back to the device.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_models import FUSED, PATHS, VARIANTS, B
from torch_peer import torch_variant

from engine.config import GpuConfig
from engine.model.layout import ModelShapes, n_params

GIB = 2**30
GROUPINGS = ("auto", "all", "pairs")  # --groups
# what --groups auto leaves free: a share of the free memory and a fixed reserve (the CUDA
# libraries' own allocations, PyTorch's cache and compilation, the engine's graphs)
MEM_KEEP_SHARE, MEM_KEEP_BYTES = 0.10, 2 * GIB
# PyTorch's modes, the fastest expected first: where groups run, their groups run in this
# order, so that --sustained finds the fastest rounds before it decides which modes run long
TORCH_SPEED = ("reduce-overhead", "max-autotune", "compile", "eager")


def engine_impls(paths: Sequence[str], switched: Sequence[str] = ()
                 ) -> dict[str, tuple[dict[str, Any], dict[str, Any] | None]]:
    """The engine's implementations to time: name -> (path options, gpu choices switched), the
    fused path first (--paths, then --variants)."""
    out: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
        name: (opts, None) for path, (name, opts) in PATHS.items() if path in paths}
    out.update({name: (FUSED, VARIANTS[name]) for name in switched})
    return out


def engine_bytes(s: ModelShapes, opts: dict[str, Any], switched: dict[str, Any] | None = None,
                 batch: int = B) -> int:
    """The memory plan of one of the engine's paths (buffers.plan_memory, and fp8.plan_fp8's
    buffers for fp8) as CudaBackend makes it where cuDNN's attention runs (the default), with
    the deterministic cuDNN backward's workspace (dS in bf16: batch·H·T² values; the flex
    backward's is smaller): the bytes the backend allocates at start."""
    from engine.backends.cuda.buffers import plan_memory
    from engine.backends.cuda.fp8 import plan_fp8

    gpu = GpuConfig(**{**{k: v for k, v in opts.items() if k != "precision"},
                       **(switched or {})})
    fp8, fused = opts.get("precision") == "fp8", gpu.fusions
    attention = "classic" if gpu.attention == "classic" else "cudnn"
    workspace = batch * s.n_head * s.seq_len ** 2 * 2 if attention == "cudnn" else 0
    grads_lp = fused and gpu.grads_low_precision and s.d_model % 4 == 0
    plan, _, _ = plan_memory(s, batch, "bf16", attention, fused, workspace, False,
                             fused and gpu.qkv_rows and attention == "cudnn",
                             fused and gpu.logits_low_precision, grads_lp)
    if fp8:
        plan_fp8(plan, s.n_layer, s.d_model, s.d_ff, batch * s.seq_len,
                 qkv=fused and gpu.qkv_rows and attention == "cudnn")
    return plan.totals()["total"]


def torch_bytes(s: ModelShapes, batch: int = B) -> int:
    """An estimate of one PyTorch mode's device memory (torch_peer.torch_step), meant to err
    high: 18 bytes a parameter (float32 weights, gradients, AdamW's m and v; autocast's bf16 copies of
    the weights), the activations eager autograd keeps, per token and layer 24·d + 4·d_ff bytes
    (the float32 residual stream at both LayerNorms, the bf16 inputs of the four GEMMs, Q, K, V
    and the attention's output, the MLP's two bf16 [d_ff] tensors), and per token 10·V bytes
    of logits (their bf16 and float32 copies, the log-softmax); 10% on top for the caching
    allocator's rounding and the backward's transients. The compiled modes keep less."""
    rows = batch * s.seq_len
    total = (18 * n_params(s) + s.n_layer * rows * (24 * s.d_model + 4 * s.d_ff)
             + 10 * rows * s.vocab_size)
    return int(1.1 * total)


def fits(nbytes: float, free_bytes: float) -> bool:
    """Whether `nbytes` fit `free_bytes` with MEM_KEEP_SHARE of it and MEM_KEEP_BYTES to spare."""
    return nbytes <= free_bytes * (1 - MEM_KEEP_SHARE) - MEM_KEEP_BYTES


def speed_rank(name: str) -> tuple[int, bool]:
    """Where a PyTorch implementation ("torch <variant>") comes in TORCH_SPEED; -sync last."""
    v = torch_variant(name.removeprefix("torch "))
    return TORCH_SPEED.index(v.mode), v.sync


def groups(impl_names: Sequence[str], bytes_of: Mapping[str, float], free_bytes: float,
           mode: str = "auto") -> list[list[str]]:
    """Which implementations are built and timed together, in the order the groups run.

    `impl_names`: the engine's fused path ("andrea") first, its other paths, then the PyTorch
    modes ("torch ..."); `bytes_of`: each one's device memory; `free_bytes`: the device's free
    memory before any is built. `all`: one group of every implementation. `pairs`: the fused
    path with each other implementation, a group each. `auto`: one group where everything fits
    (`fits`); else the engine's other paths beside the fused path, as many to a group as fit,
    and each PyTorch mode beside the fused path; what does not fit beside it, alone (the fused
    path then has a group of its own where no other group holds it). Where there are several
    groups, the PyTorch modes' run the fastest expected first (TORCH_SPEED)."""
    if mode not in GROUPINGS:
        raise ValueError(f"groups: expected one of {', '.join(GROUPINGS)}, got {mode!r}")
    names = list(impl_names)
    if mode == "all" or len(names) < 2:
        return [names]
    fused, others = names[0], names[1:]
    engine = [n for n in others if not n.startswith("torch ")]
    torch_modes = sorted((n for n in others if n.startswith("torch ")), key=speed_rank)
    if mode == "pairs":
        return [[fused, n] for n in (*engine, *torch_modes)]

    def room(group: Sequence[str]) -> bool:
        return fits(sum(bytes_of[n] for n in group), free_bytes)

    if room(names):
        return [names]
    out: list[list[str]] = [[fused]]
    for n in engine:
        home = next((g for g in out if fused in g and room([*g, n])), None)
        if home is not None:
            home.append(n)
        else:
            out.append([fused, n] if room([fused, n]) else [n])
    out += [[fused, n] if room([fused, n]) else [n] for n in torch_modes]
    if out[0] == [fused] and any(fused in g for g in out[1:]):
        out.pop(0)
    return out


def grouping_line(mode: str, plan: list[list[str]], bytes_of: Mapping[str, float],
                  free_bytes: float) -> str:
    """One line: which grouping ran, its groups, and the estimate it was decided from."""
    every = f"estimated {sum(bytes_of.values()) / GIB:.1f} GiB for all together, " \
            f"{free_bytes / GIB:.1f} GiB free"
    if len(plan) == 1:
        return f"--groups {mode}: every implementation in one group ({every})"
    listed = " | ".join(" + ".join(g) for g in plan)
    return f"--groups {mode}: {len(plan)} groups, one after the other ({every}): {listed}"


def free_memory() -> int:
    """The device's free bytes now, as the driver counts them (PyTorch's cache included)."""
    from engine.backends.cuda.runtime import Gpu

    return int(Gpu.get().drv.mem_get_info()[0])


def release_torch(reset_compiled: bool = True) -> None:
    """Let PyTorch give back to the device what dropped implementations held: a garbage
    collection (their steps' closures hold model, optimizer and inputs), with reset_compiled
    Dynamo's caches and the CUDA graph trees' pools (torch._dynamo.reset: only where nothing
    compiled is still held), and the caching allocator's free blocks (empty_cache)."""
    import gc

    try:
        import torch
    except ImportError:
        gc.collect()
        return
    if reset_compiled and torch.cuda.is_initialized():
        try:
            torch._dynamo.reset()  # first: the graphs it drops sit in reference cycles
        except Exception:  # a PyTorch without Dynamo: nothing compiled to reset
            pass
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def reset_torch_peak() -> None:
    """Start PyTorch's peak memory statistics afresh (a group's peak is read after its
    warm-up), where PyTorch is installed and has set up the device."""
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
