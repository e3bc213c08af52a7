"""`andrea-sample CHECKPOINT --prompt TEXT [--tokens N] [--temperature T] [--top-k K] [--seed S]
[--backend auto|numpy|cuda] [--tokenizer PATH]`: text from a checkpoint, streamed as it comes.

CHECKPOINT is one checkpoint directory, or a run directory (or its `checkpoints/`), whose newest
checkpoint that verifies is used. The model's shapes come from the config in the checkpoint's
state.json, the tokenizer from that config's `data.tokenizer.path` (or `--tokenizer`), checked
against the tokenizer digest the checkpoint recorded. Top-k sampling (engine.model.sampling) with
its own generator seeded by `--seed`: one seed, one text. The prompt and then the completion go
to stdout, a token at a time; what was loaded and how the text ended go to stderr. Bad input is
one line and exit status 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from engine.config import Config, parse_config
from engine.errors import UserError, cli_entry
from engine.infile import NotRegularFile, check_regular

MAX_TOKENS = 65536
HOLD_TOKENS = 4  # a UTF-8 character is at most 4 bytes, so at most 4 byte-level tokens


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # usage errors are bad input: exit 2, one line
        raise UserError(f"andrea-sample: {message} (see andrea-sample --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="andrea-sample", description="Generate text from a checkpoint, streamed "
                "to stdout (the prompt, then the completion).")
    p.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its newest "
                   "checkpoint that verifies)")
    p.add_argument("--prompt", required=True, help="the text to continue ('' starts from "
                   "<|endoftext|>)")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate at most "
                   "(default 200; ends earlier at <|endoftext|>)")
    p.add_argument("--temperature", type=float, default=None,
                   help="softmax temperature (default: the run's samples.temperature)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the k likeliest tokens (default: the run's samples.top_k)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    p.add_argument("--backend", choices=("auto", "numpy", "cuda"), default="auto")
    p.add_argument("--tokenizer", help="the tokenizer JSON to use instead of the one the run's "
                   "config names (a run directory copied from another machine)")
    return p


def check_args(args: argparse.Namespace, cfg: Config) -> tuple[int, float, int]:
    """(tokens, temperature, top_k) after the checks, the run's sampling settings filling in."""
    if not 1 <= args.tokens <= MAX_TOKENS:
        raise UserError(f"--tokens: expected an integer in 1..{MAX_TOKENS}, got {args.tokens}")
    temperature = cfg.samples.temperature if args.temperature is None else args.temperature
    if not (math.isfinite(temperature) and 0 < temperature <= 100):
        raise UserError(f"--temperature: expected a number in (0, 100], got {temperature}")
    top_k = cfg.samples.top_k if args.top_k is None else args.top_k
    if not 1 <= top_k <= cfg.model.vocab_size:
        raise UserError(f"--top-k: expected an integer in 1..{cfg.model.vocab_size} (the "
                        f"vocabulary), got {top_k}")
    if not 0 <= args.seed < 2**63:
        raise UserError(f"--seed: expected an integer in 0..2**63-1, got {args.seed}")
    return args.tokens, temperature, top_k


def check_prompt(prompt: str) -> str:
    """The prompt, when it is text. On the command line, bytes that are not UTF-8 arrive as
    lone surrogates (Python's surrogateescape): the tokenizer takes text only and the runs
    were trained on UTF-8, so such a prompt is refused, naming the first bad byte."""
    try:
        raw = os.fsencode(prompt)
    except UnicodeEncodeError as e:
        raise UserError(f"--prompt: not valid UTF-8 at character {e.start}") from None
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--prompt: not valid UTF-8 at byte {e.start} (0x{raw[e.start]:02x}); "
                        "the prompt must be UTF-8 text") from None
    return prompt


def resolve_checkpoint(path: Path) -> Path:
    """`path` when it is a checkpoint directory; for a run or checkpoints directory, its newest
    checkpoint that verifies. UserError when there is none."""
    from engine.run.checkpoint import MODEL_FILE, ckpt_root_of
    from engine.run.checkpoint_store import find_resume_checkpoint

    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such checkpoint or run directory")
    if not path.is_dir():
        raise UserError(f"{path}: not a directory, expected a checkpoint or run directory")
    if (path / MODEL_FILE).exists():
        return path
    found, skipped = find_resume_checkpoint(path)
    if found is None:
        why = "; ".join(f"{p.name}: {w}" for p, w in skipped) or "none found"
        raise UserError(f"{ckpt_root_of(path)}: no checkpoint that verifies ({why})")
    return found


def checkpoint_config(state: dict[str, Any], where: Path) -> Config:
    """The run's config as the checkpoint recorded it (its data paths need not exist)."""
    if not isinstance(state.get("config"), dict):
        raise UserError(f"{where / 'state.json'}: config: missing")
    return parse_config(state["config"], f"{where / 'state.json'}: config", where,
                        check_paths=False)


def tokenizer_file(cfg: Config, override: str | None) -> Path:
    """Where the tokenizer is: `--tokenizer`, else the config's data.tokenizer.path (relative to
    data.dir, as the engine resolves it)."""
    if override is not None:
        return Path(override)
    return Path(cfg.data.dir) / cfg.data.tokenizer.path


def load_run_tokenizer(path: Path, cfg: Config, state: dict[str, Any], ckpt: Path,
                       override: bool) -> Any:
    """The tokenizer the checkpoint was trained with, or a UserError saying what is wrong."""
    from engine.data.tokenizer import load_tokenizer

    if not path.exists() and override:
        raise UserError(f"--tokenizer {path}: no such file")
    if not path.exists():
        raise UserError(f"{path}: tokenizer file not found ({ckpt.name}'s config: "
                        "data.tokenizer.path); prepare the run's data again (andrea-prep "
                        "CONFIG.json) or pass --tokenizer PATH")
    try:
        check_regular(path)  # a FIFO or a device is never opened
    except NotRegularFile:
        raise
    except OSError as e:
        raise UserError(f"{path}: cannot read: {e.strerror or e}") from None
    tok = load_tokenizer(path, cfg.model.vocab_size)
    data = state.get("data") if isinstance(state.get("data"), dict) else {}
    want = data.get("tokenizer_sha256")
    if isinstance(want, str) and want and want != tok.sha256:
        raise UserError(f"{path}: not the tokenizer {ckpt.name} was trained with (sha256 "
                        f"{tok.sha256[:12]}…, the checkpoint says {want[:12]}…)")
    return tok


def stream_text(ids: Iterable[int], decode: Callable[[list[int]], str]) -> Iterator[str]:
    """The text of `ids` in pieces as they come: a byte-level token may end inside a UTF-8
    character, so a piece whose decoding ends in U+FFFD waits (up to HOLD_TOKENS tokens) for
    the bytes that complete it."""
    pending: list[int] = []
    for i in ids:
        pending.append(i)
        text = decode(pending)
        if not text.endswith("\ufffd") or len(pending) >= HOLD_TOKENS:
            pending = []
            yield text
    if pending:
        yield decode(pending)


def build_model(cfg: Config, backend: str, params: np.ndarray) -> Any:
    """The backend holding the checkpoint's weights, for one sequence at a time."""
    from engine.backends import get_backend
    from engine.model.layout import ModelShapes

    model = get_backend(backend)(ModelShapes.from_config(cfg.model), 1,
                                 precision=cfg.train.precision, gpu=cfg.gpu)
    model.load_params(params)
    return model


def generate_stream(model: Any, tok: Any, prompt: str, cfg: Config, n_tokens: int,
                    temperature: float, top_k: int, seed: int,
                    ended: list[bool] | None = None) -> Iterator[str]:
    """The completion of `prompt` in pieces; `ended` (when given) gets True appended when the
    model wrote <|endoftext|> before `n_tokens`."""
    from engine.model.sampling import iter_tokens

    rng = np.random.Generator(np.random.PCG64(seed))
    prompt_ids = tok.encode(prompt)
    if len(prompt_ids) == 0:
        prompt_ids = np.asarray([tok.eot_id], dtype=np.int32)
    count = 0

    def counted() -> Iterator[int]:
        nonlocal count
        for i in iter_tokens(model, prompt_ids, n_tokens, cfg.model.seq_len, top_k,
                             temperature, rng, stop_id=tok.eot_id):
            count += 1
            yield i

    yield from stream_text(counted(), tok.decode)
    if ended is not None and count < n_tokens:
        ended.append(True)


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from engine.backends import resolve_backend
    from engine.run.checkpoint import load_checkpoint

    check_prompt(args.prompt)
    path = resolve_checkpoint(Path(args.checkpoint))
    ck = load_checkpoint(path)
    cfg = checkpoint_config(ck.state, path)
    n_tokens, temperature, top_k = check_args(args, cfg)
    tok = load_run_tokenizer(tokenizer_file(cfg, args.tokenizer), cfg, ck.state, path,
                             args.tokenizer is not None)
    backend, _ = resolve_backend(args.backend)
    model = build_model(cfg, backend, ck.params)
    print(f"andrea-sample: {cfg.name} step {ck.step} ({path}) on {backend}; seed {args.seed}, "
          f"top-k {top_k}, temperature {temperature:g}, up to {n_tokens} tokens", file=err,
          flush=True)
    out.write(args.prompt)
    out.flush()
    ended: list[bool] = []
    for piece in generate_stream(model, tok, args.prompt, cfg, n_tokens, temperature, top_k,
                                 args.seed, ended):
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    print("andrea-sample: " + ("<|endoftext|> reached" if ended else f"{n_tokens} tokens"),
          file=err, flush=True)
    return 0


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args, sys.stdout, sys.stderr)


if __name__ == "__main__":
    main()
