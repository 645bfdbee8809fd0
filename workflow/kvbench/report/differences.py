"""Every method-vs-reference difference with its paired bootstrap interval: task score, KL,
top-1 agreement and first divergence per model x protocol x category x bucket, and pooled
(results/report/differences.parquet); the TTFT, TPOT, decode and end-to-end ratios to the baseline
from the paired system runs (results/report/system_ratios.parquet).

These intervals are per comparison (not adjusted): they describe. The claims, which decide, are
adjusted across the family (kvbench.report.claims).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping

import numpy as np
import pandas as pd

from kvbench.report.bootstrap import MIN_CHANGED
from kvbench.report.cells import quality_panel, system_panel
from kvbench.report.power import DEFAULT_EFFECTS, POWER, mde, n_needed
from kvbench.report.samples import QUANTITIES

DIFFERENCE_COLUMNS = [
    "model",
    "protocol",
    "method",
    "kind",
    "category",
    "bucket",
    "quantity",
    "value",
    "value_low",
    "value_high",
    "reference_value",
    "difference",
    "ci_low",
    "ci_high",
    "n",
    "samples",
    "failed",
    "se",
    "p_value",
    "mde",
    "effect",
    "n_needed",
    "level",
    "bootstrap",
    "bootstrap_seed",
]
RATIO_METRICS = ["ttft_s", "tpot_s", "decode_tok_s", "e2e_s"]
RATIO_COLUMNS = [
    "model",
    "method",
    "bucket",
    "metric",
    "ratio",
    "ci_low",
    "ci_high",
    "prompts",
    "documents",
    "pairs",
    "failed",
    "p_value",
    "mde",
    "effect",
    "n_needed",
    "pairing",
    "source",
    "level",
    "bootstrap",
    "bootstrap_seed",
]


def _kinds(paired: pd.DataFrame) -> dict[str, str]:
    return paired.dropna(subset=["kind"]).drop_duplicates("method").set_index("method").kind.astype(str).to_dict()


def quality_differences(
    paired: pd.DataFrame | None,
    baseline: str,
    n_boot: int,
    seed: int,
    level: float,
    effects: Mapping[str, float] | None = None,
    power: float = POWER,
) -> pd.DataFrame:
    """One row per model x protocol x method (not the baseline) x cell x quantity that has data."""
    if paired is None or not len(paired):
        return pd.DataFrame(columns=DIFFERENCE_COLUMNS)
    effects = {**DEFAULT_EFFECTS, **(effects or {})}
    kinds = _kinds(paired)
    quantities = [q for q, (col, _, _) in QUANTITIES.items() if paired[col].notna().any()]
    rows = []
    for cell in quality_panel(paired, n_boot, seed).cells():
        failed = cell.matrix("failed")
        for quantity in quantities:
            column, weight, _ = QUANTITIES[quantity]
            d, v = cell.matrix(f"d_{quantity}"), cell.matrix(column)
            w = cell.matrix(f"w_{quantity}") if weight else None
            for method in d.columns:
                if method == baseline or not d[method].notna().any():
                    continue
                weights = None if w is None else w[method].to_numpy(float)
                diffs = d[method].to_numpy(float)
                est = cell.resample.mean(diffs, weights)
                iv = est.interval(level)
                if cell.resample.count(np.nan_to_num(diffs) != 0)[0] < MIN_CHANGED:  # documents where resampled
                    # A difference that is 0 on all but a few samples: the bootstrap's tail is the chance
                    # of drawing none of them, far thinner than an exact sign test's; no interval.
                    iv = replace(iv, low=math.nan, high=math.nan, p_value=math.nan)
                ok = d[method].notna().to_numpy()
                value = cell.resample.mean(np.where(ok, v[method].to_numpy(float), np.nan), weights)
                value_iv = value.interval(level)
                rows.append(
                    {
                        **cell.key,
                        "method": method,
                        "kind": kinds.get(method),
                        "quantity": quantity,
                        "value": value.estimate,
                        "value_low": value_iv.low,
                        "value_high": value_iv.high,
                        "reference_value": value.estimate - est.estimate,
                        "difference": est.estimate,
                        "ci_low": iv.low,
                        "ci_high": iv.high,
                        "n": est.n,
                        "samples": est.n if est.n_units is None else est.n_units,
                        "failed": int(failed[method].fillna(0).sum()),
                        "se": iv.se,
                        "p_value": iv.p_value,
                        "mde": mde(iv.se, est.n, level, power),
                        "effect": effects.get(quantity, math.nan),
                        "n_needed": n_needed(iv.se, est.n, effects.get(quantity, math.nan), level, power),
                        "level": level,
                        "bootstrap": n_boot,
                        "bootstrap_seed": seed,
                    }
                )
    return pd.DataFrame(rows, columns=DIFFERENCE_COLUMNS)


def system_ratios(
    units: pd.DataFrame | None,
    source: str,
    in_process: bool,
    baseline: str,
    n_boot: int,
    seed: int,
    level: float,
    effects: Mapping[str, float] | None = None,
    power: float = POWER,
) -> pd.DataFrame:
    """Per model x method x bucket (and all buckets): the geometric mean over prompts of the paired
    ratio method / baseline (each prompt's repeats averaged on the log scale), with its interval.
    `mde` and `effect` are relative changes (0.05: 5 %), on the log scale as the test runs."""
    if units is None or not len(units):
        return pd.DataFrame(columns=RATIO_COLUMNS)
    effects = {**DEFAULT_EFFECTS, **(effects or {})}
    pairing = (
        "method and baseline runs of one prompt and repeat, interleaved in one process"
        if in_process
        else "per-prompt medians of separate jobs (drift between jobs is not cancelled)"
    )
    rows = []
    for cell in system_panel(units, n_boot, seed).cells(("leaf", "all")):
        paired, failed = cell.matrix("paired"), cell.matrix("failed")
        for metric in RATIO_METRICS:
            logs = cell.matrix(f"lr_{metric}")
            for method in logs.columns:
                if method == baseline or not logs[method].notna().any():
                    continue
                log_est = cell.resample.mean(logs[method].to_numpy(float))
                iv = log_est.interval(level)
                effect = effects.get(metric, math.nan)
                log_effect = math.log1p(effect) if effect == effect else math.nan
                rows.append(
                    {
                        **cell.key,
                        "method": method,
                        "metric": metric,
                        "ratio": math.exp(log_est.estimate),
                        "ci_low": math.exp(iv.low),
                        "ci_high": math.exp(iv.high),
                        "prompts": log_est.n if log_est.n_units is None else log_est.n_units,
                        "documents": log_est.n,
                        "pairs": int(paired[method].fillna(0).sum()),
                        "failed": int(failed[method].fillna(0).sum()),
                        "p_value": iv.p_value,
                        "mde": math.expm1(mde(iv.se, log_est.n, level, power)),
                        "effect": effect,
                        "n_needed": n_needed(iv.se, log_est.n, log_effect, level, power),
                        "pairing": pairing,
                        "source": source,
                        "level": level,
                        "bootstrap": n_boot,
                        "bootstrap_seed": seed,
                    }
                )
    return pd.DataFrame(rows, columns=RATIO_COLUMNS)
