"""Checkpoint benchmark for ANDREA-12M-sized state on the CPU; prints a table.

    .venv/bin/python dev/bench_checkpoint.py [--dir DIR] [--repeat 3]

Measures: write throughput of `write_checkpoint` (fsync included; MB = 1e6 bytes), the in-memory
copy of params+m+v into preallocated buffers (what the loop must do before a snapshot), and the
training stall of one asynchronous snapshot (copy + `CheckpointWriter.submit`), which should be
no more than the copy. Also: how much a background write slows a numpy compute loop that runs at
the same time (the two share the machine's cores and memory bandwidth).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.run.checkpoint import load_checkpoint
from engine.run.checkpoint_write import CheckpointWriter, write_checkpoint

SHAPE = {"n_layer": 6, "d_model": 384, "d_ff": 1536, "vocab_size": 8449, "seq_len": 1024}


def tensor_table(n_layer: int, d_model: int, d_ff: int, vocab_size: int, seq_len: int) -> list:
    """DESIGN §2 parameter order; n_params is the sum of the shapes."""
    d = d_model
    shapes = [("wte", [vocab_size, d]), ("wpe", [seq_len, d])]
    for i in range(n_layer):
        h = f"h.{i}"
        shapes += [(f"{h}.ln1.gamma", [d]), (f"{h}.ln1.beta", [d]),
                   (f"{h}.attn.W_Q", [d, d]), (f"{h}.attn.W_K", [d, d]),
                   (f"{h}.attn.W_V", [d, d]), (f"{h}.attn.W_O", [d, d]),
                   (f"{h}.ln2.gamma", [d]), (f"{h}.ln2.beta", [d]),
                   (f"{h}.mlp.W_1", [d, d_ff]), (f"{h}.mlp.W_2", [d_ff, d])]
    shapes += [("lnf.gamma", [d]), ("lnf.beta", [d])]
    table, off = [], 0
    for name, shape in shapes:
        table.append({"name": name, "shape": shape, "offset": off})
        off += int(np.prod(shape))
    return table


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compute_loop() -> float:
    a = np.ones((512, 512), np.float32)
    t0 = time.perf_counter()
    for _ in range(60):
        a = (a @ a) * np.float32(1e-3)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    table = tensor_table(**SHAPE)
    n = table[-1]["offset"] + int(np.prod(table[-1]["shape"]))
    rng = np.random.default_rng(0)
    params, m, v = (rng.standard_normal(n, dtype=np.float32) for _ in range(3))
    bufs = [np.empty_like(params) for _ in range(3)]
    state = {"config": SHAPE, "tokens": 123}
    size = 8 + 12 * n
    rows: list[tuple[str, str]] = [("n_params (from the shapes)", f"{n:,}"),
                                   ("model.ckpt bytes", f"{size:,} ({size / 1e6:.1f} MB)")]

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp) / "checkpoints"
        step = [0]

        def sync_write() -> None:
            step[0] += 1
            write_checkpoint(root, step[0], params, m, v, state, "periodic", table)

        t_write = median_time(sync_write, args.repeat)
        rows.append(("write_checkpoint (fsync), median", f"{t_write * 1e3:.0f} ms"))
        rows.append(("write throughput", f"{size / t_write / 1e6:.0f} MB/s"))
        t_load = median_time(lambda: load_checkpoint(root / "step_00000001"), args.repeat)
        rows.append(("load_checkpoint (verify+read)", f"{t_load * 1e3:.0f} ms, "
                     f"{size / t_load / 1e6:.0f} MB/s"))

        def copy() -> None:
            for dst, src in zip(bufs, (params, m, v), strict=True):
                np.copyto(dst, src)

        copy()  # fault the buffers in once, as a trainer that preallocates would
        t_copy = median_time(copy, 5)
        rows.append(("copy params+m+v (np.copyto), median", f"{t_copy * 1e3:.1f} ms"))

        writer = CheckpointWriter(root)
        stalls, submits, copies = [], [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            copy()
            step[0] += 1
            t1 = time.perf_counter()
            copies.append(t1 - t0)
            writer.submit(step[0], *bufs, state, "snapshot", table)
            stalls.append(time.perf_counter() - t0)
            submits.append(time.perf_counter() - t1)
            t_bg0 = time.perf_counter()
            writer.wait()
            t_bg = time.perf_counter() - t_bg0
        results = writer.poll()
        assert all(r.error is None for r in results), results
        t_stall = statistics.median(stalls)
        t_copy_here = statistics.median(copies)
        rows.append(("async snapshot stall (copy + submit)", f"{t_stall * 1e3:.1f} ms "
                     f"({t_stall / t_copy_here:.3f} x its own copy)"))
        rows.append(("  of which copy", f"{t_copy_here * 1e3:.1f} ms"))
        rows.append(("  of which submit", f"{statistics.median(submits) * 1e3:.2f} ms"))
        rows.append(("  background write after submit", f"{t_bg * 1e3:.0f} ms"))

        alone = statistics.median(compute_loop() for _ in range(3))
        copy()
        step[0] += 1
        writer.submit(step[0], *bufs, state, "snapshot", table)
        during = compute_loop()
        writer.wait()
        writer.close()
        rows.append(("numpy compute loop alone", f"{alone * 1e3:.0f} ms"))
        rows.append(("same loop during a background write", f"{during * 1e3:.0f} ms "
                     f"({during / alone:.2f} x)"))

    width = max(len(k) for k, _ in rows)
    print(f"{'measure':<{width}}  value")
    print(f"{'-' * width}  {'-' * 30}")
    for k, val in rows:
        print(f"{k:<{width}}  {val}")


if __name__ == "__main__":
    main()
