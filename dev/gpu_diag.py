"""Determinism and crash bisection for the CUDA backend's fusions (needs a GPU).

Each case runs in its own process (a crash there cannot poison the others): two backends of the
same model, one after the other in that process, each from the same weights through the same
steps (the fused one-graph step at full length, forward_backward at a shorter one); their
losses and weights must agree bit for bit. A case names a model, an attention and one of the
config's gpu choices switched (engine.config.GpuConfig: SWITCHES), so that a failure can be pinned
on one of them. GEMMs take cuBLASLt's first choices (gemm_tune false): two backends that each
timed theirs may pick differently, which says nothing about determinism (a run keeps its choices
in gemm_plan.json). Prints one line per case, then the failing case's error text.

    python3 dev/gpu_diag.py [--jobs 4] [--sync]   (--sync: wait after every launch)

Run it where pycuda imports (scripts/gpu-check sets PYTHONPATH for the wheels; DIAG=1 runs it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"micro": (2, 64, 2, 128, 32, 4), "small": (2, 384, 6, 1536, 256, 4)}
SWITCHES = {
    "defaults": {},
    "no QKV rows": {"qkv_rows": False},
    "cuDNN backward": {"flex_backward": False},
    "fusions off, GELU apart": {"fusions": False, "gelu_in_gemm": False},
    "fp32 logits": {"logits_low_precision": False},
    "fp32 grads": {"grads_low_precision": False},
    "fusions off": {"fusions": False},
}


def child(model: str, attention: str, switched: str) -> None:
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from engine.backends.cuda import CudaBackend
    from engine.config import GpuConfig
    from engine.model.layout import ModelShapes, init_params

    gpu = GpuConfig(attention=attention, gemm_tune=False, **json.loads(switched))

    L, d, H, F, S, B = MODELS[model]
    s = ModelShapes(n_layer=L, d_model=d, n_head=H, d_ff=F, vocab_size=8449, seq_len=S)
    params = init_params(s, seed=3)
    runs = []
    for _ in range(2):
        bk = CudaBackend(s, B, "bf16", gpu=gpu)
        bk.load_params(params)
        rng = np.random.default_rng(7)
        losses = []
        for t in range(1, 4):
            tok = rng.integers(0, 8449, (B, S + 1)).astype(np.int32)
            if bk.fused_step:
                rows, norm, _ = bk.train_step(tok[:, :-1], tok[:, 1:], loss_scale=1.0,
                                              grad_mult=1.0, lr=1e-3, beta1=0.9, beta2=0.95,
                                              eps=1e-8, weight_decay=0.1, t=t, max_norm=1.0)
            else:
                bk.zero_grads()
                rows = bk.forward_backward(tok[:, :-1], tok[:, 1:])
                norm = bk.grad_norm()
                bk.adamw(1e-3, 0.9, 0.95, 1e-8, 0.1, t)
            losses += [*rows.tolist(), norm]
        tok = rng.integers(0, 8449, (B, S)).astype(np.int32)
        bk.zero_grads()
        losses += bk.forward_backward(tok[:, :-1], tok[:, 1:]).tolist()
        g = bk.read_grads()
        runs.append((losses, hashlib.sha256(bk.read_params().tobytes()).hexdigest()[:12],
                     hashlib.sha256(g.tobytes()).hexdigest()[:12], bk.attention))
        bk.close()
    (la, pa, ga, att), (lb, pb, gb, _) = runs
    same = la == lb and pa == pb and ga == gb
    print(json.dumps({"same": same, "attention": att, "loss0": la[0],
                      "first_diff": next((i for i, (x, y) in enumerate(zip(la, lb, strict=True))
                                          if x != y), None), "params": [pa, pb],
                      "grads": [ga, gb]}))


def run_case(name: str, switched: dict[str, Any], model: str, attention: str,
             sync: bool) -> tuple[str, str]:
    e = {**os.environ, **({"ANDREA_CUDA_SYNC": "1"} if sync else {})}
    try:
        p = subprocess.run([sys.executable, __file__, "--child", model, attention,
                            json.dumps(switched)],
                           capture_output=True, text=True, timeout=240, env=e)
    except subprocess.TimeoutExpired:
        return f"{model:<6} {attention:<8} {name:<16} TIMEOUT", ""
    last = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode == 0 and last:
        r = json.loads(last[-1])
        verdict = "same bits" if r["same"] else f"DIFFER (first at {r['first_diff']})"
        return (f"{model:<6} {r['attention']:<8} {name:<16} {verdict}  loss {r['loss0']:.6f}",
                "")
    noise = ("PyCUDA WARNING", "Destroy failed", "FreeHost failed", "Unload failed",
             "cuMemFree failed")
    err = [ln for ln in (p.stdout + p.stderr).splitlines()
           if ln.strip() and not any(n in ln for n in noise)]
    return f"{model:<6} {attention:<8} {name:<16} CRASH (rc {p.returncode})", "\n".join(err[-8:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # MODEL ATTENTION SWITCHED
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--cases", default="micro:classic,small:auto,small:classic")
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0
    cases = [(n, switched, *c.split(":")) for c in args.cases.split(",")
             for n, switched in SWITCHES.items()]
    with ThreadPoolExecutor(args.jobs) as ex:
        results = list(ex.map(lambda c: run_case(*c, args.sync), cases))
    errors = []
    for line, err in results:
        print(line, flush=True)
        if err:
            errors.append(f"--- {line}\n{err}")
    for e in errors[:4]:
        print(e)
    return 1 if any(" CRASH " in line or "DIFFER" in line for line, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
