"""Prep: tokenizer + shards from a tiny config; a second run skips; changes redo only what moved."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from engine.config import parse_config
from engine.data.builtin import stdlib_code_docs
from engine.data.prep import load_prepared, main, prepare
from engine.data.sample import training_budgets, training_texts
from engine.data.shards import open_shard
from engine.data.sources import iter_documents
from engine.errors import UserError
from tests.conftest import as_source, tiny_config_dict


def config_dict(tmp_path, sources, seq_len=64, train_bytes=1_200_000):
    """An experiment config (JSON object) for `sources` with its data under tmp_path."""
    data_dir = tmp_path / "data"
    c = tiny_config_dict()
    c["name"] = "prep-test"
    c["model"].update(n_layer=1, d_model=8, n_head=1, d_ff=16, seq_len=seq_len)
    c["data"] = {"dir": str(data_dir),
                 "tokenizer": {"path": str(data_dir / "tokenizer.json"), "vocab_size": 8449,
                               "train_bytes": train_bytes},
                 "sources": sources}
    return c


def make_config(tmp_path, sources, seq_len=64, train_bytes=1_200_000):
    """The validated config (absolute paths) for `sources` with its data under tmp_path."""
    return parse_config(config_dict(tmp_path, sources, seq_len, train_bytes), "prep-test",
                        tmp_path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Local files for three sources: code as markdown files, a chat JSONL, a short text."""
    root = tmp_path_factory.mktemp("corpus")
    code = root / "code"
    code.mkdir()
    docs = stdlib_code_docs()
    for i, doc in enumerate(docs[: len(docs) // 2 : 3]):
        (code / f"m{i:03d}.md").write_text(doc, encoding="utf-8")
    chat = root / "chat.jsonl"
    with open(chat, "w", encoding="utf-8") as f:
        for i in range(200):
            conv = [{"from": "human", "value": f"Quanto fa {i} più {i + 1}? Obrigado."},
                    {"from": "gpt", "value": f"{i} + {i + 1} = {2 * i + 1}."}]
            f.write(json.dumps({"conversations": conv}) + "\n")
    return root


def sources_for(corpus):
    return [
        {"name": "ref", "builtin": "python-reference"},
        {"name": "code", "paths": [str(corpus / "code")]},
        {"name": "chat", "paths": [str(corpus / "chat.jsonl")], "format": "auto"},
    ]


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prep")
    cfg = make_config(tmp, sources_for(corpus))
    log = []
    result = prepare(cfg, progress=lambda e: log.append(e.message))
    return cfg, result, log


def test_first_run_trains_and_writes_every_shard(prepared):
    cfg, result, log = prepared
    assert result.trained_tokenizer and result.skipped == []
    tok, shards = load_prepared(cfg)
    assert tok.sha256 == result.tokenizer_sha and tok.vocab_size == 8449
    assert [s.path.stem for s in shards] == ["ref", "code", "chat"]
    for s in shards:
        assert s.tok_sha == tok.sha256 and len(s) == result.tokens[s.path.stem] > 65
    assert any("chat:" in m and "MB/s" in m for m in log)
    manifest = json.loads((tmp_dir(cfg) / "manifest.json").read_text())
    assert set(manifest["shards"]) == {"ref", "code", "chat"}


def tmp_dir(cfg):
    return Path(cfg.data.dir)


def test_shard_is_documents_encoded_and_separated_by_eot(prepared):
    cfg, _, _ = prepared
    tok, shards = load_prepared(cfg)
    docs = list(iter_documents(cfg.data.sources[2]))
    expected = np.concatenate([np.append(tok.encode(d), tok.eot_id) for d in docs])
    np.testing.assert_array_equal(shards[2].tokens, expected)
    first = shards[2].tokens[: list(shards[2].tokens).index(tok.eot_id)]
    assert tok.decode(first) == "<|user|>\nQuanto fa 0 più 1? Obrigado.\n<|assistant|>\n0 + 1 = 1."


def test_second_run_skips_everything(prepared):
    cfg, result, _ = prepared
    mtimes = {p: os.stat(p).st_mtime_ns for p in result.shard_paths.values()}
    manifest = Path(cfg.data.dir) / "manifest.json"
    before = os.stat(manifest)
    log = []
    again = prepare(cfg, progress=lambda e: log.append(e.message))
    assert not again.trained_tokenizer
    assert again.skipped == ["ref", "code", "chat"]
    assert again.tokenizer_sha == result.tokenizer_sha and again.tokens == result.tokens
    assert {p: os.stat(p).st_mtime_ns for p in again.shard_paths.values()} == mtimes
    assert sum("skipped" in m for m in log) == 4  # tokenizer + 3 sources
    after = os.stat(manifest)  # not rewritten: the same file (os.replace gives a new inode)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_changed_source_is_re_encoded_alone_and_damaged_shard_rebuilt(corpus, tmp_path):
    cfg = make_config(tmp_path, sources_for(corpus))
    first = prepare(cfg, progress=lambda m: None)
    chat = corpus / "chat.jsonl"
    original = chat.read_text()
    try:
        chat.write_text(original + json.dumps(
            {"conversations": [{"from": "human", "value": "E adesso?"}]}) + "\n")
        log = []
        second = prepare(cfg, progress=lambda e: log.append(e.message))
        assert second.skipped == ["ref", "code"]
        assert second.tokenizer_sha == first.tokenizer_sha  # the tokenizer is kept
        assert any("kept" in m for m in log)
        assert second.tokens["chat"] > first.tokens["chat"]
    finally:
        chat.write_text(original)
    path = first.shard_paths["code"]
    path.write_bytes(path.read_bytes()[:-10])  # damage: truncated
    third = prepare(cfg, progress=lambda m: None)
    assert "code" not in third.skipped
    assert len(open_shard(path)) == first.tokens["code"]


def test_force_redoes_everything(prepared):
    cfg, result, _ = prepared
    forced = prepare(cfg, progress=lambda m: None, force=True)
    assert forced.trained_tokenizer and forced.skipped == []
    assert forced.tokenizer_sha == result.tokenizer_sha  # training is deterministic


def test_source_too_small_for_a_window(corpus, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("tiny")
    sources = [*sources_for(corpus), {"name": "small", "paths": [str(small)]}]
    cfg = make_config(tmp_path, sources)
    with pytest.raises(UserError, match=r"sources\[small\]: expected at least seq_len\+1 = 65"):
        prepare(cfg, progress=lambda m: None)
    assert not (tmp_dir(cfg) / "shards" / "small.bin").exists()


def test_vocab_mismatch(corpus, tmp_path):
    c = config_dict(tmp_path, sources_for(corpus))
    c["model"]["vocab_size"] = 50257
    with pytest.raises(UserError, match=r"model\.vocab_size: must equal data\.tokenizer\.vocab_size"):
        parse_config(c, "prep-test", tmp_path)


def test_load_prepared_before_prep(tmp_path):
    cfg = make_config(tmp_path, [{"name": "ref", "builtin": "python-reference"}])
    with pytest.raises(UserError, match="run andrea-prep"):
        load_prepared(cfg)


def test_main_runs_prep_from_a_config_file(prepared, tmp_path, capsys):
    pytest.importorskip("engine.config")
    cfg, result, _ = prepared
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "experiments", "ANDREA-tiny-TRAIN.json")) as f:
        raw = json.load(f)
    raw["data"] = cfg.to_json()["data"]
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(SystemExit) as e:
        main([str(path)])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"done: 3 sources, {sum(result.tokens.values()):,} tokens" in out


def test_main_bad_config_exits_2(tmp_path, capsys):
    pytest.importorskip("engine.config")
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"name": "x"}))
    with pytest.raises(SystemExit) as e:
        main([str(path)])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_training_budgets_give_small_sources_share_to_others():
    assert training_budgets([100, 10_000, 10_000], 3000) == [100, 1450, 1450]
    assert training_budgets([10, 20], 1000) == [10, 20]
    assert sum(training_budgets([5000, 7000, 900], 6000)) == 6000


def test_training_texts_respect_the_budget(corpus):
    sources = [as_source(s) for s in sources_for(corpus)]
    texts = list(training_texts(sources, 300_000))
    assert 270_000 < sum(len(t.encode()) for t in texts) <= 300_000
    assert texts == list(training_texts(sources, 300_000))  # deterministic
