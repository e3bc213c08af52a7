"""Fuzz targets: every reader of outside data, fed hostile bytes.

The property is the same for each: any input gives a value or a clear error (a UserError, whose
message names the file) — never another exception, a hang or memory out of proportion to the
input. `tests/test_fuzz.py` runs each target briefly under Hypothesis in `make test`;
`scripts/fuzz.py` runs them for as long as it is given and prints what it tried.
"""

from __future__ import annotations

import json
import math
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import strategies as st

from engine import records
from engine.config import parse_config
from engine.errors import UserError
from engine.records import SEQUENCE_CONFIRM, STEP_GAP_MAX

ROOT = Path(__file__).resolve().parents[1]
TINY = json.loads((ROOT / "experiments" / "ANDREA-tiny-TRAIN.json").read_text())

# ---------------------------------------------------------------- inputs

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=12), c, max_size=5),
    max_leaves=30)


@st.composite
def near_json(draw: st.DrawFn, base: object) -> bytes:
    """A JSON document close to `base`: a value swapped somewhere, or the text cut, nested,
    or spliced with bytes — the mistakes and attacks a real file would show."""
    text = json.dumps(base)
    how = draw(st.sampled_from(["swap", "cut", "nest", "splice", "raw"]))
    if how == "swap" and isinstance(base, dict):
        obj = json.loads(text)
        keys = list(obj)
        k = draw(st.sampled_from(keys))
        if isinstance(obj[k], dict) and obj[k] and draw(st.booleans()):
            obj[k][draw(st.sampled_from(list(obj[k])))] = draw(JSON)
        else:
            obj[k] = draw(JSON)
        return json.dumps(obj).encode()
    if how == "cut":
        return text.encode()[: draw(st.integers(0, len(text)))]
    if how == "nest":
        d = draw(st.integers(50, 3000))
        return ("[" * d + "]" * d).encode()
    if how == "splice":
        at = draw(st.integers(0, len(text)))
        return text.encode()[:at] + draw(st.binary(max_size=40)) + text.encode()[at:]
    return draw(st.binary(max_size=300))


# ---------------------------------------------------------------- targets


def config(data: bytes) -> None:
    """engine.config.load_config on a file holding `data`."""
    from engine.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "cfg.json"
        p.write_bytes(data)
        try:
            load_config(p)
        except UserError:
            pass


def config_object(obj: object) -> None:
    """parse_config on an already-parsed object (the checkpoint's config on resume)."""
    try:
        parse_config(obj, "cfg", ROOT / "experiments", check_paths=False)
    except UserError:
        pass


def run_file_lines(data: bytes) -> None:
    """The run-file tail and every record reader, on a file holding `data`."""
    from engine.runfiles import JsonlTail, read_json

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "loss.jsonl"
        p.write_bytes(data)
        tail = JsonlTail(p, max_line=4096)
        objs = tail.read_new(max_bytes=1024)
        while tail.more:
            objs += tail.read_new(max_bytes=1024)
        for reader in (records.StepRecord, records.Event, records.Sample):
            records.parse_all(reader, objs)
        for reader in (records.RunStatus, records.EngineInfo):
            reader.from_json(read_json(p))


def run_state(data: bytes) -> None:
    """The app's whole-run model (andrea_tui.runstate) fed the same file as every kind."""
    from andrea_tui.runstate import LossHistory, RunState
    from engine.runfiles import parse_lines

    objs, _ = parse_lines(data.split(b"\n"))
    st_ = RunState()
    st_.add_events(objs)
    st_.add_loss(objs)
    st_.add_samples(objs)
    st_.set_history(LossHistory.build(objs))
    for o in objs[:4]:
        st_.set_files(o, o, o)
    _ = (st_.status, st_.step, st_.max_steps, st_.eta(), st_.elapsed(0.0), st_.last_checkpoint)


def _checkpoint_dir(tmp: Path) -> Path:
    from engine.run.checkpoint_write import write_checkpoint

    n = 12
    arrays = [np.arange(n, dtype=np.float32) * k for k in (1, 2, 3)]
    table = [{"name": "w", "shape": [3, 4], "offset": 0}]
    return write_checkpoint(tmp / "checkpoints", 3, *arrays, {"tokens": 1}, "periodic",
                            table).path


def checkpoint_state(data: bytes) -> None:
    """verify, list and load a checkpoint whose state.json holds `data`."""
    from engine.run.checkpoint import load_checkpoint, verify_checkpoint
    from engine.run.checkpoint_store import list_checkpoints

    with tempfile.TemporaryDirectory() as tmp:
        ck = _checkpoint_dir(Path(tmp))
        (ck / "state.json").write_bytes(data)
        list_checkpoints(ck.parent)
        for fn in (verify_checkpoint, load_checkpoint):
            try:
                fn(ck)
            except UserError:
                pass


def checkpoint_model(data: bytes) -> None:
    """verify and load a checkpoint whose model.ckpt holds `data`."""
    from engine.run.checkpoint import load_checkpoint, verify_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ck = _checkpoint_dir(Path(tmp))
        (ck / "model.ckpt").write_bytes(data)
        for fn in (verify_checkpoint, load_checkpoint):
            try:
                fn(ck)
            except UserError:
                pass


def shard(data: bytes) -> None:
    """open_shard on a file holding `data` (and a header made to look right)."""
    from engine.data.shards import HEADER_SIZE, MAGIC, open_shard

    with tempfile.TemporaryDirectory() as tmp:
        for body in (data, MAGIC + data[8:], MAGIC + struct.pack("<I", 1) + data[12:]):
            p = Path(tmp) / "s.bin"
            p.write_bytes(body)
            try:
                sh = open_shard(p, 8449, "0" * 64)
                assert len(sh) == (p.stat().st_size - HEADER_SIZE) // 2
            except UserError:
                pass


def tokenizer(data: bytes) -> None:
    """load_tokenizer (and the config's vocab count) on a file holding `data`."""
    from engine.config import tokenizer_vocab_size
    from engine.data.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "tokenizer.json"
        p.write_bytes(data)
        tokenizer_vocab_size(p)
        try:
            load_tokenizer(p)
        except UserError:
            pass


def _tokenizer_base() -> object:
    p = ROOT / "data" / "builtin" / "tokenizer.json"
    if p.is_file():
        obj = json.loads(p.read_text())
        obj["model"]["merges"] = obj["model"]["merges"][:20]  # keep the inputs small
        return obj
    return {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
            "pre_tokenizer": {"type": "ByteLevel"}}


def conversations(data: bytes) -> None:
    """The JSONL reader of prep (engine.data.reader) on a file holding `data`, read whole and in
    two parts cut at every tenth byte."""
    from engine.data.plan import Span
    from engine.data.reader import read_span

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "chat.jsonl"
        p.write_bytes(data)
        n = len(data)
        for cut in [n, *range(0, n, max(n // 10, 1))]:
            for lo, hi in ((0, cut), (cut, n)):
                try:
                    for text, ends in read_span(Span(str(p), n, "jsonl", lo, hi, 0, n)):
                        assert isinstance(text, str) and ends
                except UserError:
                    pass


def gutenberg_book(data: bytes) -> None:
    """The Gutenberg body finder and reader on a file holding `data`."""
    from engine.data.gutenberg import body_of
    from engine.data.plan import Span
    from engine.data.reader import read_span

    body = body_of(data)
    assert 0 <= body.start <= body.end <= len(data)
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "book.txt"
        p.write_bytes(data)
        try:
            list(read_span(Span(str(p), len(data), "gutenberg", 0, len(data), 0, len(data))))
        except UserError:
            pass


def prep_journal(data: bytes) -> None:
    """A partial shard's journal holding `data`: continued only when it is one of ours."""
    from engine.data.partial import PartialShard

    key = {"fingerprint": "f", "tokenizer": "t", "plan": "p", "n_parts": 3}
    with tempfile.TemporaryDirectory() as tmp:
        shard = PartialShard(Path(tmp) / "s.bin", 8449, "ab" * 32, key)
        shard.open()
        shard.append(np.arange(8, dtype=np.uint16), 10, 1)
        shard.commit()
        shard.close()
        shard.journal.write_bytes(data)
        again = PartialShard(Path(tmp) / "s.bin", 8449, "ab" * 32, key)
        state = again.open()
        c = again.committed
        assert state in ("resumed", "restarted")
        assert 0 <= c.parts <= 3 and 0 <= c.tokens <= 8
        again.close()


def torn_tail(case: tuple[bytes, list[list[dict[str, Any]]]]) -> None:
    """A JSONL file whose last line a crash or a full disk cut short, appended to by one
    writer after another (engine.runfiles.JsonlWriter, as a resumed engine does): the bytes
    already there stay a prefix, and every record written after them reads back whole."""
    from engine.runfiles import JsonlTail, JsonlWriter, parse_lines

    def same(a: list[Any], b: list[Any]) -> bool:  # NaN == NaN, as the bytes say
        return json.dumps(a) == json.dumps(b)

    torn, writers = case
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "events.jsonl"
        p.write_bytes(torn)
        for batch in writers:
            before = p.read_bytes()
            w = JsonlWriter(p)
            for obj in batch:
                w.write(obj)
            w.close()
            after = p.read_bytes()
            assert after.startswith(before) and after.endswith(b"\n")
            last = after.split(b"\n")[-1 - len(batch):-1]
            assert same([json.loads(ln) for ln in last], batch)
            with open(p, "ab") as f:  # the next writer meets a torn line again
                f.write(torn)
        tail = JsonlTail(p)
        objs = tail.read_new(max_bytes=7)
        while tail.more:
            objs += tail.read_new(max_bytes=7)
        assert same(objs, parse_lines(p.read_bytes().split(b"\n")[:-1])[0])


def _write_run(run: Path, loss_lines: list[bytes], max_steps: int) -> None:
    run.mkdir()
    (run / "loss.jsonl").write_bytes(b"".join(ln + b"\n" for ln in loss_lines))
    ready = {"t": 999.0, "event": "ready", "step": 0, "max_steps": max_steps}
    (run / "events.jsonl").write_text(json.dumps(ready) + "\n")
    cfg = json.loads(json.dumps(TINY))
    cfg["train"]["max_steps"] = max_steps
    (run / "config.json").write_text(json.dumps(cfg))


def forged_records(case: tuple[int, int, list[tuple[int, str, int]], int]) -> None:
    """A run's loss.jsonl with forged step records spliced between its real ones: a step far
    beyond the last, a step behind it, a negative loss, a NaN loss on a step that was not
    skipped, a step beyond max_steps (never five in a row that follow one another). Every
    reader of the file (export's, the app's history and its live state) keeps exactly the
    real steps and counts each forged one as skipped."""
    from andrea_tui.runstate import LossHistory, RunState
    from engine.runfiles import JsonlTail, parse_lines, read_events, read_steps, step_order

    n, extra, forgeries, chunk = case
    max_steps = n + extra

    def real(step: int) -> dict[str, Any]:
        return {"step": step, "loss": 2.0 + 1 / step, "grad_norm": 1.0, "t": 1000.0 + step}

    lines: list[bytes] = []
    forged_at: dict[int, list[bytes]] = {}
    for after, kind, x in forgeries:
        after = min(max(after, 1), n)  # after the real record of step `after`
        obj = {"far": {"step": after + STEP_GAP_MAX + 1 + x, "loss": 1.0},
               "behind": {"step": 1 + x % after, "loss": 1.0},
               "negative": {"step": after + 1, "loss": -1.0 - x},
               "nan": {"step": after + 1, "loss": math.nan},
               "beyond": {"step": max_steps + 1 + x, "loss": 1.0}}[kind]
        forged_at.setdefault(after, []).append(json.dumps({"t": 1000.0 + x, **obj}).encode())
    for step in range(1, n + 1):
        lines.append(json.dumps(real(step)).encode())
        lines += forged_at.get(step, [])[:SEQUENCE_CONFIRM - 1]
    n_forged = len(lines) - n
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        _write_run(run, lines, max_steps)
        records, skipped = read_steps(run / "loss.jsonl")
        assert [r.step for r in records] == list(range(1, n + 1))
        assert skipped == n_forged
        events, _ = read_events(run / "events.jsonl")
        history = LossHistory.from_tail(JsonlTail(run / "loss.jsonl"), chunk_bytes=chunk,
                                        order=step_order(run, events))
        assert history.last_record is not None and history.last_record.step == n
        assert history.unreadable == n_forged
        state = RunState()
        state.add_events(parse_lines((run / "events.jsonl").read_bytes().split(b"\n"))[0])
        for i in range(0, len(lines), 3):
            state.add_loss(parse_lines(lines[i:i + 3])[0])
        assert state.series.last_step == n and state.loss_unreadable == n_forged


# What a path outside the data may turn out to be, and the readers that must refuse it at once.
_NOT_REGULAR = ("fifo", "fifo with a writer", "directory", "link to a fifo", "socket",
                "endless device")
_READERS = ("config", "checkpoint state.json", "checkpoint verify", "jsonl tail", "json",
            "log tail", "engine log lines")


def non_regular_file(case: tuple[str, str]) -> None:
    """A FIFO, a directory, a socket, a symlink to a FIFO or an endless device where a config,
    a checkpoint's state.json or a run file should be: every reader answers at once (a
    UserError or nothing read), none waits in open() or read()."""
    import os
    import signal
    import socket

    from engine import infile
    from engine.config import load_config
    from engine.run.checkpoint import load_checkpoint, verify_checkpoint
    from engine.runfiles import JsonlTail, read_json, tail_lines, tail_text

    kind, reader = case
    with tempfile.TemporaryDirectory() as tmp:
        ck = _checkpoint_dir(Path(tmp))
        target = ck / "state.json" if reader.startswith("checkpoint") else Path(tmp) / "x.json"
        target.unlink(missing_ok=True)
        holder = None
        if kind.startswith("fifo"):
            os.mkfifo(target)
            if kind == "fifo with a writer":  # a writer that never ends the stream
                holder = os.open(target, os.O_RDWR | os.O_NONBLOCK)
        elif kind == "directory":
            target.mkdir()
        elif kind == "link to a fifo":
            os.mkfifo(Path(tmp) / "fifo")
            target.symlink_to(Path(tmp) / "fifo")
        elif kind == "socket":
            holder = socket.socket(socket.AF_UNIX)
            holder.bind(str(target))
        else:
            target.symlink_to("/dev/zero")
        calls: dict[str, Callable[[], object]] = {
            "config": lambda: load_config(target),
            "checkpoint state.json": lambda: load_checkpoint(ck),
            "checkpoint verify": lambda: verify_checkpoint(ck),
            "jsonl tail": lambda: JsonlTail(target).read_new(),
            "json": lambda: read_json(target),
            "log tail": lambda: tail_text(target, 10),
            "engine log lines": lambda: tail_lines(target, 4096),
        }

        def hung(signum: int, frame: object) -> None:
            raise AssertionError(f"{reader} on {kind}: still waiting after 5 s")

        old = signal.signal(signal.SIGALRM, hung)
        signal.alarm(5)
        wait, infile.PIPE_WAIT_S = infile.PIPE_WAIT_S, 0.5  # a config may come through a pipe
        try:
            calls[reader]()
        except UserError:
            pass
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
            infile.PIPE_WAIT_S = wait
            if isinstance(holder, int):
                os.close(holder)
            elif holder is not None:
                holder.close()


def oversized_lines(case: tuple[list[int], list[int], int]) -> None:
    """A JSONL file that grows while it is read, some of its lines longer than the reader's
    limit: every line within the limit reads back, in order; each longer one is counted once
    and never held whole (the tail's memory stays within the limit and one chunk)."""
    from engine.runfiles import JsonlTail

    sizes, cuts, chunk = case
    limit = 300
    lines = [json.dumps({"i": i, "pad": "x" * n}).encode() for i, n in enumerate(sizes)]
    data = b"".join(ln + b"\n" for ln in lines)
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "samples.jsonl"
        p.write_bytes(b"")
        tail = JsonlTail(p, max_line=limit)
        got: list[dict[str, Any]] = []
        written = 0
        for cut in sorted({min(c, len(data)) for c in cuts} | {len(data)}):
            with open(p, "ab") as f:
                f.write(data[written:cut])
            written = cut
            while True:
                got += tail.read_new(max_bytes=chunk)
                assert len(tail._partial) <= limit + chunk
                if not tail.more:
                    break
        assert [o["i"] for o in got] == [i for i, ln in enumerate(lines) if len(ln) <= limit]
        assert tail.bad_lines == sum(len(ln) > limit for ln in lines)


_CONVERSATION = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt",
                                                                      "value": "hello"}]}
_BOOK_PIECES = [b"*** START OF THE PROJECT GUTENBERG EBOOK X ***", b"*END*THE SMALL PRINT!",
                b"*** END OF THIS PROJECT GUTENBERG EBOOK X ***", b"End of Project Gutenberg's",
                b"\r\n", b"\n", b"\r", b" ", b"Body text.", b"\xff", b"\xc3\xa9"]
_JOURNAL = {"version": 1, "key": {"fingerprint": "f", "tokenizer": "t", "plan": "p",
                                  "n_parts": 3}, "parts": 1, "tokens": 8, "nbytes": 10, "docs": 1}

# target name -> (function, input strategy)
TARGETS: dict[str, tuple[Callable[..., None], st.SearchStrategy]] = {
    "config file": (config, near_json(TINY)),
    "config object": (config_object, JSON | st.builds(lambda: json.loads(json.dumps(TINY)))),
    "run-file lines": (run_file_lines, st.lists(near_json({"step": 1, "loss": 2.0, "t": 1.0,
                                                            "event": "resume"}), max_size=6)
                       .map(lambda xs: b"\n".join(xs))),
    "run state (app)": (run_state, st.lists(near_json({"step": 3, "event": "checkpoint",
                                                       "status": "running", "pid": 5,
                                                       "text": "x", "t": 2.0}), max_size=8)
                        .map(lambda xs: b"\n".join(xs))),
    "checkpoint state.json": (checkpoint_state, near_json({"format_version": 1, "step": 3,
                                                           "n_params": 12})),
    "checkpoint model.ckpt": (checkpoint_model, st.binary(max_size=200)),
    "shard header": (shard, st.binary(max_size=120)),
    "tokenizer file": (tokenizer, near_json(_tokenizer_base())),
    "conversations (prep)": (conversations, st.lists(near_json(_CONVERSATION), max_size=6)
                             .flatmap(lambda xs: st.sampled_from([b"\n", b"\r\n", b"\r"])
                                      .map(lambda sep: sep.join(xs)))),
    "gutenberg book": (gutenberg_book, st.lists(st.sampled_from(_BOOK_PIECES)
                                                | st.binary(max_size=8), max_size=30)
                       .map(b"".join)),
    "prep journal": (prep_journal, near_json(_JOURNAL)),
    "torn tail (append)": (torn_tail, st.tuples(
        st.binary(max_size=60) | st.builds(lambda x: json.dumps(x).encode()[:-1], JSON),
        st.lists(st.lists(st.dictionaries(st.text(max_size=8), JSON, max_size=4), min_size=1,
                          max_size=4), min_size=1, max_size=3))),
    "forged step records": (forged_records, st.tuples(
        st.integers(1, 60), st.integers(0, 300),
        st.lists(st.tuples(st.integers(1, 60), st.sampled_from(
            ["far", "behind", "negative", "nan", "beyond"]), st.integers(0, 10_000)),
            max_size=12),
        st.integers(16, 2048))),
    "non-regular files": (non_regular_file, st.tuples(st.sampled_from(_NOT_REGULAR),
                                                      st.sampled_from(_READERS))),
    "oversized lines": (oversized_lines, st.tuples(
        st.lists(st.integers(0, 1200), max_size=20), st.lists(st.integers(0, 30_000),
                                                               max_size=6),
        st.integers(1, 700))),
}
