"""engine.measure.stats.geomean, the one mean of ratios (a trial's speedup over concurrency
levels, a projection's over levels): a zero ratio makes the mean zero, as the limit says."""

from __future__ import annotations

import math
import statistics

import pytest

from engine.measure.stats import geomean


def test_geomean_of_ratios_and_of_a_zero() -> None:
    assert geomean([2.0, 8.0]) == pytest.approx(4.0) and geomean([1.5]) == pytest.approx(1.5)
    assert geomean([0.5, 2.0, 3.0]) == pytest.approx(math.exp(sum(map(math.log, [0.5, 2.0, 3.0])) / 3))
    # a level where nothing good was served: the mean is 0, never 1e-6 ** (1/n) of a clamped log
    # (and never a math domain error)
    assert geomean([0.0, 1e12]) == 0.0 and geomean([3.0, 0.0]) == 0.0
    for bad in ([], [-1.0, 2.0]):
        with pytest.raises(statistics.StatisticsError):
            geomean(bad)


def test_intervals_of_ratios_are_taken_on_logs() -> None:
    """Issue 39.2: a speedup's interval is never negative and is asymmetric, as a ratio's is; the
    arithmetic t-interval of the same two repeats reaches below zero."""
    from engine.measure.stats import log_interval, mean_ci

    xs = [0.9, 2.6]  # two repeats that disagree
    assert mean_ci(xs)[1] < 0  # what the trials showed before: [-9.9, 13.4]x
    c, lo, hi, lower, upper = log_interval(xs)
    assert c == pytest.approx(math.sqrt(0.9 * 2.6))
    assert 0 < lo < lower < c < upper < hi
    assert hi - c > c - lo and hi / c == pytest.approx(c / lo)  # symmetric on the log scale only
    assert log_interval([1.3]) == (1.3, None, None, None, None)
    assert log_interval([1.25, 1.25, 1.25]) == (1.25,) * 5  # exact, no exp(log(x)) rounding
    assert log_interval([0.0, 2.0])[:3] == (0.0, 0.0, 0.0)  # nothing served: geomean's limit


def test_ratio_bounds_are_never_narrower_than_the_noise_band() -> None:
    from engine.measure.stats import log_interval, ratio_bounds

    assert ratio_bounds([1.2], 0.05) == pytest.approx((1.2 * 0.9, 1.2 / 0.9))  # one repeat: the band
    agree = [1.30, 1.31]  # two repeats that happen to agree: their interval is narrower than the band
    assert ratio_bounds(agree, 0.05)[0] == pytest.approx(log_interval(agree)[0] * 0.9)
    wide = [0.9, 2.6]
    _, _, _, lower, upper = log_interval(wide)
    assert ratio_bounds(wide, 0.05) == pytest.approx((lower, upper))


def test_a_robust_spread_is_not_inflated_by_the_glitch_it_must_reveal() -> None:
    from engine.measure.stats import log_spread, robust_log_spread

    ordinary = [47.0, 48.5, 46.0, 49.0, 47.5, 48.0]
    glitched = [16.5, *ordinary]  # one pass at a third of the others: a process started beside it
    assert log_spread(glitched) > 0.3  # the standard deviation: a 3-band outlier test would be blind
    assert robust_log_spread(glitched) == pytest.approx(robust_log_spread(glitched[::-1]))
    assert robust_log_spread(glitched) < 0.05 and robust_log_spread(ordinary) < 0.05
    # normal logs: the robust spread estimates the same sd as the standard deviation
    rng = __import__("random").Random(0)
    xs = [math.exp(rng.gauss(0.0, 0.1)) for _ in range(2000)]
    assert robust_log_spread(xs) == pytest.approx(0.1, rel=0.08) and log_spread(xs) == pytest.approx(0.1, rel=0.08)
    assert robust_log_spread([10.0, 11.0]) == log_spread([10.0, 11.0])  # below 3 samples: no median to lean on
    assert robust_log_spread([10.0, 0.0, 11.0]) is None
