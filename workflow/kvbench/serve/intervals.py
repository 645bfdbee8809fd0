"""Intervals for the serve tables: percentile bootstraps (requests resampled; seeded) and the
paired t-interval of a ratio."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from kvbench.report.bootstrap import MIN_UNITS

LEVEL = 0.95
RESAMPLES = 1000


def bootstrap(
    values: np.ndarray,
    statistic: Callable[[np.ndarray], float],
    seed: int = 0,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
) -> tuple[float, float]:
    """Interval of `statistic` over resamples of `values` (NaN for fewer than 2 values)."""
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    if len(values) < 2:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    draws = [statistic(values[rng.integers(0, len(values), len(values))]) for _ in range(resamples)]
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(draws, [tail, 100 - tail])
    return float(low), float(high)


def paired_ratio_of_medians(a: np.ndarray, b: np.ndarray, seed: int = 0) -> tuple[float, float, float, int]:
    """median(a) / median(b) over pairs (a[i], b[i]), its interval and the pairs' n, the pairs
    resampled together (a pair with a NaN is left out and not counted): what both sides share (the
    request's document, its place in the round) stays matched in every resample. Below MIN_UNITS
    pairs, the point alone (a resample of a few pairs has a handful of distinct values)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    keep = ~(np.isnan(a) | np.isnan(b))
    a, b = a[keep], b[keep]
    if len(a) < MIN_UNITS:
        return (float(np.median(a) / np.median(b)) if len(a) else math.nan), math.nan, math.nan, len(a)
    rng = np.random.default_rng(seed)
    picks = (rng.integers(0, len(a), len(a)) for _ in range(RESAMPLES))
    draws = [np.median(a[i]) / np.median(b[i]) for i in picks]
    tail = 100 * (1 - LEVEL) / 2
    low, high = np.percentile(draws, [tail, 100 - tail])
    return float(np.median(a) / np.median(b)), float(low), float(high), len(a)


def paired_log_ratio(
    a: np.ndarray, b: np.ndarray, groups: np.ndarray | None = None
) -> tuple[float, float, float, int, int]:
    """The geometric mean of a[i] / b[i] over whole pairs of positive times, its t-interval, the
    pairs' n and the interval's units. A ratio of paired times is log-symmetric, and at the n a
    round gives (5-15 pairs) a bootstrap of medians has a handful of distinct values and
    under-covers. The units are the pairs, or with `groups` (a label per pair) the groups: pairs
    that ran in the same stretch of time share its noise, so the mean log ratio's standard error is
    the cluster-robust one (each group's summed residuals, the CR1 factor G / (G - 1)) with
    Student's t at G - 1 degrees of freedom; one pair a group is the plain paired t-interval.
    Back-transformed. Below MIN_UNITS units, the point alone."""
    from scipy.stats import t

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    keep = (a > 0) & (b > 0)  # a NaN compares false: its pair is left out too
    logs = np.log(a[keep] / b[keep])
    n = len(logs)
    if n == 0:
        return math.nan, math.nan, math.nan, 0, 0
    mean = float(logs.mean())
    labels = np.arange(n) if groups is None else np.unique(np.asarray(groups)[keep], return_inverse=True)[1]
    units = int(labels.max()) + 1
    if units < MIN_UNITS:
        return math.exp(mean), math.nan, math.nan, n, units
    residuals = np.bincount(labels, weights=logs - mean)
    se = math.sqrt(units / (units - 1) * float((residuals**2).sum())) / n
    half = float(t.ppf(0.5 + LEVEL / 2, units - 1)) * se
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half), n, units
