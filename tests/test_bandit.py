"""Firehose bandit: phases, the EXP3 update against a hand computation, floors, exact resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from engine.data.bandit import Bandit, progress_score
from engine.errors import UserError

NAMES = ["docs", "prose", "chat"]
LENGTHS = [7, 14, 21, 28, 42]


def make(**kw):
    args = {"source_names": NAMES, "phase_lengths": LENGTHS, "eta": 0.5, "floor": 0.05,
            "seed": 7}
    args.update(kw)
    return Bandit(**args)


def noisy_losses(rng, step, falling=None):
    """Flat losses with noise; the `falling` source's loss drops steadily."""
    out = {}
    for name in NAMES:
        base = 5.0 - (0.02 * step if name == falling else 0.0)
        out[name] = base + float(rng.normal(0, 0.01))
    return out


def test_progress_score_by_hand():
    assert progress_score([4.0, 3.0, 2.0, 1.0]) == 2.0  # (4+3)/2 - (2+1)/2
    assert progress_score([5.0, 4.0, 3.0]) == 2.0  # odd: the middle value is left out
    assert progress_score([1.0, 1.5]) == -0.5
    assert progress_score([3.0]) == 0.0 and progress_score([]) == 0.0


def test_initial_mixture_is_uniform():
    b = make()
    np.testing.assert_allclose(b.weights, [1 / 3] * 3)
    assert b.phase == 1 and b.phase_step == 0 and b.phase_len in LENGTHS


def test_phases_last_their_drawn_length_from_the_set():
    b = make()
    rng = np.random.default_rng(0)
    lengths_seen = []
    steps_in_phase = 0
    expected_len = b.phase_len
    for step in range(2000):
        change = b.observe(noisy_losses(rng, step))
        steps_in_phase += 1
        if change is None:
            assert b.phase_step == steps_in_phase
            continue
        assert steps_in_phase == expected_len
        assert change.new_phase == change.old_phase + 1 == b.phase
        assert change.new_length in LENGTHS and change.new_length == b.phase_len
        lengths_seen.append(change.new_length)
        expected_len, steps_in_phase = change.new_length, 0
    assert set(lengths_seen) == set(LENGTHS)  # all lengths occur, nothing else does


def test_one_phase_update_matches_hand_computation():
    b = make(eta=0.5, floor=0.05)
    n = b.phase_len
    losses = {"docs": [4.0 - 0.1 * i for i in range(n)], "prose": [3.0] * n}
    change = None
    for i in range(n):
        change = b.observe({"docs": losses["docs"][i], "prose": 3.0, "chat": None})
    assert change is not None
    h = n // 2
    docs_score = sum(losses["docs"][:h]) / h - sum(losses["docs"][-h:]) / h
    np.testing.assert_allclose(change.scores, [docs_score, 0.0, 0.0])
    prefs = [0.5 * docs_score / (1 / 3), 0.0, 0.0]
    z = [math.exp(p) for p in prefs]
    expected = [(1 - 3 * 0.05) * x / sum(z) + 0.05 for x in z]
    np.testing.assert_allclose(b.weights, expected, rtol=1e-12)
    np.testing.assert_allclose(change.new_weights, expected, rtol=1e-12)
    assert change.to_dict()["weights"]["docs"] == pytest.approx(expected[0])
    assert b.last_scores == pytest.approx({"docs": docs_score, "prose": 0.0, "chat": 0.0})


def test_weights_sum_to_one_and_respect_floor_under_extreme_scores():
    b = make(floor=0.1, eta=50.0)
    for step in range(600):
        # A source with a huge loss drop each phase drives its preference far up.
        b.observe({"docs": 1000.0 - 100.0 * (step % 42), "prose": 1.0, "chat": None})
        assert math.isclose(b.weights.sum(), 1.0, rel_tol=0, abs_tol=1e-12)
        assert np.all(b.weights >= 0.1 - 1e-15)
        assert np.all(np.isfinite(b.weights))


def test_a_source_whose_loss_keeps_falling_gains_weight():
    b = make()
    rng = np.random.default_rng(1)
    for step in range(600):
        b.observe(noisy_losses(rng, step, falling="prose"))
    assert b.phase > 10
    assert int(np.argmax(b.weights)) == NAMES.index("prose")
    assert b.weights[NAMES.index("prose")] > 0.6


def test_loss_score_favours_the_harder_source():
    b = make(score="loss")
    for _ in range(300):
        b.observe({"docs": 6.0, "prose": 4.0, "chat": 4.0})
    assert int(np.argmax(b.weights)) == NAMES.index("docs")


def test_state_round_trip_gives_the_same_future():
    a = make()
    rng = np.random.default_rng(2)
    for step in range(100):
        a.observe(noisy_losses(rng, step, falling="docs"))
    state = json.loads(json.dumps(a.state_dict()))
    b = make(seed=999)
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    for step in range(100, 400):
        obs = noisy_losses(rng, step, falling="chat")
        ca, cb = a.observe(obs), b.observe(obs)
        assert (ca is None) == (cb is None)
        if ca is not None:
            assert ca.to_dict() == cb.to_dict()
        assert a.weights.tolist() == b.weights.tolist()  # bit for bit
        assert (a.phase, a.phase_step, a.phase_len) == (b.phase, b.phase_step, b.phase_len)


def test_state_for_other_sources_is_refused():
    state = make().state_dict()
    other = Bandit(["a", "b"], LENGTHS, 0.5, 0.05, 7)
    with pytest.raises(UserError, match="source_names: expected \\['a', 'b'\\]"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"phase_lengths": []}, "bandit.phase_lengths: expected positive integers"),
        ({"phase_lengths": [7, 0]}, "bandit.phase_lengths: expected positive integers"),
        ({"eta": -1.0}, "bandit.eta: expected a number >= 0, got -1.0"),
        ({"floor": 0.5}, r"bandit.floor: expected a number in \[0, 1/3\]"),
        ({"score": "vibes"}, "bandit.score: expected one of progress, loss, got 'vibes'"),
        ({"source_names": ["a", "a"]}, "expected distinct source names"),
    ],
)
def test_bad_settings(kw, message):
    with pytest.raises(UserError, match=message):
        make(**kw)
