"""The model's parameter layout: shapes, the flat tensor table, init and the weight-decay mask.

DESIGN §2 (contract): one flat float32 buffer holds every parameter in this order, row-major,
`x @ W` with W `[in, out]`:
`wte [V,d]`, `wpe [T,d]`, per layer i: `h.i.ln1.gamma`, `h.i.ln1.beta`, `h.i.attn.W_Q`,
`h.i.attn.W_K`, `h.i.attn.W_V`, `h.i.attn.W_O`, `h.i.ln2.gamma`, `h.i.ln2.beta`, `h.i.mlp.W_1`,
`h.i.mlp.W_2`; then `lnf.gamma`, `lnf.beta`. The checkpoint stores the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.config import ModelConfig
from engine.errors import UserError

INIT_STD = 0.02
INIT_CHUNK = 1 << 22  # values drawn per call (about 0.1 s): a stop is answered between calls


@dataclass(frozen=True)
class ModelShapes:
    """The hyper-parameters that fix every tensor's shape."""

    n_layer: int
    d_model: int
    n_head: int
    d_ff: int
    vocab_size: int
    seq_len: int

    def __post_init__(self) -> None:
        for field in ("n_layer", "d_model", "n_head", "d_ff", "vocab_size", "seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"model.{field}: expected a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise UserError(
                f"model.n_head: d_model ({self.d_model}) must be divisible by n_head, "
                f"got {self.n_head}"
            )

    @classmethod
    def from_config(cls, m: ModelConfig) -> ModelShapes:
        """The shapes of the config's `model` section."""
        return cls(m.n_layer, m.d_model, m.n_head, m.d_ff, m.vocab_size, m.seq_len)


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor in the flat buffer: shape and offset (in elements, not bytes)."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def _named_shapes(s: ModelShapes) -> list[tuple[str, tuple[int, ...]]]:
    d = s.d_model
    out: list[tuple[str, tuple[int, ...]]] = [
        ("wte", (s.vocab_size, d)),
        ("wpe", (s.seq_len, d)),
    ]
    for i in range(s.n_layer):
        p = f"h.{i}."
        out += [
            (p + "ln1.gamma", (d,)),
            (p + "ln1.beta", (d,)),
            (p + "attn.W_Q", (d, d)),
            (p + "attn.W_K", (d, d)),
            (p + "attn.W_V", (d, d)),
            (p + "attn.W_O", (d, d)),
            (p + "ln2.gamma", (d,)),
            (p + "ln2.beta", (d,)),
            (p + "mlp.W_1", (d, s.d_ff)),
            (p + "mlp.W_2", (s.d_ff, d)),
        ]
    out += [("lnf.gamma", (d,)), ("lnf.beta", (d,))]
    return out


def tensor_table(shapes: ModelShapes) -> list[TensorSpec]:
    """Every parameter tensor in contract order, with contiguous offsets."""
    table = []
    offset = 0
    for name, shape in _named_shapes(shapes):
        table.append(TensorSpec(name, shape, offset))
        offset += math.prod(shape)
    return table


def n_params(shapes: ModelShapes) -> int:
    """Total parameter count (ANDREA-120M: 92,248,320)."""
    last = tensor_table(shapes)[-1]
    return last.offset + last.size


def views(flat: np.ndarray, shapes: ModelShapes) -> dict[str, np.ndarray]:
    """Named, shaped views into a flat buffer laid out as `tensor_table` says (no copies)."""
    return {
        t.name: flat[t.offset : t.offset + t.size].reshape(t.shape) for t in tensor_table(shapes)
    }


def init_params(shapes: ModelShapes, seed: int) -> np.ndarray:
    """Deterministic init: normal(0, 0.02) from PCG64(seed), drawn tensor by tensor in table order.

    W_O and W_2 are scaled by 1/sqrt(2·n_layer) (GPT-2: each residual branch adds variance);
    LayerNorm gammas are 1 and betas 0 (they consume no random numbers).
    """
    rng = np.random.Generator(np.random.PCG64(seed))
    flat = np.empty(n_params(shapes), dtype=np.float32)
    residual_scale = 1.0 / math.sqrt(2 * shapes.n_layer)
    for t in tensor_table(shapes):
        dst = flat[t.offset : t.offset + t.size]
        if t.name.endswith(".gamma"):
            dst[:] = 1.0
        elif t.name.endswith(".beta"):
            dst[:] = 0.0
        else:
            std = INIT_STD
            if t.name.endswith("attn.W_O") or t.name.endswith("mlp.W_2"):
                std *= residual_scale
            # in chunks, drawn in place: the same numbers as one draw of the whole tensor, no
            # temporary copy, and no single call long enough to keep a stop signal waiting
            for start in range(0, t.size, INIT_CHUNK):
                part = dst[start : start + INIT_CHUNK]
                rng.standard_normal(dtype=np.float32, out=part)
                part *= np.float32(std)
    return flat


def decay_mask(shapes: ModelShapes) -> np.ndarray:
    """True where AdamW applies weight decay: every element of a 2-D tensor (not LN, not 1-D)."""
    mask = np.zeros(n_params(shapes), dtype=bool)
    for t in tensor_table(shapes):
        if len(t.shape) == 2:
            mask[t.offset : t.offset + t.size] = True
    return mask
