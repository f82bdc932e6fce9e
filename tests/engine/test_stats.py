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
