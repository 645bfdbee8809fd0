"""Paired bootstrap intervals, their p-values, Holm's adjustment and a test that methods differ:
the statistics behind every comparison the report prints.

A cell's units (quality samples, or system prompts with their repeats averaged) are resampled
with replacement once, as a count matrix (draws x units), and every statistic of the cell is a
matrix product with it: all methods of a cell see the same resamples, so a difference between two
of them is paired. A cell whose units share documents resamples documents, each with all of its
units (a cluster bootstrap; n counts documents). Otherwise a pooled cell (several categories or
buckets) resamples within each of them where each holds enough units (stratified: the design fixes
how many samples each holds; see kvbench.report.cells.STRATUM_MIN), else all of its units together.

Intervals are expanded percentile intervals (Hesterberg 2015, "What teachers should know about
the bootstrap"): the percentile interval read at alpha' = 2 Phi(sqrt(n / (n - 1)) t_{alpha/2, n-1})
instead of alpha, which repairs the plain percentile interval's under-coverage at small n (it is
about a t interval's width on symmetric data and keeps the percentile interval's skew). The p-value
inverts the same interval family: p < alpha exactly when the interval at level 1 - alpha excludes
the null. Tails thinner than TAIL_DRAWS draws are not counted alone (a count of 0 would say p = 0
whatever the number of draws): see tail_mass.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np
from scipy import special

MIN_UNITS = 5  # fewer units give no interval: a resample of 3 samples has 10 distinct values
# A paired difference that is 0 on all but fewer than this many units gets no bootstrap interval:
# with 5 changes all in one direction an exact sign test gives p = 2 / 2^5 = 0.0625, while the
# bootstrap's tail (the chance of drawing none of them) says far less.
MIN_CHANGED = 6
TAIL_DRAWS = 20  # a tail holding fewer draws is extrapolated from a normal fit


def rng_for(seed: int, *key: object) -> np.random.Generator:
    """A generator per cell from the run's seed and the cell's key: a cell's draws do not depend on
    which other cells exist or in which order they are computed."""
    return np.random.default_rng([int(seed), zlib.crc32("\x1f".join(map(str, key)).encode())])


def resample_counts(strata: Sequence[int], n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Draws x units: how often each unit is drawn, units grouped by stratum (sizes `strata`, in
    order), each stratum resampled to its own size."""
    parts = []
    for size in strata:
        if size > 0:
            drawn = rng.integers(0, size, size=(n_boot, size)) + size * np.arange(n_boot)[:, None]
            parts.append(np.bincount(drawn.ravel(), minlength=n_boot * size).reshape(n_boot, size))
    return np.concatenate(parts, axis=1).astype(float) if parts else np.zeros((n_boot, 0))


@lru_cache(maxsize=4096)
def expanded_alpha(alpha: float, n: int) -> float:
    return float(2 * special.ndtr(math.sqrt(n / (n - 1)) * special.stdtrit(n - 1, alpha / 2)))


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    n: int
    se: float  # standard deviation of the draws
    p_value: float  # two-sided, for `null`
    level: float
    null: float = 0.0
    n_units: int | None = None  # the samples (prompts) behind n where n counts documents

    @property
    def direction(self) -> int:
        """+1 if the interval lies above the null, -1 below, 0 if it holds it (or there is none)."""
        return 1 if self.low > self.null else -1 if self.high < self.null else 0


def tail_mass(draws: np.ndarray, bound: float, above: bool) -> float:
    """The share of draws at or beyond `bound` (above it if `above`; draws equal to it count half),
    counted where TAIL_DRAWS or more draws lie there. A thinner tail is the smaller of a normal fit
    to the draws and (count + 1) / (draws + 1): the fit resolves p-values below 1 / draws, the
    count keeps a bounded distribution (a rank correlation near 1, a minimum) from being read as
    having a normal tail it does not have."""
    beyond = draws > bound if above else draws < bound
    count = beyond.sum() + 0.5 * (draws == bound).sum()
    if count >= TAIL_DRAWS:
        return float(count / len(draws))
    sd = draws.std(ddof=1)
    z = (bound - draws.mean()) / sd if sd > 0 else math.copysign(math.inf, bound - draws.mean())
    if z != z:  # every draw equals the bound
        return 0.5
    fit = float(special.ndtr(-z) if above else special.ndtr(z))
    return min(fit, float((count + 1) / (len(draws) + 1)))


def p_beyond(draws: np.ndarray, n: int, bound: float, above: bool) -> float:
    """The smallest alpha at which the expanded percentile interval of level 1 - alpha lies
    entirely below `bound` (`above=True`: the draws' mass above it is the evidence against that)
    or entirely above it."""
    tail = tail_mass(draws, bound, above)
    if tail <= 0:
        return 0.0
    return float(min(1.0, 2 * special.stdtr(n - 1, special.ndtri(tail) / math.sqrt(n / (n - 1)))))


def interval(
    estimate: float, draws: np.ndarray, n: int, level: float, null: float = 0.0, n_units: int | None = None
) -> Interval:
    """The expanded percentile interval of `draws` (NaN draws, from resamples without data, are
    left out) and the two-sided p-value for `null`; none below MIN_UNITS units (documents, where
    they are resampled: `n` counts them)."""
    draws = np.asarray(draws, float)
    draws = draws[np.isfinite(draws)]
    if n < MIN_UNITS or len(draws) < 2 or not math.isfinite(estimate):
        return Interval(estimate, math.nan, math.nan, n, math.nan, math.nan, level, null, n_units)
    a = expanded_alpha(1 - level, n)
    low, high = np.quantile(draws, [a / 2, 1 - a / 2])
    p = min(p_beyond(draws, n, null, above=False), p_beyond(draws, n, null, above=True))
    return Interval(float(estimate), float(low), float(high), n, float(draws.std(ddof=1)), p, level, null, n_units)


@dataclass(frozen=True)
class Estimate:
    """A statistic and its bootstrap draws on one cell's resamples (subtracting two estimates of
    the same cell gives the paired difference). A mean or a ratio keeps the units it rests on
    (`mask`) and how to recompute it on fewer (`restrict`), so a difference of two is taken on the
    units both have; a mean also keeps its per-unit values (`units`), so the difference knows on
    how many units the two differ at all (`changed`). `n` counts documents where they are
    resampled (`n_units` then counts the samples or prompts)."""

    estimate: float
    draws: np.ndarray = field(repr=False, compare=False)
    n: int
    units: np.ndarray | None = field(default=None, repr=False, compare=False)
    changed: int | None = None
    n_units: int | None = None
    mask: np.ndarray | None = field(default=None, repr=False, compare=False)
    restrict: Callable[[np.ndarray], "Estimate"] | None = field(default=None, repr=False, compare=False)
    # level -> (low, high): an exact bound for when too few units differ for the bootstrap
    exact: Callable[[float], tuple[float, float]] | None = field(default=None, repr=False, compare=False)
    clusters: np.ndarray | None = field(default=None, repr=False, compare=False)  # each unit's document

    def __sub__(self, other: "Estimate") -> "Estimate":
        a, b = self, other
        if a.mask is not None and b.mask is not None and len(a.mask) == len(b.mask) and a.restrict and b.restrict:
            both = a.mask & b.mask
            if not (np.array_equal(both, a.mask) and np.array_equal(both, b.mask)):
                a, b = a.restrict(both), b.restrict(both)  # a unit only one of them has is no pair
        units = changed = None
        if a.units is not None and b.units is not None and len(a.units) == len(b.units):
            units = a.units - b.units
            # where documents are resampled, the independent changes are the documents that hold one
            changed = count_units(np.isfinite(units) & (units != 0), a.clusters)
        n_units = None if a.n_units is None or b.n_units is None else min(a.n_units, b.n_units)
        return Estimate(a.estimate - b.estimate, a.draws - b.draws, min(a.n, b.n), units, changed, n_units)

    def interval(self, level: float, null: float = 0.0) -> Interval:
        """The interval and p-value for `null`; for a paired difference that is 0 on all but a few
        units (fewer than MIN_CHANGED differ) the `exact` bound where the estimate has one (no
        p-value), else none: the bootstrap's tail there is the chance of drawing none of them, far
        thinner than an exact sign test's."""
        if self.changed is not None and self.changed < MIN_CHANGED:
            if self.exact is not None and self.n >= MIN_UNITS:
                low, high = self.exact(level)
                return Interval(self.estimate, low, high, self.n, math.nan, math.nan, level, null, self.n_units)
            return replace(interval(self.estimate, self.draws, 0, level, null, self.n_units), n=self.n)
        return interval(self.estimate, self.draws, self.n, level, null, self.n_units)


def sparse_ratio_bound(changed: int, n: int, base_mean: float, score_range: float, level: float) -> tuple[float, float]:
    """An exact bound for a paired ratio of means (method / baseline) over n units of which only
    `changed` differ, each difference within +-score_range: the share of units that differ is at
    most its Clopper-Pearson bound p at one-sided (1 + level) / 2, so the mean difference lies
    within +-p * score_range and the ratio within 1 +- p * score_range / base_mean. It ignores
    the direction of the differences seen, so it is wide, but unlike the bootstrap it does not
    call a handful of changed units (or none) a precise ratio."""
    if n <= 0 or not base_mean > 0:
        return math.nan, math.nan
    p = 1.0 if changed >= n else float(special.betaincinv(changed + 1, n - changed, (1 + level) / 2))
    return 1 - p * score_range / base_mean, 1 + p * score_range / base_mean


def count_units(ok: np.ndarray, clusters: np.ndarray | None) -> int:
    """How many units `ok` selects: documents where they are resampled (`clusters`), else units."""
    return int(ok.sum()) if clusters is None else len(np.unique(clusters[ok]))


def _present(*vectors: np.ndarray) -> np.ndarray:
    return np.logical_and.reduce([np.isfinite(np.asarray(v, float)) for v in vectors])


@dataclass(frozen=True)
class Resample:
    """One cell's units and their bootstrap count matrix; each method's values are vectors over
    the same units, NaN where the method has none for a unit. Where units share documents
    (`clusters`: each unit's document), documents are resampled and n counts them."""

    counts: np.ndarray  # draws x units
    clusters: np.ndarray | None = None

    @classmethod
    def of(cls, strata: Sequence[int], n_boot: int, rng: np.random.Generator) -> "Resample":
        return cls(resample_counts(strata, n_boot, rng))

    @classmethod
    def clustered(cls, documents: Sequence[object], n_boot: int, rng: np.random.Generator) -> "Resample":
        """A cluster bootstrap: documents drawn with replacement, each with all of its units (units
        of one document share its difficulty, so resampling them alone understates the spread)."""
        codes = np.unique(np.asarray(documents, dtype=str), return_inverse=True)[1].ravel()
        return cls(resample_counts([int(codes.max()) + 1], n_boot, rng)[:, codes], codes)

    def count(self, ok: np.ndarray) -> tuple[int, int | None]:
        """(n, units behind it): n counts documents where they are resampled."""
        return count_units(ok, self.clusters), None if self.clusters is None else int(ok.sum())

    def _sums(self, values: np.ndarray, ok: np.ndarray) -> tuple[float, np.ndarray]:
        filled = np.where(ok, values, 0.0)
        return float(filled.sum()), self.counts @ filled

    def mean(self, values: np.ndarray, weights: np.ndarray | None = None) -> Estimate:
        """The (weighted) mean over the units that have a value; a ratio estimator per draw."""
        values = np.asarray(values, float)
        w = np.ones_like(values) if weights is None else np.asarray(weights, float)
        ok = _present(values, w) & (w > 0)
        num, num_d = self._sums(values * np.where(ok, w, 0.0), ok)
        den, den_d = self._sums(w, ok)
        n, n_units = self.count(ok)
        with np.errstate(invalid="ignore", divide="ignore"):
            return Estimate(
                num / den if den > 0 else math.nan,
                num_d / den_d,
                n,
                np.where(ok, values, np.nan),
                n_units=n_units,
                mask=ok,
                restrict=lambda mask: self.mean(np.where(mask, values, np.nan), w),
                clusters=self.clusters,
            )

    def ratio(self, num: np.ndarray, den: np.ndarray) -> Estimate:
        """sum(num) / sum(den) over the units that have both (paired): a ratio of means."""
        num, den = np.asarray(num, float), np.asarray(den, float)
        ok = _present(num, den)
        n_sum, n_d = self._sums(num, ok)
        d_sum, d_d = self._sums(den, ok)
        n, n_units = self.count(ok)
        with np.errstate(invalid="ignore", divide="ignore"):
            return Estimate(
                n_sum / d_sum if d_sum != 0 else math.nan,
                np.where(d_d != 0, n_d / d_d, np.nan),
                n,
                n_units=n_units,
                mask=ok,
                restrict=lambda mask: self.ratio(np.where(mask, num, np.nan), den),
            )

    def geometric_mean(self, logs: np.ndarray) -> Estimate:
        """exp(mean of `logs`) over the units that have one: with unit values log(method / baseline),
        the typical paired ratio."""
        log_mean = self.mean(logs)
        return Estimate(
            math.exp(log_mean.estimate) if log_mean.estimate == log_mean.estimate else math.nan,
            np.exp(log_mean.draws),
            log_mean.n,
            n_units=log_mean.n_units,
        )

    def median(self, values: np.ndarray) -> Estimate:
        """The median over the units that have a value, per draw from the counts (the lower of the
        two middle values when a draw holds an even number)."""
        values = np.asarray(values, float)
        ok = np.isfinite(values)
        n, n_units = self.count(ok)
        if n == 0:
            return Estimate(math.nan, np.full(len(self.counts), np.nan), 0)
        order = np.argsort(values[ok], kind="stable")
        sorted_values = values[ok][order]
        cum = np.cumsum(self.counts[:, ok][:, order], axis=1)
        half = cum[:, -1:] / 2
        at = np.argmax(cum >= half, axis=1)
        draws = np.where(cum[:, -1] > 0, sorted_values[at], np.nan)
        return Estimate(float(np.median(sorted_values)), draws, n, n_units=n_units)


def holm(p_values: Sequence[float]) -> np.ndarray:
    """Holm's step-down adjusted p-values (NaN stays NaN and is not counted in the family)."""
    p = np.asarray(p_values, float)
    out = np.full(p.shape, np.nan)
    idx = np.flatnonzero(np.isfinite(p))
    m = len(idx)
    if m:
        order = idx[np.argsort(p[idx], kind="stable")]
        stepped = np.maximum.accumulate((m - np.arange(m)) * p[order])
        out[order] = np.minimum(stepped, 1.0)
    return out


def equal_means_test(
    values: np.ndarray, n_boot: int, rng: np.random.Generator, documents: np.ndarray | None = None
) -> tuple[float, int]:
    """Do the columns (methods) of `values` (units x methods, NaN where missing) differ in mean?
    Statistic: the variance of the column means. Null distribution: the same statistic on
    resamples of the units after centring every column on the grand mean (rows resampled whole,
    so the pairing stays; documents whole where units share them). Returns the p-value
    ((1 + draws at least as large) / (1 + draws)) and the number of units (documents)."""
    values = np.asarray(values, float)
    ok = np.isfinite(values)
    keep = ok.any(axis=0)
    values, ok = values[:, keep], ok[:, keep]
    rows = ok.any(axis=1)
    values, ok = values[rows], ok[rows]
    docs = None if documents is None else np.asarray(documents, dtype=str)[rows]
    shared = docs is not None and len(np.unique(docs)) < len(docs)
    n = len(np.unique(docs)) if shared else int(len(values))
    if values.shape[1] < 2 or n < MIN_UNITS:
        return math.nan, n
    means = np.nanmean(values, axis=0)
    observed = means.var()
    centred = np.where(ok, values - means + np.nanmean(values), 0.0)
    counts = Resample.clustered(docs, n_boot, rng).counts if shared else resample_counts([n], n_boot, rng)
    with np.errstate(invalid="ignore", divide="ignore"):
        draws = (counts @ centred) / (counts @ ok.astype(float))
    null = np.nanvar(draws, axis=1)
    return float((1 + np.sum(null >= observed * (1 - 1e-12))) / (1 + len(null))), n
