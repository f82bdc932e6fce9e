"""The one statistics helper: a 95% Student-t interval of a mean (and its one-sided lower bound), the
repeat-until-tight rule, and the geometric mean that averages ratios (speedups over levels).

Used by the load generator (engine.measure.runner: repeats of one configuration) and by the tuner's trials
(tuner.study.objective: repeats of a speedup ratio). Measurements on these machines are noisy (about
+-15% run to run), so a figure is repeated until its interval is narrow enough, never just once.
"""

from __future__ import annotations

import math
import statistics


def t95(n: int) -> float:
    """Two-sided 95% Student-t quantile for a mean of n samples (n >= 2: n - 1 degrees of freedom)."""
    from scipy.stats import t

    return float(t.ppf(0.975, n - 1))


def mean_ci(xs: list[float]) -> tuple[float, float | None, float | None]:
    """Mean and its 95% confidence interval (None, None with fewer than two samples)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, None, None
    half = t95(len(xs)) * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, m - half, m + half


def lower95(xs: list[float]) -> float | None:
    """One-sided 95% lower confidence bound of the mean (None with fewer than two samples): what
    "faster than the baseline" needs. It is one-sided because only one direction is claimed; with
    two repeats the two-sided interval (t = 12.7) would reject every realistic speedup."""
    if len(xs) < 2:
        return None
    from scipy.stats import t

    return statistics.fmean(xs) - float(t.ppf(0.95, len(xs) - 1)) * statistics.stdev(xs) / math.sqrt(len(xs))


def rel_half_width(xs: list[float]) -> float | None:
    """The interval's half-width over the mean: the relative noise of the figure (None without
    an interval or with a mean of zero)."""
    m, lo, hi = mean_ci(xs)
    if lo is None or hi is None or m <= 0:
        return None
    return (hi - lo) / 2 / m


def tight(xs: list[float], rel_width: float, n_min: int = 2) -> bool:
    """The repeat-until-tight rule: at least n_min samples and a relative half-width <= rel_width."""
    rel = rel_half_width(xs) if len(xs) >= max(2, n_min) else None
    return rel is not None and rel <= rel_width


def geomean(xs: list[float]) -> float:
    """The geometric mean of non-negative ratios: 0 when any is 0 (its limit: a level where a
    configuration served nothing good cannot be averaged away by the others). A negative value or an
    empty list is a ValueError (statistics.StatisticsError; no ratio is negative)."""
    if xs and min(xs) == 0:
        return 0.0
    return statistics.geometric_mean(xs)
