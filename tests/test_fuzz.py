"""Every reader of outside data, fuzzed briefly (scripts/fuzz.py runs the same targets long):
any bytes give a value or a clear error, never another exception or a hang."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzz_targets import TARGETS


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_reader_survives_hostile_input(name: str) -> None:
    fn, strategy = TARGETS[name]

    @settings(max_examples=40, deadline=2000, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(strategy)
    def check(data: object) -> None:
        fn(data)

    check()
