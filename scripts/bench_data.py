#!/usr/bin/env python3
"""Benchmark the data pipeline on the built-in sources and print a table.

Measures: built-in corpus size per source (bytes, docs, seconds to extract), tokenizer training
time on `--train-bytes` of text, encode throughput (MB/s, HF encode_batch), and the sampler's
time per batch at ANDREA-120M shapes (B=8, T=1024). Everything is written to a temporary
directory; nothing in the repository is touched.

    .venv/bin/python scripts/bench_data.py [--train-bytes 8000000] [--batches 500]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import SourceConfig
from engine.data.builtin import BUILTINS
from engine.data.prep import BATCH_BYTES, training_texts
from engine.data.sampler import Sampler
from engine.data.shards import open_shard, write_shard
from engine.data.sources import iter_documents
from engine.data.tokenizer import train_tokenizer


def row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-bytes", type=int, default=8_000_000)
    ap.add_argument("--batches", type=int, default=500)
    args = ap.parse_args()
    sources = [SourceConfig(name=n, builtin=n) for n in BUILTINS]
    lines = [f"cores: {os.cpu_count()}", "", row("source", "docs", "bytes", "extract s"),
             row("---", "---:", "---:", "---:")]
    docs: dict[str, list[str]] = {}
    for s in sources:
        t0 = time.perf_counter()
        docs[s.name] = list(iter_documents(s))
        dt = time.perf_counter() - t0
        size = sum(len(d.encode()) for d in docs[s.name])
        lines.append(row(s.name, len(docs[s.name]), f"{size:,}", f"{dt:.2f}"))

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        tok = train_tokenizer(training_texts(sources, args.train_bytes), Path(tmp) / "tok.json")
        train_s = time.perf_counter() - t0
        lines += ["", f"tokenizer training: {train_s:.2f} s on up to "
                  f"{args.train_bytes / 1e6:.1f} MB ({tok.vocab_size} ids)", "",
                  row("source", "tokens", "bytes/token", "encode s", "MB/s"),
                  row("---", "---:", "---:", "---:", "---:")]
        shards = []
        for name, ds in docs.items():
            size = sum(len(d.encode()) for d in ds)
            t0 = time.perf_counter()
            parts, batch, batch_bytes = [], [], 0
            for d in ds:  # same batching as prep
                batch.append(d)
                batch_bytes += len(d)
                if batch_bytes >= BATCH_BYTES:
                    parts += tok.encode_batch(batch)
                    batch, batch_bytes = [], 0
            parts += tok.encode_batch(batch)
            dt = time.perf_counter() - t0
            eot = np.array([tok.eot_id], np.uint16)
            arr = np.concatenate([x for p in parts for x in (p, eot)])
            lines.append(row(name, f"{arr.size:,}", f"{size / arr.size:.2f}", f"{dt:.2f}",
                             f"{size / 1e6 / dt:.2f}"))
            path = Path(tmp) / f"{name}.bin"
            write_shard(path, arr, tok.vocab_size, tok.sha256)
            shards.append(open_shard(path, tok.vocab_size, tok.sha256))

        sampler = Sampler(shards, seq_len=1024, seed=0)
        weights = np.full(len(shards), 1 / len(shards))
        sampler.sample(8, weights)  # warm the page cache
        t0 = time.perf_counter()
        for _ in range(args.batches):
            sampler.sample(8, weights)
        per = (time.perf_counter() - t0) / args.batches
        lines += ["", f"sampler: {per * 1e6:.0f} us per batch at B=8, T=1024 "
                  f"(mean of {args.batches})"]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
