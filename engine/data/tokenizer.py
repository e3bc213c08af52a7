"""Byte-level BPE tokenizer with exactly 8449 ids (DESIGN §2).

Ids 0..255 are the 256 bytes, 256..8447 the 8192 merges in the order they were learned, 8448 is
`<|endoftext|>`. HF `tokenizers` does the training and the fast encoding; we rebuild its vocabulary
afterwards because the trainer numbers the initial alphabet by its own order, and we need byte b to
be id b so that shards and checkpoints mean the same thing whoever trained the tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine import jsonio
from engine.config import TOKENIZER_BYTES
from engine.errors import UserError

EOT = "<|endoftext|>"
N_BYTES = 256
DEFAULT_VOCAB_SIZE = 8449


def _byte_chars() -> list[str]:
    """The printable stand-in character HF's ByteLevel uses for each byte 0..255 (GPT-2's map)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars: dict[int, int] = {b: b for b in printable}
    extra = 0
    for b in range(N_BYTES):
        if b not in chars:
            chars[b] = N_BYTES + extra
            extra += 1
    return [chr(chars[b]) for b in range(N_BYTES)]


BYTE_CHARS = _byte_chars()


class Tokenizer:
    """A loaded ANDREA tokenizer: encode to uint16 ids, decode back exactly."""

    def __init__(self, hf: HFTokenizer, path: Path, sha256: str) -> None:
        self._hf = hf
        self.path = path
        self.sha256 = sha256
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        eot = hf.token_to_id(EOT)
        assert eot is not None
        self.eot_id = eot

    @property
    def hf(self) -> HFTokenizer:
        """The HF `tokenizers` object (engine.data.encoders reads its merges)."""
        return self._hf

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._hf.encode(text, add_special_tokens=False).ids, dtype=np.uint16)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # HF parallelises the batch over its own thread pool.
        encs = self._hf.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint16) for e in encs]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=False)


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _merge_pairs(raw_merges: list) -> list[tuple[str, str]]:
    # Older tokenizers versions save merges as "a b" strings, newer as [a, b] pairs.
    pairs = []
    for m in raw_merges:
        if isinstance(m, str):
            a, b = m.split(" ", 1)
        else:
            a, b = m
        pairs.append((a, b))
    return pairs


def _build(merges: list[tuple[str, str]]) -> HFTokenizer:
    """Byte-level BPE with byte b = id b, merges numbered from 256 in order, EOT last."""
    vocab = {c: b for b, c in enumerate(BYTE_CHARS)}
    kept = []
    for a, b in merges:
        if a not in vocab or b not in vocab:
            continue
        kept.append((a, b))
        merged = a + b
        if merged not in vocab:
            vocab[merged] = len(vocab)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=kept))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([EOT])
    return hf


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # unique: preps may overlap
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def train_tokenizer(
    texts: Iterable[str], path: str | os.PathLike, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> Tokenizer:
    """Train on `texts` and save to `path` (JSON). Same texts give the same file bytes."""
    if vocab_size != DEFAULT_VOCAB_SIZE:
        raise UserError(
            f"data.tokenizer.vocab_size: expected {DEFAULT_VOCAB_SIZE} "
            f"(256 bytes + 8192 merges + {EOT}), got {vocab_size}"
        )
    n_merged = vocab_size - N_BYTES - 1
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=N_BYTES + n_merged,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    hf.train_from_iterator(texts, trainer=trainer)
    merges = _merge_pairs(json.loads(hf.to_str())["model"]["merges"])
    built = _build(merges)
    got = built.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise UserError(
            f"tokenizer training: the training text gave {got - N_BYTES - 1} distinct merges, "
            f"expected {n_merged}: give it more (or more varied) text"
        )
    path = Path(path)
    # Canonical JSON bytes so the sha256 only depends on the tokenizer's content.
    data = json.dumps(json.loads(built.to_str()), ensure_ascii=False, sort_keys=True).encode()
    _write_atomic(path, data)
    return load_tokenizer(path, vocab_size)


def load_tokenizer(path: str | os.PathLike, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Load a tokenizer written by `train_tokenizer`, checking it is ours and the right size."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: tokenizer file not found (run andrea-prep CONFIG.json)")
    try:
        spec = jsonio.load_file(path, max_bytes=TOKENIZER_BYTES)
    except jsonio.JsonError as e:
        raise UserError(f"not a tokenizer JSON file: {e}") from None
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        raise UserError(f"{path}: model: expected a byte-level BPE tokenizer, got another kind")
    pre = spec.get("pre_tokenizer")
    pre = pre if isinstance(pre, dict) else {}
    if pre.get("type") != "ByteLevel":
        raise UserError(
            f"{path}: pre_tokenizer: expected ByteLevel, got {pre.get('type', 'none')}"
        )
    try:
        hf = HFTokenizer.from_str(json.dumps(spec))
    except Exception as e:  # HF raises plain Exception subclasses on bad specs
        raise UserError(f"{path}: not a loadable tokenizer ({e})") from None
    size = hf.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise UserError(f"{path}: vocabulary: expected {vocab_size} ids, got {size}")
    if hf.token_to_id(EOT) != vocab_size - 1:
        raise UserError(
            f"{path}: {EOT}: expected id {vocab_size - 1}, got {hf.token_to_id(EOT)}"
        )
    for b, c in enumerate(BYTE_CHARS):
        if hf.token_to_id(c) != b:
            raise UserError(f"{path}: byte {b}: expected id {b}, got {hf.token_to_id(c)}")
    return Tokenizer(hf, path, _file_sha256(path))
