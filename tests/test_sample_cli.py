"""`andrea-sample`: text from a real checkpoint (a 3-step micro run on a copy of the built-in
data), the same for one seed, streamed whole characters at a time, and one clear line (exit 2)
for each kind of bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DATA_DIR, micro_config_dict, run_engine

PROMPT = "def main("


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, prepared_data: Path) -> Path:
    """A run directory with one final checkpoint, trained on its own copy of the data (so a
    test may take the tokenizer away)."""
    root = tmp_path_factory.mktemp("sample")
    shutil.copytree(DATA_DIR, root / "data", ignore=shutil.ignore_patterns(".*"))  # no lock, no temp files
    cfg = micro_config_dict(max_steps=3)
    cfg["data"]["dir"] = str(root / "data")
    (root / "cfg.json").write_text(json.dumps(cfg))
    r = run_engine(root / "cfg.json", root / "run")
    assert r.returncode == 0, r.stdout + r.stderr
    return root / "run"


def sample(target: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine.run.sample_cli", str(target), *args],
                          capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_the_same_seed_gives_the_same_text(trained: Path) -> None:
    args = ("--prompt", PROMPT, "--tokens", "24", "--backend", "numpy")
    a = sample(trained, *args, "--seed", "7")
    b = sample(trained / "checkpoints" / "step_00000003", *args, "--seed", "7")
    c = sample(trained, *args, "--seed", "8")
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + c.stderr
    assert a.stdout == b.stdout  # a run directory means its newest valid checkpoint
    assert a.stdout.startswith(PROMPT) and len(a.stdout) > len(PROMPT) + 5
    assert a.stdout != c.stdout  # another seed, another draw
    assert "ANDREA-micro step 3" in a.stderr and "seed 7" in a.stderr


def test_text_streams_in_whole_characters(trained: Path) -> None:
    from engine.data.tokenizer import load_tokenizer
    from engine.run.sample_cli import stream_text

    tok = load_tokenizer(DATA_DIR / "tokenizer.json")
    ids = [*b"a", *"😀".encode(), *"é".encode(), *b"z"]  # ids 0..255 are the bytes
    pieces = list(stream_text(ids, tok.decode))
    assert "".join(pieces) == "a😀éz"
    assert all("\ufffd" not in p for p in pieces)
    assert len(pieces) == 4  # one piece per character, as its last byte arrives


def test_a_missing_tokenizer_is_one_line(trained: Path) -> None:
    tok = trained.parent / "data" / "tokenizer.json"
    moved = tok.with_name("tokenizer.json.away")
    tok.rename(moved)
    try:
        r = sample(trained, "--prompt", PROMPT, "--backend", "numpy")
    finally:
        moved.rename(tok)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr
    assert str(tok) in lines[0] and "tokenizer file not found" in lines[0]
    assert "--tokenizer" in lines[0]


def test_another_tokenizer_is_refused(trained: Path, tmp_path: Path) -> None:
    other = tmp_path / "tokenizer.json"  # the same vocabulary, other bytes: another sha256
    other.write_text(json.dumps(json.loads((DATA_DIR / "tokenizer.json").read_text()),
                                indent=1))
    r = sample(trained, "--prompt", PROMPT, "--tokenizer", str(other), "--backend", "numpy")
    assert r.returncode == 2 and "not the tokenizer step_00000003 was trained with" in r.stderr


@pytest.mark.parametrize(("args", "words"), [
    (("--tokens", "0"), "--tokens"),
    (("--temperature", "0"), "--temperature"),
    (("--top-k", "100000"), "--top-k"),
    (("--seed", "-1"), "--seed"),
    (("--backend", "tpu"), "invalid choice"),
])
def test_bad_arguments_are_one_line(trained: Path, args: tuple[str, ...], words: str) -> None:
    r = sample(trained, "--prompt", PROMPT, *args)
    assert r.returncode == 2 and words in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


def test_no_checkpoint_is_one_line(tmp_path: Path) -> None:
    r = sample(tmp_path / "nowhere", "--prompt", "x")
    assert r.returncode == 2 and "no such checkpoint or run directory" in r.stderr
    (tmp_path / "empty").mkdir()
    r = sample(tmp_path / "empty", "--prompt", "x")
    assert r.returncode == 2 and "no checkpoint that verifies" in r.stderr


def test_g_in_the_checkpoint_browser_streams_the_same_text(trained: Path) -> None:
    import asyncio
    import time

    from andrea_tui.ckpt_screens import CheckpointApp, CheckpointListScreen
    from andrea_tui.generate_screen import GenerateScreen

    want = sample(trained, "--prompt", PROMPT, "--tokens", "20", "--seed", "5")
    assert want.returncode == 0, want.stderr

    async def go() -> None:
        app = CheckpointApp(trained)
        async with app.run_test(size=(120, 40)) as pilot:
            async def until(cond, what: str, timeout: float = 60) -> None:
                deadline = time.monotonic() + timeout
                while not cond():
                    assert time.monotonic() < deadline, what
                    await pilot.pause(0.05)

            await until(lambda: isinstance(app.screen, CheckpointListScreen)
                        and app.screen.entries, "the checkpoint list")
            await pilot.press("g")
            await until(lambda: isinstance(app.screen, GenerateScreen), "the prompt")
            gen = app.screen
            await pilot.press(*PROMPT)
            gen.query_one("#gen-tokens").value = "20"
            gen.query_one("#gen-seed").value = "5"
            await pilot.press("enter")
            await until(lambda: gen.done, "the completion")
            assert gen.text == want.stdout
            assert "20 tokens" in gen.status or "endoftext" in gen.status
            await pilot.press("escape")
            await until(lambda: isinstance(app.screen, CheckpointListScreen), "back")

    asyncio.run(go())
