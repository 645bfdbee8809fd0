"""How much evidence a comparison has, and how much it would need: the minimum detectable effect
(MDE) of a two-sided paired test at the report's level and 80 % power, and the number of units
(samples, or prompts) at which a stated effect becomes detectable.

Both follow the paired t test's normal-theory formula with the observed standard error, the
standard planning approximation (the bootstrap intervals are about as wide):
MDE = (t_{1 - alpha/2, n-1} + t_{power, n-1}) * se, with se = sd / sqrt(n) of the unit differences.
`power_table` applies them to every method-vs-reference comparison of pilot tables, so a GPU
run's sample counts can be chosen from a small run's spread.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Iterable, Mapping

import numpy as np
import pandas as pd
from scipy import special

POWER = 0.80
# Effects a run should be able to detect, per compared quantity (`report.power.effects` overrides):
# task score 0.05 (5 points of F1 / ROUGE-L / accuracy), KL 0.01 nats per position, top-1
# agreement 2 points, first divergence 2 tokens, TTFT / TPOT / decode speed / end-to-end 5 % (a paired
# ratio of 1.05).
DEFAULT_EFFECTS = {
    "score": 0.05,
    "kl_mean": 0.01,
    "kl_first": 0.01,
    "top1_agreement": 0.02,
    "first_divergence": 2.0,
    "ttft_s": 0.05,
    "tpot_s": 0.05,
    "decode_tok_s": 0.05,
    "e2e_s": 0.05,
}
MAX_N = 10_000_000


@lru_cache(maxsize=65536)
def _factor(n: float, level: float, power: float) -> float:
    df = max(n - 1, 1)
    return float(special.stdtrit(df, 1 - (1 - level) / 2) + special.stdtrit(df, power))


def mde(se: float, n: int, level: float, power: float = POWER) -> float:
    """The smallest true difference a two-sided paired test at `level` detects with `power`, at
    the observed standard error `se` over `n` units."""
    if n < 2 or not se == se:
        return math.nan
    return _factor(n, level, power) * se


def n_needed(se: float, n: int, effect: float, level: float, power: float = POWER) -> float:
    """Units at which `effect` becomes detectable (MDE <= effect), the unit-level spread held at
    the observed sd = se * sqrt(n). NaN without a spread; `n`'s own spread of 0 needs 2."""
    if n < 2 or not se == se or not effect > 0:
        return math.nan
    sd = se * math.sqrt(n)
    if sd == 0:
        return 2.0
    z = special.ndtri(1 - (1 - level) / 2) + special.ndtri(power)
    m = max(2, math.ceil((z * sd / effect) ** 2))
    if m > MAX_N:
        return math.inf
    while _factor(m, level, power) * sd / math.sqrt(m) > effect:  # t quantiles shrink with m: a few steps
        m += 1
    return float(m)


def spread(
    differences: np.ndarray, weights: np.ndarray | None = None, documents: np.ndarray | None = None
) -> tuple[float, float, int]:
    """(estimate, standard error, n) of a (weighted) mean of unit differences; a weighted mean is
    a ratio estimator, its se the delta method's. With `documents` (each unit's), units of one
    document are summed before the spread is taken (a cluster-robust se) and n counts documents,
    as the report's cluster bootstrap does."""
    d = np.asarray(differences, float)
    w = np.ones_like(d) if weights is None else np.asarray(weights, float)
    ok = np.isfinite(d) & np.isfinite(w) & (w > 0)
    d, w = d[ok], w[ok]
    groups = np.arange(len(d)) if documents is None else np.unique(np.asarray(documents)[ok], return_inverse=True)[1]
    n = int(groups.max()) + 1 if len(d) else 0
    if n < 2:
        return (float(np.sum(w * d) / np.sum(w)) if len(d) else math.nan), math.nan, n
    theta = float(np.sum(w * d) / np.sum(w))
    resid = np.bincount(groups.ravel(), weights=w * (d - theta) / w.mean())  # per document
    return theta, float(math.sqrt(n / (n - 1) * np.sum(resid**2)) / len(d)), n


def power_row(
    differences: np.ndarray,
    weights: np.ndarray | None,
    effect: float,
    level: float,
    power: float = POWER,
    documents: np.ndarray | None = None,
) -> dict[str, float]:
    estimate, se, n = spread(differences, weights, documents)
    return {
        "estimate": estimate,
        "n": n,
        "n_units": int(np.isfinite(np.asarray(differences, float)).sum()),
        "sd": se * math.sqrt(n) if n >= 2 else math.nan,
        "se": se,
        "mde": mde(se, n, level, power),
        "effect": effect,
        "n_needed": n_needed(se, n, effect, level, power),
        "level": level,
        "power": power,
    }


def power_table(
    paired: pd.DataFrame,
    effects: Mapping[str, float] | None = None,
    level: float = 0.95,
    power: float = POWER,
    by: Iterable[str] = ("model", "protocol", "method", "category"),
) -> pd.DataFrame:
    """Per group of `by` (and `pooled` over categories when `category` is in it) and per compared
    quantity with a stated effect: n, sd, se of the unit differences, the MDE at n, and the n the
    effect needs. Where the frame has a `document` column and a group's units share documents, n
    counts documents (`n_units` the units) and sd is per document.

    `paired` is the per-sample frame of kvbench.report.samples.paired_quality (or any frame with
    the `d_<quantity>` difference columns and `w_<quantity>` weights it holds): call it on a pilot
    run's tables, e.g. `power_table(paired_quality(load_tables(...), "full"))`."""
    effects = {**DEFAULT_EFFECTS, **(effects or {})}
    by = [c for c in by if c in paired]
    quantities = [c[2:] for c in paired.columns if c.startswith("d_") and c[2:] in effects]
    frames = [paired]
    if "category" in by:
        frames.append(paired.assign(category="pooled"))
    rows = []
    for key, part in pd.concat(frames, ignore_index=True).groupby(by, sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        for quantity in quantities:
            weights = part[f"w_{quantity}"].to_numpy(float) if f"w_{quantity}" in part else None
            documents = part["document"].to_numpy(str) if "document" in part else None
            row = power_row(
                part[f"d_{quantity}"].to_numpy(float),
                weights,
                effects.get(quantity, math.nan),
                level,
                power,
                documents,
            )
            if row["n"]:
                rows.append({**dict(zip(by, key)), "quantity": quantity, **row})
    columns = [*by, "quantity", "estimate", "n", "n_units", "sd", "se", "mde", "effect", "n_needed", "level", "power"]
    return pd.DataFrame(rows, columns=columns)
