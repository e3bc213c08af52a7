"""Text samples during training: top-k sampling from a backend's last-position logits.

Sampling uses its own generator, seeded from the run seed and the step, so it never touches the
training's random streams (resume stays bit-exact) and the same step always gives the same text.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from engine.config import Config


class _Logits(Protocol):
    def logits_last(self, tokens: np.ndarray) -> np.ndarray: ...


def iter_tokens(model: _Logits, prompt_ids: np.ndarray, length: int, seq_len: int,
                top_k: int, temperature: float, rng: np.random.Generator,
                stop_id: int | None = None) -> Iterator[int]:
    """Yield up to `length` token ids after `prompt_ids`, one at a time as each is drawn (the
    window slides past seq_len); ends early at `stop_id`, which is not yielded."""
    ids = [int(t) for t in prompt_ids]
    for _ in range(length):
        window = np.asarray(ids[-seq_len:], dtype=np.int32)
        logits = np.asarray(model.logits_last(window), dtype=np.float64) / temperature
        k = min(top_k, logits.size)
        top = np.argpartition(logits, -k)[-k:]
        p = np.exp(logits[top] - logits[top].max())
        p /= p.sum()
        nxt = int(top[rng.choice(k, p=p)])
        if stop_id is not None and nxt == stop_id:
            return
        ids.append(nxt)
        yield nxt


def sample_tokens(model: _Logits, prompt_ids: np.ndarray, length: int, seq_len: int,
                  top_k: int, temperature: float, rng: np.random.Generator,
                  stop_id: int | None = None) -> list[int]:
    """Generate up to `length` token ids after `prompt_ids` (the window slides past seq_len)."""
    return list(iter_tokens(model, prompt_ids, length, seq_len, top_k, temperature, rng,
                            stop_id))


def generate(model: _Logits, tokenizer: Any, prompt: str, cfg: Config, seed: int,
             step: int) -> str:
    """The text generated after `prompt` at `step` (deterministic in seed and step)."""
    rng = np.random.Generator(np.random.PCG64([seed, step, 0x5A4D]))
    prompt_ids = tokenizer.encode(prompt)
    if len(prompt_ids) == 0:
        prompt_ids = np.asarray([tokenizer.eot_id], dtype=np.int32)
    s = cfg.samples
    ids = sample_tokens(model, prompt_ids, s.length, cfg.model.seq_len, s.top_k, s.temperature,
                        rng, stop_id=tokenizer.eot_id)
    return tokenizer.decode(ids)
