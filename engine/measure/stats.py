"""The one statistics helper: a 95% Student-t interval of a mean (and its one-sided lower bound), the
same on a log scale for ratios and rates (`log_interval`), the repeat-until-tight rule, and the
geometric mean that averages ratios (speedups over levels).

Used by the load generator (engine.measure.runner: repeats of one configuration) and by the tuner's trials
(tuner.study.objective: repeats of a speedup ratio). Measurements on these machines are noisy (about
+-15% run to run), so a figure is repeated until its interval is narrow enough, never just once.
"""

from __future__ import annotations

import functools
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


def t95_one_sided(n: int) -> float:
    """One-sided 95% Student-t quantile for a mean of n samples (n >= 2)."""
    return t_one_sided(n, 0.05)


@functools.lru_cache(maxsize=256)
def t_one_sided(n: int, alpha: float) -> float:
    """One-sided (1 - alpha) Student-t quantile for a mean of n samples (n >= 2); cached: the
    confirmation round asks for the same few quantiles again and again."""
    from scipy.stats import t

    return float(t.ppf(1 - alpha, n - 1))


def log_interval(xs: list[float]) -> tuple[float, float | None, float | None, float | None, float | None]:
    """A positive figure's (a speedup, a tok/s) geometric mean and its intervals, computed on the
    logs and mapped back: (center, two-sided 95% low, high, one-sided 95% lower, one-sided 95%
    upper). Bounds are None with fewer than two samples.

    Ratios multiply, so their noise is symmetric on a log scale: the interval of a speedup can
    never reach 0 or below, and it is wider above the center than below, as a ratio's is. A
    non-positive sample (nothing served) gives 0 for the center and every bound (geomean's limit).
    """
    if any(x <= 0 for x in xs):
        zero = 0.0 if len(xs) >= 2 else None
        return 0.0, zero, zero, zero, zero
    if len(set(xs)) == 1:  # exact: exp(log(x)) may miss x by a rounding
        same = xs[0] if len(xs) >= 2 else None
        return xs[0], same, same, same, same
    logs = [math.log(x) for x in xs]
    m = statistics.fmean(logs)
    se = statistics.stdev(logs) / math.sqrt(len(xs))
    two, one = t95(len(xs)) * se, t95_one_sided(len(xs)) * se
    return math.exp(m), math.exp(m - two), math.exp(m + two), math.exp(m - one), math.exp(m + one)


def ratio_bounds(xs: list[float], noise: float) -> tuple[float, float]:
    """(pessimistic, optimistic) bounds of a ratio's mean: its one-sided 95% bounds on logs, never
    narrower than twice the noise band around the geometric mean (two samples that happen to agree
    prove less than their interval says; one sample has no interval at all)."""
    m, _, _, lower, upper = log_interval(xs)
    band_lo, band_hi = m * (1 - 2 * noise), m / max(1 - 2 * noise, 1e-9)
    if lower is None or upper is None:
        return band_lo, band_hi
    return min(lower, band_lo), max(upper, band_hi)


def log_spread(xs: list[float]) -> float | None:
    """The relative spread of one sample of a positive figure: the standard deviation of its logs
    (0.05 ~ +-5% per sample); None with fewer than two samples or a non-positive one."""
    if len(xs) < 2 or any(x <= 0 for x in xs):
        return None
    return statistics.stdev([math.log(x) for x in xs])


def robust_log_spread(xs: list[float]) -> float | None:
    """The relative spread of one sample of a positive figure that a few glitches do not inflate:
    1.4826 x the median absolute deviation of its logs (the standard deviation for normal logs);
    log_spread below three samples, where a median says nothing of the spread. What an outlier is
    judged against: a standard deviation that counts the outlier hides it."""
    if len(xs) < 3:
        return log_spread(xs)
    if any(x <= 0 for x in xs):
        return None
    logs = [math.log(x) for x in xs]
    mid = statistics.median(logs)
    return 1.4826 * statistics.median(abs(v - mid) for v in logs)


def f95(d1: int, d2: int) -> float:
    """The one-sided 95% quantile of the F distribution with (d1, d2) degrees of freedom: how far
    the ratio of two sample variances from one unchanged source can reach by chance."""
    from scipy.stats import f

    return float(f.ppf(0.95, d1, d2))


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
