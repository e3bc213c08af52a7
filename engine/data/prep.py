"""`andrea-prep`: train (or reuse) the tokenizer and write one token shard per source.

- Fast: each source is planned into parts (engine.data.plan) that `--jobs` encoder processes
  read and encode in parallel (engine.data.pool), with tiktoken where it gives exactly the
  tokenizer's ids, else HF `tokenizers` (engine.data.encoders). Tokens are written in document
  order, so a shard is the same file whatever `--jobs` and whichever encoder.
- Streaming: no document is ever read whole (a large file is read in PART_BYTES pieces cut at
  safe places; of JSONL, one line at a time, engine.data.reader); memory is bounded by the parts
  in flight and the longest line, not by the corpus.
- Resumable: a shard is written part by part and committed every COMMIT_S (engine.data.partial);
  a run after an interruption (a stop, kill -9, a full disk) continues where it stopped and says
  so. Temporary files of processes that died are removed at start. One prep at a time per data
  directory (a lock; a second one waits).
- Idempotent: `<data.dir>/manifest.json` records each source's fingerprint and the tokenizer's
  sha256; a source whose fingerprint and tokenizer are unchanged (and whose shard checks out) is
  skipped.
Documents are separated by `<|endoftext|>` (one after each document).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from engine import infile, jsonio
from engine.config import Config, SourceConfig, load_config
from engine.data.encoders import ENCODERS, choose_encoder
from engine.data.partial import PartialShard
from engine.data.plan import PART_BYTES, Plan, plan_source
from engine.data.pool import EncoderPool, Interrupted, die_with_parent
from engine.data.sample import training_texts
from engine.data.shards import Shard, open_shard
from engine.data.sources import source_fingerprint
from engine.data.tokenizer import Tokenizer, load_tokenizer, train_tokenizer
from engine.env import usable_cores
from engine.errors import UserError, cli_entry
from engine.records import PrepEvent
from engine.runfiles import pid_alive

MANIFEST_VERSION = 1
PROGRESS_EVERY_S = 2.0
COMMIT_S = 1.0  # at most this much encoding is redone after an interruption
POLL_S = 0.1  # how often a stop request is looked at while waiting

Progress = Callable[[PrepEvent], None]
ShouldStop = Callable[[], bool]
_TMP_RE = re.compile(r"^\..+\.tmp-(\d+)$")


class PrepInterrupted(Exception):
    """Preparation stopped because a stop was asked for; nothing half-written was kept, and
    what was committed is continued by the next run."""


def _never() -> bool:
    return False


def print_progress(event: PrepEvent) -> None:
    print(event.message, flush=True)


@dataclass
class PrepResult:
    tokenizer_path: Path
    tokenizer_sha: str
    trained_tokenizer: bool
    shard_paths: dict[str, Path] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    encoder: str = ""  # the encoder that ran ("" when every source was skipped)


def data_paths(config: Config) -> tuple[Path, Path]:
    """(data dir, tokenizer path); a relative tokenizer path is taken inside the data dir."""
    data_dir = Path(config.data.dir)
    tok_path = Path(config.data.tokenizer.path)
    if not tok_path.is_absolute():
        tok_path = data_dir / tok_path
    return data_dir, tok_path


def shard_path(data_dir: Path, name: str) -> Path:
    return data_dir / "shards" / f"{name}.bin"


def default_jobs() -> int:
    return usable_cores()


def _read_manifest(path: Path) -> dict:
    try:
        m = jsonio.load_file(path, max_bytes=jsonio.STATE_BYTES)
    except jsonio.JsonError:
        return {}  # missing or damaged: everything is redone, which is always safe
    return m if isinstance(m, dict) and m.get("version") == MANIFEST_VERSION else {}


def _write_manifest(path: Path, manifest: dict) -> None:
    """Replace the manifest atomically, and only when it changed: every engine start prepares,
    and a rewrite of an up-to-date directory would swap files under whoever copies or reads it."""
    data = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")
    try:
        # read no more than the new text: the file may be anything (a FIFO is not opened)
        with infile.open_regular(path) as f:
            if os.fstat(f.fileno()).st_size == len(data) and f.read(len(data)) == data:
                return
    except OSError:
        pass  # missing or unreadable: written below
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # unique: preps may overlap
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _say(progress: Progress, message: str, source: str = "") -> None:
    progress(PrepEvent(message=message, source=source))


# ---------------------------------------------------------------- the data directory


class _DirLock:
    """One preparation at a time per data directory: an flock on `.prep.lock` (a second prep
    waits for the first, then finds its work done)."""

    def __init__(self, data_dir: Path, progress: Progress, should_stop: ShouldStop) -> None:
        self.path = data_dir / ".prep.lock"
        self.progress = progress
        self.should_stop = should_stop
        self._fd = -1

    def __enter__(self) -> _DirLock:
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"data.dir: cannot write {self.path}: {e.strerror or e}") from None
        said = False
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if not said:
                    _say(self.progress, f"waiting for another andrea-prep using "
                                        f"{self.path.parent} ...")
                    said = True
            if self.should_stop():
                os.close(self._fd)
                raise PrepInterrupted
            time.sleep(POLL_S)

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)  # releases the lock


def remove_stale_tmp(data_dir: Path) -> list[Path]:
    """Remove the `.NAME.tmp-PID` files that processes which have died left in the data
    directory and its shards/ (call with the directory's lock held). Returns them."""
    removed = []
    for d in (data_dir, data_dir / "shards"):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            m = _TMP_RE.match(name)
            if m and not pid_alive(int(m.group(1))):
                try:
                    (d / name).unlink()
                    removed.append(d / name)
                except OSError:
                    pass
    return removed


# ---------------------------------------------------------------- the tokenizer


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
            _say(progress, f"tokenizer: using {tok_path} as given (sha256 {tok.sha256[:12]})")
        elif recorded.get("recipe") != recipe:
            _say(progress,
                 f"tokenizer: kept {tok_path}, though its training inputs changed since "
                 "(--force retrains it and re-encodes every source)")
        else:
            _say(progress, f"tokenizer: unchanged, skipped ({tok_path})")
        return tok, False
    _say(progress, f"tokenizer: training on up to {train_bytes / 1e6:.1f} MB ...")
    t0 = time.perf_counter()
    tok = _train_in_child(sources, train_bytes, tok_path, vocab_size, should_stop)
    _say(progress,
         f"tokenizer: trained {tok.vocab_size} ids in {time.perf_counter() - t0:.1f} s "
         f"-> {tok_path} (sha256 {tok.sha256[:12]})")
    manifest["tokenizer"] = {"sha256": tok.sha256, "recipe": recipe}
    return tok, True


def _train_child(conn: Any, sources: Sequence[SourceConfig], train_bytes: int, path: Path,
                 vocab_size: int) -> None:
    """The tokenizer training, in a process of its own (the parent can end it at any time)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl+C: the parent decides
    die_with_parent()
    try:
        train_tokenizer(training_texts(sources, train_bytes), path, vocab_size)
        conn.send(None)
    except UserError as e:
        conn.send(str(e))
    except BaseException as e:  # a bug: report it rather than die silently
        conn.send(f"tokenizer training failed: {type(e).__name__}: {e}")


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


# ---------------------------------------------------------------- encoding a source


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f}"


def _duration(seconds: float) -> str:
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class _Meter:
    """Progress of one source: bytes done of the total, the rate since this run began on it."""

    def __init__(self, name: str, total: int, done: int) -> None:
        self.name, self.total, self.start_done = name, total, done
        self.t0 = time.perf_counter()

    def event(self, done: int) -> PrepEvent:
        secs = max(time.perf_counter() - self.t0, 1e-9)
        rate = (done - self.start_done) / secs
        eta = (self.total - done) / rate if rate > 0 else None
        pct = 100 * done / self.total if self.total else 100.0
        msg = (f"  {self.name}: {_mb(done)} of {_mb(self.total)} MB ({pct:.0f}%), "
               f"{rate / 1e6:.2f} MB/s, ETA {_duration(eta) if eta is not None else '?'}")
        return PrepEvent(message=msg, source=self.name, bytes_done=done, bytes_total=self.total,
                         mb_s=rate / 1e6, eta_s=eta)


def _encode_source(name: str, plan: Plan, shard: PartialShard,
                   pool: EncoderPool, seq_len: int, progress: Progress,
                   should_stop: ShouldStop) -> tuple[int, int | None, float]:
    """Encode the parts of `plan` not yet in `shard` and complete it. Returns (tokens, input
    bytes kept from an interrupted run or None, seconds)."""
    state = shard.open()
    resumed = state == "resumed"
    c = shard.committed
    n_parts = len(plan.parts)
    if resumed and c.parts == n_parts:
        _say(progress, f"{name}: all {n_parts} parts kept from an interrupted run; completing "
                       "the shard", name)
    elif resumed:
        _say(progress, f"{name}: resuming at part {c.parts + 1} of {n_parts}: {_mb(c.nbytes)} of "
                       f"{_mb(plan.total_bytes)} MB ({c.tokens:,} tokens) kept from an "
                       "interrupted run", name)
    elif state == "restarted":
        _say(progress, f"{name}: an unfinished shard from other inputs (files, tokenizer or "
                       "--part-mb changed) was discarded; starting over", name)
    meter = _Meter(name, plan.total_bytes, c.nbytes)
    last_commit = last_report = time.perf_counter()
    try:
        for result in pool.run(plan.parts, c.parts, should_stop):
            shard.append(result.tokens, result.nbytes, result.docs)
            now = time.perf_counter()
            if now - last_commit >= COMMIT_S:
                shard.commit()
                last_commit = now
            if now - last_report >= PROGRESS_EVERY_S:
                progress(meter.event(shard.written.nbytes))
                last_report = now
    except Interrupted:
        shard.commit()  # what was written is kept for the next run
        shard.close()
        w = shard.written
        _say(progress, f"{name}: stopped at part {w.parts} of {n_parts} ({_mb(w.nbytes)} of "
                       f"{_mb(plan.total_bytes)} MB kept; the next run continues)", name)
        raise PrepInterrupted from None
    except BaseException:
        shard.close()  # the committed parts stay for the next run
        raise
    n_tokens = shard.written.tokens
    if n_tokens < seq_len + 1:
        shard.discard()
        raise UserError(
            f"data.sources[{name}]: expected at least seq_len+1 = {seq_len + 1} tokens, "
            f"got {n_tokens}: add more text"
        )
    shard.finish()
    return n_tokens, c.nbytes if resumed else None, time.perf_counter() - meter.t0


def prepare(config: Config, progress: Progress = print_progress, force: bool = False,
            should_stop: ShouldStop = _never, jobs: int | None = None, encoder: str = "auto",
            part_bytes: int = PART_BYTES) -> PrepResult:
    """Train or load the tokenizer, then encode every source into its shard (skip unchanged,
    continue interrupted ones). The config is a validated one (engine.config): vocab sizes
    agree, sources exist. `jobs` encoder processes (default: every CPU this process may use),
    `encoder` one of ENCODERS ("auto": tiktoken where exact, else HF), parts of `part_bytes`.
    `should_stop` is asked every POLL_S; when it says yes, preparation ends within about a second
    with PrepInterrupted, leaving only complete files and committed parts behind."""
    data_dir, _ = data_paths(config)
    jobs = default_jobs() if jobs is None else jobs
    most = max(8, 4 * default_jobs())  # each encoder process holds ~60 MB
    if not 1 <= jobs <= most:
        raise UserError(f"--jobs: expected 1..{most} (this machine has {default_jobs()} "
                        f"cores), got {jobs}")
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"data.dir: cannot create {data_dir}: {e.strerror or e}") from None
    with _DirLock(data_dir, progress, should_stop):
        stale = remove_stale_tmp(data_dir)
        if stale:
            _say(progress, f"removed {len(stale)} temporary file(s) left by processes that died: "
                           + ", ".join(p.name for p in stale[:5]) + (" ..." if len(stale) > 5
                                                                       else ""))
        return _prepare_locked(config, progress, force, should_stop, jobs, encoder, part_bytes)


def _prepare_locked(config: Config, progress: Progress, force: bool, should_stop: ShouldStop,
                    jobs: int, encoder: str, part_bytes: int) -> PrepResult:
    data_dir, _ = data_paths(config)
    manifest_path = data_dir / "manifest.json"
    manifest = _read_manifest(manifest_path)
    manifest["version"] = MANIFEST_VERSION
    tok, trained = _get_tokenizer(config, manifest, force, progress, should_stop)
    _write_manifest(manifest_path, manifest)

    result = PrepResult(tok.path, tok.sha256, trained)
    shard_records = manifest.setdefault("shards", {})
    todo: list[tuple[SourceConfig, str, Plan]] = []
    for source in config.data.sources:
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
                _say(progress, f"{name}: unchanged, skipped ({len(shard):,} tokens)", name)
                result.shard_paths[name] = path
                result.tokens[name] = len(shard)
                result.skipped.append(name)
                continue
        todo.append((source, fp, plan_source(source, part_bytes)))
    if not todo:
        return result

    enc_name, why = choose_encoder(tok, encoder)
    n_jobs = max(1, min(jobs, max(len(plan.parts) for _, _, plan in todo)))
    result.encoder = enc_name
    _say(progress, f"encoding with {enc_name} ({why}), {n_jobs} process(es), parts of "
                   f"{part_bytes / 2**20:g} MiB")
    pool = EncoderPool(n_jobs, tok.path, tok.vocab_size, tok.sha256, enc_name)
    try:
        for source, fp, plan in todo:
            name = source.name
            path = shard_path(data_dir, name)
            key = {"fingerprint": fp, "tokenizer": tok.sha256, "plan": plan.digest(),
                   "n_parts": len(plan.parts)}
            shard = PartialShard(path, tok.vocab_size, tok.sha256, key)
            if force:
                shard.discard()
            n_tokens, kept, secs = _encode_source(
                name, plan, shard, pool, config.model.seq_len, progress, should_stop)
            w = shard.written
            now = w.nbytes - (kept or 0)
            mb_s = now / 1e6 / max(secs, 1e-9)
            progress(PrepEvent(
                message=f"{name}: {w.docs:,} docs, {w.nbytes / 1e6:.2f} MB -> {n_tokens:,} "
                        f"tokens ({w.nbytes / max(n_tokens, 1):.2f} bytes/token); "
                        f"{now / 1e6:.2f} MB encoded in {secs:.1f} s, {mb_s:.2f} MB/s -> {path}",
                source=name, bytes_done=w.nbytes, bytes_total=plan.total_bytes, mb_s=mb_s,
                eta_s=0.0))
            shard_records[name] = {
                "fingerprint": fp,
                "tokenizer": tok.sha256,
                "tokens": n_tokens,
                "bytes": w.nbytes,
                "docs": w.docs,
                "parts": len(plan.parts),
                "encoder": enc_name,
            }
            _write_manifest(data_dir / "manifest.json", manifest)
            result.shard_paths[name] = path
            result.tokens[name] = n_tokens
            if kept is not None:
                result.resumed.append(name)
    finally:
        pool.close()
    return result


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


# ---------------------------------------------------------------- the command


class _Terminal:
    """Prep's lines on the terminal: on a tty the progress line is rewritten in place."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.pending = False

    def __call__(self, event: PrepEvent) -> None:
        if self.tty and event.bytes_done is not None:
            print("\r\x1b[K" + event.message, end="", flush=True)
            self.pending = True
            return
        if self.pending:
            print("\r\x1b[K", end="")
            self.pending = False
        print(event.message, flush=True)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[Callable[[], str | None]]:
    """While inside, SIGTERM, SIGINT and SIGHUP ask prep to stop; yields what asked (None:
    nothing yet). The previous handlers are put back on the way out."""
    asked: list[str] = []

    def handler(signum: int, frame: object) -> None:
        asked.append(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler)
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        yield lambda: asked[0] if asked else None
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


@cli_entry
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="andrea-prep", description="Train the tokenizer and write the token shards."
    )
    parser.add_argument("config", help="experiment config (JSON)")
    parser.add_argument("--force", action="store_true", help="retrain and re-encode everything")
    parser.add_argument("--jobs", type=int, default=None,
                        help=f"encoder processes (default: the CPUs, {default_jobs()} here)")
    parser.add_argument("--encoder", choices=ENCODERS, default="auto",
                        help="auto: tiktoken where it gives exactly the tokenizer's ids, else HF")
    parser.add_argument("--part-mb", type=float, default=PART_BYTES / 2**20,
                        help="MiB of input per unit of work (default %(default)g)")
    args = parser.parse_args(argv)
    if not 1 / 64 <= args.part_mb <= 1024:  # tiny parts cost a task each: 16 KiB at least
        raise UserError(f"--part-mb: expected a size in [0.015625, 1024] MiB, got "
                        f"{args.part_mb:g}")
    config = load_config(args.config)
    terminal = _Terminal()
    with _stop_on_signals() as stopped_by:
        try:
            result = prepare(config, progress=terminal, force=args.force,
                             should_stop=lambda: stopped_by() is not None, jobs=args.jobs,
                             encoder=args.encoder, part_bytes=max(1, int(args.part_mb * 2**20)))
        except PrepInterrupted:
            terminal(PrepEvent(message=f"stopped ({stopped_by() or 'interrupted'}): what was "
                                       "written is kept; run andrea-prep again to continue"))
            return 130
    total = sum(result.tokens.values())
    terminal(PrepEvent(message=f"done: {len(result.tokens)} sources, {total:,} tokens in "
                               f"{config.data.dir}"))
    return 0


if __name__ == "__main__":
    main()
