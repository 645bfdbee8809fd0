"""The cells the report compares methods in, each with its units' bootstrap resamples.

Quality: per model x protocol, a cell is one task category x context bucket (a leaf), or pooled:
a category over its buckets, a bucket over its categories, everything (`ALL`). A pooled cell
resamples within each leaf (stratified). System: per model, one cell per bucket and one over all
buckets (stratified alike), units are prompts. Every cell draws from its own generator (the run's
seed and the cell's key), so its intervals do not depend on what else the run holds. Leaves too
small to stratify on (STRATUM_MIN) are resampled together. A cell where some document holds more
than one unit (a pooled cell: one corpus document serves every task and bucket) resamples
documents instead (Resample.clustered; documents cross the strata, so it is not stratified).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterator

import numpy as np
import pandas as pd

from kvbench.report.bootstrap import Resample, rng_for

ALL = "all"
LEVELS = ("leaf", "category", "bucket", "all")
# A pooled cell resamples within its leaves only when each holds at least this many units: a
# stratified bootstrap's variance falls short by (n - 1) / n per stratum (to nothing at 1 unit,
# which the default run's one-sample categories would make of every pooled interval). Smaller
# leaves are resampled together, which the spread between them can only widen.
STRATUM_MIN = 20
DOCUMENT = "document"  # the unit's (first) source document, where the unit table has one


@dataclass
class Cell:
    key: dict[str, str]  # model, protocol (quality), category (quality), bucket
    units: pd.DataFrame  # the cell's units, in stratum order
    resample: Resample
    matrices: "Panel"

    def matrix(self, column: str) -> pd.DataFrame:
        """units x methods (NaN: the method has no value for the unit)."""
        return self.matrices.matrix(self.key, column).iloc[self.units["_row"].to_numpy()]

    @property
    def n_units(self) -> int:
        return len(self.units)


class Panel:
    """Pivoted unit tables per group and the cells over them."""

    def __init__(
        self, rows: pd.DataFrame, group: list[str], unit: list[str], strata: list[str], n_boot: int, seed: int, tag: str
    ) -> None:
        self.rows, self.group, self.unit, self.strata = rows, group, unit, strata
        self.n_boot, self.seed, self.tag = n_boot, seed, tag
        self._pivots: dict[tuple, pd.DataFrame] = {}

    @cached_property
    def groups(self) -> dict[tuple, tuple[pd.DataFrame, pd.DataFrame]]:
        """group key -> (its rows, its units sorted by stratum with their row number `_row`)."""
        out = {}
        for key, rows in self.rows.groupby(self.group, sort=True):
            key = key if isinstance(key, tuple) else (key,)
            docs = [DOCUMENT] if DOCUMENT in rows else []
            units = (
                rows[[*self.strata, *self.unit, *docs]]
                .drop_duplicates(self.unit)
                .sort_values([*self.strata, *self.unit], ignore_index=True)
            )
            out[key] = (rows, units.assign(_row=np.arange(len(units))))
        return out

    def matrix(self, key: dict[str, str], column: str) -> pd.DataFrame:
        gkey = tuple(key[g] for g in self.group)
        if (gkey, column) not in self._pivots:
            rows, units = self.groups[gkey]
            table = rows.drop_duplicates([*self.unit, "method"]).set_index([*self.unit, "method"])[column]
            table = table.astype(float).unstack("method")
            index = pd.Index(units[self.unit[0]]) if len(self.unit) == 1 else pd.MultiIndex.from_frame(units[self.unit])
            self._pivots[(gkey, column)] = table.reindex(index)
        return self._pivots[(gkey, column)]

    def methods(self, key: dict[str, str]) -> list[str]:
        return sorted(self.groups[tuple(key[g] for g in self.group)][0].method.unique())

    def cells(self, levels: tuple[str, ...] = LEVELS) -> Iterator[Cell]:
        """Every cell of the wanted levels; a pooled level that would repeat a leaf (one bucket, or one
        category) is left out."""
        for gkey, (_, units) in self.groups.items():
            base = dict(zip(self.group, gkey))
            values = {s: sorted(units[s].unique()) for s in self.strata}
            for level in levels:
                for pooled, fixed in _selections(level, self.strata, values):
                    chosen = units
                    for col, val in fixed.items():
                        chosen = chosen[chosen[col] == val]
                    if chosen.empty:
                        continue
                    key = {**base, **fixed, **{p: ALL for p in pooled}}
                    rng = rng_for(self.seed, self.tag, *key.values())
                    yield Cell(key, chosen.reset_index(drop=True), self._resample(chosen, rng), self)

    def _resample(self, units: pd.DataFrame, rng: np.random.Generator) -> Resample:
        if DOCUMENT in units and units[DOCUMENT].duplicated().any():
            return Resample.clustered(units[DOCUMENT].to_numpy(), self.n_boot, rng)
        strata = units.groupby(self.strata, sort=True).size().to_numpy()
        return Resample.of(strata if strata.min() >= STRATUM_MIN else [len(units)], self.n_boot, rng)


def _selections(level: str, strata: list[str], values: dict[str, list[str]]) -> Iterator[tuple[list[str], dict]]:
    """(strata pooled over, strata fixed at a value) for one level."""
    if len(strata) == 1:  # system: bucket only
        (s,) = strata
        if level == "leaf":
            yield from (([], {s: v}) for v in values[s])
        elif level == "all":
            yield [s], {}
        return
    first, second = strata
    if level == "leaf":
        yield from (([], {first: a, second: b}) for a in values[first] for b in values[second])
    elif level == "category" and len(values[first]) > 1 and len(values[second]) > 1:
        yield from (([second], {first: a}) for a in values[first])
    elif level == "bucket" and len(values[first]) > 1 and len(values[second]) > 1:
        yield from (([first], {second: b}) for b in values[second])
    elif level == "all":
        yield [first, second], {}


def quality_panel(paired: pd.DataFrame, n_boot: int, seed: int) -> Panel:
    return Panel(paired, ["model", "protocol"], ["task", "sample"], ["category", "bucket"], n_boot, seed, "quality")


def system_panel(units: pd.DataFrame, n_boot: int, seed: int) -> Panel:
    return Panel(units, ["model"], ["prompt_id"], ["bucket"], n_boot, seed, "system")
