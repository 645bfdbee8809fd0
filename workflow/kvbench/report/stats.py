"""Rank statistics for the report: Spearman's rho across methods with a paired bootstrap over
samples, and Kendall's tau between two orderings of the same items (also per bootstrap draw)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd
from scipy import stats

from kvbench.report.bootstrap import MIN_UNITS, Resample, interval, resample_counts

MIN_METHODS = 3  # fewer items than this give no rank correlation worth a number
MIN_SAMPLES = MIN_UNITS  # fewer samples give a degenerate bootstrap interval (3 samples: 10 distinct resamples)


@dataclass(frozen=True)
class RankCorrelation:
    rho: float
    ci_low: float
    ci_high: float
    n_items: int
    n_samples: int
    draws: np.ndarray = field(default_factory=lambda: np.empty(0), repr=False, compare=False)
    n_documents: int = 0  # the interval's n: documents where the samples share them, else samples


def spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman's rho of each row of x with the same row of y (ties: average ranks)."""
    rx = stats.rankdata(x, axis=1)
    ry = stats.rankdata(y, axis=1)
    rx -= rx.mean(axis=1, keepdims=True)
    ry -= ry.mean(axis=1, keepdims=True)
    denom = np.sqrt((rx**2).sum(axis=1) * (ry**2).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denom > 0, (rx * ry).sum(axis=1) / denom, np.nan)


def _means(counts: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Draws x items: each item's mean over the drawn units that have a value (NaN: none drawn)."""
    ok = np.isfinite(values)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (counts @ np.where(ok, values, 0.0)) / (counts @ ok.astype(float))


def bootstrap_spearman(
    x: pd.DataFrame,
    y: pd.DataFrame,
    n_boot: int,
    seed: int,
    level: float = 0.95,
    strata: Sequence[int] | None = None,
    documents: pd.Series | None = None,
) -> RankCorrelation:
    """rho between per-item means of x and y (items = columns, samples = rows, paired: the same
    sample index in both), with an expanded percentile interval (kvbench.report.bootstrap) from
    resampling the samples, within `strata` (sizes of consecutive row groups) if given; where the
    samples share `documents` (each row's, by x's index), documents are resampled whole and the
    interval's n counts them (returned as `n_documents`).

    A sample missing for an item (NaN) is left out of that item's mean. Items whose mean is
    undefined are dropped; with fewer than MIN_METHODS items the result is NaN, and with fewer
    than MIN_SAMPLES samples the interval is (resampling a handful of samples says nothing). A
    draw that lost every sample of some item cannot rank it: it counts as undefined.
    """
    x, y = x.align(y, join="inner")
    docs = None
    if documents is not None:  # a sample without a document is its own
        found = documents.reindex(x.index).to_numpy(object)
        docs = np.array([d if isinstance(d, str) else f"unit:{i}" for i, d in enumerate(found)])
    keep = x.notna().any() & y.notna().any()
    x, y = x.loc[:, keep].to_numpy(float), y.loc[:, keep].to_numpy(float)
    n_samples, n_items = x.shape
    n = n_samples if docs is None else len(set(docs))
    if n_items < MIN_METHODS or n_samples == 0:
        return RankCorrelation(math.nan, math.nan, math.nan, n_items, n_samples, n_documents=n)
    point = float(spearman_rows(np.nanmean(x, axis=0)[None], np.nanmean(y, axis=0)[None])[0])
    if n_samples < MIN_SAMPLES:
        return RankCorrelation(point, math.nan, math.nan, n_items, n_samples, n_documents=n)
    rng = np.random.default_rng(seed)
    if n < n_samples:
        counts = Resample.clustered(docs, n_boot, rng).counts
    else:
        counts = resample_counts(list(strata) if strata is not None else [n_samples], n_boot, rng)
    bx, by = _means(counts, x), _means(counts, y)
    rhos = spearman_rows(bx, by)
    rhos[np.isnan(bx).any(axis=1) | np.isnan(by).any(axis=1)] = np.nan
    iv = interval(point, rhos, n, level)
    return RankCorrelation(point, iv.low, iv.high, n_items, n_samples, rhos, n)


def kendall_tau(a: pd.Series, b: pd.Series) -> tuple[float, int]:
    """Kendall's tau-b between two scores of the same items (index), over the items both have."""
    a, b = a.align(b, join="inner")
    ok = a.notna() & b.notna()
    n = int(ok.sum())
    if n < MIN_METHODS:
        return math.nan, n
    tau = stats.kendalltau(a[ok].to_numpy(float), b[ok].to_numpy(float)).statistic
    return float(tau), n


def kendall_tau_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Kendall's tau-b of each row of a with the same row of b (draws x items), NaN where a row has
    no untied pair."""
    i, j = np.triu_indices(a.shape[1], k=1)
    sa, sb = np.sign(a[:, i] - a[:, j]), np.sign(b[:, i] - b[:, j])
    with np.errstate(invalid="ignore", divide="ignore"):
        tau = (sa * sb).sum(axis=1) / np.sqrt((sa != 0).sum(axis=1) * (sb != 0).sum(axis=1))
    return np.where(np.isfinite(tau), tau, np.nan)
