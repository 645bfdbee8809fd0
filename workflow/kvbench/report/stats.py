"""Rank statistics for the report: Spearman's rho across methods with a paired bootstrap over
samples, and Kendall's tau between two orderings of the same items."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

MIN_METHODS = 3  # fewer items than this give no rank correlation worth a number
MIN_SAMPLES = 5  # fewer samples give a degenerate bootstrap interval (3 samples: 10 distinct resamples)


@dataclass(frozen=True)
class RankCorrelation:
    rho: float
    ci_low: float
    ci_high: float
    n_items: int
    n_samples: int


def _spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman's rho of each row of x with the same row of y (ties: average ranks)."""
    rx = stats.rankdata(x, axis=1)
    ry = stats.rankdata(y, axis=1)
    rx -= rx.mean(axis=1, keepdims=True)
    ry -= ry.mean(axis=1, keepdims=True)
    denom = np.sqrt((rx**2).sum(axis=1) * (ry**2).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denom > 0, (rx * ry).sum(axis=1) / denom, np.nan)


def bootstrap_spearman(
    x: pd.DataFrame, y: pd.DataFrame, n_boot: int, seed: int, level: float = 0.95,
) -> RankCorrelation:
    """rho between per-item means of x and y (items = columns, samples = rows, paired: the same
    sample index in both), with a percentile interval from resampling the samples.

    A sample missing for an item (NaN) is left out of that item's mean. Items whose mean is
    undefined are dropped; with fewer than MIN_METHODS items the result is NaN, and with fewer
    than MIN_SAMPLES samples the interval is (resampling a handful of samples says nothing).
    """
    x, y = x.align(y, join="inner")
    keep = x.notna().any() & y.notna().any()
    x, y = x.loc[:, keep].to_numpy(float), y.loc[:, keep].to_numpy(float)
    n_samples, n_items = x.shape
    if n_items < MIN_METHODS or n_samples == 0:
        return RankCorrelation(math.nan, math.nan, math.nan, n_items, n_samples)
    point = float(_spearman_rows(np.nanmean(x, axis=0)[None], np.nanmean(y, axis=0)[None])[0])
    if n_samples < MIN_SAMPLES:
        return RankCorrelation(point, math.nan, math.nan, n_items, n_samples)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n_samples, size=(n_boot, n_samples))
    with warnings.catch_warnings():  # an all-NaN slice warns; it is handled below
        warnings.simplefilter("ignore", RuntimeWarning)
        bx, by = np.nanmean(x[idx], axis=1), np.nanmean(y[idx], axis=1)
    # A draw that lost every sample of some item cannot rank it: it counts as undefined.
    rhos = _spearman_rows(bx, by)
    rhos[np.isnan(bx).any(axis=1) | np.isnan(by).any(axis=1)] = np.nan
    tail = 100 * (1 - level) / 2
    if np.isnan(rhos).all():
        low = high = math.nan
    else:
        low, high = np.nanpercentile(rhos, [tail, 100 - tail])
    return RankCorrelation(point, float(low), float(high), n_items, n_samples)


def kendall_tau(a: pd.Series, b: pd.Series) -> tuple[float, int]:
    """Kendall's tau-b between two scores of the same items (index), over the items both have."""
    a, b = a.align(b, join="inner")
    ok = a.notna() & b.notna()
    n = int(ok.sum())
    if n < MIN_METHODS:
        return math.nan, n
    tau = stats.kendalltau(a[ok].to_numpy(float), b[ok].to_numpy(float)).statistic
    return float(tau), n
