"""`andrea-prep`: train (or reuse) the tokenizer and write one token shard per source.

Idempotent: `<data.dir>/manifest.json` records each source's fingerprint and the tokenizer's
sha256; a source whose fingerprint and tokenizer are unchanged (and whose shard still checks out)
is skipped. Documents are separated by `<|endoftext|>` (one after each document).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from engine import jsonio
from engine.config import Config, SourceConfig, load_config
from engine.data.builtin import even_selection
from engine.data.shards import Shard, open_shard, write_shard
from engine.data.sources import iter_documents, source_fingerprint
from engine.data.tokenizer import Tokenizer, load_tokenizer, train_tokenizer
from engine.errors import UserError, cli_entry

MANIFEST_VERSION = 1
BATCH_BYTES = 4_000_000  # text per encode_batch call: big enough for HF's threads, bounded memory
PROGRESS_EVERY_S = 2.0

Progress = Callable[[str], None]
ShouldStop = Callable[[], bool]
POLL_S = 0.1  # how often a stop request is looked at while the tokenizer trains


class PrepInterrupted(Exception):
    """Preparation stopped because a stop was asked for; nothing half-written was kept."""


def _never() -> bool:
    return False


@dataclass
class PrepResult:
    tokenizer_path: Path
    tokenizer_sha: str
    trained_tokenizer: bool
    shard_paths: dict[str, Path] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def data_paths(config: Config) -> tuple[Path, Path]:
    """(data dir, tokenizer path); a relative tokenizer path is taken inside the data dir."""
    data_dir = Path(config.data.dir)
    tok_path = Path(config.data.tokenizer.path)
    if not tok_path.is_absolute():
        tok_path = data_dir / tok_path
    return data_dir, tok_path


def shard_path(data_dir: Path, name: str) -> Path:
    return data_dir / "shards" / f"{name}.bin"


def _read_manifest(path: Path) -> dict:
    try:
        m = jsonio.load_file(path, max_bytes=jsonio.STATE_BYTES)
    except jsonio.JsonError:
        return {}  # missing or damaged: everything is redone, which is always safe
    return m if isinstance(m, dict) and m.get("version") == MANIFEST_VERSION else {}


def _write_manifest(path: Path, manifest: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # unique: preps may overlap
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def training_budgets(totals: list[int], train_bytes: int) -> list[int]:
    """Split train_bytes over sources as evenly as their sizes allow (water-filling): a source
    smaller than its even share gives the rest to the others."""
    budgets = [0] * len(totals)
    remaining = train_bytes
    order = sorted(range(len(totals)), key=lambda i: totals[i])
    for rank, i in enumerate(order):
        budgets[i] = min(totals[i], remaining // (len(totals) - rank))
        remaining -= budgets[i]
    return budgets


def training_texts(sources: Sequence[SourceConfig], train_bytes: int) -> Iterator[str]:
    """A balanced, deterministic slice of every source for tokenizer training, at most
    train_bytes in all, chosen evenly over each source's documents."""
    sizes = [[len(d.encode("utf-8")) for d in iter_documents(s)] for s in sources]
    budgets = training_budgets([sum(s) for s in sizes], train_bytes)
    for source, doc_sizes, budget in zip(sources, sizes, budgets, strict=True):
        keep = set(even_selection(doc_sizes, budget))
        taken = 0
        for i, doc in enumerate(iter_documents(source)):
            room = budget - taken
            if room <= 0:
                break
            if i in keep:
                # A single huge document would blow the budget: cut it (on a char boundary).
                piece = doc
                if doc_sizes[i] > room:
                    piece = doc.encode()[:room].decode("utf-8", "ignore")
                taken += len(piece.encode("utf-8"))
                yield piece


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode_source(
    tok: Tokenizer, source: SourceConfig, path: Path, progress: Progress,
    should_stop: ShouldStop = _never,
) -> tuple[int, int, int, float]:
    """Encode a source into its shard; returns (tokens, bytes, docs, seconds)."""
    name = source.name
    eot = np.array([tok.eot_id], dtype=np.uint16)
    stats = {"bytes": 0, "docs": 0}
    t0 = time.perf_counter()
    last = t0

    def chunks() -> Iterator[np.ndarray]:
        nonlocal last
        for batch in _batches(iter_documents(source)):
            if should_stop():
                raise PrepInterrupted  # write_shard removes its temporary file
            for ids in tok.encode_batch(batch):
                yield ids
                yield eot
            stats["bytes"] += sum(len(d.encode("utf-8")) for d in batch)
            stats["docs"] += len(batch)
            now = time.perf_counter()
            if now - last >= PROGRESS_EVERY_S:
                last = now
                mb = stats["bytes"] / 1e6
                progress(f"  {name}: {mb:.1f} MB, {mb / (now - t0):.2f} MB/s ...")

    n_tokens = write_shard(path, chunks(), tok.vocab_size, tok.sha256)
    return n_tokens, stats["bytes"], stats["docs"], time.perf_counter() - t0


def _get_tokenizer(
    config: Config, manifest: dict, force: bool, progress: Progress,
    should_stop: ShouldStop = _never,
) -> tuple[Tokenizer, bool]:
    """Load the existing tokenizer, or train one when there is none (or with --force).

    An existing tokenizer is kept even when the sources changed since it was trained: a new one
    would make every shard and checkpoint made with the old one unusable. (tok, trained)
    """
    _, tok_path = data_paths(config)
    vocab_size = config.data.tokenizer.vocab_size
    train_bytes = config.data.tokenizer.train_bytes
    sources = config.data.sources
    recipe = {
        "vocab_size": vocab_size,
        "train_bytes": train_bytes,
        "sources": {s.name: source_fingerprint(s) for s in sources},
    }
    recorded = manifest.get("tokenizer", {})
    if tok_path.exists() and not force:
        tok = load_tokenizer(tok_path, vocab_size)
        if recorded.get("sha256") != tok.sha256:
            progress(f"tokenizer: using {tok_path} as given (sha256 {tok.sha256[:12]})")
        elif recorded.get("recipe") != recipe:
            progress(
                f"tokenizer: kept {tok_path}, though its training inputs changed since "
                "(--force retrains it and re-encodes every source)"
            )
        else:
            progress(f"tokenizer: unchanged, skipped ({tok_path})")
        return tok, False
    progress(f"tokenizer: training on up to {train_bytes / 1e6:.1f} MB ...")
    t0 = time.perf_counter()
    tok = _train_in_child(sources, train_bytes, tok_path, vocab_size, should_stop)
    progress(
        f"tokenizer: trained {tok.vocab_size} ids in {time.perf_counter() - t0:.1f} s "
        f"-> {tok_path} (sha256 {tok.sha256[:12]})"
    )
    manifest["tokenizer"] = {"sha256": tok.sha256, "recipe": recipe}
    return tok, True


def prepare(config: Config, progress: Progress = print, force: bool = False,
            should_stop: ShouldStop = _never) -> PrepResult:
    """Train or load the tokenizer, then encode every source into its shard (skip unchanged).
    The config is a validated one (engine.config): vocab sizes agree, sources exist.
    `should_stop` is asked every POLL_S or batch; when it says yes, preparation ends within about
    a second with PrepInterrupted, leaving only complete files (tmp + rename) behind."""
    data_dir, _ = data_paths(config)
    seq_len = config.model.seq_len
    sources = config.data.sources
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"data.dir: cannot create {data_dir}: {e.strerror or e}") from None
    manifest_path = data_dir / "manifest.json"
    manifest = _read_manifest(manifest_path)
    manifest["version"] = MANIFEST_VERSION
    tok, trained = _get_tokenizer(config, manifest, force, progress, should_stop)
    _write_manifest(manifest_path, manifest)

    result = PrepResult(tok.path, tok.sha256, trained)
    shard_records = manifest.setdefault("shards", {})
    for source in sources:
        name = source.name
        path = shard_path(data_dir, name)
        fp = source_fingerprint(source)
        rec = shard_records.get(name, {})
        if not force and rec.get("fingerprint") == fp and rec.get("tokenizer") == tok.sha256:
            try:
                shard = open_shard(path, tok.vocab_size, tok.sha256)
            except UserError:
                shard = None  # damaged or gone: rebuild it
            if shard is not None and len(shard) == rec.get("tokens"):
                progress(f"{name}: unchanged, skipped ({len(shard):,} tokens)")
                result.shard_paths[name] = path
                result.tokens[name] = len(shard)
                result.skipped.append(name)
                continue
        n_tokens, n_bytes, n_docs, secs = _encode_source(tok, source, path, progress, should_stop)
        if n_tokens < seq_len + 1:
            path.unlink(missing_ok=True)
            raise UserError(
                f"data.sources[{name}]: expected at least seq_len+1 = {seq_len + 1} tokens, "
                f"got {n_tokens}: add more text"
            )
        progress(
            f"{name}: {n_docs:,} docs, {n_bytes / 1e6:.2f} MB -> {n_tokens:,} tokens "
            f"({n_bytes / max(n_tokens, 1):.2f} bytes/token) in {secs:.1f} s, "
            f"{n_bytes / 1e6 / max(secs, 1e-9):.2f} MB/s -> {path}"
        )
        shard_records[name] = {
            "fingerprint": fp,
            "tokenizer": tok.sha256,
            "tokens": n_tokens,
            "bytes": n_bytes,
            "docs": n_docs,
        }
        _write_manifest(manifest_path, manifest)
        result.shard_paths[name] = path
        result.tokens[name] = n_tokens
    return result


def _train_child(conn: Any, sources: Sequence[SourceConfig], train_bytes: int, path: Path,
                 vocab_size: int) -> None:
    """The tokenizer training, in a process of its own (the parent can end it at any time)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl+C: the parent decides
    _die_with_parent()
    try:
        train_tokenizer(training_texts(sources, train_bytes), path, vocab_size)
        conn.send(None)
    except UserError as e:
        conn.send(str(e))
    except BaseException as e:  # a bug: report it rather than die silently
        conn.send(f"tokenizer training failed: {type(e).__name__}: {e}")


def _die_with_parent() -> None:
    """Linux: end this process when its parent dies (a kill -9 of the engine)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _train_in_child(sources: Sequence[SourceConfig], train_bytes: int, path: Path,
                    vocab_size: int, should_stop: ShouldStop) -> Tokenizer:
    """Train the tokenizer in a child process and wait for it, looking at `should_stop` every
    POLL_S: HF's trainer runs in native code for seconds to minutes and would hold a stop (and
    its signal handlers) until it returns. A stopped child is killed and its temporary file
    removed; the tokenizer file is only ever renamed into place complete."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_train_child, args=(child, list(sources), train_bytes, path,
                                                  vocab_size), daemon=True)
    proc.start()
    child.close()
    try:
        while not parent.poll(POLL_S):
            if should_stop():
                raise PrepInterrupted
            if not proc.is_alive() and not parent.poll():
                raise UserError(f"tokenizer training ended without a result (exit status "
                                f"{proc.exitcode})")
        error = parent.recv()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        parent.close()
        Path(path).with_name(f".{Path(path).name}.tmp-{proc.pid}").unlink(missing_ok=True)
    if error is not None:
        raise UserError(error)
    return load_tokenizer(path, vocab_size)


class Prepared(NamedTuple):
    tokenizer: Tokenizer
    shards: list[Shard]  # in config source order


def load_prepared(config: Config) -> Prepared:
    """The tokenizer and the shards that `prepare` wrote, checked against each other."""
    data_dir, tok_path = data_paths(config)
    tok = load_tokenizer(tok_path, config.data.tokenizer.vocab_size)
    shards = [
        open_shard(shard_path(data_dir, s.name), tok.vocab_size, tok.sha256)
        for s in config.data.sources
    ]
    return Prepared(tok, shards)


@cli_entry
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="andrea-prep", description="Train the tokenizer and write the token shards."
    )
    parser.add_argument("config", help="experiment config (JSON)")
    parser.add_argument("--force", action="store_true", help="retrain and re-encode everything")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    result = prepare(config, force=args.force)
    total = sum(result.tokens.values())
    print(f"done: {len(result.tokens)} sources, {total:,} tokens in {config.data.dir}")
    return 0


if __name__ == "__main__":
    main()
