"""Workload-aware recommendation: for every scenario x task category x context bucket, the best
method that meets every limit of the scenario, the runner-up, the numbers and one line of why.

A scenario (config `report.scenarios`) is a set of limits on measured columns of the joined method
table, absolute or relative to the baseline method, and the column to prefer among the methods
that meet them. A limit on a column this run did not measure cannot be met, and neither can the
preferred column (a method is never named best on a number nobody measured): the answer then says
"none qualifies" and names what was not measured. A method that failed on any sample of the cell
does not qualify either (an empty output is a score of 0, not a failure). Methods tied on the
preferred column are told apart by the smaller KV (or, preferring KV, the shorter TTFT); a tie on
both is reported as a tie, never settled by the name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import pandas as pd

from kvbench.report.joined import MEASURED

NONE = "none qualifies"
QUALITY_LIMITS = {"quality", "kl_mean", "top1_agreement", "first_divergence"}


@dataclass(frozen=True)
class Limit:
    column: str
    bound: str  # "min" or "max"
    value: float
    relative: bool

    def measured(self, row: Mapping[str, Any]) -> float:
        value = row.get(f"{self.column}_rel" if self.relative else self.column)
        return math.nan if value is None or pd.isna(value) else float(value)

    def met(self, row: Mapping[str, Any]) -> bool:
        v = self.measured(row)
        return v == v and (v >= self.value if self.bound == "min" else v <= self.value)

    def label(self, baseline: str) -> str:
        op = ">=" if self.bound == "min" else "<="
        return f"{self.column} {op} {self.value:g}" + (f"x {baseline}" if self.relative else "")


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    limits: tuple[Limit, ...]
    prefer: str
    order: str  # "max" or "min"

    @classmethod
    def from_config(cls, name: str, cfg: Mapping[str, Any]) -> "Scenario":
        limits = []
        for column, spec in cfg.get("limits", {}).items():
            if column not in MEASURED:
                raise ValueError(f"report.scenarios.{name}.limits: unknown column {column!r} (one of {MEASURED})")
            bounds = [b for b in ("min", "max") if b in spec]
            if not bounds:
                raise ValueError(f"report.scenarios.{name}.limits.{column}: give min and/or max")
            limits += [Limit(column, b, float(spec[b]), bool(spec.get("relative", False))) for b in bounds]
        (order, prefer), = cfg["prefer"].items()
        if prefer not in MEASURED:
            raise ValueError(f"report.scenarios.{name}.prefer: unknown column {prefer!r} (one of {MEASURED})")
        return cls(name, cfg.get("description", ""), tuple(limits), prefer, order)


def scenarios_from_config(cfg: Mapping[str, Any]) -> list[Scenario]:
    return [Scenario.from_config(name, spec) for name, spec in cfg.items()]


def _value(row: Mapping[str, Any], column: str, baseline: str) -> str:
    v, rel = row.get(column), row.get(f"{column}_rel")
    if v is None or pd.isna(v):
        return f"{column} not measured"
    text = f"{column} {v / 1e6:.3g} MB" if column == "kv_bytes" else f"{column} {v:.3g}"
    return text + (f" ({rel:.2f}x {baseline})" if rel is not None and not pd.isna(rel) else "")


def _failures(row: Mapping[str, Any], scenario: Scenario, baseline: str) -> list[str]:
    errors = sum(int(row.get(c) or 0) for c in ("system_errors", "quality_errors") if not pd.isna(row.get(c)))
    out = [f"failed on {errors} sample(s)"] if errors else []
    for limit in scenario.limits:
        if not limit.met(row):
            v = limit.measured(row)
            if v == v:
                out.append(f"{limit.label(baseline)} ({v:.3g})")
            elif limit.relative and not pd.isna(row.get(limit.column)):
                out.append(f"{limit.label(baseline)} ({baseline} not measured or 0 here)")
            else:
                out.append(f"{limit.label(baseline)} (not measured)")
    if pd.isna(row.get(scenario.prefer)):
        out.append(f"{scenario.prefer} (preferred) not measured")
    return out


def _tiebreak(scenario: Scenario) -> str:
    return "ttft_s" if scenario.prefer == "kv_bytes" else "kv_bytes"


def recommend_cell(cell: pd.DataFrame, scenario: Scenario, baseline: str) -> dict[str, Any]:
    rows = cell.to_dict("records")
    judged = [(row, _failures(row, scenario, baseline)) for row in rows]
    sign = -1 if scenario.order == "max" else 1
    second = _tiebreak(scenario)

    def key(row: Mapping[str, Any], column: str, s: int = 1) -> float:
        v = row.get(column)
        return math.inf if v is None or pd.isna(v) else s * float(v)

    def preference(row: Mapping[str, Any]) -> tuple[float, float]:
        return key(row, scenario.prefer, sign), key(row, second)

    ok = sorted((row for row, fails in judged if not fails), key=preference)
    shown = dict.fromkeys([*(limit.column for limit in scenario.limits), scenario.prefer])

    def numbers(row: Mapping[str, Any]) -> str:
        return ", ".join(_value(row, column, baseline) for column in shown)
    out = {"qualifying": len(ok), "candidates": len(rows), "best": NONE, "runner_up": None,
           "best_value": math.nan, "runner_up_value": math.nan, "tied": None}
    unjudged = sorted(row["method"] for row in rows if any(
        pd.isna(row.get(limit.column)) for limit in scenario.limits if limit.column in QUALITY_LIMITS))
    note = (f"; quality not measured for {', '.join(unjudged)} (the quality stage did not run them here), "
            "so they cannot meet its limits" if unjudged else "")
    if ok:
        best = ok[0]
        tied = [r for r in ok[1:] if key(r, scenario.prefer) == key(best, scenario.prefer)]
        unresolved = [r["method"] for r in tied if preference(r) == preference(best)]
        word = "highest" if scenario.order == "max" else "lowest"
        name = " = ".join([best["method"], *unresolved]) if unresolved else best["method"]
        out |= {"best": f"tie: {name}" if unresolved else name, "best_value": best.get(scenario.prefer),
                "numbers": numbers(best), "tied": ", ".join(r["method"] for r in tied) or None}
        why = f"{name}: {word} {_value(best, scenario.prefer, baseline)} of {len(ok)} method(s) within every limit"
        if unresolved:
            why += f" (a tie on {scenario.prefer} and {second})"
        elif tied:
            why += (f" (tied on {scenario.prefer} with {', '.join(r['method'] for r in tied)}; "
                    f"the smaller {second} decides)")
        rest = [r for r in ok[1:] if r["method"] not in unresolved]
        if rest:
            runner = rest[0]
            out |= {"runner_up": runner["method"], "runner_up_value": runner.get(scenario.prefer)}
            why += f"; runner-up {runner['method']} ({_value(runner, scenario.prefer, baseline)})"
        out["why"] = why + note
        return out
    closest, fails = min(judged, key=lambda j: (len(j[1]), preference(j[0])))
    out |= {"numbers": numbers(closest),
            "why": f"none of {len(rows)} method(s) meets every limit; closest {closest['method']} misses "
                   + "; ".join(fails) + note}
    return out


def recommendations(table: pd.DataFrame, scenarios: list[Scenario], baseline: str) -> pd.DataFrame:
    rows = []
    for scenario in scenarios:
        common = {"limits": "; ".join(limit.label(baseline) for limit in scenario.limits),
                  "prefer": f"{scenario.order} {scenario.prefer}", "description": scenario.description}
        if table.empty:
            rows.append({"model": "-", "scenario": scenario.name, "category": "-", "bucket": "-", "best": NONE,
                         "why": "no method was measured (stages system and quality not run)", "qualifying": 0,
                         "candidates": 0, **common})
        for (model, category, bucket), cell in table.groupby(["model", "category", "bucket"], sort=True):
            rows.append({"model": model, "scenario": scenario.name, "category": category, "bucket": bucket,
                         **recommend_cell(cell, scenario, baseline), **common})
    columns = ["model", "scenario", "category", "bucket", "best", "runner_up", "best_value", "runner_up_value",
               "tied", "numbers", "why", "qualifying", "candidates", "limits", "prefer", "description"]
    return pd.DataFrame(rows, columns=columns)
