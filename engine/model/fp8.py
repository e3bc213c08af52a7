"""FP8 scaling: the recipe every backend follows for train/precision "fp8" (the numpy reference
computes it on the CPU; kernels/fp8.cu on FP8 tensor cores, and reads like this).

Each layer's linear maps run on FP8 operands: the MLP's two (fc1: ln2's output · W1, fc2:
GELU's output · W2) and the attention's two (qkv: ln1's output · [W_Q | W_K | W_V], proj:
attention's output · W_O), each in its forward and its two backward GEMMs (FP8_GEMMS). An
operand goes to FP8 as q = fp8(x·s), and the GEMM's product is multiplied back by the operands'
inverse scales. E4M3 (max 448) holds weights and activations, E5M2 (max 57344) gradients. The
scale s = FMAX / a of every such tensor (per layer, DELAYED) comes from the largest amax in its
history of the last HISTORY training passes (delayed scaling), so a kernel can cast as it goes
instead of reading the tensor once for its amax first:

- the weights' copies are made in every training pass from the fp32 masters, the cast taking
  the master's amax as it goes (a weight changes little from one pass to the next: its recent
  amax scales it about as well as its amax now would, which would cost a read of the master);
  W_Q, W_K and W_V share one scale (the qkv GEMM multiplies by one), their amax the largest of
  the three;
- the activations and gradients are cast as the pass makes them, each taking its amax as it
  goes.

A tensor with no history yet (a fresh run; a run resumed from a checkpoint without its rows) is
scaled by its own amax in that pass.

Every training pass then records each tensor's amax (0 where it was not finite: one bad batch
must not zero the scales of the next HISTORY passes) in the slot `next` of its history. The
history travels in every checkpoint (state.json, records.STATE_FP8_HISTORY), its rows named, so
a resumed run scales exactly as the run would have gone on. A checkpoint whose history names
fewer tensors (one written while fewer GEMMs ran in FP8, or the weights were scaled by their own
amax each pass) still loads: the tensors it has no rows for start with no history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

# per layer, the GEMMs that run in FP8 (where the GPU's library has an FP8 algorithm for one and
# the start-up timing finds it the faster): "fwd" the product, "dgrad" the input's gradient,
# "wgrad" the weight's
MLP_GEMMS = ("fc1 fwd", "fc2 fwd", "fc2 dgrad", "fc1 dgrad", "fc2 wgrad", "fc1 wgrad")
ATTN_GEMMS = ("qkv fwd", "proj fwd", "proj dgrad", "qkv dgrad", "proj wgrad", "qkv wgrad")
FP8_GEMMS = MLP_GEMMS + ATTN_GEMMS
HISTORY = 16  # training passes of amax history a delayed scale looks back over
# per layer, in this order, the tensors with an amax history (every FP8 operand): the MLP's
# x (fc1's input, ln2's output), h (fc2's input, GELU's output), dy (the gradient of fc2's
# output), dh (that of fc1's output), w1, w2; the attention's ln1 (qkv's input), att (proj's
# input, attention's output), dproj (the gradient of proj's output), dqkv (that of Q, K, V),
# wqkv (W_Q, W_K, W_V: one scale), wo (W_O)
DELAYED = ("x", "h", "dy", "dh", "w1", "w2", "ln1", "att", "dproj", "dqkv", "wqkv", "wo")
F32_MAX = np.float32(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Fp8Format:
    name: str
    mbits: int  # mantissa bits
    emin: int  # exponent of the smallest normal number (subnormals share its quantum)
    max: float  # the largest finite value: a conversion saturates there


E4M3 = Fp8Format("E4M3", 3, -6, 448.0)
E5M2 = Fp8Format("E5M2", 2, -14, 57344.0)


def round_fp8(x: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    """The FP8 value nearest to each float32 of x (ties to even), saturated at ±fmt.max, as
    float32: what __nv_cvt_float_to_fp8(v, __NV_SATFINITE, ...) stores, decoded. NaN stays NaN."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x)
    _, e = np.frexp(a)  # a = m·2**e with m in [0.5, 1): a's exponent is e - 1
    quantum = np.ldexp(np.float32(1.0), np.maximum(e - 1, fmt.emin) - fmt.mbits)
    q = np.minimum(np.rint(a / quantum) * quantum, np.float32(fmt.max))
    return np.copysign(q, x).astype(np.float32)


def amax_of(x: np.ndarray) -> np.float32:
    """max |x| as the kernels take it: NaN is passed over (fmaxf), an empty or all-NaN tensor
    gives 0."""
    return np.float32(np.fmax.reduce(np.abs(np.asarray(x, np.float32)).ravel(), initial=0.0))


def scale_for(a: np.float32, fmt: Fp8Format) -> np.float32:
    """s = FMAX / a in float32 (kernels/fp8.cu fp8_scale): 1 for a == 0; the largest finite
    float where FMAX / a overflows (a below ~1e-36); 0 for an infinite a."""
    a = np.float32(a)
    if a == 0:
        return np.float32(1.0)
    with np.errstate(over="ignore"):
        s = np.float32(np.float32(fmt.max) / a)
    return F32_MAX if np.isinf(s) else s


@dataclass
class AmaxHistory:
    """Each delayed tensor's amax over the last HISTORY training passes: `amax`
    [n_layer·len(DELAYED), HISTORY] float32, rows in (layer, DELAYED) order; `next` the slot the
    coming pass writes."""

    amax: np.ndarray
    next: int = 0

    @classmethod
    def empty(cls, n_layer: int, length: int = HISTORY) -> AmaxHistory:
        return cls(np.zeros((n_layer * len(DELAYED), length), np.float32))

    @classmethod
    def for_model(cls, history: AmaxHistory | None, n_layer: int) -> AmaxHistory:
        """`history` (a checkpoint's) where it has this model's rows and HISTORY slots, an empty
        one for None; ValueError for any other shape (a backend then starts afresh)."""
        if history is None:
            return cls.empty(n_layer)
        want = (n_layer * len(DELAYED), HISTORY)
        if history.amax.shape != want:
            raise ValueError(f"expected {want[0]} tensors x {want[1]} passes, got "
                             f"{history.amax.shape[0]} x {history.amax.shape[1]}")
        return history

    def row(self, layer: int, tensor: str) -> int:
        return layer * len(DELAYED) + DELAYED.index(tensor)

    def delayed_amax(self, layer: int, tensor: str) -> np.float32:
        """The largest recorded amax of one tensor (0: no history yet)."""
        return np.float32(self.amax[self.row(layer, tensor)].max())

    def record(self, now: np.ndarray) -> None:
        """One training pass's amax of every delayed tensor ([n_layer·len(DELAYED)], in row
        order) into slot `next`; a non-finite amax is recorded as 0."""
        now = np.asarray(now, np.float32)
        self.amax[:, self.next] = np.where(np.isfinite(now), now, np.float32(0.0))
        self.next = (self.next + 1) % self.amax.shape[1]

    def to_json(self) -> dict[str, Any]:
        """For state.json: the float32 bits as integers (exact through JSON)."""
        return {"tensors": list(DELAYED), "length": int(self.amax.shape[1]),
                "next": int(self.next),
                "amax_bits": [int(b) for b in self.amax.view(np.uint32).ravel()]}

    @classmethod
    def from_json(cls, d: Any, n_layer: int) -> CheckpointHistory:
        """The history a checkpoint holds for a model of n_layer layers, in this recipe's layout:
        each stored tensor's rows in its place, by name; the rows of DELAYED's tensors that it
        does not name zero (no history yet: the result's `without` names them). ValueError
        saying what does not fit."""
        if not isinstance(d, dict):
            raise ValueError(f"expected an object, got {type(d).__name__}")
        stored = d.get("tensors")
        if (not isinstance(stored, list) or not stored
                or not all(isinstance(t, str) and t in DELAYED for t in stored)
                or len(set(stored)) != len(stored)):
            raise ValueError(f"tensors: expected distinct names among {list(DELAYED)}, got "
                             f"{stored!r}")
        length, nxt, bits = d.get("length"), d.get("next"), d.get("amax_bits")
        if not isinstance(length, int) or not 1 <= length <= 4096:
            raise ValueError(f"length: expected an integer in 1..4096, got {length!r}")
        if not isinstance(nxt, int) or not 0 <= nxt < length:
            raise ValueError(f"next: expected an integer in 0..{length - 1}, got {nxt!r}")
        rows = n_layer * len(stored)
        if (not isinstance(bits, list) or len(bits) != rows * length
                or not all(isinstance(b, int) and 0 <= b < 2**32 for b in bits)):
            raise ValueError(f"amax_bits: expected {rows * length} float32 bit patterns "
                             f"({n_layer} layers x {len(stored)} tensors x {length})")
        got = np.array(bits, np.uint32).view(np.float32).reshape(n_layer, len(stored), length)
        if not (np.isfinite(got) & (got >= 0)).all():
            raise ValueError("amax_bits: every amax must be finite and >= 0")
        amax = np.zeros((n_layer, len(DELAYED), length), np.float32)
        amax[:, [DELAYED.index(t) for t in stored]] = got
        without = tuple(t for t in DELAYED if t not in stored)
        return CheckpointHistory(cls(amax.reshape(n_layer * len(DELAYED), length), nxt), without)


class CheckpointHistory(NamedTuple):
    """AmaxHistory.from_json's result: the history, and the delayed tensors the checkpoint held
    no rows for (its recipe ran fewer GEMMs in FP8, or scaled them by their own amax each pass;
    empty for this recipe's): their rows are zero, so each is scaled by its own amax until it
    has a history."""

    history: AmaxHistory
    without: tuple[str, ...] = ()
