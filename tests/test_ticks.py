"""Axis ticks at round values (1-2-5 steps, powers of ten, clock steps), one label format per
axis, and the ranges the charts draw: the grad-norm axis robust to an outlier and to a clip
line far beyond the data."""

from __future__ import annotations

import math

import numpy as np
import pytest

from andrea_tui import ticks
from andrea_tui.series import column_ranges


@pytest.mark.parametrize(("lo", "hi", "target", "want"), [
    (7.90, 9.06, 5, [8.0, 8.2, 8.4, 8.6, 8.8, 9.0]),  # not 9.06 / 8.48 / 7.90
    (7.90, 9.06, 3, [8.0, 8.5, 9.0]),
    (1, 141, 5, [20, 40, 60, 80, 100, 120, 140]),  # not 1 / 48 / 94 / 141
    (0, 22301, 5, [0, 5000, 10000, 15000, 20000]),
    (0, 51200, 3, [0, 20000, 40000]),
    (199.8, 400, 5, [200, 250, 300, 350, 400]),
    (0.56, 1.44, 2, [0.6, 0.8, 1.0, 1.2, 1.4]),  # at least two ticks, even over the target
    (-1, 1, 3, [-1, 0, 1]),
    (1e-4, 3e-3, 3, [1e-3, 2e-3, 3e-3]),
    (5, 5, 5, [5]),
])
def test_linear_ticks_are_whole_multiples_of_a_1_2_5_step(lo, hi, target, want) -> None:
    got = ticks.linear_ticks(lo, hi, target)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert 0.1 + 0.2 not in got  # exact decimals, not float sums
    if len(got) > 1:
        step = got[1] - got[0]
        mantissa = step / 10 ** math.floor(math.log10(step))
        assert round(mantissa, 9) in (1, 2, 5)


def test_ticks_stay_exact_decimals() -> None:
    assert ticks.linear_ticks(0.1, 0.7, 6) == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    assert ticks.linear_ticks(float("nan"), 1) == [] and ticks.linear_ticks(2, 1) == []


@pytest.mark.parametrize(("values", "kind", "want"), [
    ([0, 5000, 10000, 15000, 20000], "count", ["0", "5k", "10k", "15k", "20k"]),
    ([0, 50000, 100000, 150000], "count", ["0", "50k", "100k", "150k"]),
    ([0, 500000, 1000000, 1500000], "count", ["0", "0.5M", "1.0M", "1.5M"]),
    ([1000, 2000, 3000], "count", ["1k", "2k", "3k"]),  # steps a thousand apart
    ([0, 500, 1000, 1500], "count", ["0", "500", "1,000", "1,500"]),
    ([10000, 10500, 11000], "count", ["10.0k", "10.5k", "11.0k"]),  # one format for all
    ([8.0, 8.5, 9.0], "value", ["8.0", "8.5", "9.0"]),
    ([6.0, 6.5, 7.0], "value", ["6.0", "6.5", "7.0"]),  # never 6 next to 6.5
    ([0.0, 0.25, 0.5], "value", ["0.00", "0.25", "0.50"]),
    ([-1.0, -0.5, 0.0], "value", ["-1.0", "-0.5", "0.0"]),
    ([0, 2e8, 4e8, 6e8, 8e8, 1e9], "value", ["0", "2e8", "4e8", "6e8", "8e8", "1e9"]),
    ([5e-4, 1e-3, 1.5e-3], "value", ["5.0e-4", "1.0e-3", "1.5e-3"]),
    ([3.0999999, 3.1, 3.1000001], "value", None),  # distinct ticks: distinct labels
])
def test_every_tick_of_an_axis_has_one_label_format(values, kind, want) -> None:
    labels = ticks.tick_labels(values, kind)
    if want is not None:
        assert labels == want
    assert len(set(labels)) == len(values)


def test_a_bad_kind_or_a_non_finite_tick_is_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        ticks.tick_labels([1.0], "money")
    with pytest.raises(ValueError, match="finite"):
        ticks.tick_labels([1.0, math.inf])


@pytest.mark.parametrize(("lo", "hi", "kind", "want_ticks", "want_labels"), [
    (0.5, 6594, "value", [1, 10, 100, 1000], ["1", "10", "100", "1000"]),
    (1e3, 2e6, "count", [1e3, 1e4, 1e5, 1e6], ["1k", "10k", "100k", "1M"]),
    (1.5, 80, "value", [2, 5, 10, 20, 50], ["2", "5", "10", "20", "50"]),
    (0.3, 0.8, "value", [0.3, 0.4, 0.5, 0.6, 0.7, 0.8], None),  # inside a decade: linear
    (1e-5, 1e9, "value", [1e-5, 1, 1e5], ["1e-5", "1e0", "1e5"]),  # every 5th power
])
def test_log_ticks(lo, hi, kind, want_ticks, want_labels) -> None:
    got, labels = ticks.axis(lo, hi, kind, 5, log=True)
    assert got == pytest.approx(want_ticks)
    if want_labels is not None:
        assert labels == want_labels


@pytest.mark.parametrize(("lo", "hi", "want"), [
    (0, 1.5, ["0s", "30s", "60s", "90s"]),
    (0, 14, ["0m", "5m", "10m"]),
    (0, 90, ["0m", "30m", "60m", "90m"]),
    (0, 300, ["0h", "1h", "2h", "3h", "4h", "5h"]),
    (0, 60 * 24 * 5, ["0d", "1d", "2d", "3d", "4d", "5d"]),
])
def test_time_ticks_are_what_a_clock_reads(lo, hi, want) -> None:
    positions, labels = ticks.time_ticks(lo, hi, 5)
    assert labels == want
    assert all(lo <= p <= hi for p in positions)


def test_a_line_level_is_written_as_its_axis_would() -> None:
    assert ticks.label(1e9) == "1e9"
    assert ticks.label(1.0) == "1"
    assert ticks.label(134.7) == "134.7"
    assert ticks.label(50_000, "count") == "50k"


# ---------------------------------------------------------------- ranges


def grad_series(n: int = 2000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 1.0 + 0.1 * rng.standard_normal(n)


def test_one_outlier_leaves_the_grad_axis_alone_and_is_counted() -> None:
    g = grad_series()
    g[1500], g[1539] = 134.7, 6594.0
    x = np.arange(len(g), dtype=float)
    _, lo, hi = column_ranges(x, g, 80)
    yr = ticks.grad_range(g, lo, hi, None)
    assert yr is not None
    assert yr.hi < 2.0  # the bulk's top (about 1.3), not 6594
    assert yr.lo < float(g.min()) and yr.hi > float(np.sort(g)[-3])
    assert yr.above == 2
    assert ticks.full_range(g).hi > 6594  # what the axis was before: stretched


def test_the_clip_line_is_shown_only_near_the_data() -> None:
    g = grad_series()
    x = np.arange(len(g), dtype=float)
    _, lo, hi = column_ranges(x, g, 80)
    far = ticks.grad_range(g, lo, hi, 1e9)
    assert far is not None and far.line is None and far.line_off_scale and far.hi < 2.0
    near = ticks.grad_range(g, lo, hi, 2.5)  # within CLIP_NEAR of the data's top
    assert near is not None and near.line == 2.5 and near.hi >= 2.5 and not near.line_off_scale
    inside = ticks.grad_range(g, lo, hi, 1.0)
    assert inside is not None and inside.line == 1.0 and inside.hi < 1.6
    # on a log axis (log10 units) the whole range shows: the outlier is inside it
    g[700] = 6594.0
    lg = np.log10(g)
    _, llo, lhi = column_ranges(x, lg, 80)
    log = ticks.grad_range(lg, llo, lhi, 9.0, log=True)
    assert log is not None and log.hi >= math.log10(6594) and log.above == 0
    assert log.line is None and log.line_off_scale


def test_a_slowly_growing_series_is_all_on_the_axis() -> None:
    g = np.geomspace(0.5, 50.0, 3000)  # a run diverging slowly: no outliers, a trend
    x = np.arange(len(g), dtype=float)
    _, lo, hi = column_ranges(x, g, 80)
    yr = ticks.grad_range(g, lo, hi, None)
    assert yr is not None and yr.above == 0 and yr.hi >= 50.0


def test_percentile_range_counts_what_it_leaves_out() -> None:
    y = np.concatenate([np.linspace(2.0, 3.0, 1000), [1084.0, 1e4], [np.nan]])
    yr = ticks.percentile_range(y)
    assert yr is not None and yr.hi < 5 and yr.above == 2
    assert ticks.percentile_range(np.array([1.0])) is None
    flat = ticks.full_range(np.full(10, 1e-3))
    assert flat is not None and flat.lo < 1e-3 < flat.hi  # a flat series gets a span
