"""Encoder processes: parts (engine.data.plan) go out to `jobs` worker processes, their tokens come
back in part order, whatever order the workers finish in.

Each worker loads the tokenizer and the encoder once, then reads and encodes one part at a time:
its text in segments of SEGMENT_CHARS cut at safe places (engine.data.reader.read_segments),
`<|endoftext|>` after each document, and gives the memory it freed back to the system. At most
WINDOW_PER_JOB parts per worker are out or waiting to be written, so memory stays bounded
however large the source. Workers end with their parent (a kill -9 of prep takes
them along), ignore Ctrl+C (the parent decides), and a worker that dies is reported, not waited
for.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np

from engine.data.encoders import Encoder, make_encoder
from engine.data.plan import Part
from engine.data.reader import read_segments
from engine.data.tokenizer import load_tokenizer
from engine.errors import RunError, UserError

SEGMENT_CHARS = 1 << 16  # text per encode call: HF's per-call memory grows with it
WINDOW_PER_JOB = 2
# Tokens go to the parent in messages of at most this many: a message is held twice while it is
# received (multiprocessing reads it into a buffer, then copies it out), a part's tokens once.
SEND_TOKENS = 1 << 19
POLL_S = 0.1


class Interrupted(Exception):
    """`should_stop` said yes while parts were out; the workers were ended."""


@dataclass(frozen=True)
class PartResult:
    index: int
    tokens: np.ndarray  # uint16
    nbytes: int
    docs: int


def encode_part(encoder: Encoder, eot_id: int, part: Part) -> tuple[np.ndarray, int]:
    """A part's tokens (documents followed by `<|endoftext|>`) and its document count."""
    chunks: list[np.ndarray] = []
    eot = np.array([eot_id], dtype=np.uint16)
    docs = 0
    for segment, ends in read_segments(part, SEGMENT_CHARS):
        if segment:
            chunks.append(encoder.encode(segment))
        if ends:
            chunks.append(eot)
            docs += 1
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)
    return tokens, docs


def die_with_parent() -> None:
    """Linux: end this process when its parent dies (a kill -9 of prep or the engine)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def give_back_memory() -> None:
    """glibc: return the heap's free pages to the system. A long conversation's strings, freed,
    would otherwise stay in this process's resident memory under the next part's."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _worker(conn: Connection, parent_pid: int, tok_path: str, vocab_size: int, tok_sha: str,
            encoder_name: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    if os.getppid() != parent_pid:
        return  # the parent died before this process could ask to die with it
    try:
        tok = load_tokenizer(tok_path, vocab_size)
        if tok.sha256 != tok_sha:
            raise UserError(f"{tok_path}: changed while being used (sha256 {tok.sha256[:12]}, "
                            f"expected {tok_sha[:12]})")
        encoder = make_encoder(tok, encoder_name)
    except UserError as e:
        conn.send(("error", -1, str(e), "user"))
        return
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        index, part = task
        try:
            tokens, docs = encode_part(encoder, tok.eot_id, part)
        except UserError as e:
            conn.send(("error", index, str(e), "user"))
            continue
        except Exception as e:  # a bug: say where, rather than die silently
            conn.send(("error", index, f"encoding part {index} failed: "
                       + "".join(traceback.format_exception_only(e)).strip(), "run"))
            continue
        conn.send(("ok", index, docs, part.nbytes, int(tokens.size)))
        for lo in range(0, tokens.size, SEND_TOKENS):
            conn.send_bytes(tokens[lo : lo + SEND_TOKENS])
        del tokens
        give_back_memory()


class EncoderPool:
    """`jobs` worker processes encoding parts with the tokenizer at `tok_path` (whose sha256
    must be `tok_sha`)."""

    def __init__(self, jobs: int, tok_path: Path, vocab_size: int, tok_sha: str,
                 encoder_name: str) -> None:
        ctx = mp.get_context("spawn")
        self.jobs = jobs
        self._workers: list[tuple[Any, Connection]] = []
        try:
            for _ in range(jobs):
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=_worker, daemon=True,
                                   args=(child, os.getpid(), str(tok_path), vocab_size,
                                         tok_sha, encoder_name))
                proc.start()
                child.close()
                self._workers.append((proc, parent))
        except BaseException:
            self.close()
            raise

    def run(self, parts: Sequence[Part], start: int,
            should_stop: Callable[[], bool]) -> Iterator[PartResult]:
        """Encode parts[start:], yielding results in part order. A part's bad input is raised
        (UserError) when its turn comes, after every part before it: the first error in document
        order, however many processes run."""
        n = len(parts)
        next_out, next_write = start, start
        window = self.jobs * WINDOW_PER_JOB
        idle = list(range(len(self._workers)))
        busy: dict[int, int] = {}  # worker -> part index
        done: dict[int, PartResult | Exception] = {}
        while next_write < n:
            while idle and next_out < n and next_out < next_write + window:
                w = idle.pop()
                try:
                    self._workers[w][1].send((next_out, parts[next_out]))
                except OSError:  # a broken pipe: the worker is gone
                    raise self._died(w, next_out) from None
                busy[w] = next_out
                next_out += 1
            conns = {self._workers[w][1]: w for w in busy}
            sentinels = {self._workers[w][0].sentinel: w for w in busy}
            ready = wait(list(conns) + list(sentinels), timeout=POLL_S)
            if should_stop():
                raise Interrupted
            for r in ready:
                if r in conns:
                    w = conns[r]
                    self._receive(w, done)
                    busy.pop(w)
                    idle.append(w)
                elif sentinels[r] in busy and not self._workers[sentinels[r]][1].poll():
                    raise self._died(sentinels[r], busy[sentinels[r]])
            while next_write in done:
                result = done.pop(next_write)
                if isinstance(result, Exception):
                    raise result
                yield result
                next_write += 1

    def _receive(self, w: int, done: dict[int, PartResult | Exception]) -> None:
        _, conn = self._workers[w]
        try:
            msg = conn.recv()
            if msg[0] == "error":
                _, index, text, kind = msg
                error = UserError(text) if kind == "user" else RunError(text)
                if index < 0:  # the worker could not start
                    raise error
                done[index] = error
                return
            _, index, docs, nbytes, n = msg
            tokens = np.empty(n, dtype=np.uint16)
            at = 0
            while at < n:
                chunk = np.frombuffer(conn.recv_bytes(), dtype=np.uint16)
                tokens[at : at + chunk.size] = chunk
                at += chunk.size
        except (EOFError, OSError):
            raise self._died(w, None) from None
        done[index] = PartResult(index, tokens, nbytes, docs)

    def _died(self, w: int, index: int | None) -> RunError:
        proc = self._workers[w][0]
        proc.join(1.0)
        on = f" on part {index}" if index is not None else ""
        return RunError(f"an encoder process ended unexpectedly (exit status "
                        f"{proc.exitcode}){on}")

    def close(self) -> None:
        """End the workers now (a part being encoded is dropped)."""
        for proc, conn in self._workers:
            if proc.is_alive():
                proc.kill()
            conn.close()
        for proc, _ in self._workers:
            proc.join()
        self._workers = []
