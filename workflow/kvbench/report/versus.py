"""The recommendation's pick against its runner-up: a paired comparison on the preferred column,
on the same units and bootstrap draws as the joined table's intervals (kvbench.report.cells).

Quality columns (score, KL, top-1 agreement, first divergence) compare by the difference of the
two methods' means over the samples both have (KL and top-1 pooled over positions, as in the
joined table); timings, bytes, ratio and decode speed by the geometric mean of per-unit ratios
(pick / runner-up), on the samples of the quality pass or the prompts of the system stage,
whichever the row's `*_source` names. A difference that is 0 on all but a few samples gets no
interval (kvbench.report.bootstrap.Estimate); peak memory is a maximum, not resampled: no test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pandas as pd

from kvbench.report.bootstrap import Estimate
from kvbench.report.cells import Cell, quality_panel, system_panel
from kvbench.report.contracts import CONTRACTS
from kvbench.report.joined import (
    PER_SAMPLE,
    QUALITY_COLUMNS,
    SYSTEM_ONLY,
    TIMINGS,
    fidelity_units,
    log_ratio,
    position_weights,
)

QUALITY_KEY = ("model", "protocol", "category", "bucket")
FIDELITY = {"kl_mean": 0, "top1_agreement": 1, "first_divergence": 2}


@dataclass(frozen=True)
class Comparison:
    """pick vs runner-up on one column: a difference (null 0) or a ratio (null 1)."""

    column: str
    estimate: float
    low: float
    high: float
    n: int
    units: int | None  # samples or prompts behind n where n counts documents
    unit: str  # what n counts without documents: samples or prompts
    ratio: bool

    @property
    def null(self) -> float:
        return 1.0 if self.ratio else 0.0

    def favours_pick(self, order: str) -> bool:
        """The interval excludes no-effect on the pick's side (higher for max, lower for min)."""
        if self.low != self.low:
            return False
        return self.low > self.null if order == "max" else self.high < self.null

    @property
    def n_text(self) -> str:
        return f"{self.n} {self.unit}" if self.units is None else f"{self.n} documents ({self.units} {self.unit})"

    def text(self, pick: str, runner: str) -> str:
        what = f"{pick} / {runner}" if self.ratio else f"{pick} - {runner}"
        kind = "geometric mean of paired ratios" if self.ratio else "paired difference of means"
        bounds = f" [{self.low:.3g}, {self.high:.3g}]" if self.low == self.low else " (no interval)"
        return f"{what} on {self.column}: {self.estimate:.3g}{bounds}, {kind}, n = {self.n_text}"


class Versus:
    """Comparisons of two methods of one row's cell; the cells' draws are rebuilt from the run's
    seed and the cell's key, so they are the joined table's."""

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
        if paired is not None and len(paired):
            for cell in quality_panel(paired, n_boot, seed).cells(("leaf",)):
                self.quality[tuple(cell.key[k] for k in QUALITY_KEY)] = cell
        if units is not None and len(units):
            for cell in system_panel(units, n_boot, seed).cells(("leaf", "all")):
                self.system[(cell.key["model"], cell.key["bucket"])] = cell

    def __call__(self, pick: Mapping[str, Any], runner: Mapping[str, Any], column: str) -> Comparison | None:
        a, b = pick["method"], runner["method"]
        if column in QUALITY_COLUMNS:
            cell = self.quality.get(tuple(pick[k] for k in QUALITY_KEY))
            return None if cell is None else self._means(cell, a, b, column)
        if column in SYSTEM_ONLY or column not in PER_SAMPLE:
            return self._system_ratio(pick, a, b, column) if column == "decode_tok_s" else None
        source = pick.get("timing_source" if column in TIMINGS else "bytes_source")
        if source == CONTRACTS["quality_scores"].path:
            cell = self.quality.get(tuple(pick[k] for k in QUALITY_KEY))
            return None if cell is None else self._ratio(cell, a, b, column, "samples")
        return self._system_ratio(pick, a, b, column)

    def _system_ratio(self, pick: Mapping[str, Any], a: str, b: str, column: str) -> Comparison | None:
        cell = self.system.get((pick["model"], pick.get("system_bucket")))
        return None if cell is None else self._ratio(cell, a, b, column, "prompts")

    def _vector(self, cell: Cell, column: str, method: str) -> np.ndarray | None:
        matrix = cell.matrix(column)
        return matrix[method].to_numpy(float) if method in matrix else None

    def _means(self, cell: Cell, a: str, b: str, column: str) -> Comparison | None:
        r = cell.resample
        if column == "quality":
            va, vb = self._vector(cell, "score", a), self._vector(cell, "score", b)
            if va is None or vb is None:
                return None
            return self._compare(r.mean(va) - r.mean(vb), column, "samples", ratio=False)
        positions = cell.matrix("positions").max(axis=1).to_numpy(float)
        vectors = []
        for method in (a, b):
            col = {c: self._vector(cell, c, method) for c in FIDELITY}
            if any(v is None for v in col.values()):
                return None
            vectors.append(fidelity_units(col, positions, method == self.baseline)[FIDELITY[column]])
        weights = None if column == "first_divergence" else position_weights(positions)
        return self._compare(r.mean(vectors[0], weights) - r.mean(vectors[1], weights), column, "samples", ratio=False)

    def _ratio(self, cell: Cell, a: str, b: str, column: str, unit: str) -> Comparison | None:
        va, vb = self._vector(cell, column, a), self._vector(cell, column, b)
        if va is None or vb is None or not np.isfinite(log_ratio(va, vb)).any():
            return None
        return self._compare(cell.resample.geometric_mean(log_ratio(va, vb)), column, unit, ratio=True)

    def _compare(self, est: Estimate, column: str, unit: str, ratio: bool) -> Comparison:
        iv = est.interval(self.level, null=1.0 if ratio else 0.0)
        return Comparison(column, est.estimate, iv.low, iv.high, est.n, est.n_units, unit, ratio)
