"""The FP8 recipe (engine/model/fp8.py) against the formats' definitions: rounding, saturation,
scales, the amax history and its JSON form."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.model.fp8 import (
    DELAYED,
    E4M3,
    E5M2,
    HISTORY,
    AmaxHistory,
    Fp8Format,
    amax_of,
    round_fp8,
    scale_for,
)


def every_value(fmt: Fp8Format) -> np.ndarray:
    """Every finite non-negative value of the format, from its bit layout (OCP FP8): sign,
    exponent, mantissa; E4M3 has no infinities and only S.1111.111 is NaN; E5M2's top exponent
    is IEEE's inf/NaN."""
    ebits = 7 - fmt.mbits
    bias = 2 ** (ebits - 1) - 1
    out = []
    for code in range(128):
        exp, man = code >> fmt.mbits, code & ((1 << fmt.mbits) - 1)
        if fmt is E5M2 and exp == 2**ebits - 1:
            continue
        if fmt is E4M3 and code == 0x7F:
            continue
        frac = man / 2**fmt.mbits
        out.append(frac * 2.0 ** (1 - bias) if exp == 0 else (1 + frac) * 2.0 ** (exp - bias))
    return np.array(sorted(out), np.float64)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["E4M3", "E5M2"])
def test_rounding_is_to_the_nearest_value_ties_to_even_and_saturates(fmt: Fp8Format) -> None:
    rng = np.random.default_rng(0)
    values = every_value(fmt)
    assert values.max() == fmt.max and values[1] == 2.0 ** (fmt.emin - fmt.mbits)
    # every value is itself, with either sign
    assert np.array_equal(round_fp8(values.astype(np.float32), fmt), values)
    assert np.array_equal(round_fp8(-values.astype(np.float32), fmt), -values)
    # halfway between two neighbours: the one with the even code
    mids = ((values[:-1] + values[1:]) / 2).astype(np.float32)
    even = np.where(np.arange(len(mids)) % 2 == 0, values[:-1], values[1:])
    assert np.array_equal(round_fp8(mids, fmt), even)
    # random float32s: the nearest value (ties: the one with an even mantissa), up to the max
    x = (rng.standard_normal(200_000) * 10.0 ** rng.uniform(-6, 5, 200_000)).astype(np.float32)
    got = round_fp8(x, fmt).astype(np.float64)
    a = np.minimum(np.abs(x).astype(np.float64), fmt.max)
    i = np.clip(np.searchsorted(values, a), 1, len(values) - 1)
    lo, hi = values[i - 1], values[i]
    even_lo = (np.arange(len(values))[i - 1] % 2) == 0  # codes ascend with the values
    pick = np.where(a - lo < hi - a, lo, np.where(a - lo > hi - a, hi, np.where(even_lo, lo, hi)))
    pick = np.where(a >= fmt.max, fmt.max, pick)
    assert np.array_equal(np.abs(got), pick)
    assert np.array_equal(np.sign(got[got != 0]), np.sign(x[got != 0]))
    # beyond the range: saturated; NaN stays NaN
    assert list(round_fp8(np.array([1e30, -np.inf, np.nan], np.float32), fmt)[:2]) == \
        [fmt.max, -fmt.max]
    assert np.isnan(round_fp8(np.array([np.nan], np.float32), fmt)[0])


def test_amax_passes_over_nan_and_the_scale_guards_its_edges() -> None:
    assert amax_of(np.array([1.0, -3.0, np.nan], np.float32)) == 3.0
    assert amax_of(np.array([np.nan], np.float32)) == 0.0
    assert amax_of(np.zeros(0, np.float32)) == 0.0
    assert scale_for(np.float32(0.0), E4M3) == 1.0
    assert scale_for(np.float32(2.0), E4M3) == np.float32(224.0)
    assert scale_for(np.float32(1e-40), E4M3) == np.finfo(np.float32).max
    assert scale_for(np.float32(np.inf), E5M2) == 0.0
    s = scale_for(np.float32(0.37), E5M2)
    assert s.dtype == np.float32 and s == np.float32(np.float32(57344.0) / np.float32(0.37))


def test_the_history_records_each_pass_in_turn_and_keeps_its_bits_through_json() -> None:
    h = AmaxHistory.empty(n_layer=2)
    # every FP8 operand, the weights too: the MLP's, then the attention's
    assert DELAYED == ("x", "h", "dy", "dh", "w1", "w2",
                       "ln1", "att", "dproj", "dqkv", "wqkv", "wo")
    assert h.amax.shape == (2 * 12, HISTORY) and h.delayed_amax(1, "wo") == 0.0
    for p in range(HISTORY + 3):
        h.record(np.arange(24, dtype=np.float32) + p)
    assert h.next == 3
    # the largest of the last HISTORY passes, at row layer·12 + the tensor's place
    assert h.delayed_amax(0, "x") == HISTORY + 2
    assert h.delayed_amax(0, "w1") == HISTORY + 2 + 4
    assert h.delayed_amax(0, "dqkv") == HISTORY + 2 + 9
    assert h.delayed_amax(1, "dh") == HISTORY + 2 + 12 + 3
    assert h.delayed_amax(1, "w2") == HISTORY + 2 + 12 + 5
    assert h.delayed_amax(1, "ln1") == HISTORY + 2 + 12 + 6
    assert h.delayed_amax(1, "wo") == HISTORY + 2 + 12 + 11
    back, without = AmaxHistory.from_json(json.loads(json.dumps(h.to_json())), n_layer=2)
    assert without == ()
    assert back.next == h.next and np.array_equal(back.amax.view(np.uint32),
                                                  h.amax.view(np.uint32))


@pytest.mark.parametrize("stored", [
    ("x", "h", "dy", "dh", "w1", "w2"),  # the MLP's GEMMs alone in FP8
    ("x", "h", "dy", "dh"),  # those, the weights scaled by their own amax each pass
    ("wo", "dqkv", "x"),  # any distinct names, in any order
], ids=["mlp", "mlp-without-weights", "any-order"])
def test_a_history_naming_fewer_tensors_loads_with_the_others_empty_and_says_so(
        stored: tuple[str, ...]) -> None:
    """A checkpoint written while fewer GEMMs ran in FP8 holds rows for fewer tensors: each goes
    to its row of this layout, by name; the others' rows are zero (no history: scaled by their
    own amax until they have one), and `without` names them in DELAYED's order."""
    L, n = 3, len(stored)
    old = np.arange(1, L * n * HISTORY + 1, dtype=np.float32).reshape(L, n, HISTORY) * 0.5
    d = {"tensors": list(stored), "length": HISTORY, "next": 5,
         "amax_bits": [int(b) for b in old.view(np.uint32).ravel()]}
    got = AmaxHistory.from_json(json.loads(json.dumps(d)), n_layer=L)
    missing = tuple(t for t in DELAYED if t not in stored)
    assert got.without == missing
    h = got.history
    assert h.amax.shape == (L * len(DELAYED), HISTORY) and h.next == 5
    for layer in range(L):
        for t, tensor in enumerate(stored):
            assert np.array_equal(h.amax[h.row(layer, tensor)], old[layer, t])
        for tensor in missing:
            assert not h.amax[h.row(layer, tensor)].any() and h.delayed_amax(layer, tensor) == 0
    # it fits the model as this layout, and is written back in it
    assert AmaxHistory.for_model(h, L) is h
    again = AmaxHistory.from_json(h.to_json(), n_layer=L)
    assert again.without == () and np.array_equal(again.history.amax, h.amax)
    # the shorter layout's misfits are refused as any other's
    d["amax_bits"].pop()
    with pytest.raises(ValueError, match=rf"amax_bits: expected {L * n * HISTORY} float32 .*"
                                         rf"\({L} layers x {n} tensors x {HISTORY}\)"):
        AmaxHistory.from_json(d, n_layer=L)


@pytest.mark.parametrize("tensors", [
    ["x", "h", "w3"],  # a name not in DELAYED
    ["x", "h", "x"],  # a name twice
    [],  # none
    "x h dy dh",  # not a list
    None,  # absent
    ["x", 1],  # not a name
])
def test_a_history_whose_tensors_are_not_distinct_delayed_names_is_refused(tensors) -> None:
    d = AmaxHistory.empty(n_layer=2).to_json()
    d["tensors"] = tensors
    with pytest.raises(ValueError) as e:
        AmaxHistory.from_json(d, n_layer=2)
    assert str(e.value).startswith("tensors: expected distinct names among ")


def test_a_non_finite_amax_is_recorded_as_zero() -> None:
    h = AmaxHistory.empty(n_layer=1)
    h.record(np.array([1.0, np.nan, np.inf, -np.inf, 2.0, np.nan] * 2, np.float32))
    assert list(h.amax[:, 0]) == [1.0, 0.0, 0.0, 0.0, 2.0, 0.0] * 2


@pytest.mark.parametrize("change, says", [
    # fewer names than the rows hold
    (lambda d: d.update(tensors=["x", "h"]),
     rf"amax_bits: expected {2 * 2 * HISTORY} float32 bit patterns \(2 layers x 2 tensors"),
    (lambda d: d.update(length=0), "length: expected an integer in 1..4096"),
    (lambda d: d.update(next=HISTORY), f"next: expected an integer in 0..{HISTORY - 1}"),
    (lambda d: d["amax_bits"].pop(),
     f"amax_bits: expected {2 * 12 * HISTORY} float32 bit patterns"),
    (lambda d: d["amax_bits"].__setitem__(0, 0x7F800000), "finite and >= 0"),
    (lambda d: d["amax_bits"].__setitem__(0, -1), "amax_bits: expected"),
])
def test_a_history_that_does_not_fit_the_model_is_refused(change, says) -> None:
    d = AmaxHistory.empty(n_layer=2).to_json()
    change(d)
    with pytest.raises(ValueError, match=says):
        AmaxHistory.from_json(d, n_layer=2)
    with pytest.raises(ValueError, match="expected an object"):
        AmaxHistory.from_json([1, 2], n_layer=2)
