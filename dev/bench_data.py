#!/usr/bin/env python3
"""Benchmark data preparation on a generated corpus and print a table.

Generates `--gb` of text deterministically in a temporary directory from the built-in sources,
repeated with variation (documents reordered, half of them with their letters permuted), in the
seed's four shapes: Gutenberg books of about 16 MB (licence header and footer included), a
documentation tree of Markdown files, a tree of code files, and JSONL conversations. Then, each in
a process of its own whose whole process tree's peak RSS is sampled:
- the baseline: the plain way to encode, one process running HF `encode_batch` (HF's own
  threads on every core) over whole documents, on the first `--baseline-mb` MB of every source;
- `andrea-prep --jobs N` for each N in `--jobs`, on the whole corpus, with the same tokenizer
  (trained once on `--train-bytes` of the corpus; its time is reported).
It checks that every run wrote the same shard bytes, and times the sampler at ANDREA-120M shapes
(B=8, T=1024) on the shards. No network, no data beyond Python's own:

    .venv/bin/python dev/bench_data.py --gb 1 --jobs 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from engine.config import parse_config  # noqa: E402
from engine.data.builtin import BUILTINS  # noqa: E402
from tests.procs import measure  # noqa: E402

SHARES = {"books": 0.30, "docs": 0.25, "code": 0.25, "chat": 0.20}
BOOK_BYTES = 16_000_000
CHAT_FILE_BYTES = 64_000_000
BATCH_BYTES = 4_000_000  # the baseline's text per encode_batch call


def row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


# ---------------------------------------------------------------- the corpus


def _variants(docs: list[str], rep: int) -> list[str]:
    """Repetition `rep` of `docs`: reordered, and for rep > 0 half of them with their lowercase
    letters permuted (new words, the same shapes: no encoder cache gets a free ride)."""
    rng = random.Random(rep)
    order = list(range(len(docs)))
    rng.shuffle(order)
    letters = "abcdefghijklmnopqrstuvwxyz"
    perm = list(letters)
    rng.shuffle(perm)
    table = str.maketrans(letters, "".join(perm))
    return [docs[i].translate(table) if rep and i % 2 else docs[i] for i in order]


def _stream(docs: list[str]):
    rep = 0
    while True:
        yield from _variants(docs, rep)
        rep += 1


class _Writer:
    def __init__(self, budget: int) -> None:
        self.budget, self.written = budget, 0

    @property
    def full(self) -> bool:
        return self.written >= self.budget

    def write(self, path: Path, text: str) -> None:
        data = text.encode("utf-8")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self.written += len(data)


def generate(root: Path, total: int) -> list[dict]:
    """Write the corpus under `root`; returns the config's sources."""
    prose = list(BUILTINS["python-reference"]()) + list(BUILTINS["stdlib-docstrings"]())
    code = list(BUILTINS["stdlib-code"]())
    docstrings = list(BUILTINS["stdlib-docstrings"]())

    w = _Writer(int(total * SHARES["books"]))
    src = _stream(prose)
    i = 0
    while not w.full:
        body, size = [], 0
        while size < BOOK_BYTES:
            d = next(src)
            body.append(d)
            size += len(d)
        w.write(root / "books" / f"pg{i:05d}.txt",
                f"The Project Gutenberg eBook of Volume {i}\r\n\r\n*** START OF THE PROJECT "
                f"GUTENBERG EBOOK VOLUME {i} ***\r\n\r\n" + "\n\n".join(body).replace("\n", "\r\n")
                + f"\r\n\r\n*** END OF THE PROJECT GUTENBERG EBOOK VOLUME {i} ***\r\n"
                + "Section 1. General Terms of Use\r\n" * 200)
        i += 1

    w = _Writer(int(total * SHARES["docs"]))
    src = _stream(docstrings)
    i = 0
    while not w.full:
        page = "\n\n".join(f"## {d}" for d in (next(src) for _ in range(8)))
        w.write(root / "docs" / f"part{i // 1000:03d}" / f"page{i:06d}.md", page)
        i += 1

    w = _Writer(int(total * SHARES["code"]))
    src = _stream(code)
    i = 0
    while not w.full:
        w.write(root / "code" / f"pkg{i // 1000:03d}" / f"mod{i:06d}.txt", next(src))
        i += 1

    w = _Writer(int(total * SHARES["chat"]))
    src = _stream(docstrings)
    i = 0
    while not w.full:
        lines, size = [], 0
        while size < CHAT_FILE_BYTES and w.written + size < w.budget:
            d = next(src)
            head, _, rest = d.partition("\n\n")
            conv = {"conversations": [
                {"from": "system", "value": "You answer questions about Python."},
                {"from": "human", "value": f"What does {head} do?"},
                {"from": "gpt", "value": rest or head}]}
            line = json.dumps(conv, ensure_ascii=False)
            lines.append(line)
            size += len(line) + 1
        w.write(root / "chat" / f"hermes-{i:03d}.jsonl", "\n".join(lines) + "\n")
        i += 1

    return [
        {"name": "books", "paths": [str(root / "books")], "format": "gutenberg"},
        {"name": "docs", "paths": [str(root / "docs")], "format": "docs"},
        {"name": "code", "paths": [str(root / "code")], "format": "text"},
        {"name": "chat", "paths": [str(root / "chat")], "format": "jsonl"},
    ]


def write_config(path: Path, data_dir: Path, sources: list[dict], train_bytes: int) -> None:
    c = json.loads((ROOT / "experiments" / "ANDREA-120M-TRAIN.json").read_text())
    c["data"] = {"dir": str(data_dir),
                 "tokenizer": {"path": "tokenizer.json", "vocab_size": 8449,
                               "train_bytes": train_bytes},
                 "sources": sources}
    path.write_text(json.dumps(c, indent=2))


# ---------------------------------------------------------------- measuring


def run_measured(argv: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS of the process tree, stdout) of a command that must succeed."""
    wall, peak, rc, out = measure(argv, ROOT)
    if rc != 0:
        raise SystemExit(f"failed ({rc}): {' '.join(argv)}\n{out}")
    return wall, peak, out


def baseline(config: Path, mb: float, sizes_path: Path) -> None:
    """The baseline: whole documents, HF encode_batch in batches of BATCH_BYTES,
    on the first `mb` MB of every source (in proportion to its size). Prints JSON."""
    from engine.config import load_config
    from engine.data.sources import iter_documents
    from engine.data.tokenizer import load_tokenizer

    cfg = load_config(config)
    tok = load_tokenizer(Path(cfg.data.dir) / "tokenizer.json")
    sizes = {s["name"]: s["bytes"] for s in json.loads(sizes_path.read_text())}
    total = sum(sizes.values())
    done, secs = 0, 0.0
    for source in cfg.data.sources:
        budget = mb * 1e6 * sizes[source.name] / total
        taken = 0
        batch: list[str] = []
        t0 = time.perf_counter()
        for doc in iter_documents(source):
            batch.append(doc)
            taken += len(doc.encode("utf-8"))
            if sum(len(d) for d in batch) >= BATCH_BYTES or taken >= budget:
                tok.encode_batch(batch)
                batch = []
            if taken >= budget:
                break
        if batch:
            tok.encode_batch(batch)
        secs += time.perf_counter() - t0
        done += taken
    print(json.dumps({"bytes": done, "seconds": secs}))


def shard_digest(data_dir: Path) -> str:
    h = hashlib.sha256()
    for p in sorted((data_dir / "shards").glob("*.bin")):
        with open(p, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="corpus size (default 1)")
    ap.add_argument("--jobs", default="1,2", help="andrea-prep --jobs values (default 1,2)")
    ap.add_argument("--encoder", default="auto", help="andrea-prep --encoder (default auto)")
    ap.add_argument("--baseline-mb", type=float, default=64,
                    help="MB the single-process HF baseline encodes (default 64)")
    ap.add_argument("--train-bytes", type=int, default=8_000_000)
    ap.add_argument("--dir", type=Path, default=None,
                    help="work here (kept) instead of a temporary directory")
    ap.add_argument("--baseline", nargs=3, help=argparse.SUPPRESS)  # CONFIG MB SIZES.json
    args = ap.parse_args()
    if args.baseline:
        baseline(Path(args.baseline[0]), float(args.baseline[1]), Path(args.baseline[2]))
        return
    jobs = [int(j) for j in args.jobs.split(",")]
    work = args.dir or Path(tempfile.mkdtemp(prefix="bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        run(args, jobs, work)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, jobs: list[int], work: Path) -> None:
    py = sys.executable
    t0 = time.perf_counter()
    sources = generate(work / "corpus", int(args.gb * 1e9))
    gen_s = time.perf_counter() - t0
    sizes = []
    for s in sources:
        files = [p for p in Path(s["paths"][0]).rglob("*") if p.is_file()]
        sizes.append({"name": s["name"], "files": len(files),
                      "bytes": sum(p.stat().st_size for p in files)})
    total = sum(s["bytes"] for s in sizes)
    lines = [f"cores: {os.cpu_count()} (this process may use {len(os.sched_getaffinity(0))}), "
             f"load average {os.getloadavg()[0]:.1f}",
             f"corpus: {total / 1e9:.2f} GB generated in {gen_s:.0f} s", "",
             row("source", "format", "files", "MB"), row("---", "---", "---:", "---:")]
    for s, z in zip(sources, sizes, strict=True):
        lines.append(row(s["name"], s["format"], f"{z['files']:,}", f"{z['bytes'] / 1e6:,.0f}"))

    # the tokenizer, trained once and shared by every run
    from engine.data.sample import training_texts
    from engine.data.tokenizer import train_tokenizer

    tok_cfg = work / "tok.json"
    write_config(tok_cfg, work / "tok-data", sources, args.train_bytes)
    cfg = parse_config(json.loads(tok_cfg.read_text()), "bench", work)
    t0 = time.perf_counter()
    tok = train_tokenizer(training_texts(cfg.data.sources, args.train_bytes),
                          work / "tok-data" / "tokenizer.json")
    train_s = time.perf_counter() - t0
    lines += ["", f"tokenizer: trained on {args.train_bytes / 1e6:.0f} MB sampled from every "
              f"source in {train_s:.1f} s (sha256 {tok.sha256[:12]})"]

    def fresh(name: str) -> Path:
        data = work / name
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir()
        shutil.copy(tok.path, data / "tokenizer.json")
        path = work / f"{name}.json"
        write_config(path, data, sources, args.train_bytes)
        return path

    results = []
    cfg_path = fresh("baseline")
    sizes_path = work / "sizes.json"
    sizes_path.write_text(json.dumps(sizes))
    _, peak, out = run_measured([py, __file__, "--baseline", str(cfg_path),
                                 str(args.baseline_mb), str(sizes_path)])
    b = json.loads(out.strip().splitlines()[-1])
    base_mb_s = b["bytes"] / 1e6 / b["seconds"]
    results.append(("HF encode_batch, whole documents (baseline)", "1 (HF threads)", "hf",
                    b["bytes"], b["seconds"], base_mb_s, peak, "-"))

    digests = set()
    for n in jobs:
        cfg_path = fresh(f"prep-{n}")
        wall, peak, out = run_measured([py, "-m", "engine.data.prep", str(cfg_path),
                                        "--jobs", str(n), "--encoder", args.encoder])
        enc = next((ln.split()[2] for ln in out.splitlines() if ln.startswith("encoding with")),
                   "?")
        manifest = json.loads((work / f"prep-{n}" / "manifest.json").read_text())
        nbytes = sum(r["bytes"] for r in manifest["shards"].values())
        digest = shard_digest(work / f"prep-{n}")
        digests.add(digest)
        results.append((f"andrea-prep --jobs {n}", f"1 + {n}", enc, nbytes, wall,
                        nbytes / 1e6 / wall, peak, digest))
        last = work / f"prep-{n}"

    lines += ["", row("path", "processes", "encoder", "MB", "seconds", "MB/s", "x baseline",
                      "peak RSS (tree)", "shards sha256"),
              row("---", "---", "---", "---:", "---:", "---:", "---:", "---:", "---")]
    for name, procs, enc, nbytes, secs, mb_s, peak, digest in results:
        lines.append(row(name, procs, enc, f"{nbytes / 1e6:,.0f}", f"{secs:.1f}", f"{mb_s:.2f}",
                         f"{mb_s / base_mb_s:.1f}", f"{peak / 1e6:,.0f} MB", digest))
    lines.append("")
    lines.append("andrea-prep seconds are wall time of the whole command (start-up, planning, "
                 "encoding, writing); the baseline's are its encoding loop alone.")
    lines.append("shards: " + ("identical for every --jobs" if len(digests) == 1
                               else f"DIFFER: {sorted(digests)}"))

    from engine.data.prep import load_prepared
    from engine.data.sampler import Sampler

    prepared = load_prepared(parse_config(json.loads((work / f"prep-{jobs[-1]}.json")
                                                     .read_text()), "bench", last))
    sampler = Sampler(prepared.shards, seq_len=1024, seed=0)
    weights = np.full(len(prepared.shards), 1 / len(prepared.shards))
    sampler.sample(8, weights)
    t0 = time.perf_counter()
    for _ in range(500):
        sampler.sample(8, weights)
    per = (time.perf_counter() - t0) / 500
    lines.append(f"sampler: {per * 1e6:.0f} us per batch at B=8, T=1024 (mean of 500)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
