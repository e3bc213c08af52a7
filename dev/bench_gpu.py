"""GPU benchmark: one full ANDREA training step (forward, backward, grad norm, clip, AdamW) on the
CUDA backend, on its fused path and on its classic one, against PyTorch on the same model and GPU,
in the same run. Prints one table per model, and with --profile the per-kernel profile of both paths.

    python3 dev/bench_gpu.py [--models 120M,12M,312M,1.2B] [--torch eager,compile,reduce-overhead]
                             [--paths fused,classic,fp8] [--groups auto|all|pairs]
                             [--steps 30] [--rounds 3] [--profile 120M,12M] [--profile-torch]
                             [--json FILE] [--sustained 300] [--lead-s 1.5]

The models are the shipped configs' (experiments/ANDREA-<key>-TRAIN.json, their `model`
section) at micro-batch B = 8: one micro-batch of 8 x 1024 tokens a step, whatever a config's
grad_accum. Implementations, each built (and compiled) once, then timed in interleaved rounds of
--steps steps back to back (the round's time over its steps; PyTorch's step has no synchronize
and the engine queues the next step behind the running one, so neither waits for the host inside
a round, except `andrea classic`, driven from the host, and the `-sync` PyTorch variants). Each
round comes after at least --lead-s seconds (1.5) of the same implementation's steps, untimed,
so that no round inherits the GPU's power state from the round before it. The table shows the
median of the rounds and the spread between them.

Groups: where every implementation does not fit the GPU's memory at once, they are built and
timed in groups, one after the other (bench_groups.py: the estimates, the groups, --groups
auto|all|pairs), rounds interleaved within a group; everything of a group is closed and
PyTorch's cache emptied before the next is built (the fused path stays built from one group to
the next that holds it). The andrea row is the median of its rounds in every group. The report
and --json say which grouping ran.

With --sustained N, the engine and the PyTorch modes within 1.3x of the fastest (timed so far,
where groups run: the PyTorch modes' groups run the fastest expected first) also run N steps back
to back, twice in turn, timed step by step with events on their streams: the median of steps
N/3+1..N, where a long run holds the GPU at its power limit (andrea-train's measure):
- `andrea`: the default path (cuDNN attention where installed, fused kernels, GEMMs timed at
  start, weight-gradient stream, the one-graph step: CudaBackend.train_step);
- `andrea classic`: the classic path (the gpu section's attention `classic`, fusions off: plain
  cuBLAS, separate kernels, the optimizer driven from the host), what the fusions are measured
  against; `andrea fp8`: the fused path with train/precision fp8 (--paths, or --fp8);
- PyTorch at its best practice on the same model (bf16 autocast, fused AdamW, flash SDPA,
  TF32 on, clip_grad_norm_, Q/K/V from one Linear as nanoGPT's c_attn): eager, torch.compile,
  torch.compile(mode="reduce-overhead") (CUDA graphs), the same with cuDNN's fused attention
  (reduce-overhead-cudnn), and max-autotune when asked. A variant is a mode with optional
  suffixes, in this order: -sepqkv (three Linears for Q, K, V), -cudnn (scaled_dot_product_
  attention through cuDNN's fused attention instead of the backend PyTorch picks by itself),
  -sync (the host waits for every step: what a training loop that reads the loss at once
  costs). Its loss at step 1 is checked against the engine's on the same weights and tokens.

The profile (--profile; --profile-torch adds PyTorch's reduce-overhead step, or the variant
named) is gpu_profile.py's: a step's kernel time split into the GEMMs, the attention and the
rest, and the GEMMs' rate.

MFU = tokens/s · FLOPs per token (bench_models.flops_per_token, llm.c's count) / the peak
dense bf16 of an H100/H200 SXM, 989 TFLOP/s. What is timed (the models, the engine's paths)
is bench_models.py's; the timing loops gpu_timing.py's, the PyTorch model torch_peer.py's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_groups import (
    GIB,
    GROUPINGS,
    engine_bytes,
    engine_impls,
    free_memory,
    grouping_line,
    groups,
    release_torch,
    reset_torch_peak,
    torch_bytes,
)
from bench_models import (
    FP8_GOAL,
    FUSED,
    MODELS,
    PATHS,
    PEAK_BF16,
    SPEEDUP_GOAL,
    VARIANTS,
    B,
    andrea_backend,
    backend_notes,
    batches,
    failed,
    flops_per_token,
)
from gpu_profile import print_split, run_profiles
from gpu_timing import Clock, EnergyMeter, andrea_clock, andrea_step, bench_sustained, timed_round
from torch_peer import torch_clock, torch_model, torch_step, torch_variant

from engine.model.layout import ModelShapes

LEAD_S = 1.5  # seconds of untimed steps before each timed round (timed_round)


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


@dataclass
class ModelBench:
    """One model's implementations while they are timed, group after group (bench_model): what
    is built now (`held`: name -> (step, backend or PyTorch objects)), their clocks and step
    counts, every round's time, the rows' notes and the long runs of each group."""

    key: str
    engine: dict[str, tuple[dict[str, Any], dict[str, Any] | None]]  # engine_impls
    note: dict[str, Any]  # the model's entry of --json's notes
    names: list[str]
    held: dict[str, tuple[Callable[..., None], Any]] = field(default_factory=dict)
    clocks: dict[str, Clock] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    sustained_runs: list[dict[str, dict[str, Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.s = MODELS[self.key]
        self.toks = batches(self.s)
        self.t_counter = dict.fromkeys(self.names, 0)
        self.medians: dict[str, list[float]] = {n: [] for n in self.names}

    def say(self, name: str, text: str) -> None:
        """Add `text` to the row's note (once: a path rebuilt in each group fails alike)."""
        if text not in self.info.get(name, ""):
            self.info[name] = "; ".join(x for x in (self.info.get(name, ""), text) if x)

    def drop(self, name: str) -> None:
        """Close one implementation (an engine backend; PyTorch's go with release_torch)."""
        _, obj = self.held.pop(name)
        self.clocks.pop(name, None)
        if name in self.engine:
            try:
                obj.close()
            except Exception as e:  # a backend whose step failed may not close cleanly
                self.say(name, f"close {failed(e)}")

    def release(self, keep: Sequence[str] = ()) -> None:
        """Close every implementation not in `keep` and empty PyTorch's cache."""
        for name in [n for n in self.held if n not in keep]:
            self.drop(name)
        release_torch(reset_compiled=not any(n.startswith("torch ") for n in self.held))

    def build(self, group: Sequence[str]) -> list[str]:
        """Build the group's implementations not built yet; the names built. One that fails is
        reported in its row, not fatal."""
        new = []
        for name in group:
            if name in self.held:
                continue
            try:
                if name in self.engine:
                    opts, switched = self.engine[name]
                    bk = andrea_backend(self.s, opts, switched=switched)
                    self.held[name], self.clocks[name] = (andrea_step(bk), bk), andrea_clock(bk)
                    self.note["grouping"]["plan_gib"][name] = bk.memory_plan()["total"] / GIB
                else:
                    self.held[name] = torch_step(self.s, name.removeprefix("torch "))
                    self.clocks[name] = torch_clock()
            except Exception as e:
                self.say(name, failed(e))
                continue
            new.append(name)
        return new

    def warm_up(self, names: Sequence[str]) -> None:
        """Three steps of each newly built implementation: graph capture, compilation (timed),
        cuBLAS/cuDNN set-up; then the notes of the engine's paths (backend_notes), once."""
        for name in names:
            step, obj = self.held[name]
            t0 = time.perf_counter()
            try:
                for _ in range(3):
                    self.t_counter[name] += 1
                    c = self.t_counter[name]
                    step(self.toks[c % len(self.toks)], c)
                self.clocks[name].finish()
            except Exception as e:
                self.say(name, failed(e))
                self.drop(name)
                continue
            if name.startswith("torch ") and torch_variant(name[6:]).mode != "eager":
                self.say(name, f"compile+3 steps {time.perf_counter() - t0:.0f} s")
            if name in ("andrea", "andrea classic", "andrea fp8") and name not in self.note:
                self.t_counter[name] += 20
                self.note[name] = backend_notes(obj, self.toks, self.t_counter[name] - 19)

    def torch_peak(self, names: Sequence[str]) -> None:
        """PyTorch's peak reserved memory since the group began, for the modes it built."""
        if names:
            import torch

            self.note["grouping"]["torch_peak_gib"][" + ".join(names)] = \
                torch.cuda.max_memory_reserved() / GIB

    def time_rounds(self, group: Sequence[str], rounds: int, steps: int, lead_s: float) -> None:
        """`rounds` interleaved rounds of the group's implementations (timed_round): `steps`
        steps back to back after lead_s of untimed ones, timed from the first step's start to
        the last one's end (every implementation queues ahead where it can: PyTorch without a
        host sync inside the step, the engine with the next step queued behind the running
        one). One that fails is reported and closed; the others go on."""
        for rnd in range(rounds):
            for name in [n for n in group if n in self.held]:
                step, _ = self.held[name]
                try:
                    sec = timed_round(name, step, self.clocks[name], self.toks, self.t_counter,
                                      steps, lead_s)
                except Exception as e:
                    self.say(name, failed(e))
                    self.drop(name)
                    continue
                self.medians[name].append(sec)
                print(f"  {self.key} round {rnd + 1} {name}: {sec * 1e3:.2f} ms", flush=True)

    def long_runs(self, group: Sequence[str], n: int) -> None:
        """--sustained: the fused path and the group's PyTorch modes within 1.3x of the fastest
        PyTorch rounds timed so far (eager and compile are far behind reduce-overhead: their
        long runs would only spend device time), n steps back to back in turn; once a model
        (where groups run, in the first group that can: the fastest PyTorch mode expected
        runs first, and at 1.2B each further long run would cost minutes)."""
        if self.sustained_runs:
            return
        torch_ms = {m: statistics.median(v) for m, v in self.medians.items()
                    if m.startswith("torch") and v}
        near = [m for m in group if m in self.held and m in torch_ms
                and torch_ms[m] <= 1.3 * min(torch_ms.values())]
        if "andrea" not in self.held or not near:  # nothing to compare the long runs with
            return
        meter = EnergyMeter.open()
        try:
            self.sustained_runs.append(bench_sustained(
                self.key, {m: self.held[m] for m in ("andrea", *near)}, self.clocks, self.toks,
                self.t_counter, n, meter))
        finally:
            if meter is not None:
                meter.close()


def bench_model(key: str, torch_variants: list[str], steps: int, rounds: int,
                notes: dict[str, Any], variants: tuple[str, ...] = (),
                paths: Sequence[str] = ("fused", "classic"), sustained: int = 0,
                lead_s: float = LEAD_S, grouping: str = "auto") -> list[dict[str, Any]]:
    """Every implementation of ANDREA-`key` timed, in the groups `grouping` decides (groups);
    the table's rows."""
    s = MODELS[key]
    engine = engine_impls(paths, variants)
    names = [*engine, *(f"torch {v}" for v in torch_variants)]
    est = {n: float(engine_bytes(s, *engine[n])) for n in engine}
    est.update({n: float(torch_bytes(s)) for n in names if n not in engine})
    free = free_memory()
    plan = groups(names, est, free, grouping)
    mb = ModelBench(key, engine, notes.setdefault(key, {}), names)
    mb.note["grouping"] = {"mode": grouping, "groups": plan, "free_gib": free / GIB,
                           "estimate_gib": {n: b / GIB for n, b in est.items()},
                           "plan_gib": {}, "torch_peak_gib": {},
                           "line": grouping_line(grouping, plan, est, free)}
    print(f"  ANDREA-{key}: {mb.note['grouping']['line']}", flush=True)
    try:
        for i, group in enumerate(plan, 1):
            mb.release(keep=group)
            if len(plan) > 1:
                print(f"  {key} group {i}/{len(plan)}: {' + '.join(group)}", flush=True)
            reset_torch_peak()
            new = mb.build(group)
            mb.warm_up(new)
            mb.torch_peak([n for n in new if n in mb.held and n.startswith("torch ")])
            mb.time_rounds(group, rounds, steps, lead_s)
            if sustained:
                mb.long_runs(group, sustained)
    finally:
        mb.release()
    if mb.sustained_runs:
        mb.note["sustained"] = merge_sustained(mb.sustained_runs)
        mb.note["sustained_runs"] = mb.sustained_runs
    elif sustained:
        mb.note["sustained_skipped"] = why = (
            "no group held the fused path beside a PyTorch mode (or every PyTorch mode failed)")
        print(f"  ANDREA-{key}: --sustained {sustained}: no long runs: {why}", flush=True)
    for group in plan:
        if "andrea" not in group and len(plan) > 1:
            for name in group:
                mb.say(name, "timed alone (no room beside andrea)")
    if (in_groups := sum("andrea" in g for g in plan)) > 1:
        mb.say("andrea", f"rounds of {in_groups} groups")
    return table_rows(key, mb.medians, mb.info)


def merge_sustained(runs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The long runs of every group (bench_sustained's results) as one: each PyTorch mode's,
    and the engine's from the group whose PyTorch mode ran fastest (so that the report's ratio
    compares two runs taken in turn), else from the first group."""
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        out.update({n: v for n, v in run.items() if n != "andrea"})

    def fastest(run: dict[str, dict[str, Any]]) -> float:
        return min((v["ms"] for n, v in run.items() if n != "andrea" and "ms" in v),
                   default=math.inf)

    home = min(runs, key=fastest) if runs else {}
    if "andrea" in home:
        out = {"andrea": home["andrea"], **out}
    return out


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


# --- the command line -------------------------------------------------------------------------


def csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="120M,12M",
                    help=f"the shipped configs' models to time, comma-separated: "
                         f"{', '.join(MODELS)}")
    ap.add_argument("--torch", default="eager,compile,reduce-overhead,reduce-overhead-cudnn",
                    help="PyTorch variants to compare, comma-separated ('' for none): a mode "
                         "(eager, compile, reduce-overhead, max-autotune) with optional suffixes "
                         "-sepqkv, -cudnn, -sync")
    ap.add_argument("--paths", default="fused,classic",
                    help="the engine's paths to time, comma-separated: fused (always: every row "
                         "is measured against it), classic, fp8")
    ap.add_argument("--groups", default="auto", choices=GROUPINGS,
                    help="build and time the implementations all at once (all), the fused path "
                         "with one other at a time (pairs), or as the GPU's free memory allows "
                         "(auto, the default)")
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
    ap.add_argument("--profile-torch", nargs="?", const="reduce-overhead", default="",
                    metavar="VARIANT",
                    help="with --profile, also profile PyTorch's step (reduce-overhead, or the "
                         "variant named)")
    ap.add_argument("--telemetry", default="",
                    help="models whose step is timed with the telemetry sampler running, e.g. 12M")
    ap.add_argument("--sustained", type=int, default=0, metavar="N",
                    help="also run the engine and the fastest PyTorch modes for N steps back to "
                         "back, twice in turn, and compare their median step past the first "
                         "third (steps 101..300 of 300: andrea-train's window)")
    ap.add_argument("--no-loss-check", action="store_true")
    ap.add_argument("--fp8", action="store_true",
                    help="also time the engine with train/precision fp8 (the linear maps in "
                         "FP8): adds fp8 to --paths")
    ap.add_argument("--variants", nargs="?", const=",".join(VARIANTS), default="",
                    help="also time the fused path with one gpu choice switched at a time: "
                         "all, or the names given (comma-separated, e.g. 'andrea no QKV rows')")
    return ap.parse_args(argv)


def engine_paths(args: argparse.Namespace) -> list[str]:
    """--paths, with fp8 added by --fp8."""
    paths = csv(args.paths)
    return [*paths, "fp8"] if args.fp8 and "fp8" not in paths else paths


def refusal(args: argparse.Namespace, variants: list[str], switched: tuple[str, ...]) -> str:
    """'' when the arguments can run, else the one line that says why not."""
    for v in variants + ([args.profile_torch] if args.profile_torch else []):
        try:
            torch_variant(v)
        except ValueError as e:
            return f"--{'torch' if v in variants else 'profile-torch'}: {e}"
    for flag in ("models", "profile", "telemetry"):
        if unknown := [m for m in csv(getattr(args, flag)) if m not in MODELS]:
            return (f"--{flag}: unknown {', '.join(map(repr, unknown))}; known: "
                    f"{', '.join(MODELS)}")
    paths = engine_paths(args)
    if unknown := [p for p in paths if p not in PATHS]:
        return f"--paths: unknown {', '.join(map(repr, unknown))}; known: {', '.join(PATHS)}"
    if "fused" not in paths:
        return "--paths: expected fused among them (every row is measured against it)"
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
                                      "lead_s": args.lead_s, "sustained": args.sustained,
                                      "groups": args.groups, "paths": engine_paths(args)}}
    run_profiles(csv(args.profile), csv(args.profile_paths), args.profile_torch,
                 out["profile"])
    for key in csv(args.telemetry):
        out["telemetry"] = bench_telemetry(key, args.steps, args.rounds)
    for key in models:
        if variants and not args.no_loss_check:
            ours, theirs = loss_check(MODELS[key])
            out["loss_check"][key] = {"andrea": ours, "torch": theirs}
            print(f"\nANDREA-{key} loss at step 1, same weights and tokens: engine {ours:.5f}, "
                  f"PyTorch {theirs:.5f} (|diff| {abs(ours - theirs):.2e})")
        out["rows"] += bench_model(key, variants, args.steps, args.rounds, out["notes"],
                                   switched, engine_paths(args), args.sustained, args.lead_s,
                                   args.groups)
    return out


# --- the report -------------------------------------------------------------------------------


def print_report(out: dict[str, Any], models: list[str], args: argparse.Namespace) -> None:
    """The table of every implementation, each model's grouping and ratios to the fastest
    PyTorch, the fused path's kernels, memory and slowest GEMMs against the classic path's,
    and where the profiled steps spend their kernel time."""
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
        print_model_lines(key, out, args)
    print_memory(out)
    print_split(out["profile"])


def print_model_lines(key: str, out: dict[str, Any], args: argparse.Namespace) -> None:
    """ANDREA-`key`'s grouping, its ratio (and both sides' MFU) to the fastest PyTorch in the
    rounds and in the long runs, and fp8's against bf16."""
    rows = [r for r in out["rows"] if r["model"] == f"ANDREA-{key}"]
    note = out["notes"].get(key, {})
    if "grouping" in note:
        print(f"ANDREA-{key}: {note['grouping']['line']}")
    torch_rows = [r for r in rows if r["impl"].startswith("torch") and r["ms"] == r["ms"]]
    ours = next((r for r in rows if r["impl"] == "andrea" and r["ms"] == r["ms"]), None)
    best = min(torch_rows, key=lambda r: r["ms"]) if torch_rows else None
    if best and ours:
        print(f"ANDREA-{key}: andrea {ours['ms']:.2f} ms (MFU {ours['mfu'] * 100:.1f}%) vs the "
              f"fastest PyTorch ({best['impl']}) {best['ms']:.2f} ms (MFU "
              f"{best['mfu'] * 100:.1f}%): {best['ms'] / ours['ms']:.2f}x "
              f"(goal {SPEEDUP_GOAL[key]:.2f}x)")
    sus = {n: v for n, v in note.get("sustained", {}).items() if "ms" in v}  # not the failed
    sus_torch = {n: v for n, v in sus.items() if n.startswith("torch")}
    if "andrea" in sus and sus_torch:
        name, best_s = min(sus_torch.items(), key=lambda kv: kv[1]["ms"])
        at_1ms = B * MODELS[key].seq_len * flops_per_token(MODELS[key]) / PEAK_BF16 * 1e3
        print(f"ANDREA-{key}, {args.sustained} steps back to back: andrea "
              f"{sus['andrea']['ms']:.2f} ms (MFU {at_1ms / sus['andrea']['ms'] * 100:.1f}%) vs "
              f"the fastest PyTorch ({name}) {best_s['ms']:.2f} ms (MFU "
              f"{at_1ms / best_s['ms'] * 100:.1f}%): {best_s['ms'] / sus['andrea']['ms']:.2f}x")
    f8 = next((r for r in rows if r["impl"] == "andrea fp8" and r["ms"] == r["ms"]), None)
    if f8 and ours:
        print(f"ANDREA-{key}: andrea fp8 {f8['ms']:.2f} ms vs the engine's bf16 "
              f"{ours['ms']:.2f} ms: {ours['ms'] / f8['ms']:.2f}x"
              + (f" (goal {FP8_GOAL[key]:.2f}x)" if key in FP8_GOAL else "")
              + (f"; vs the fastest PyTorch {best['ms'] / f8['ms']:.2f}x" if best else ""))


def print_memory(out: dict[str, Any]) -> None:
    """Kernels a step and the memory plan, classic → fused, and the fused path's slowest GEMMs."""
    print("\nkernels per step and memory plan (classic → fused):")
    for key, by in out["notes"].items():
        b, a = by.get("andrea classic", {}), by.get("andrea", {})
        if not (a and b):
            continue
        pb, pa = b["memory_plan"], a["memory_plan"]
        print(f"  ANDREA-{key}: kernels {b['kernels_per_step']} → {a['kernels_per_step']}; "
              f"memory total {pb['total'] / GIB:.2f} → {pa['total'] / GIB:.2f} GiB "
              f"(activations {pb['activations'] / GIB:.2f} → "
              f"{pa['activations'] / GIB:.2f}, scratch {pb['scratch'] / 2**20:.0f} → "
              f"{pa['scratch'] / 2**20:.0f} MiB)")
        print(f"    fused: {a['describe']}")
        f8 = by.get("andrea fp8")
        if f8:
            print(f"    fp8: {f8['describe']}; memory {f8['memory_plan']['total'] / GIB:.2f}"
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
    models = csv(args.models)
    variants = csv(args.torch)
    switched = tuple(dict.fromkeys(csv(args.variants)))
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
    # the engine's own path must have run: every other row is measured against it
    return 1 if any(r["impl"] == "andrea" and not r["rounds_ms"] for r in out["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
