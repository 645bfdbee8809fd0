"""The recommendation's pick against its runner-up: a paired comparison on the preferred column,
on the same units and bootstrap draws as the joined table's intervals (kvbench.report.cells).

Quality columns (score, KL, top-1 agreement, first divergence) compare by the difference of the
two methods' means over the samples both have (KL and top-1 pooled over positions, as in the
joined table). Timings, bytes, ratio and decode speed compare by the geometric mean of per-unit
ratios (pick / runner-up): over the samples of the quality pass (one pass, both methods), or over
the system stage's prompts as the difference of each method's log ratio to the baseline run of its
own job, prompt and repeat (so drift between jobs cancels as it does in the joined table). Both
methods' numbers must come from the same stage. A difference that is 0 on all but a few samples
gets no interval (kvbench.report.bootstrap.Estimate); peak memory is a maximum, not resampled: no
comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pandas as pd

from kvbench.report.bootstrap import Estimate
from kvbench.report.cells import Cell, quality_panel, system_panel
from kvbench.report.joined import QUALITY_COLUMNS, fidelity_units, from_quality_pass, log_ratio, position_weights

QUALITY_KEY = ("model", "protocol", "category", "bucket")
FIDELITY_INDEX = {"kl_mean": 0, "top1_agreement": 1, "first_divergence": 2}  # in fidelity_units' tuple
NOT_RESAMPLED = {"peak_memory_mb": "a maximum, not resampled"}


@dataclass(frozen=True)
class Comparison:
    """pick vs runner-up on one column: a difference (null 0) or a ratio (null 1)."""

    column: str
    estimate: float
    low: float
    high: float
    n: int  # the interval's units: documents where the cell resamples them
    n_units: int | None  # the samples or prompts behind n where n counts documents
    unit: str  # what n counts without documents: samples or prompts
    ratio: bool

    @property
    def null(self) -> float:
        return 1.0 if self.ratio else 0.0

    def favours(self, order: str) -> int:
        """+1: the interval excludes no-effect on the pick's side (higher for max, lower for min);
        -1: on the runner-up's; 0: it holds no-effect, or there is none."""
        if self.low != self.low:
            return 0
        above, below = self.low > self.null, self.high < self.null
        if not (above or below):
            return 0
        return 1 if above == (order == "max") else -1

    @property
    def samples(self) -> int:
        return self.n if self.n_units is None else self.n_units

    @property
    def n_text(self) -> str:
        return f"{self.n} {self.unit}" if self.n_units is None else f"{self.n} documents ({self.n_units} {self.unit})"

    def text(self, pick: str, runner: str) -> str:
        what = f"{pick} / {runner}" if self.ratio else f"{pick} - {runner}"
        kind = "geometric mean of paired ratios" if self.ratio else "paired difference of means"
        bounds = f" [{self.low:.3g}, {self.high:.3g}]" if self.low == self.low else " (no interval)"
        return f"{what} on {self.column}: {self.estimate:.3g}{bounds}, {kind}, n = {self.n_text}"


class Versus:
    """Comparisons of two methods of one row's cell; the cells' draws are rebuilt from the run's
    seed and the cell's key, so they are the joined table's. Returns None where no comparison can
    be made, with the reason in `why_not`."""

    def __init__(
        self,
        paired: pd.DataFrame | None,
        units: pd.DataFrame | None,
        baseline: str,
        n_boot: int,
        seed: int,
        level: float,
    ) -> None:
        self.baseline, self.level = baseline, level
        self.quality: dict[tuple, Cell] = {}
        self.system: dict[tuple, Cell] = {}
        self.why_not = ""
        if paired is not None and len(paired):
            for cell in quality_panel(paired, n_boot, seed).cells(("leaf",)):
                self.quality[tuple(cell.key[k] for k in QUALITY_KEY)] = cell
        if units is not None and len(units):
            for cell in system_panel(units, n_boot, seed).cells(("leaf", "all")):
                self.system[(cell.key["model"], cell.key["bucket"])] = cell

    def __call__(self, pick: Mapping[str, Any], runner: Mapping[str, Any], column: str) -> Comparison | None:
        a, b = pick["method"], runner["method"]
        self.why_not = NOT_RESAMPLED.get(column, "")
        if self.why_not:
            return None
        quality = from_quality_pass(pick, column)
        if quality != from_quality_pass(runner, column):
            self.why_not = "their numbers come from different stages"
            return None
        if quality:
            cell = self.quality.get(tuple(pick[k] for k in QUALITY_KEY))
            if cell is None:
                comparison = None
            elif column in QUALITY_COLUMNS:
                comparison = self._means(cell, a, b, column)
            else:
                comparison = self._ratio(cell, log_ratio(self._vector(cell, column, a), self._vector(cell, column, b)))
        else:
            cell = self.system.get((pick["model"], pick.get("system_bucket")))
            lr = f"lr_{column}"
            comparison = (
                None if cell is None else self._ratio(cell, self._vector(cell, lr, a) - self._vector(cell, lr, b))
            )
        if comparison is None:
            self.why_not = "no unit has both"
            return None
        return Comparison(column, *comparison, "samples" if quality else "prompts", column not in QUALITY_COLUMNS)

    def _vector(self, cell: Cell, column: str, method: str) -> np.ndarray:
        matrix = cell.matrix(column)
        return matrix[method].to_numpy(float) if method in matrix else np.full(cell.n_units, np.nan)

    def _means(self, cell: Cell, a: str, b: str, column: str) -> tuple | None:
        r = cell.resample
        if column == "quality":
            return self._interval(r.mean(self._vector(cell, "score", a)) - r.mean(self._vector(cell, "score", b)), 0.0)
        positions = cell.matrix("positions").max(axis=1).to_numpy(float)
        a_units, b_units = (
            fidelity_units(
                {c: self._vector(cell, c, method) for c in FIDELITY_INDEX}, positions, method == self.baseline
            )[FIDELITY_INDEX[column]]
            for method in (a, b)
        )
        weights = None if column == "first_divergence" else position_weights(positions)
        return self._interval(r.mean(a_units, weights) - r.mean(b_units, weights), 0.0)

    def _ratio(self, cell: Cell, logs: np.ndarray) -> tuple | None:
        return self._interval(cell.resample.geometric_mean(logs), 1.0) if np.isfinite(logs).any() else None

    def _interval(self, est: Estimate, null: float) -> tuple | None:
        if est.n == 0:
            return None
        iv = est.interval(self.level, null=null)
        return est.estimate, iv.low, iv.high, est.n, est.n_units
