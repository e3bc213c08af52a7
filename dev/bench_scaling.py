#!/usr/bin/env python3
"""Scaling table: `andrea-train` itself on 1, 2, 4, 8 GPUs of this host (as many as it has;
`--gpus N`), batch_size per GPU as the config says, in one run. Prints one table per model: the
median `step_ms` the engine records in loss.jsonl (after a warm-up), tok/s of the job, the
speed-up and the scaling efficiency against one GPU, the NCCL fp32 all-reduce of the model's
gradients timed on its own, and how much of it the step shows (exposed: the step's growth over
one GPU's; hidden: the rest, overlapped with compute). --after-backward adds the rows of one all-reduce
after the backward instead of one per layer inside the step (the gpu section's ddp_overlap
false).

    python3 dev/bench_scaling.py [--models 120M,12M] [--gpus 1,2,4,8] [--steps 80]
                                 [--warmup 20] [--json FILE] [--after-backward]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.runfiles import read_steps  # noqa: E402

ALLREDUCE = r"""
import os, sys, time, numpy as np
from pathlib import Path
from engine.run.comm import Channel
from engine.run.world import world_from_env
from engine.backends.cuda.runtime import Gpu
from engine.run.ddp import NcclReducer
w = world_from_env()
os.environ["ANDREA_CUDA_DEVICE"] = str(w.local_rank)
gpu = Gpu.get()
ch = Channel.join(w, Path(sys.argv[1]))
red = NcclReducer(ch)
n = int(sys.argv[2])
buf = gpu.drv.mem_alloc(n * 4)
gpu.drv.memset_d32(buf, 0, n)
class B:
    def grad_device(self): return int(buf), n, gpu.stream
b = B()
for _ in range(3): red.reduce(b)
gpu.stream.synchronize(); ch.allgather(b"")
ts = []
for _ in range(20):
    t0 = time.perf_counter(); red.reduce(b); gpu.stream.synchronize(); ts.append(time.perf_counter() - t0)
ch.finish()
if w.main: print("ALLREDUCE_MS", sorted(ts)[len(ts) // 2] * 1e3)
"""


def train(cfg: Path, run: Path, steps: int, gpus: int, overlap: bool = True) -> list[float]:
    """andrea-train on a copy of `cfg` with its gpu section's ddp_overlap set: the step_ms of
    every step it recorded."""
    c = json.loads(cfg.read_text())
    c["data"]["dir"] = str((cfg.parent / c["data"]["dir"]).resolve())  # the copy lives elsewhere
    c["gpu"] = {**c.get("gpu", {}), "ddp_overlap": overlap}
    copy = run.with_name(f"{run.name}.json")
    copy.write_text(json.dumps(c, indent=1))
    cmd = [sys.executable, "-m", "engine.run.cli", str(copy), "--run-dir", str(run),
           "--backend", "cuda", "--max-steps", str(steps)]
    if gpus > 1:
        cmd += ["--gpus", str(gpus)]
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"andrea-train failed ({r.returncode}):\n{r.stdout[-2000:]}\n"
                         f"{r.stderr[-2000:]}")
    return [rec.step_ms for rec in read_steps(run / "loss.jsonl")[0]]


def allreduce_ms(n: int, gpus: int, tmp: Path) -> float:
    from engine.run.launch import free_port

    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", ALLREDUCE, str(tmp), str(n)],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "RANK": str(r),
                                   "WORLD_SIZE": str(gpus), "LOCAL_RANK": str(r),
                                   "MASTER_PORT": port}) for r in range(gpus)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("ALLREDUCE_MS"))
    return float(line.split()[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="120M,12M")
    ap.add_argument("--gpus", default="", help="GPU counts, e.g. 1,2,4,8 (default: 1 and "
                    "every power of two up to this host's GPUs)")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--after-backward", action="store_true",
                    help="also time each GPU count > 1 with one all-reduce after the backward "
                         "(gpu.ddp_overlap false) instead of one per layer inside the step")
    args = ap.parse_args()
    import pycuda.driver as drv

    from engine.config import load_config
    from engine.model.layout import ModelShapes, n_params

    drv.init()
    have = drv.Device.count()
    counts = ([int(x) for x in args.gpus.split(",")] if args.gpus else
              [g for g in (1, 2, 4, 8, 16) if g <= have])
    if counts[0] != 1 or max(counts) > have:
        raise SystemExit(f"--gpus {args.gpus}: starts at 1, at most the {have} GPUs here")
    rows = []
    print("| model | GPUs | step ms (median) | tok/s | × one GPU | efficiency | all-reduce ms "
          "(fp32, alone) | exposed ms | hidden ms |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            cfg = ROOT / "experiments" / f"ANDREA-{name}-TRAIN.json"
            c = load_config(cfg)
            n = n_params(ModelShapes.from_config(c.model))
            base_tok = base_ms = None
            runs = [(g, True) for g in counts]
            if args.after_backward:
                runs += [(g, False) for g in counts if g > 1]
            for g, overlap in runs:
                t0 = time.time()
                ms = train(cfg, Path(tmp) / f"{name}-{g}-{overlap}", args.steps, g, overlap)
                med = statistics.median(ms[args.warmup:])
                tok_s = c.tokens_per_step * g / (med / 1e3)
                base_tok, base_ms = base_tok or tok_s, base_ms or med
                ar = allreduce_ms(n, g, Path(tmp)) if g > 1 else float("nan")
                exposed = max(0.0, med - base_ms) if g > 1 else float("nan")
                hidden = max(0.0, ar - exposed) if g > 1 else float("nan")
                rows.append({"model": name, "gpus": g, "overlap": overlap, "step_ms": med, "tok_s": tok_s,
                             "speedup": tok_s / base_tok, "efficiency": tok_s / base_tok / g,
                             "allreduce_ms": ar, "exposed_ms": exposed, "hidden_ms": hidden,
                             "wall_s": time.time() - t0})
                dash = "–"
                label = f"{g}" if overlap or g == 1 else f"{g}, all-reduce after backward"
                print(f"| ANDREA-{name} | {label} | {med:.2f} | {tok_s / 1e3:,.0f}K | "
                      f"{tok_s / base_tok:.2f} | {tok_s / base_tok / g:.0%} | "
                      f"{dash if g == 1 else f'{ar:.2f}'} | "
                      f"{dash if g == 1 else f'{exposed:.2f}'} | "
                      f"{dash if g == 1 else f'{hidden:.2f}'} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
