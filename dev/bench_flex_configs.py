#!/usr/bin/env python3
"""Time the flex attention backward's config variants (dev/flex-variants) on the GPU against
the frontend's own config and cuDNN's deterministic backward, on the engine's buffers.

    python3 dev/bench_flex_configs.py [--variants DIR] [--heads 12,6] [--batch 8]
        [--seq 1024] [--reps 20] [--trials 5] [--json PATH] [--timeout 180] [--no-graph]

For each H (hd 64, causal, bf16): Q, K, V in the engine's rows (one [B·T, 3·H·64] matrix,
time-major rows t·B + b, as CudnnAttention(rows=True) reads them) and dO ([B·T, H·64]), random
normal with a fixed seed (--seed); cuDNN's forward once (O and its stats), cuDNN's deterministic
backward once (the reference), in the cuDNN row's process, which hands the inputs, O, the stats
and the reference to the variants' processes through a temporary folder (a variant's process
makes them itself where that failed). Then each variant, loaded with
flex_call.FlexBackward (its manifest beside it; libtvm_ffi.so and libcute_dsl_runtime.so from
the pack, DIR's parent, the .xz unpacked there as `scripts/flex-pack --unpack` does): the first
call in a try (an error: the row says "failed: ..."), the same bits twice, dQ/dK/dV against
cuDNN's (relative Frobenius norm of the difference, max |diff|) and against the `frontend`
variant's (bit-identical or not), then `reps` calls timed with CUDA events (after 3 warm-up
calls; eager launches on one stream, then one call captured in a CUDA graph (graphs.capture, the
dq_sem memset a memset node: the engine's step makes it a k_fill node) replayed `reps` times),
the median of `trials`. cuDNN's deterministic backward is timed the same way (the "cudnn" row).
Prints a table per H (µs per call eager and graph; the ratios use the graph's, else eager's) and
with --json writes every figure.

Each variant (and cuDNN's baseline) runs in its own process (this script with --worker) with a
timeout: a kernel that faults (which kills the CUDA context) or never ends (dQ ranks that do not
fit its schedule spin on dq_sem) fails its own row only. The plan (flex_plan.causal_plan) is
adapted to each variant's manifest (`variant_plan`): the masks from its `plan_mask_words`
(SdP_swapAB False transposes the S/dP accumulator), the dQ ranks n instead of m - n without spt.

Bad arguments, or no variants directory, run-time libraries, GPU (sm_90) or cuDNN frontend: one
line on stderr, exit 2. Exit 1 when the cuDNN row or the frontend's (when run) has no time for
some H, else 0.

tests/test_bench_flex_configs.py checks on the CPU the arguments and their errors, the
variants' listing, the runtime library checks, `variant_plan`, the worker's and the tables' flow
on fake CUDA objects, and the mask words the variants' manifests carry (from the DSL's partition,
flex_build_main.plan_mask_words). A variant that compiles may still be wrong or spin on the GPU:
its row's relative difference and the timeout say so. The spt=False ranks follow the frontend's
planner (plan/kernels/common.py:283-302).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.backends.cuda.flex_attn import RUNTIME_NAME, TVM_FFI_NAME  # noqa: E402
from engine.backends.cuda.flex_plan import HEAD_DIM as HD  # noqa: E402

WARMUP = 3
REL_BOUND = 1e-2  # tests/gpu/test_flex_gpu.py's FLEX_VS_CUDNN: above it a row is marked WRONG
NAN_BF16 = 0x7FC0


class Refused(Exception):
    """An argument or a missing piece: one line on stderr, exit 2."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's usage + message: one line instead
        raise Refused(message)


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _heads(text: str) -> list[int]:
    try:
        hs = [int(h) for h in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of head counts, got "
                                         f"{text!r}") from None
    if not hs or any(h < 1 for h in hs):
        raise argparse.ArgumentTypeError(f"head counts must be >= 1, got {text!r}")
    return hs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = OneLineParser(prog="bench_flex_configs.py",
                       description="Time flex attention backward config variants on the GPU.")
    ap.add_argument("--variants", default=str(ROOT / "flex-pack" / "variants"),
                    help="the variants' folder (dev/flex-variants; default flex-pack/variants)")
    ap.add_argument("--heads", type=_heads, default=[12, 6], help="head counts (default 12,6)")
    ap.add_argument("--batch", type=_positive, default=8)
    ap.add_argument("--seq", type=_positive, default=1024, help="a multiple of 128")
    ap.add_argument("--reps", type=_positive, default=20, help="calls per timing (default 20)")
    ap.add_argument("--trials", type=_positive, default=5, help="timings, median (default 5)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--timeout", type=_positive, default=180,
                    help="seconds per variant's process (default 180)")
    ap.add_argument("--only", help="comma-separated variant names (default: all built)")
    ap.add_argument("--no-graph", action="store_true", help="eager timing only")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--refdir", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.seq % 128:
        raise Refused(f"--seq must be a multiple of 128 (the plan's blocks), got {a.seq}")
    if a.worker and not a.result:
        raise Refused("--worker needs --result")
    if a.json and not a.worker:  # found out now, not after the whole sweep
        out = Path(a.json)
        if out.is_dir() or not out.parent.is_dir() or not os.access(out.parent, os.W_OK) or (
                out.exists() and not os.access(out, os.W_OK)):
            raise Refused(f"--json {a.json}: cannot write a file there")
    return a


# ---- the variants and the pack (CPU) ---------------------------------------------------------
def list_variants(vdir: Path, only: str | None = None) -> tuple[list[dict], list[dict]]:
    """(built, not built): the variants in `vdir`, `frontend` first, each {"name", "library",
    "manifest", "overrides"}; not built: index.json's rows that failed (name, overrides,
    error). Refused when the folder or every library is missing."""
    if not vdir.is_dir():
        raise Refused(f"no variants folder {vdir} (build it with dev/flex-variants, carry "
                      f"flex-pack/)")
    index = vdir / "index.json"
    rows: list[dict] = []
    if index.is_file():
        try:
            rows = list(json.loads(index.read_text())["variants"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise Refused(f"{index} is not a variants index ({type(e).__name__}: {e})") from None
    else:
        rows = [{"name": p.stem, "ok": True} for p in sorted(vdir.glob("*.json"))]
    built, failed = [], []
    for r in rows:
        if not isinstance(r, dict) or not isinstance(r.get("name"), str):
            raise Refused(f"{index}: a row without a name: {r!r}")
        name = r["name"]
        lib, manifest = vdir / f"{name}.so", vdir / f"{name}.json"
        if not r.get("ok", False):
            failed.append({"name": name, "overrides": r.get("overrides", {}),
                           "error": r.get("error", "not built")})
        elif lib.is_file() and manifest.is_file():
            try:
                m = json.loads(manifest.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise Refused(f"{manifest} is not readable JSON ({e})") from None
            built.append({"name": name, "library": str(lib), "manifest": m,
                          "overrides": m.get("overrides", r.get("overrides", {}))})
        else:
            failed.append({"name": name, "overrides": r.get("overrides", {}),
                           "error": f"{lib.name} or {manifest.name} missing"})
    if only:
        want = [n for n in only.split(",") if n]
        names = {v["name"] for v in built}
        missing = [n for n in want if n not in names]
        if missing:
            raise Refused(f"--only names variants not built in {vdir}: {missing}")
        built = [v for v in built if v["name"] in want]
    if not built:
        raise Refused(f"no built variants in {vdir} (dev/flex-variants)")
    built.sort(key=lambda v: v["name"] != "frontend")  # stable: frontend first
    return built, failed


def runtime_libs(pack: Path) -> tuple[str, str]:
    """(libtvm_ffi.so, libcute_dsl_runtime.so) in the pack, the latter unpacked from its .xz
    first where needed (as `scripts/flex-pack --unpack`). Refused when missing."""
    tvm, runtime, xz = pack / TVM_FFI_NAME, pack / RUNTIME_NAME, pack / (RUNTIME_NAME + ".xz")
    if not tvm.is_file():
        raise Refused(f"{tvm} is missing (scripts/flex-pack packs it; carry flex-pack/)")
    if not runtime.is_file():
        if not xz.is_file():
            raise Refused(f"neither {runtime} nor {xz.name} in {pack} (scripts/flex-pack)")
        try:
            tmp = runtime.with_suffix(".tmp")
            with lzma.open(xz) as f, open(tmp, "wb") as g:
                shutil.copyfileobj(f, g, 1 << 20)
            tmp.rename(runtime)
        except (OSError, lzma.LZMAError) as e:
            raise Refused(f"cannot unpack {xz} ({type(e).__name__}: {e})") from None
    return str(tvm), str(runtime)


def check_gpu() -> str:
    """The device, or Refused saying why there is none fit (no pycuda, no device, not sm_90,
    no cuDNN frontend). Makes no CUDA context."""
    try:
        import pycuda.driver as drv
    except Exception as e:
        raise Refused(f"no GPU: pycuda is not importable ({type(e).__name__}: {e})") from None
    try:
        drv.init()
        if drv.Device.count() < 1:
            raise Refused("no GPU: no CUDA device")
        ordinal = int(os.environ.get("ANDREA_CUDA_DEVICE", "0"))
        dev = drv.Device(ordinal)
        cc = dev.compute_capability()
        name = dev.name()
    except Refused:
        raise
    except Exception as e:
        raise Refused(f"no GPU: the CUDA driver is unusable ({type(e).__name__}: {e})") from None
    if tuple(cc) != (9, 0):
        raise Refused(f"the flex kernels are sm_90a's, this GPU ({name}) is sm_{cc[0]}{cc[1]}")
    from engine.backends.cuda.cudnn_attn import cudnn_available

    ok, why = cudnn_available()
    if not ok:
        raise Refused(f"no cuDNN: {why}")
    return name


def variant_plan(arrays: list[tuple[str, np.ndarray]], manifest: dict
                 ) -> tuple[list[tuple[str, np.ndarray]], list[str]]:
    """flex_plan's arrays (FIELDS' order) adapted to a variant's manifest, and notes saying
    what changed: the masks from `plan_mask_words` where they differ (SdP_swapAB False), the
    dQ ranks `order`, `forder` = n (the key block: its count of earlier contributors) where the
    kernel runs without spt (spt False or not deterministic), as the frontend's planner gives
    them (plan/kernels/common.py:283-302)."""
    out = dict(arrays)
    notes: list[str] = []
    words = manifest.get("plan_mask_words")
    if words is not None:
        w = np.asarray(words, dtype=np.uint64)
        masks = out["masks"]
        if w.shape != masks.shape[2:] or (w > 0xFFFFFFFF).any():
            raise ValueError(f"plan_mask_words has shape {w.shape}, the plan's masks "
                             f"{masks.shape[2:]}")
        w = w.astype(np.uint32)
        if not (masks == w[None, None]).all():
            out["masks"] = np.ascontiguousarray(np.broadcast_to(w, masks.shape))
            notes.append("masks from the manifest")
    cfg = manifest.get("bwd_config") or {}
    if not (cfg.get("spt", True) and cfg.get("deterministic", True)):
        idx, fcnt = out["idx"], out["fcnt"].reshape(-1)
        out["order"] = idx.astype(np.int32).copy()  # partial: the diagonal m = n, rank n
        out["forder"] = np.repeat(idx.astype(np.int32), fcnt)  # full: m > n, rank n
        notes.append("dQ ranks without spt")
    return [(name, out[name]) for name, _ in arrays], notes


# ---- the worker (GPU) ------------------------------------------------------------------------
def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (round to nearest even), uint16."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_float(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def compare(got: np.ndarray, ref: np.ndarray, d: int) -> dict:
    """Per gradient (dQ, dK, dV: columns j·d of the [R, 3d] rows): relative Frobenius norm of
    got − ref and max |got − ref|; non-finite values: inf."""
    out: dict[str, Any] = {}
    for j, name in enumerate(("dQ", "dK", "dV")):
        g = bf16_float(got[:, j * d:(j + 1) * d]).astype(np.float64)
        r = bf16_float(ref[:, j * d:(j + 1) * d]).astype(np.float64)
        if not np.isfinite(g).all():
            out[name] = {"rel": float("inf"), "max_abs": float("inf")}
            continue
        diff = g - r
        out[name] = {"rel": float(np.linalg.norm(diff) / max(np.linalg.norm(r), 1e-30)),
                     "max_abs": float(np.abs(diff).max())}
    out["rel"] = max(out[n]["rel"] for n in ("dQ", "dK", "dV"))
    out["max_abs"] = max(out[n]["max_abs"] for n in ("dQ", "dK", "dV"))
    return out


def timed(fn, reps: int, trials: int, stream: Any, drv: Any) -> dict:
    """µs per call of `fn` (which queues one call on `stream`): WARMUP calls, then `trials`
    timings of `reps` calls between two events; their median and all."""
    for _ in range(WARMUP):
        fn()
    stream.synchronize()
    us = []
    for _ in range(trials):
        start, end = drv.Event(), drv.Event()
        start.record(stream)
        for _ in range(reps):
            fn()
        end.record(stream)
        end.synchronize()
        us.append(end.time_since(start) * 1000.0 / reps)
    return {"us": statistics.median(us), "trials_us": [round(x, 2) for x in us]}


class Buffers:
    """Device allocations of one H, freed together."""

    def __init__(self, drv: Any) -> None:
        self.drv, self.mems = drv, []

    def alloc(self, nbytes: int) -> int:
        m = self.drv.mem_alloc(max(int(nbytes), 16))
        self.mems.append(m)
        return int(m)

    def put(self, a: np.ndarray) -> int:
        p = self.alloc(a.nbytes)
        self.drv.memcpy_htod(p, np.ascontiguousarray(a))
        return p

    def nan16(self, ptr: int, count: int) -> None:
        self.drv.memset_d16(ptr, NAN_BF16, count)
        self.drv.Context.synchronize()

    def get16(self, ptr: int, shape: tuple[int, ...]) -> np.ndarray:
        self.drv.Context.synchronize()
        h = np.empty(shape, np.uint16)
        self.drv.memcpy_dtoh(h, ptr)
        return h

    def free(self) -> None:
        for m in self.mems:
            m.free()
        self.mems.clear()


def _short(e: BaseException, limit: int = 300) -> str:
    text = " | ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
    text = f"{type(e).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


HOST = ("qkv", "do", "o", "stats", "ref")  # what the cuDNN process hands the variants' ones


def _ref_dir(a: argparse.Namespace, H: int) -> Path | None:
    return Path(a.refdir) / f"H{H}-B{a.batch}-T{a.seq}-s{a.seed}" if a.refdir else None


def _reference(a: argparse.Namespace, H: int, gpu: Any, bufs: Buffers, save: bool
               ) -> tuple[dict[str, np.ndarray], Any]:
    """The inputs (bf16 bits: qkv [R, 3d], do [R, d]), cuDNN's forward (o, stats) and its
    deterministic backward (ref [R, 3d]) for this H, host-side; and the CudnnAttention that made
    them (None when they were loaded: the cuDNN process saved them in --refdir, `save`)."""
    from engine.backends.cuda.cudnn_attn import CudnnAttention

    B, T, d = a.batch, a.seq, H * HD
    R = B * T
    where = _ref_dir(a, H)
    if not save and where is not None and all((where / f"{n}.npy").is_file() for n in HOST):
        return {n: np.load(where / f"{n}.npy") for n in HOST}, None
    drv, stream = gpu.drv, gpu.stream
    rng = np.random.default_rng([a.seed, H])
    host = {"qkv": bf16_bits(rng.standard_normal((R, 3 * d), dtype=np.float32)),
            "do": bf16_bits(rng.standard_normal((R, d), dtype=np.float32))}
    ar = CudnnAttention("bf16", H, HD, stream.handle, rows=True)
    try:
        ar.build(B, T, backward=True)
        qkv, do = bufs.put(host["qkv"]), bufs.put(host["do"])
        o, stats, ref = bufs.alloc(R * d * 2), bufs.alloc(B * H * T * 4), bufs.alloc(R * 3 * d * 2)
        ws = bufs.alloc(ar.workspace_bytes(B, T))
        q, k, v = (qkv + j * d * 2 for j in range(3))
        ar.fwd(q, k, v, o, stats, B, T, ws)
        bufs.nan16(ref, R * 3 * d)
        ar.bwd(q, k, v, o, do, stats, ref, ref + d * 2, ref + 2 * d * 2, B, T, ws)
        host["o"] = bufs.get16(o, (R, d))
        host["stats"] = np.empty((B, H, T), np.float32)
        drv.memcpy_dtoh(host["stats"], stats)
        host["ref"] = bufs.get16(ref, (R, 3 * d))
    except BaseException:
        ar.close()
        raise
    if save and where is not None:
        where.mkdir(parents=True, exist_ok=True)
        for n in HOST:
            np.save(where / f"{n}.tmp.npy", host[n])
            os.replace(where / f"{n}.tmp.npy", where / f"{n}.npy")
    return host, ar


def worker_one(a: argparse.Namespace, H: int, gpu: Any, variant: dict | None,
               libs: tuple[str, str]) -> dict:
    """One H for cuDNN's backward (variant None) or one variant; the row's figures."""
    from engine.backends.cuda import graphs
    from engine.errors import RunError, UserError

    drv, stream = gpu.drv, gpu.stream
    B, T, d = a.batch, a.seq, H * HD
    R = B * T
    bufs = Buffers(drv)
    ar = None
    try:
        host, ar = _reference(a, H, gpu, bufs, save=variant is None)
        row: dict[str, Any] = {
            "inputs_sha": sha(np.concatenate([host["qkv"].ravel(), host["do"].ravel()])),
            "cudnn_sha": sha(host["ref"]),
            "reference": "computed here" if ar is not None else "the cuDNN process's"}
        qkv, do, o, stats = (bufs.put(host[n]) for n in ("qkv", "do", "o", "stats"))
        out = bufs.alloc(R * 3 * d * 2)
        if variant is None:
            if ar is None:
                raise RuntimeError("cuDNN's row needs its own graphs")
            row["cudnn_version"] = ar.version
            ws = bufs.alloc(ar.workspace_bytes(B, T))
            q, k, v = (qkv + j * d * 2 for j in range(3))

            def call() -> None:
                ar.bwd(q, k, v, o, do, stats, out, out + d * 2, out + 2 * d * 2, B, T, ws)
        else:
            from engine.backends.cuda.flex_call import FlexBackward

            try:
                fb = FlexBackward(variant["library"], B, T, H, tvm_ffi_lib=libs[0],
                                  cute_runtime_lib=libs[1], device_id=gpu.ordinal,
                                  variant_ok=True)
                arrays, notes = variant_plan(fb.plan_arrays(), variant["manifest"])
            except (RunError, UserError, ValueError) as e:
                return {**row, "error": f"failed to load: {_short(e)}"}
            row["plan_notes"] = notes
            fb.set_plan([bufs.put(arr) if arr.size else 0 for _, arr in arrays])
            scratch = {name: bufs.alloc(n) for name, n in fb.scratch_bytes().items()}
            args = fb.make_args(qkv=qkv, o=o, do=do, lse=stats, dqkv=out, lse2=scratch["lse2"],
                                dpsum=scratch["dpsum"], dq_accum=scratch["dq_accum"],
                                dq_sem=scratch["dq_sem"], scale=1.0 / HD ** 0.5)

            def call() -> None:
                fb.run(args, stream.handle)

        bits = []
        for attempt in range(2):
            bufs.nan16(out, R * 3 * d)
            try:
                call()
                stream.synchronize()
            except Exception as e:  # RunError from the entry point; a fault at synchronize
                return {**row, "error": f"failed ({'first' if attempt == 0 else 'second'} "
                                        f"call): {_short(e)}"}
            bits.append(bufs.get16(out, (R, 3 * d)))
        row["sha"] = sha(bits[0])
        row["same_bits_twice"] = bool(np.array_equal(bits[0], bits[1]))
        row["vs_cudnn"] = compare(bits[0], host["ref"], d)
        row["eager"] = timed(call, a.reps, a.trials, stream, drv)
        if not a.no_graph:
            try:
                g = graphs.capture(stream.handle, call)
            except Exception as e:
                row["graph_error"] = _short(e)
            else:
                try:
                    row["graph"] = timed(g.launch, a.reps, a.trials, stream, drv)
                    row["graph_nodes"] = g.node_counts()
                    row["graph_same_bits"] = bool(np.array_equal(
                        bufs.get16(out, (R, 3 * d)), bits[0]))
                finally:
                    g.close()
        return row
    finally:
        try:
            stream.synchronize()
        except Exception:
            pass
        if ar is not None:
            ar.close()
        bufs.free()


def worker(a: argparse.Namespace) -> int:
    """--worker NAME: "cudnn" or a variant's name; writes --result after each H."""
    result: dict[str, Any] = {"name": a.worker, "heads": {}}
    path = Path(a.result)

    def save() -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, path)

    try:
        vdir = Path(a.variants)
        variant = None
        if a.worker != "cudnn":
            built, _ = list_variants(vdir, a.worker)
            variant = built[0]
        libs = runtime_libs(vdir.parent)
        from engine.backends.cuda.runtime import Gpu

        gpu = Gpu.get()
        result["device"] = gpu.describe("bf16")
    except Exception as e:
        result["error"] = _short(e)
        save()
        return 1
    for H in a.heads:
        t0 = time.time()
        try:
            r = worker_one(a, H, gpu, variant, libs)
        except Exception as e:
            r = {"error": f"failed: {_short(e)}"}
        r["wall_s"] = round(time.time() - t0, 1)
        result["heads"][str(H)] = r
        save()
    return 0


# ---- the parent: one process per variant, the tables -----------------------------------------
def run_worker(a: argparse.Namespace, name: str, tmp: Path) -> dict:
    path = tmp / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--result", str(path),
           "--refdir", str(tmp / "reference"),
           "--variants", str(Path(a.variants).resolve()),
           "--heads", ",".join(map(str, a.heads)), "--batch", str(a.batch), "--seq", str(a.seq),
           "--reps", str(a.reps), "--trials", str(a.trials), "--seed", str(a.seed)]
    if a.no_graph:
        cmd.append("--no-graph")
    why = ""
    t0 = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                           stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            why = f"exit {r.returncode}: {' | '.join(tail) or 'no output'}"
    except subprocess.TimeoutExpired:
        why = (f"timed out after {a.timeout} s (a kernel that never ends? dq_sem ranks that do "
               f"not fit the schedule spin)")
    try:
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        result = {"name": name, "heads": {}}
    result["wall_s"] = round(time.time() - t0, 1)
    if why:
        result["process_error"] = why
    for H in a.heads:  # an H the process never finished (or never started: its set-up failed)
        result["heads"].setdefault(
            str(H), {"error": f"failed: {result.get('error') or why or 'no result'}"})
    return result


def _us(row: dict) -> float | None:
    for mode in ("graph", "eager"):
        if mode in row:
            return row[mode]["us"]
    return None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}x" if a and b else "-"


def table(H: int, rows: dict[str, dict]) -> list[str]:
    base = rows.get("cudnn", {})
    front = rows.get("frontend", {})
    lines = [f"\nH={H}: µs per call (graph: one call captured, replayed; ratios on graph, else "
             f"eager; < 1 is faster)",
             f"{'variant':<22} {'eager µs':>9} {'graph µs':>9} {'vs front':>9} {'vs cuDNN':>9} "
             f"{'2x bits':>7} {'=front':>6} {'rel diff':>9} {'max|diff|':>9}  notes"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"{name:<22} {r['error']}")
            continue
        eager = f"{r['eager']['us']:.1f}" if "eager" in r else "-"
        graph = f"{r['graph']['us']:.1f}" if "graph" in r else "-"
        same_front = ("-" if name in ("cudnn", "frontend") or "sha" not in front
                      else "yes" if r.get("sha") == front["sha"] else "no")
        vs = r.get("vs_cudnn", {})
        notes = list(r.get("plan_notes", []))
        if vs.get("rel", 0) > REL_BOUND:
            notes.insert(0, f"WRONG? rel diff > {REL_BOUND:g}")
        if r.get("graph_same_bits") is False:
            notes.append("graph replay: other bits")
        if "graph_error" in r:
            notes.append(f"graph: {r['graph_error']}")
        lines.append(
            f"{name:<22} {eager:>9} {graph:>9} {_ratio(_us(r), _us(front)):>9} "
            f"{_ratio(_us(r), _us(base)):>9} {'yes' if r.get('same_bits_twice') else 'NO':>7} "
            f"{same_front:>6} {vs.get('rel', float('nan')):>9.2e} "
            f"{vs.get('max_abs', float('nan')):>9.2e}  {'; '.join(notes)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse_args(argv)
        if a.worker:
            return worker(a)
        vdir = Path(a.variants)
        built, not_built = list_variants(vdir, a.only)
        device = check_gpu()  # before unpacking the run-time library (tens of MB) anywhere
        runtime_libs(vdir.parent)
    except Refused as e:
        print(f"bench_flex_configs: {e}", file=sys.stderr)
        return 2
    print(f"{device}; B={a.batch} T={a.seq} H={a.heads} hd={HD} bf16 causal; {len(built)} "
          f"variants from {vdir}; reps {a.reps}, trials {a.trials}", flush=True)
    results: dict[str, dict] = {}
    t_all = time.time()
    with tempfile.TemporaryDirectory(prefix="flexbench.") as tmp:
        for name in ["cudnn", *(v["name"] for v in built)]:
            res = run_worker(a, name, Path(tmp))
            results[name] = res
            parts = []
            for H in a.heads:
                r = res["heads"][str(H)]
                if "error" in r:
                    parts.append(f"H{H} {r['error'][:160]}")
                else:
                    vs = r["vs_cudnn"]
                    parts.append(f"H{H} eager {r['eager']['us']:.1f} µs"
                                 + (f", graph {r['graph']['us']:.1f} µs" if "graph" in r else "")
                                 + f", same bits {r['same_bits_twice']}, rel {vs['rel']:.2e}")
            print(f"{name} ({res['wall_s']} s): " + "; ".join(parts), flush=True)
    warnings = []
    for H in a.heads:
        shas = {res["heads"][str(H)].get("cudnn_sha") for res in results.values()} - {None}
        ins = {res["heads"][str(H)].get("inputs_sha") for res in results.values()} - {None}
        if len(shas) > 1 or len(ins) > 1:
            warnings.append(f"H={H}: the processes saw {len(ins)} input sets and {len(shas)} "
                            f"cuDNN references (expected one each)")
    for H in a.heads:
        for line in table(H, {n: res["heads"][str(H)] for n, res in results.items()}):
            print(line)
    if not_built:
        print("\nnot built (dev/flex-variants):")
        for v in not_built:
            print(f"  {v['name']}: {v['error']}")
    for w in warnings:
        print(f"WARNING: {w}")
    print(f"\n{time.time() - t_all:.0f} s in all")
    if a.json:
        out = {"device": device, "args": {k: getattr(a, k) for k in
                                          ("variants", "heads", "batch", "seq", "reps", "trials",
                                           "seed", "timeout", "no_graph", "only")},
               "overrides": {v["name"]: v["overrides"] for v in built},
               "results": results, "not_built": not_built, "warnings": warnings}
        try:
            Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
            print(f"results: {a.json}")
        except OSError as e:  # the disk filled during the sweep: the table above stands
            print(f"bench_flex_configs: --json {a.json}: {e.strerror or e}", file=sys.stderr)
            return 2
    ok = all(_us(results[n]["heads"][str(H)]) for n in ("cudnn", "frontend") if n in results
             for H in a.heads)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
