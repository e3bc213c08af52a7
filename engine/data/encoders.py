"""The encoder prep runs: HF `tokenizers` (always right) or tiktoken (several times faster), the
latter only where it gives exactly HF's ids.

tiktoken is an optional extra (`pip install -e '.[fast]'`). It is given the trained merges as
ranks (token id = rank), GPT-2's pre-tokenization pattern and `<|endoftext|>`. Its BPE merges,
at each step, the adjacent pair whose concatenation has the lowest rank; HF merges the pair with
the lowest-ranked merge rule. These agree for a tokenizer whose merges each make a new token
(id 256 + the merge's index) and whose every token is what HF's own BPE makes of the token's
bytes ("self-reachable"). Why: while HF encodes a word, the part of it under any token t = x + y
with x, y adjacent has gone through the merges HF makes of t's bytes alone (a merge crossing the
part's edges would have left a piece across them), which end in [t] only through t's own rule;
so x + y is t's rule, every pair tiktoken could merge is a rule of the same rank, and both pick
the same pair (the leftmost lowest) at every step; a whole word that is a token comes out as
that token either way. `tiktoken_ranks` checks these conditions on the loaded tokenizer and
says why when one fails; then HF runs. The two pattern engines (Oniguruma in HF, fancy-regex in
tiktoken) were compared on every Unicode code point in letter, digit, punctuation and whitespace
contexts; tests/test_encoders.py keeps checking a sample of them, the built-in sources and a
hostile corpus.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Protocol

import numpy as np

from engine.data.tokenizer import BYTE_CHARS, EOT, N_BYTES, Tokenizer
from engine.errors import UserError

ENCODERS = ("auto", "tiktoken", "hf")
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class Encoder(Protocol):
    name: str

    def encode(self, text: str) -> np.ndarray:
        """uint16 ids; the special token's text inside `text` is the special id."""
        ...


class HFEncoder:
    name = "hf"

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok

    def encode(self, text: str) -> np.ndarray:
        return self._tok.encode(text)


class TiktokenEncoder:
    name = "tiktoken"

    def __init__(self, tok: Tokenizer, ranks: dict[bytes, int]) -> None:
        import tiktoken

        self._enc = tiktoken.Encoding(
            f"andrea-{tok.sha256[:12]}", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
            special_tokens={EOT: tok.eot_id},
        )

    def encode(self, text: str) -> np.ndarray:
        ids = self._enc.encode_to_numpy(text, allowed_special="all")
        return ids.astype(np.uint16)


def tiktoken_available() -> bool:
    return importlib.util.find_spec("tiktoken") is not None


def tiktoken_ranks(tok: Tokenizer) -> tuple[dict[bytes, int] | None, str]:
    """(ranks, "") when tiktoken gives exactly `tok`'s ids, else (None, why not)."""
    spec = json.loads(tok.hf.to_str())
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer") or {}
    if spec.get("normalizer") is not None:
        return None, "the tokenizer has a normalizer"
    if pre.get("use_regex") is not True or pre.get("add_prefix_space") is not False:
        return None, "the pre-tokenizer is not GPT-2's pattern without a prefix space"
    if model.get("dropout") or model.get("byte_fallback") or model.get(
            "continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None, "the BPE model has options tiktoken does not have"
    added = [t.get("content") for t in spec.get("added_tokens") or []]
    if added != [EOT]:
        return None, f"added tokens other than {EOT}: {added[:3]}"
    vocab: dict[str, int] = model.get("vocab") or {}
    merges = model.get("merges") or []
    if len(merges) != tok.vocab_size - N_BYTES - 1:
        return None, f"{len(merges)} merges for {tok.vocab_size} ids (some merge made no new id)"
    for j, m in enumerate(merges):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if vocab.get(a + b) != N_BYTES + j:
            return None, f"merge {j} ({a!r}, {b!r}) does not make id {N_BYTES + j}"
    byte_of = {c: b for b, c in enumerate(BYTE_CHARS)}
    bpe = tok.hf.model
    ranks = {}
    for token, i in vocab.items():
        if i >= N_BYTES:
            pieces = bpe.tokenize(token)
            if len(pieces) != 1 or pieces[0].id != i:
                return None, f"token {i} is not what BPE makes of its own bytes"
        ranks[bytes(byte_of[c] for c in token)] = i
    return ranks, ""


def choose_encoder(tok: Tokenizer, want: str) -> tuple[str, str]:
    """(encoder name, why) for `want` in ENCODERS; "tiktoken" when it is not exact is an error."""
    if want not in ENCODERS:
        raise UserError(f"--encoder: expected one of {', '.join(ENCODERS)}, got {want!r}")
    if want == "hf":
        return "hf", "asked for"
    if not tiktoken_available():
        if want == "tiktoken":
            raise UserError("--encoder tiktoken: tiktoken is not installed "
                            "(pip install -e '.[fast]')")
        return "hf", "tiktoken not installed; pip install -e '.[fast]' is faster"
    ranks, why = tiktoken_ranks(tok)
    if ranks is None:
        if want == "tiktoken":
            raise UserError(f"--encoder tiktoken: would not give this tokenizer's ids: {why}")
        return "hf", f"tiktoken would not give this tokenizer's ids: {why}"
    return "tiktoken", "exact for this tokenizer"


def make_encoder(tok: Tokenizer, name: str) -> Encoder:
    """The encoder `choose_encoder` named, for `tok`."""
    if name == "tiktoken":
        ranks, why = tiktoken_ranks(tok)
        if ranks is None:
            raise UserError(f"tiktoken would not give this tokenizer's ids: {why}")
        return TiktokenEncoder(tok, ranks)
    return HFEncoder(tok)
