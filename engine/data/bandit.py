"""The Firehose bandit (DESIGN §9): picks the data mixture phase by phase.

Training runs in phases whose length is drawn from `phase_lengths`. During a phase the mixture is
fixed; the bandit collects each source's per-step mean loss. At the boundary it scores each source
by its learning progress over the phase (mean loss of the first half of its observations minus the
mean of the second half: positive when the loss fell), adds `eta * score / p` to the source's
preference (EXP3: importance-weighted by the probability p the source had, so rarely drawn sources
are not penalised for being rare) and sets the next mixture to
`(1 - K*floor) * softmax(preferences) + floor`, so no source ever starves. `score="loss"` scores
by relative difficulty instead (see `phase_scores`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.errors import UserError

SCORES = ("progress", "loss")
STATE_VERSION = 1


@dataclass(frozen=True)
class PhaseChange:
    """A phase boundary. Arrays are in source order (`source_names`)."""

    old_phase: int
    new_phase: int
    source_names: list[str]
    scores: np.ndarray  # the finished phase's score per source
    new_weights: np.ndarray  # the new phase's mixture
    new_length: int  # the new phase's length in steps

    def to_dict(self) -> dict:
        """JSON-ready, sources by name."""
        names = self.source_names
        return {
            "old_phase": self.old_phase,
            "new_phase": self.new_phase,
            "scores": {n: float(x) for n, x in zip(names, self.scores, strict=True)},
            "weights": {n: float(x) for n, x in zip(names, self.new_weights, strict=True)},
            "phase_len": self.new_length,
        }


def progress_score(losses: list[float]) -> float:
    """Drop of the loss over a phase: mean(first half) - mean(second half); 0 with < 2 points."""
    half = len(losses) // 2
    if half == 0:
        return 0.0
    return math.fsum(losses[:half]) / half - math.fsum(losses[-half:]) / half


def phase_scores(kind: str, observations: list[list[float]]) -> np.ndarray:
    """Score each source's finished phase; sources without observations score 0.

    `progress`: the drop of its loss over the phase (learning progress).
    `loss`: its mean loss minus the mean over the observed sources (favours what is still hard).
    """
    if kind == "progress":
        return np.array([progress_score(obs) for obs in observations])
    means = [math.fsum(obs) / len(obs) if obs else None for obs in observations]
    seen = [m for m in means if m is not None]
    if not seen:
        return np.zeros(len(observations))
    centre = math.fsum(seen) / len(seen)
    return np.array([0.0 if m is None else m - centre for m in means])


def mix_weights(prefs: np.ndarray, floor: float) -> np.ndarray:
    z = np.exp(prefs - prefs.max())  # shift so the largest is exp(0): no overflow
    soft = z / z.sum()
    return (1.0 - len(prefs) * floor) * soft + floor


class Bandit:
    def __init__(
        self,
        source_names: list[str],
        phase_lengths: list[int],
        eta: float,
        floor: float,
        seed: int,
        score: str = "progress",
    ) -> None:
        k = len(source_names)
        if k == 0 or len(set(source_names)) != k:
            raise UserError(f"data.sources: expected distinct source names, got {source_names}")
        if not phase_lengths or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in phase_lengths
        ):
            raise UserError(
                f"bandit.phase_lengths: expected positive integers, got {phase_lengths!r}"
            )
        if not (isinstance(eta, int | float) and math.isfinite(eta) and eta >= 0):
            raise UserError(f"bandit.eta: expected a number >= 0, got {eta!r}")
        if not (isinstance(floor, int | float) and 0 <= floor <= 1 / k):
            raise UserError(
                f"bandit.floor: expected a number in [0, 1/{k}] for {k} sources, got {floor!r}"
            )
        if score not in SCORES:
            raise UserError(f"bandit.score: expected one of {', '.join(SCORES)}, got {score!r}")
        self.source_names = list(source_names)
        self.phase_lengths = list(phase_lengths)
        self.eta = float(eta)
        self.floor = float(floor)
        self.seed = seed
        self.score = score
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.prefs = np.zeros(k, dtype=np.float64)
        self.weights = mix_weights(self.prefs, self.floor)
        self.phase = 1
        self.phase_step = 0
        self.phase_len = self._draw_length()
        self.last_scores: dict[str, float] | None = None
        self._obs: list[list[float]] = [[] for _ in range(k)]

    def _draw_length(self) -> int:
        return int(self.phase_lengths[int(self.rng.integers(len(self.phase_lengths)))])

    def observe(self, step_src_loss: dict[str, float | None]) -> PhaseChange | None:
        """Record one optimizer step's per-source mean loss; at a phase end, move to the next."""
        for i, name in enumerate(self.source_names):
            loss = step_src_loss.get(name)
            if loss is not None and math.isfinite(loss):
                self._obs[i].append(float(loss))
        self.phase_step += 1
        if self.phase_step < self.phase_len:
            return None
        return self._end_phase()

    def _end_phase(self) -> PhaseChange:
        scores = phase_scores(self.score, self._obs)
        self.prefs = self.prefs + self.eta * scores / self.weights
        self.weights = mix_weights(self.prefs, self.floor)
        self.last_scores = {n: float(s) for n, s in zip(self.source_names, scores, strict=True)}
        old = self.phase
        self.phase += 1
        self.phase_step = 0
        self.phase_len = self._draw_length()
        self._obs = [[] for _ in self.source_names]
        return PhaseChange(
            old_phase=old,
            new_phase=self.phase,
            source_names=list(self.source_names),
            scores=scores,
            new_weights=self.weights.copy(),
            new_length=self.phase_len,
        )

    def state_dict(self) -> dict:
        """Everything needed to continue exactly; JSON-serialisable (floats round-trip by repr)."""
        return {
            "version": STATE_VERSION,
            "source_names": list(self.source_names),
            "phase_lengths": list(self.phase_lengths),
            "eta": self.eta,
            "floor": self.floor,
            "seed": self.seed,
            "score": self.score,
            "prefs": [float(p) for p in self.prefs],
            "weights": [float(w) for w in self.weights],
            "phase": self.phase,
            "phase_step": self.phase_step,
            "phase_len": self.phase_len,
            "last_scores": self.last_scores,
            "observations": [list(o) for o in self._obs],
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise UserError(
                f"bandit state: version: expected {STATE_VERSION}, got {state.get('version')!r}"
            )
        if state.get("source_names") != self.source_names:
            raise UserError(
                f"bandit state: source_names: expected {self.source_names} (the config's), "
                f"got {state.get('source_names')}"
            )
        self.phase_lengths = list(state["phase_lengths"])
        self.eta = float(state["eta"])
        self.floor = float(state["floor"])
        self.seed = state["seed"]
        self.score = state["score"]
        self.prefs = np.array(state["prefs"], dtype=np.float64)
        self.weights = np.array(state["weights"], dtype=np.float64)
        self.phase = int(state["phase"])
        self.phase_step = int(state["phase_step"])
        self.phase_len = int(state["phase_len"])
        self.last_scores = state["last_scores"]
        self._obs = [[float(x) for x in o] for o in state["observations"]]
        self.rng.bit_generator.state = state["rng"]
