"""Workload-aware recommendation: for every scenario x protocol x task category x context bucket,
the best method that meets every limit of the scenario, decided by its interval, the runner-up,
the numbers and one line of why.

A scenario (config `report.scenarios`) is a set of limits on measured columns of the joined method
table, absolute or relative to the baseline method, and the column to prefer among the methods
that meet them. A method meets a limit only if its interval's unfavourable end does (the upper end
for a maximum, the lower for a minimum: a one-sided bound at (1 + level) / 2); an interval that
straddles the limit, or a point without an interval (too few units: see
kvbench.report.bootstrap.Estimate; a relative quality that differs from the baseline's on a few
samples only has an exact bound instead, kvbench.report.bootstrap.sparse_ratio_bound), is
undecided, and a cell where no method qualifies but some are undecided says `undecided at n = ...`. A limit on
a column this run did not measure cannot be met, and neither can the preferred column (a method is
never named best on a number nobody measured): the answer then says "none qualifies" and names
what was not measured. A method that failed on any sample of the cell does not qualify either (an
empty output is a score of 0, not a failure). Among the methods that qualify the best is the best
point estimate of the preferred column (it carries its interval and n); methods tied on it are told
apart by the smaller KV (or, preferring KV, the shorter TTFT); a tie on both is reported as a tie,
never settled by the name. The pick is named only if it beats the runner-up (the next qualifying
method) by a paired comparison on the preferred column (or on the tie-break column, when the two
tie on the preferred one) whose interval excludes no-effect (kvbench.report.versus); otherwise the
answer is `undecided at n = ...: pick or runner-up`, the leader kept in `best_candidate`. Each row reads the quality stage's protocol it names (context-only is
the cache-reuse case: a context compressed once and asked many questions); the system stage's
columns are the same in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import pandas as pd

from kvbench.report.joined import MEASURED, QUALITY_COLUMNS, from_quality_pass
from kvbench.report.versus import Versus

NONE = "none qualifies"
UNDECIDED = "undecided at n = {n}"
NOT_SEPARATED = "undecided at n = {n}: {pick} or {runner}"
MET, FAILS, OPEN, UNMEASURED = "met", "fails", "undecided", "not measured"


def _num(row: Mapping[str, Any], column: str) -> float:
    value = row.get(column)
    return math.nan if value is None or pd.isna(value) else float(value)


def unit_of(row: Mapping[str, Any], column: str) -> str:
    """What a column's n counts in this row: quality samples or system prompts."""
    return "samples" if from_quality_pass(row, column) else "prompts"


@dataclass(frozen=True)
class Limit:
    column: str
    bound: str  # "min" or "max"
    value: float
    relative: bool

    @property
    def name(self) -> str:
        return f"{self.column}_rel" if self.relative else self.column

    def measured(self, row: Mapping[str, Any]) -> float:
        return _num(row, self.name)

    def status(self, row: Mapping[str, Any]) -> str:
        """met (the unfavourable end meets it), fails (the favourable end does not), undecided (the
        interval straddles it, or there is none: a point alone decides nothing) or not measured."""
        v, low, high = self.measured(row), _num(row, f"{self.name}_low"), _num(row, f"{self.name}_high")
        if v != v:
            return UNMEASURED
        worst, best = (high, low) if self.bound == "max" else (low, high)
        ok = (lambda x: x <= self.value) if self.bound == "max" else (lambda x: x >= self.value)
        if worst != worst:
            return OPEN
        return MET if ok(worst) else OPEN if ok(best) else FAILS

    def met(self, row: Mapping[str, Any]) -> bool:
        return self.status(row) == MET

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
        ((order, prefer),) = cfg["prefer"].items()
        if prefer not in MEASURED:
            raise ValueError(f"report.scenarios.{name}.prefer: unknown column {prefer!r} (one of {MEASURED})")
        return cls(name, cfg.get("description", ""), tuple(limits), prefer, order)


def scenarios_from_config(cfg: Mapping[str, Any]) -> list[Scenario]:
    return [Scenario.from_config(name, spec) for name, spec in cfg.items()]


def _interval(row: Mapping[str, Any], name: str) -> str:
    low, high = _num(row, f"{name}_low"), _num(row, f"{name}_high")
    return f" [{low:.3g}, {high:.3g}]" if low == low else ""


def _value(row: Mapping[str, Any], column: str, baseline: str) -> str:
    v, rel = _num(row, column), _num(row, f"{column}_rel")
    if v != v:
        return f"{column} not measured"
    scale, unit = (1e6, " MB") if column == "kv_bytes" else (1.0, "")
    text = f"{column} {v / scale:.3g}{unit}"
    low, high = _num(row, f"{column}_low"), _num(row, f"{column}_high")
    if low == low and column != "kv_bytes":
        text += f" [{low:.3g}, {high:.3g}]"
    if rel == rel:
        text += f" ({rel:.2f}x {baseline}{_interval(row, f'{column}_rel')})"
    n = _num(row, f"{column}_n")
    return text + (f", n = {n:.0f} {unit_of(row, column)}" if n == n else "")


def _judge(row: Mapping[str, Any], scenario: Scenario, baseline: str) -> tuple[list[str], list[str]]:
    """(why the row fails, why it is undecided)."""
    errors = sum(int(row.get(c) or 0) for c in ("system_errors", "quality_errors") if not pd.isna(row.get(c)))
    fails = [f"failed on {errors} sample(s)"] if errors else []
    open_ = []
    for limit in scenario.limits:
        status = limit.status(row)
        v = limit.measured(row)
        n = _num(row, f"{limit.column}_n")
        at = f"n = {n:.0f} {unit_of(row, limit.column)}" if n == n else "no n"
        if status == FAILS:
            fails.append(f"{limit.label(baseline)} ({v:.3g}{_interval(row, limit.name)})")
        elif status == OPEN:
            open_.append(f"{limit.label(baseline)} ({v:.3g}{_interval(row, limit.name) or ', no interval'}, {at})")
        elif status == UNMEASURED:
            if limit.relative and not pd.isna(row.get(limit.column)):
                fails.append(f"{limit.label(baseline)} ({baseline} not measured or 0 here)")
            else:
                fails.append(f"{limit.label(baseline)} (not measured)")
    if pd.isna(row.get(scenario.prefer)):
        fails.append(f"{scenario.prefer} (preferred) not measured")
    return fails, open_


def _tiebreak(scenario: Scenario) -> str:
    return "ttft_s" if scenario.prefer == "kv_bytes" else "kv_bytes"


def _undecided_n(rows: list[Mapping[str, Any]], scenario: Scenario) -> str:
    """The smallest n behind an undecided limit of these rows, with its unit."""
    found = []
    for row in rows:
        for limit in scenario.limits:
            n = _num(row, f"{limit.column}_n")
            if limit.status(row) == OPEN and n == n:
                found.append((n, unit_of(row, limit.column)))
    if not found:
        return "?"
    n, unit = min(found)
    return f"{n:.0f} {unit}"


def recommend_cell(cell: pd.DataFrame, scenario: Scenario, baseline: str, versus: Versus) -> dict[str, Any]:
    rows = cell.to_dict("records")
    judged = [(row, *_judge(row, scenario, baseline)) for row in rows]
    sign = -1 if scenario.order == "max" else 1
    second = _tiebreak(scenario)

    def key(row: Mapping[str, Any], column: str, s: int = 1) -> float:
        v = row.get(column)
        return math.inf if v is None or pd.isna(v) else s * float(v)

    def preference(row: Mapping[str, Any]) -> tuple[float, float]:
        return key(row, scenario.prefer, sign), key(row, second)

    ok = sorted((row for row, fails, open_ in judged if not fails and not open_), key=preference)
    maybe = sorted((row for row, fails, open_ in judged if not fails and open_), key=preference)
    shown = dict.fromkeys([*(limit.column for limit in scenario.limits), scenario.prefer])

    def numbers(row: Mapping[str, Any]) -> str:
        return "; ".join(_value(row, column, baseline) for column in shown)

    out = {
        "qualifying": len(ok),
        "candidates": len(rows),
        "best": NONE,
        "best_candidate": None,
        "runner_up": None,
        "best_value": math.nan,
        "best_ci_low": math.nan,
        "best_ci_high": math.nan,
        "best_n": math.nan,
        "runner_up_value": math.nan,
        "versus_runner_up": math.nan,
        "versus_runner_up_low": math.nan,
        "versus_runner_up_high": math.nan,
        "versus_runner_up_n": math.nan,
        "versus_runner_up_test": None,
        "tied": None,
        "undecided": ", ".join(r["method"] for r in maybe) or None,
    }
    unjudged = sorted(
        row["method"]
        for row in rows
        if any(pd.isna(row.get(limit.column)) for limit in scenario.limits if limit.column in QUALITY_COLUMNS)
    )
    note = (
        f"; quality not measured for {', '.join(unjudged)} (the quality stage did not run them here), "
        "so they cannot meet its limits"
        if unjudged
        else ""
    )
    if ok:
        best = ok[0]
        tied = [r for r in ok[1:] if key(r, scenario.prefer) == key(best, scenario.prefer)]
        unresolved = [r["method"] for r in tied if preference(r) == preference(best)]
        word = "highest" if scenario.order == "max" else "lowest"
        name = " = ".join([best["method"], *unresolved]) if unresolved else best["method"]
        out |= {
            "best": f"tie: {name}" if unresolved else name,
            "best_candidate": name,
            "best_value": best.get(scenario.prefer),
            "best_ci_low": _num(best, f"{scenario.prefer}_low"),
            "best_ci_high": _num(best, f"{scenario.prefer}_high"),
            "best_n": _num(best, f"{scenario.prefer}_n"),
            "numbers": numbers(best),
            "tied": ", ".join(r["method"] for r in tied) or None,
        }
        why = (
            f"{name}: {word} {_value(best, scenario.prefer, baseline)} of {len(ok)} method(s) whose intervals meet "
            "every limit"
        )
        if unresolved:
            why += f" (a tie on {scenario.prefer} and {second})"
        elif tied:
            why += (
                f" (tied on {scenario.prefer} with {', '.join(r['method'] for r in tied)}; "
                f"the smaller {second} decides)"
            )
        rest = [r for r in ok[1:] if r["method"] not in unresolved]
        if rest:
            runner = rest[0]
            out |= {"runner_up": runner["method"], "runner_up_value": runner.get(scenario.prefer)}
            why += f"; runner-up {runner['method']} ({_value(runner, scenario.prefer, baseline)})"
        if rest and not unresolved:
            on_tie = key(runner, scenario.prefer) == key(best, scenario.prefer)
            column, order = (second, "min") if on_tie else (scenario.prefer, scenario.order)
            comparison = versus(best, runner, column)
            side = 0 if comparison is None else comparison.favours(order)
            if comparison is None:
                why += f"; no paired comparison with it on {column} ({versus.why_not})"
                n = _num(best, f"{column}_n")
                n_text = f"{n:.0f} {unit_of(best, column)}" if n == n else "?"
            else:
                out |= {
                    "versus_runner_up": comparison.estimate,
                    "versus_runner_up_low": comparison.low,
                    "versus_runner_up_high": comparison.high,
                    "versus_runner_up_n": comparison.samples,
                    "versus_runner_up_test": comparison.text(name, runner["method"]),
                }
                why += f"; {comparison.text(name, runner['method'])}"
                n_text = comparison.n_text
                why += {
                    1: " (separated)",
                    0: " (includes no-effect: not separated at this n)",
                    -1: f" (favours {runner['method']}: the {column} point estimates and the paired comparison disagree)",
                }[side]
            if side != 1:
                out["best"] = NOT_SEPARATED.format(n=n_text, pick=name, runner=runner["method"])
        better = [r for r in maybe if preference(r) < preference(best)]
        if better:
            why += (
                f"; {', '.join(r['method'] for r in better)} might do better but "
                f"{'is' if len(better) == 1 else 'are'} undecided at n = {_undecided_n(better, scenario)}"
            )
        out["why"] = why + note
        return out
    if maybe:
        top = maybe[0]
        n = _undecided_n(maybe, scenario)
        open_ = next(o for r, _, o in judged if r is top)
        out |= {
            "best": UNDECIDED.format(n=n),
            "numbers": numbers(top),
            "why": f"no method's interval meets every limit at n = {n}; undecided: "
            + ", ".join(r["method"] for r in maybe)
            + f"; {top['method']} (best {scenario.prefer}) on "
            + "; ".join(open_)
            + note,
        }
        return out
    closest, fails, _ = min(judged, key=lambda j: (len(j[1]), preference(j[0])))
    out |= {
        "numbers": numbers(closest),
        "why": f"none of {len(rows)} method(s) meets every limit; closest {closest['method']} misses "
        + "; ".join(fails)
        + note,
    }
    return out


def recommendations(table: pd.DataFrame, scenarios: list[Scenario], baseline: str, versus: Versus) -> pd.DataFrame:
    rows = []
    cells = ["model", "protocol", "category", "bucket"]
    for scenario in scenarios:
        common = {
            "limits": "; ".join(limit.label(baseline) for limit in scenario.limits),
            "prefer": f"{scenario.order} {scenario.prefer}",
            "description": scenario.description,
        }
        if table.empty:
            rows.append(
                {
                    "model": "-",
                    "scenario": scenario.name,
                    "protocol": "-",
                    "category": "-",
                    "bucket": "-",
                    "best": NONE,
                    "why": "no method was measured (stages system and quality not run)",
                    "qualifying": 0,
                    "candidates": 0,
                    **common,
                }
            )
        for key, cell in table.groupby(cells, sort=True):
            rows.append(
                {
                    "scenario": scenario.name,
                    **dict(zip(cells, key)),
                    **recommend_cell(cell, scenario, baseline, versus),
                    **common,
                }
            )
    columns = [
        "model",
        "scenario",
        "protocol",
        "category",
        "bucket",
        "best",
        "best_candidate",
        "runner_up",
        "best_value",
        "best_ci_low",
        "best_ci_high",
        "best_n",
        "runner_up_value",
        "versus_runner_up",
        "versus_runner_up_low",
        "versus_runner_up_high",
        "versus_runner_up_n",
        "versus_runner_up_test",
        "tied",
        "undecided",
        "numbers",
        "why",
        "qualifying",
        "candidates",
        "limits",
        "prefer",
        "description",
    ]
    return pd.DataFrame(rows, columns=columns)
