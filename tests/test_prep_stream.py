"""The streaming, parallel prep writes exactly what the whole-document reference does (every
document whole through HF's encoder, `<|endoftext|>` after each), whatever --jobs, encoder and
part size; errors in a later part name the file and the byte or line, the first in document
order."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.config import parse_config
from engine.data import prep as prep_module
from engine.data.plan import Span, plan_source
from engine.data.prep import PrepInterrupted, main, prepare
from engine.data.reader import read_span
from engine.data.sample import training_texts
from engine.data.shards import open_shard
from engine.data.sources import iter_documents
from engine.data.tokenizer import load_tokenizer
from engine.errors import UserError
from tests.conftest import as_source, tiny_config_dict
from tests.corpora import prose, write_hostile_tree

FORMATS = ("text", "docs", "jsonl", "gutenberg")


def make_config(data_dir: Path, sources: list[dict], tokenizer: Path | None = None):
    c = tiny_config_dict()
    c["model"].update(seq_len=16)
    c["data"] = {"dir": str(data_dir),
                 "tokenizer": {"path": "tokenizer.json", "vocab_size": 8449,
                               "train_bytes": 1_000_000},
                 "sources": sources}
    if tokenizer is not None:
        data_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(tokenizer, data_dir / "tokenizer.json")
    return parse_config(c, "stream-test", data_dir)


def whole_documents(tok, source) -> np.ndarray:
    """The reference: every document whole, HF encode_batch, EOT after each."""
    docs = list(iter_documents(source))
    encs = tok.hf.encode_batch(docs, add_special_tokens=False)
    eot = np.array([tok.eot_id], dtype=np.uint16)
    return np.concatenate([x for e in encs for x in (np.asarray(e.ids, np.uint16), eot)])


@pytest.fixture(scope="module")
def tokfile(prepared_data):
    return prepared_data / "tokenizer.json"


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    paths = write_hostile_tree(root)
    return [{"name": f"h-{fmt}", "paths": paths[fmt], "format": fmt} for fmt in FORMATS]


def quiet(event):
    pass


def test_builtin_sources_match_the_whole_document_reference(tmp_path, tokfile):
    sources = [{"name": n, "builtin": n}
               for n in ("python-reference", "stdlib-docstrings", "stdlib-code")]
    cfg = make_config(tmp_path, sources, tokfile)
    result = prepare(cfg, progress=quiet, jobs=2, part_bytes=256 << 10)
    assert result.encoder == "tiktoken"
    tok = load_tokenizer(tokfile)
    for s in cfg.data.sources:
        got = open_shard(result.shard_paths[s.name]).tokens
        np.testing.assert_array_equal(got, whole_documents(tok, s), err_msg=s.name)


def test_hostile_sources_match_the_whole_document_reference(tmp_path, tokfile, hostile):
    cfg = make_config(tmp_path / "a", hostile, tokfile)
    result = prepare(cfg, progress=quiet, jobs=2, part_bytes=64 << 10)
    tok = load_tokenizer(tokfile)
    plans = {s.name: plan_source(s, 64 << 10) for s in cfg.data.sources}
    assert len(plans["h-text"].parts) > 20 and len(plans["h-jsonl"].parts) > 10  # cut up
    for s in cfg.data.sources:
        got = open_shard(result.shard_paths[s.name]).tokens
        np.testing.assert_array_equal(got, whole_documents(tok, s), err_msg=s.name)
    # the same files with one process and other cuts: the same shard bytes
    again = prepare(make_config(tmp_path / "b", hostile, tokfile), progress=quiet, jobs=1,
                    part_bytes=1 << 20)
    for name, path in result.shard_paths.items():
        assert again.shard_paths[name].read_bytes() == path.read_bytes(), name


def test_hf_encoder_with_two_processes_writes_the_same_shard(tmp_path, tokfile):
    src = tmp_path / "prose.txt"
    src.write_text(prose(600_000), encoding="utf-8")
    sources = [{"name": "p", "paths": [str(src)]}]
    a = prepare(make_config(tmp_path / "a", sources, tokfile), progress=quiet, jobs=2,
                encoder="hf", part_bytes=100_000)
    b = prepare(make_config(tmp_path / "b", sources, tokfile), progress=quiet, jobs=1,
                part_bytes=1 << 20)
    assert a.encoder == "hf" and b.encoder == "tiktoken"
    assert a.shard_paths["p"].read_bytes() == b.shard_paths["p"].read_bytes()


def test_progress_events_carry_source_bytes_rate_and_eta(tmp_path, tokfile, monkeypatch):
    monkeypatch.setattr(prep_module, "PROGRESS_EVERY_S", 0.0)
    src = tmp_path / "prose.txt"
    src.write_text(prose(1_000_000), encoding="utf-8")
    events = []
    prepare(make_config(tmp_path / "d", [{"name": "p", "paths": [str(src)]}], tokfile),
            progress=events.append, jobs=2, part_bytes=100_000)
    *live, last = [e for e in events if e.bytes_done is not None]
    assert len(live) >= 3
    total = src.stat().st_size
    assert all(e.source == "p" and e.bytes_total == total for e in live)
    assert [e.bytes_done for e in live] == sorted(e.bytes_done for e in live)
    assert all(e.mb_s > 0 and e.eta_s >= 0 and "MB/s, ETA" in e.message for e in live)
    assert last.source == "p" and last.bytes_done == total and last.eta_s == 0
    assert last.message.startswith("p: ") and last is events[-1]
    assert any(e.message.startswith("encoding with tiktoken") and not e.source for e in events)


def test_bad_utf8_deep_in_a_large_file_names_the_byte(tmp_path, tokfile):
    src = tmp_path / "big.txt"
    data = prose(1_000_000).encode()
    at = 600_001
    src.write_bytes(data[:at] + b"\xff" + data[at:])
    sources = [{"name": "p", "paths": [str(src)]}]
    with pytest.raises(UserError) as reading:
        list(iter_documents(as_source(sources[0])))
    with pytest.raises(UserError) as new:
        prepare(make_config(tmp_path / "d", sources, tokfile), progress=quiet, jobs=2,
                part_bytes=50_000)
    assert str(new.value) == str(reading.value) == f"{src}: byte {at}: expected UTF-8 text"


def test_bad_jsonl_line_in_a_later_part_names_the_line(tmp_path, tokfile):
    src = tmp_path / "chat.jsonl"
    good = json.dumps({"conversations": [{"from": "human", "value": "hi " * 40}]})
    lines = [good] * 3000
    lines[2500] = '{"conversations": [{"from": "robot", "value": "x"}]}'
    src.write_text("\r\n".join(lines) + "\n", encoding="utf-8")
    sources = [{"name": "c", "paths": [str(src)]}]
    with pytest.raises(UserError) as reading:
        list(iter_documents(as_source(sources[0])))
    with pytest.raises(UserError) as new:
        prepare(make_config(tmp_path / "d", sources, tokfile), progress=quiet, jobs=2,
                part_bytes=20_000)
    assert str(new.value) == str(reading.value)
    assert f"{src}:2501: conversations[0].from" in str(new.value)


def test_the_first_error_in_document_order_is_the_one_reported(tmp_path, tokfile, capsys):
    d = tmp_path / "files"
    d.mkdir()
    for i in range(12):
        (d / f"f{i:02d}.txt").write_bytes(prose(60_000, seed=i).encode()
                                          + (b"\xfe" if i in (5, 9) else b""))
    cfg_path = tmp_path / "cfg.json"
    raw = make_config(tmp_path / "data", [{"name": "p", "paths": [str(d)]}], tokfile).to_json()
    cfg_path.write_text(json.dumps(raw))
    with pytest.raises(SystemExit) as e:
        main([str(cfg_path), "--jobs", "2", "--part-mb", "0.05"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {d / 'f05.txt'}: byte ") and err.count("\n") == 1
    assert not (tmp_path / "data" / "shards" / "p.bin").exists()


@pytest.mark.parametrize("line, message", [
    ('{"conversations": [{"from": "gpt", "value": "x"}], "n": ' + "1" * 5000 + "}",
     "not usable JSON (Exceeds the limit"),
    ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
    ('{"conversations": [{"from": "gpt", "value": "\\udc00"}]}', "a lone surrogate (\\udc00)"),
])
def test_hostile_jsonl_lines_are_one_clear_error(tmp_path, line, message):
    p = tmp_path / "c.jsonl"
    good = json.dumps({"conversations": [{"from": "human", "value": "hi"}]})
    p.write_text(f"{good}\n\n{line}\n{good}\n", encoding="utf-8")
    size = p.stat().st_size
    with pytest.raises(UserError) as e:
        list(read_span(Span(str(p), size, "jsonl", 0, size, 0, size)))
    assert str(e.value).startswith(f"{p}:3: ") and message in str(e.value), str(e.value)


def test_a_file_that_changed_since_it_was_planned_is_refused(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("some text\n")
    span = Span(str(p), 5, "text", 0, 5, 0, 5)
    with pytest.raises(UserError, match=r"a\.txt: changed while being prepared \(10 bytes, was 5\)"):
        list(read_span(span))


def test_training_sample_of_a_large_file_is_spread_and_bounded(tmp_path):
    src = tmp_path / "numbered.txt"
    src.write_text("".join(f"line {i:07d} of the file\n" for i in range(300_000)))
    texts = list(training_texts([as_source({"name": "n", "paths": [str(src)]})], 200_000))
    sample = "".join(texts)
    assert 190_000 < len(sample.encode()) <= 200_000
    numbers = [int(x) for x in re.findall(r"line (\d{7})", sample)]
    assert min(numbers) < 30_000 and max(numbers) > 270_000  # from the start and the end


def test_a_second_prep_waits_for_the_first(tmp_path, tokfile):
    import fcntl

    cfg = make_config(tmp_path / "d", [{"name": "r", "builtin": "python-reference"}], tokfile)
    fd = os.open(tmp_path / "d" / ".prep.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    log = []
    try:
        with pytest.raises(PrepInterrupted):
            prepare(cfg, progress=lambda e: log.append(e.message), should_stop=lambda: True)
    finally:
        os.close(fd)
    assert log == [f"waiting for another andrea-prep using {tmp_path / 'd'} ..."]


def test_stale_temporary_files_of_dead_processes_are_removed(tmp_path, tokfile):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    cfg = make_config(tmp_path / "d", [{"name": "r", "builtin": "python-reference"}], tokfile)
    shards = tmp_path / "d" / "shards"
    shards.mkdir(parents=True)
    stale = [shards / f".r.bin.tmp-{dead}", tmp_path / "d" / f".manifest.json.tmp-{dead}"]
    live = shards / f".x.bin.tmp-{os.getpid()}"
    for p in [*stale, live]:
        p.write_bytes(b"half")
    log = []
    prepare(cfg, progress=lambda e: log.append(e.message))
    assert not any(p.exists() for p in stale) and live.exists()
    assert any(m.startswith("removed 2 temporary file(s) left by processes that died") for m in log)
