"""The GEMM tuner's setting from the environment (engine/backends/cuda/gemm.py; no GPU)."""

from __future__ import annotations

import pytest

from engine.backends.cuda.gemm import CANDIDATES, candidates
from engine.errors import UserError


def test_candidates_default_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANDREA_GEMM_CANDIDATES", raising=False)
    assert candidates() == CANDIDATES == 8
    monkeypatch.setenv("ANDREA_GEMM_CANDIDATES", "32")
    assert candidates() == 32


@pytest.mark.parametrize("bad", ["0", "65", "many", "-3", "8.5", " 8"])
def test_a_bad_candidates_value_is_named(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv("ANDREA_GEMM_CANDIDATES", bad)
    with pytest.raises(UserError, match=r"ANDREA_GEMM_CANDIDATES: expected an integer from 1 "
                                        r"to 64, got"):
        candidates()
